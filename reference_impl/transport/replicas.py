"""Several rollout engine replicas fed by one sender: the update routes fanned out to every engine.

An RL trainer with several rollout engines (replicas of one kind, each with its own TP workers) opens one
transfer group holding all of them (`transport.group`) and sends every chunk once: each engine's
/update_weights call is in flight at the same time, every engine worker joins the same broadcast, and
the chunk counts as received only when every engine answered 200. `ReplicaClient` is that fan-out with
the interface of one `EngineClient` (what the sync loop and the channels call: `pause`, `start`, `update`,
`finish`, the cache resets, `resume`, `session_open`, `calls`), so the chunk loop is the same for one engine and
for many.

Sessions: a broadcast must be taken by every rank of the group, so the sender may broadcast only while
every engine holds an open session (`session_open` is the conjunction): when one engine refused its
start, or ended its session on a failed chunk (vLLM), no later chunk of that sync is broadcast, and the
engines whose sessions are still open are finished there and then (with the sync's weight version), so
that no engine is left in an update session nobody will close (an embedded engine refuses completions
while one is open; a vLLM engine keeps its layers pending).

The sender's account of each engine (chunks it answered 200, names it accepted or refused, its update
counts, whether it finished) is kept per sync (`accounts`) and returned with the sync's report
(`observed.SyncReport.engines`), so the harness can judge every engine on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from wsh_vllm_plugin.protocol import UpdateInfo

from reference_impl.transport.client import EngineClient, EngineRejected, names_rejected
from reference_impl.transport.observed import EngineAccount, HttpCall, Rejection

T = TypeVar("T")


class ReplicasRejected(EngineRejected):
    """Some engine replicas answered a fanned-out call with a non-200 (or not at all).

    `call` and `status` are the first failing engine's; `rejections` lists every failing engine's, and the
    message names each failing engine ("engine 1: /update_weights -> 400: ...").

    Attributes:
        failures: engine index -> its `EngineRejected`.
    """

    def __init__(self, failures: dict[int, EngineRejected]) -> None:
        first = failures[min(failures)]
        super().__init__(first.call, first.body)
        self.failures = dict(sorted(failures.items()))
        self.args = ("; ".join(f"engine {i}: {e}" for i, e in self.failures.items()),)

    @property
    def rejections(self) -> list[Rejection]:
        """Every failing engine's rejections, engine by engine."""
        return [r for e in self.failures.values() for r in e.rejections]


class ReplicaClient:
    """One `EngineClient` per engine replica, called together (see the module doc).

    Args:
        clients: one client per engine, in engine order (`EngineClient.engine` = its index).

    Raises:
        ValueError: no clients, or a client's `engine` is not its index.
    """

    def __init__(self, clients: Sequence[EngineClient]) -> None:
        if not clients:
            raise ValueError("a ReplicaClient needs at least one engine client")
        bad = [(i, c.engine) for i, c in enumerate(clients) if c.engine != i]
        if bad:
            raise ValueError(f"engine clients must be numbered by their place (index, engine): {bad}")
        self.clients = list(clients)
        self.pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="replica-http")
        self._accounts: dict[int, list[EngineAccount]] = {}
        self._versions: dict[int, int | None] = {}  # sync -> the weight version its start announced

    # ------------------------------------------------------------------ what EngineClient offers

    @property
    def base_url(self) -> str:
        """Every engine's base URL, comma-separated (for messages)."""
        return ",".join(c.base_url for c in self.clients)

    @property
    def session_open(self) -> bool:
        """Whether every engine holds an open update session (only then may the sender broadcast)."""
        return all(c.session_open for c in self.clients)

    @property
    def session_closed_by(self) -> str:
        """Why some engine holds no session, engine by engine ("" when every one holds one)."""
        return "; ".join(
            f"engine {c.engine}: {c.session_closed_by or 'no session'}" for c in self.clients if not c.session_open
        )

    @property
    def calls(self) -> list[HttpCall]:
        """Every engine's recorded calls, in the order they were sent."""
        return sorted((call for c in self.clients for call in c.calls), key=lambda call: call.t)

    @calls.setter
    def calls(self, value: list[HttpCall]) -> None:
        """Only `[]` is accepted: the caller took the calls and clears every engine's log."""
        if value:
            raise ValueError("ReplicaClient.calls can only be cleared (assign [])")
        for c in self.clients:
            c.calls = []

    def start(self, sync: int, weight_version: int | None = None) -> Any:
        """POST /start_weight_update to every engine; engine 0's answer.

        Raises:
            ReplicasRejected: some engine refused (the others' sessions stay open; `session_open` is False).
        """
        self._accounts[sync] = [EngineAccount(engine=c.engine) for c in self.clients]
        self._versions[sync] = weight_version
        outcomes = self._each(lambda c: c.start(sync, weight_version))
        self._end_dangling_sessions(sync)
        return self._raise_or_first(outcomes)

    def update(self, update_info: UpdateInfo | dict[str, Any], sync: int, chunk: int) -> Any:
        """POST /update_weights to every engine at once (each joins the chunk's broadcast); engine 0's answer.
        Each engine's answer goes into its account. `update_info`: as `EngineClient.update` takes it.

        Raises:
            ReplicasRejected: some engine refused the chunk (the others took it).
        """
        outcomes = self._each(lambda c: c.update(update_info, sync, chunk))
        names = update_info["names"] if isinstance(update_info, dict) else update_info.names
        for account, outcome in zip(self._sync_accounts(sync), outcomes, strict=True):
            if isinstance(outcome, EngineRejected):
                account.names_rejected.update(names_rejected(names, outcome))
            else:
                account.chunks_received.append(chunk)
                account.names_accepted.extend(names)
        self._end_dangling_sessions(sync)
        return self._raise_or_first(outcomes)

    def finish(self, sync: int, weight_version: int) -> Any:
        """POST /finish_weight_update to every engine; engine 0's answer (with its update counts). Each
        engine's counts go into its account.

        Raises:
            ReplicasRejected: some engine refused.
        """
        outcomes = self._each(lambda c: c.finish(sync, weight_version))
        self._account_finishes(sync, outcomes)
        return self._raise_or_first(outcomes)

    def _account_finishes(self, sync: int, outcomes: Sequence[Any], engines: Sequence[int] | None = None) -> None:
        accounts = self._sync_accounts(sync)
        for i, outcome in zip(engines if engines is not None else range(len(outcomes)), outcomes, strict=True):
            if not isinstance(outcome, EngineRejected):
                accounts[i].finished = True
                accounts[i].engine_update_counts = {k: int(v) for k, v in outcome.get("update_counts", {}).items()}

    def _end_dangling_sessions(self, sync: int) -> None:
        """When some engine holds no session (its start was refused, or it ended the session on a failed
        chunk), finish the sessions still open on the others: the sync cannot go on for any of them."""
        open_ = [c for c in self.clients if c.session_open]
        if not open_ or len(open_) == len(self.clients):
            return
        version = self._versions.get(sync)
        outcomes = self._each_of(open_, lambda c: c.finish(sync, version if version is not None else sync))
        self._account_finishes(sync, outcomes, [c.engine for c in open_])

    @property
    def pauses_generation(self) -> bool:
        """Whether the sender pauses these engines' generation around an update (one kind: engine 0's)."""
        return self.clients[0].pauses_generation

    def pause(self, sync: int | None = None) -> Any:
        """POST /pause to every engine (`EngineClient.pause`).

        Raises:
            ReplicasRejected: some engine refused.
        """
        return self._all(lambda c: c.pause(sync))[0]

    def resume(self, sync: int | None = None) -> Any:
        """POST /resume to every engine, those that refused the pause too.

        Raises:
            ReplicasRejected: some engine refused.
        """
        return self._all(lambda c: c.resume(sync))[0]

    def reset_prefix_cache(self, sync: int | None = None) -> Any:
        """POST /reset_prefix_cache to every engine.

        Raises:
            ReplicasRejected: some engine refused.
        """
        return self._all(lambda c: c.reset_prefix_cache(sync))[0]

    def reset_encoder_cache(self, sync: int | None = None) -> Any:
        """POST /reset_encoder_cache to every engine.

        Raises:
            ReplicasRejected: some engine refused.
        """
        return self._all(lambda c: c.reset_encoder_cache(sync))[0]

    def close(self) -> None:
        """Close every engine's connection pool and the fan-out threads."""
        for c in self.clients:
            c.close()
        self.pool.shutdown(wait=False)

    # ------------------------------------------------------------------ accounts

    def accounts(self, sync: int) -> list[EngineAccount]:
        """The sender's account of each engine in sync `sync` (empty accounts when it never started)."""
        return [a.model_copy(deep=True) for a in self._sync_accounts(sync)]

    def _sync_accounts(self, sync: int) -> list[EngineAccount]:
        return self._accounts.setdefault(sync, [EngineAccount(engine=c.engine) for c in self.clients])

    # ------------------------------------------------------------------ fan-out

    def _each(self, fn: Callable[[EngineClient], T]) -> list[T | EngineRejected]:
        """`fn(client)` for every engine at once; each result, or the `EngineRejected` it raised."""
        return self._each_of(self.clients, fn)

    def _each_of(self, clients: Sequence[EngineClient], fn: Callable[[EngineClient], T]) -> list[T | EngineRejected]:
        """`fn(client)` for each of `clients` at once; each result, or the `EngineRejected` it raised."""

        def one(c: EngineClient) -> T | EngineRejected:
            try:
                return fn(c)
            except EngineRejected as e:
                return e

        futures = [self.pool.submit(one, c) for c in clients]
        return [f.result() for f in futures]

    def _all(self, fn: Callable[[EngineClient], T]) -> list[T]:
        outcomes = self._each(fn)
        self._raise_or_first(outcomes)
        return outcomes  # type: ignore[return-value]  (no EngineRejected left)

    @staticmethod
    def _raise_or_first(outcomes: Sequence[Any]) -> Any:
        failures = {i: o for i, o in enumerate(outcomes) if isinstance(o, EngineRejected)}
        if failures:
            raise ReplicasRejected(failures)
        return outcomes[0]


def engines_of(client: EngineClient | ReplicaClient) -> list[EngineClient]:
    """The engines behind `client`, in engine order: a `ReplicaClient`'s clients, or `[client]`."""
    return list(client.clients) if isinstance(client, ReplicaClient) else [client]

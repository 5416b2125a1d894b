"""One scenario while it runs: its processes, its deadlines, its syncs and the oracles that judge them.

`ScenarioSession` is made by `harness.runner.Runner.run_scenario` once the engine and the trainer ranks
are up. It drives the rank actors (Ray) and the harness's own engine client, fills the run record as it
goes, and never lets one of the harness's oracles raise into a verdict (`oracle`). Every remote call has
a deadline; when one passes, the session records a DEADLOCK naming what was in flight and every rank's
last phase (`transport.progress`) and raises `ScenarioFailed`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from harness import mid_session, recovery
from harness.checks import LOGPROB_BUDGETS, check_transfer_init, logprob_parity
from harness.faults import Fault
from harness.oracles.expected import ExpectedState
from harness.oracles.fresh import fresh_engine_checksums
from harness.oracles.tp_shards import expected_tp_checksums
from harness.outcome import merge_sync, sync_failed
from harness.placement import TrainerPool
from harness.rank_failures import rank_failures
from harness.record import (
    Bound,
    EngineSync,
    ErrorRecord,
    OracleFailure,
    RunRecord,
    SyncRecord,
    TransferGroupRecord,
    error_from,
)
from harness.recovery import RESTORE_SEAMS
from harness.scenario import Scenario
from harness.watch import EngineExited, EngineWatch, wait_watched
from reference_impl.engine.base import EngineKind
from reference_impl.forward.hf import FORWARD_NAME as HF_FORWARD
from reference_impl.forward.hf import HfForward, Prompt
from reference_impl.models.families import model_family
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient, EngineRejected
from reference_impl.transport.progress import read_progress

# What the harness measures on an engine after a sync (`SyncRecord` and `EngineSync` fields alike).
ENGINE_MEASURED = (
    "engine_checksums",
    "engine_tp_checksums",
    "engine_weight_version",
    "served_weight_version",
    "mid_session",
    "probe",
    "logprobs",
    "logprobs_expected",
    "engine_logprobs",
)
PROBE_TEMPERATURE = 1.0  # a generated token's log-prob: vLLM reports it from the raw logits


# Called after every sync (and its log-prob comparison) with the record, the sync's index and the scenario's
# processes (label -> pid: "rank0", ..., "engine"); e.g. `harness.soak.sample_resources`.
SyncHook = Callable[[RunRecord, int, dict[str, int | None]], None]


class ScenarioFailed(Exception):
    """Raised to stop a scenario early; what happened is already in the record."""


def oracle_into(failures: list[OracleFailure], check: str, fn: Callable[[], Any], sync: int | None = None) -> Any:
    """Run one of the harness's own oracles; when it raises, append an `OracleFailure` for `check` (the check
    then says "oracle could not run") and return None: an oracle never makes a verdict of the system under
    test. A deadline passing inside it is still a DEADLOCK (`ScenarioFailed` passes through)."""
    try:
        return fn()
    except ScenarioFailed:
        raise
    except Exception as e:
        cause = getattr(e, "cause", None) or e
        text = " ".join(str(cause).split())[:500] or "(no message)"
        failures.append(OracleFailure(check=check, sync=sync, reason=f"{type(cause).__name__}: {text}"))
        return None


@dataclass
class ScenarioSession:
    """The live scenario (see the module doc). `deadline` is seconds per remote step. With several engine
    replicas every engine is asked everything the harness asks one engine, each through its own client
    (`checkers[i]`), and what it answers goes into its part of the sync (`SyncRecord.engines[i]`)."""

    sc: Scenario
    record: RunRecord
    kind: EngineKind
    pool: TrainerPool
    engines: list[Any]  # the EngineActor handles, one per engine replica
    deadline: float
    trace_dir: Path
    checkpoint: Path
    fault: Fault | None = None
    checker: EngineClient = None  # type: ignore[assignment]  # the harness's own client of engine 0
    checkers: list[EngineClient] = field(default_factory=list)  # one per engine replica, once they are up
    prompts: list[Prompt] = field(default_factory=list)
    expected: ExpectedState | None = None
    hf_view: HfForward | None = None  # the transformers forward over the expected state, built on first use
    hf_view_state: tuple[Any, ...] = ()  # the key of the expected state the view holds
    probe: list[int] = field(default_factory=list)  # a prompt served before and after every sync
    checks_s: float = 0.0  # seconds spent in the harness's own reads, probes, log-prob views and oracles
    watches: list[EngineWatch] = field(default_factory=list)  # one per engine once their servers run
    pids: dict[str, int | None] = field(default_factory=dict)  # "rank0", ..., "engine", "engine1", ...
    after_sync: SyncHook | None = None  # an observer after every sync (resource samples); never a verdict
    # the /dev/shm segments the scenario's processes held once the sender connected (its channel's first
    # segment, made before any resource sample): the runner unlinks those still there after a failed run
    shm_at_connect: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------ remote calls and oracles

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Count the time of the block as checks (`RunRecord.wall["checks_s"]`), not as syncs."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.checks_s += time.perf_counter() - t0

    def watch(self, what: str) -> ErrorRecord | None:
        """The `ErrorRecord` of the first engine server found gone (`harness.watch.EngineWatch`), else None."""
        for engine_watch in self.watches:
            error = engine_watch(what)
            if error is not None:
                return error
        return None

    def get(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        """ray.get every ref (`harness.watch.wait_watched`: a timeout is a DEADLOCK, an engine gone meanwhile is
        recorded, each raising ScenarioFailed); a rank's exception is recorded as that rank's crash, ranks whose
        process died first (`rank_failures`), then ScenarioFailed is raised."""
        try:
            return self._wait(refs, timeout, what)
        except ray.exceptions.RayError as e:
            deaths, others = rank_failures(refs, self.pool.log_path, self.trace_dir)
            self.record.errors.extend(deaths + others[:1] or [error_from(e, None, "trainer")])
            raise ScenarioFailed(what) from e

    def get_oracle(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        """`get` for one of the harness's oracles run on the ranks: an exception in the actor is raised as it is
        (for `oracle` to record), not recorded as the rank's crash; but a rank whose process died meanwhile is
        (the trainer is gone, whatever it ran), and ScenarioFailed is raised."""
        try:
            return self._wait(refs, timeout, what)
        except ray.exceptions.RayError:
            deaths, others = rank_failures(refs, self.pool.log_path, self.trace_dir)
            if not deaths:
                raise
            self.record.errors.extend(deaths + others[:1])
            raise ScenarioFailed(what) from None

    def _wait(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        try:
            return wait_watched(refs, timeout, what, self.watch if self.watches else None)
        except ray.exceptions.GetTimeoutError:
            self.deadline_passed(what, timeout)
            raise ScenarioFailed(what) from None
        except EngineExited as e:
            self.record.errors.insert(0, e.error)
            raise ScenarioFailed(what) from None

    def oracle(self, check: str, sync: int | None, fn: Callable[[], Any]) -> Any:
        """`oracle_into` this record's oracle failures."""
        return oracle_into(self.record.oracle_failures, check, fn, sync)

    def deadline_passed(self, what: str, timeout: float) -> None:
        """Mark a DEADLOCK in `what` and keep every rank's last phase."""
        self.record.deadlock = True
        self.record.deadlock_at = what
        self.record.notes.append(f"{what}: no progress within {timeout:.0f} s")
        self.record.progress = read_progress(self.trace_dir)

    def on_ranks(self, method: str, *args: Any, what: str, timeout: float | None = None) -> list[Any]:
        """Call `method(*args)` on every trainer rank and wait (`get`)."""
        refs = [getattr(a, method).remote(*args) for a in self.pool.actors]
        return self.get(refs, self.deadline if timeout is None else timeout, what)

    # ------------------------------------------------------------------ the scenario's steps

    def connect(self, master_address: str = "127.0.0.1", token: str | None = None) -> None:
        """Every rank sets up its channel to the engines (the sender's /init_weight_transfer_engine to each, one
        transfer group of the sender and every engine worker, its store at `master_address`; `token` goes with
        every call). The group as the sender set it up goes into the record. An engine that joined more than
        one transfer group stops the scenario: nothing sent after it would reach the engine."""
        urls = [c.base_url for c in self.checkers]
        for calls in self.on_ranks(
            "connect_engine",
            urls,
            self.sc.engine,
            self.sc.colocate,
            120.0,
            self.sc.engine_ranks,
            master_address,
            token,
            what="connect engine",
        ):
            self.record.http.extend(calls)
        infos = self.on_ranks("transfer_group", what="transfer group", timeout=60)[0]
        if infos:
            self.record.transfer_group = TransferGroupRecord(
                master_address=infos[0]["master_address"],
                world_size=infos[0]["world_size"],
                rank_offsets=[i["rank_offset"] for i in infos],
                engine_ranks=self.sc.engine_ranks,
                engine_urls=urls,
                token_required=token is not None,
            )
        if not all(check_transfer_init(self.record.engine_view(i)).ok for i in range(len(self.checkers))):
            self.record.notes.append("stopped after connect: the engine joined more than one transfer group")
            raise ScenarioFailed("connect engine")

    def run_syncs(self) -> None:
        """Syncs #0..N-1 with the trainer's step before each later one, then one more that re-sends unchanged
        weights (its log-probs must not move); after every sync the engine's report, the expected state and
        the log-probs. A fault armed for one sync (`fault_sync`) is applied just before it and undone after.
        When some sync failed, the engine's liveness and a clean recovery sync end the run (`harness.recovery`)."""
        sc = self.sc
        if sc.logprobs:
            budget = LOGPROB_BUDGETS[sc.dtype]
            gap = model_family(load_model(sc.model).model_type).trainer_logprob_gap
            self.record.logprob_budget = dict(budget)
            self.record.trainer_logprob_budget = {k: v + gap for k, v in budget.items()}
        with self.checking():
            self.expected = self.oracle("parity_expected", None, lambda: ExpectedState(self.checkpoint, sc.seed))
            if self.kind.capabilities.per_tensor_reports:  # what each engine holds before sync 0, and should
                self._read_engine_start()
        try:
            for i in range(sc.syncs + 1):
                if 0 < i < sc.syncs:
                    refs = [a.perturb.remote(i, sc.seed) for a in self.pool.actors]
                    if self.expected is not None:  # while the ranks step
                        self.expected = self.oracle("parity_expected", i, functools.partial(self.expected.advance, i))
                    self.get(refs, self.deadline, f"perturb {i}")
                armed = self._arm(i)
                self.sync(i, perturbed=i != sc.syncs, held=i == sc.syncs > 0)
                if armed:
                    self.on_ranks("run_in_process", RESTORE_SEAMS, what=f"disarm fault after sync {i}", timeout=60)
        except EngineRejected as e:  # the harness's own call (checksums, log-probs) got no 200: stop syncing
            self.record.notes.append(f"the syncs stopped: the harness's {e.route} got {e.status} from the engine")
        except ScenarioFailed:  # a rank raised: an engine that died first is the cause to name
            recovery.session_engine_died(self, after=len(self.record.syncs))
            raise
        failed = [s.index for s in self.record.syncs if sync_failed(self.record, s)]
        if failed or len(self.record.syncs) < sc.syncs + 1:
            recovery.recover(self, after=failed[-1] if failed else len(self.record.syncs) - 1)

    def _read_engine_start(self) -> None:
        """Each engine's checksums and weight version before sync 0 (its answers), and what a fresh engine of
        its checkpoint and seed holds (`oracles.fresh`, built in this process): `check_engine_fresh`."""
        rec, checkers = self.record, self.checkers
        sums = lambda: [c.checksum_report()["checksums"] for c in checkers]  # noqa: E731
        rec.engine_start_checksums = self.oracle("engine_fresh", None, sums) or []
        versions = lambda: [c.weight_version() for c in checkers]  # noqa: E731
        rec.engine_start_versions = self.oracle("engine_fresh", None, versions) or []
        seeds = [self.sc.engine_seed + i for i in range(len(checkers))]
        fresh = lambda: [fresh_engine_checksums(self.checkpoint, s) for s in seeds]  # noqa: E731
        rec.engine_fresh_checksums = self.oracle("engine_fresh", None, fresh) or []

    def _arm(self, index: int) -> bool:
        """Apply a trainer fault armed for sync `index` only; returns whether it was applied."""
        fault = self.fault
        if fault is None or fault.trainer is None or self.sc.fault_sync != index:
            return False
        self.on_ranks("run_in_process", fault.trainer, what=f"arm fault for sync {index}", timeout=60)
        self.record.notes.append(f"fault armed for sync {index} only: {fault.name}")
        return True

    def sync(self, index: int, perturbed: bool = True, held: bool = False) -> SyncRecord:
        """One sync on every rank, merged into the record, then each engine's report, its weight version, the
        probe through its caches and its log-probs. Before the sync the probe is served once by every engine
        (so an engine with a prefix cache holds it under the old weights). `held`: the sender is held after
        its first chunk and before its finish while the harness asks each engine (`harness.mid_session`)."""
        sc = self.sc
        if self.probe:
            with self.checking():
                for checker in self.checkers:
                    checker.generate(self.probe, PROBE_TEMPERATURE, sync=index)
        gate = mid_session.gate_dir(self.trace_dir, index) if held else None
        if gate is not None:
            arm = functools.partial(mid_session.arm, str(gate))
            self.on_ranks("run_in_process", arm, what=f"hold sync {index} mid-session", timeout=60)
        t0 = time.perf_counter()
        refs = [a.sync.remote(index, index, sc.export_mode, sc.chunk_bytes) for a in self.pool.actors]
        asked = None
        if gate is not None:
            caps = self.kind.capabilities
            asked = mid_session.ask_while_held(gate, refs, self.checkers, caps, self.probe, index, self.deadline)
        left = self.deadline - (time.perf_counter() - t0) if gate is not None else self.deadline
        reports = self.get(refs, max(left, 1.0), f"sync {index}")
        harness_s = time.perf_counter() - t0
        sync = merge_sync(index, reports, self.record)
        sync.perturbed, sync.harness_s = perturbed, harness_s
        self.record.syncs.append(sync)  # before the engine is asked anything more: nothing of it is lost
        if gate is not None:
            self.on_ranks("run_in_process", mid_session.disarm, what=f"release sync {index}", timeout=60)
        if asked is not None:
            for part, asks in zip(self.engine_parts(sync), asked, strict=True):
                part.mid_session = asks
            sync.mid_session = asked[0]  # engine 0's, where one engine's measurements go (`held` reads it)
        with self.checking():
            # The expected state's checksums once the ranks are done, never while they sync: this process
            # shares the host's cores with them, and every timed sync would pay for the oracle's hashing.
            expected = self.expected
            sums = self.oracle("parity_expected", index, expected.checksums) if expected is not None else None
            sync.expected_checksums = sums or {}
            self._measure(sync, index)
            if self.after_sync is not None:
                self.oracle("resources", index, functools.partial(self.after_sync, self.record, index, self.pids))
        return sync

    def _measure(self, sync: SyncRecord, index: int) -> None:
        """Each engine's report, weight version, probe and log-probs after sync `index`."""
        sc, expected = self.sc, self.expected
        if sc.engine_tp > 1 and self.kind.capabilities.per_tensor_reports and expected is not None:
            sync.expected_tp_checksums = self.oracle("engine_tp_shards", index, self._expected_tp_checksums) or {}
        parts = self.engine_parts(sync)
        for checker, part in zip(self.checkers, parts, strict=True):
            if self.kind.capabilities.per_tensor_reports:
                report = checker.checksum_report()
                part.engine_checksums = report["checksums"]
                part.engine_tp_checksums = report.get("tp_checksums", {})
            if part.finished:
                part.engine_weight_version = checker.weight_version(sync=index)
            if self.probe:
                self.measure_probe(checker, part, index)
        if self.prompts:
            self.measure_logprobs(sync, parts)
        if parts[0] is not sync:  # several engines: engine 0's measurements also where one engine's go
            for name in ENGINE_MEASURED:
                setattr(sync, name, getattr(parts[0], name))

    def engine_parts(self, sync: SyncRecord) -> list[SyncRecord | EngineSync]:
        """Where each engine's measurements of `sync` go: the sync itself with one engine, else its per-engine
        parts (made here from the sender's accounts; an engine the sender gave no account of gets an empty
        one)."""
        if len(self.checkers) == 1:
            return [sync]
        accounts = {e.engine: e for e in sync.engines}
        sync.engines = [accounts.get(i) or EngineSync(engine=i) for i in range(len(self.checkers))]
        return list(sync.engines)

    def _expected_tp_checksums(self) -> dict[str, dict[str, str]]:
        assert self.expected is not None
        config = json.loads((self.checkpoint / "config.json").read_text())
        return expected_tp_checksums(self.expected.tensors, config, self.sc.engine_tp)

    def measure_logprobs(self, sync: SyncRecord, parts: list[SyncRecord | EngineSync]) -> None:
        """Every engine's prompt log-probs on the fixed prompts after this sync, against two views: the
        trainer's own (its Megatron forward on every rank, computed once, into `logprobs`) and a transformers
        forward over the expected state (`logprobs_expected`, in this process). Both are oracles: when one
        cannot run, that is recorded for its check, never raised."""
        temperature = self.sc.temperature(self.kind.capabilities.prompt_logprobs_honour_temperature)
        for checker, part in zip(self.checkers, parts, strict=True):
            part.engine_logprobs = [
                checker.prompt_logprobs(
                    p.input_ids, temperature, p.image_url, sync=sync.index, chat_content=p.chat_content
                )
                for p in self.prompts
            ]
        what = f"trainer log-probs after sync {sync.index}"
        refs = lambda: [a.trainer_logprobs.remote(temperature) for a in self.pool.actors]  # noqa: E731
        trainer = self.oracle("logprob_parity", sync.index, lambda: self.get_oracle(refs(), self.deadline, what)[0])
        view = self.oracle("logprob_expected", sync.index, lambda: self._expected_view(temperature))
        versus = trainer["prompts"] if trainer is not None else None
        for part in parts:
            engine = part.engine_logprobs
            if trainer is not None:
                parity = self.oracle("logprob_parity", sync.index, lambda e=engine: logprob_parity(versus, e))
                if parity is not None:
                    part.logprobs = parity | {"forward": trainer["forward"], "temperature": temperature}
            if view is not None:
                parity = self.oracle("logprob_expected", sync.index, lambda e=engine: logprob_parity(view, e))
                if parity is not None:
                    part.logprobs_expected = parity | {"forward": HF_FORWARD, "temperature": temperature}

    def measure_probe(self, checker: EngineClient, part: SyncRecord | EngineSync, index: int) -> None:
        """Serve the probe prompt again after sync `index` (no prompt log-probs: the engine may answer from its
        prefix cache) and put its generated token's log-prob beside that token's log-prob under the
        expected state (`part.probe`): a cache that outlived the update answers with the old weights."""
        token, engine, part.served_weight_version = checker.generate(self.probe, PROBE_TEMPERATURE, sync=index)
        sequence = Prompt([*self.probe, token])
        expected = self.oracle(
            "engine_caches", index, lambda: self._expected_view(PROBE_TEMPERATURE, [sequence])[0][-1]
        )
        if expected is not None:
            part.probe = {"token": token, "engine": engine, "expected": expected}

    def _expected_view(self, temperature: float, prompts: list[Prompt] | None = None) -> list[list[float]]:
        """Log-probs of the fixed prompts (or `prompts`) from a transformers model holding the expected state,
        at `temperature`; kept with the state (`ExpectedState.kept`): an earlier scenario of the same
        checkpoint, seed and steps already ran this forward."""
        expected = self.expected
        if expected is None:
            raise RuntimeError("no expected state (its oracle could not run)")
        prompts = prompts or self.prompts
        what = ("logprobs", HF_FORWARD, temperature, tuple(p.key() for p in prompts))
        return expected.kept(what, lambda: self._hf_logprobs(expected, temperature, prompts))

    def _hf_logprobs(self, expected: ExpectedState, temperature: float, prompts: list[Prompt]) -> list[list[float]]:
        if self.hf_view is None:
            self.hf_view = HfForward(self.checkpoint)
        if self.hf_view_state != expected.key:
            self.hf_view.load(expected.tensors)
            self.hf_view_state = expected.key
        return [self.hf_view.logprobs(p, temperature)[0].tolist() for p in prompts]

    def measure_bound(self) -> None:
        """The same-run bound of the last sync (`record.bound`), measured in the same processes and groups
        when every sync ended cleanly and no fault is injected (a faulted path has no clean bytes to bound).
        Its time counts as checks; a refused or failed measurement is a note, never a verdict; a hang is a
        DEADLOCK like any other."""
        syncs = self.record.syncs
        if self.fault is not None or not syncs or self.record.recovery is not None:
            return
        if any(sync_failed(self.record, s) for s in syncs):
            return
        with self.checking():
            refs = [a.measure_bound.remote() for a in self.pool.actors]
            try:
                (parts, calls), *_ = self.get_oracle(refs, self.deadline, "same-run bound")
            except ScenarioFailed:
                raise
            except Exception as e:  # a rank's or engine's refusal: the measurement is missing, said why
                self.record.notes.append(f"same-run bound not measured: {type(e).__name__}: {str(e)[:300]}")
                return
            self.record.http.extend(calls)
            self.record.bound = Bound(**parts)

    def cross_export(self) -> None:
        """Both export modes of the last state (a second export path: an oracle of the parity check)."""
        with self.checking():
            self._cross_export()

    def _cross_export(self) -> None:
        for mode in ("raw", "bridge"):
            refs = lambda m=mode: [a.export_checksums.remote(m) for a in self.pool.actors]  # noqa: E731
            sums = self.oracle(
                "parity_cross_mode", None, lambda r=refs, m=mode: self.get_oracle(r(), self.deadline, f"export {m}")
            )
            if sums is None:
                return
            self.record.cross_mode_checksums[mode] = sums[0]

"""The engine asked while an update session is open: the re-sync is held twice, after its first chunk and
before its finish.

Between /start_weight_update and /finish_weight_update an engine holds half-updated weights. What an RL
trainer relies on then, and no read after a finished sync can see:

- the engine still reports the weight version committed before the session (`GET /weight_info`): in vLLM
  only a finish commits one (a start's `weight_version` is read, not committed). Async RL keys rollouts,
  staleness and importance weights on it; a version committed at the start, or once every shard arrived,
  claims weights that are not all loaded, or not finished (`checks.engine_state.check_weight_version`);
- no request is served from half-updated weights (`checks.engine_state.check_completions_in_session`): an
  engine whose kind refuses completions during a session (`Capabilities.refuses_completions_in_session`:
  the embedded engine's 409) refuses one; an engine that serves between chunks (vLLM) has its generation
  paused by the sender (`GET /is_paused` is true). On vLLM 0.32 a completion scheduled mid-session killed
  the engine core ("Cannot copy out of meta tensor": its layers not yet reloaded are on the meta device), so
  vLLM is not asked one.

Where (`POINTS`): once the sync's first chunk is answered (the session has just begun to change weights),
and once every chunk is answered, before the finish is sent (all weights in, none committed: vLLM's
layerwise reload not yet finalized). A bug that is wrong only at one end of the session shows at that end.

How: before the re-sync (index `syncs`, which changes the version but not the weights), every trainer rank
runs `arm(gate)`, which wraps the `send_chunk` and `finish_update` seams (`reference_impl.seams`; only the
sender calls them): at each point the sender writes `gate/<point>.held` and waits, at most `HOLD_S`, for
`gate/<point>.release`. The harness (`ask_while_held`) waits for each point in turn or for every rank's end
(a sync that failed before a point is not asked there), asks each engine through a twin of its client (a
refusal asked for is not a failed call of the run, so it stays out of the HTTP log) and writes the
release; after the sync, `disarm` puts the seams back. The gate is files in the scenario's trace
directory, which the trainer ranks share with the harness (their progress lines live there too).

The held sync is judged like every other sync, and not timed (`SyncRecord.held`): the summary's steady
columns leave it out (`harness.results`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from harness.record import MidSessionAsk
from reference_impl import seams
from reference_impl.engine.base import Capabilities
from reference_impl.engine.exception_text import excerpt
from reference_impl.transport.client import EngineClient, EngineRejected

AFTER_FIRST_CHUNK, BEFORE_FINISH = "after_first_chunk", "before_finish"
POINTS = (AFTER_FIRST_CHUNK, BEFORE_FINISH)  # where the sender is held, in the order it reaches them
HELD, RELEASE = ".held", ".release"  # a point's gate files: f"{point}{HELD}", f"{point}{RELEASE}"
HOLD_S = 120.0  # seconds the sender waits for a release at most, then goes on (the harness never came)
POLL_S = 0.002  # seconds between looks at the gate's files, on either side
ASK_TEMPERATURE = 1.0
NOTE_CHARS = 250  # what an ask's note keeps of a refusal: its route, status and the body's start

_previous: dict[str, Callable[..., Any]] = {}  # what ran at each seam before `arm` (in a trainer rank)


def gate_dir(trace_dir: Path, sync: int) -> Path:
    """The gate of sync `sync` in the scenario's trace directory, made empty (a gate left by an earlier run of
    the same scenario id is cleared)."""
    gate = trace_dir / f"held-sync{sync}"
    gate.mkdir(parents=True, exist_ok=True)
    for old in gate.iterdir():
        old.unlink()
    return gate


def hold(gate: Path, point: str) -> None:
    """In the sender: say it reached `point` and wait for its release (at most `HOLD_S` seconds)."""
    (gate / f"{point}{HELD}").write_text(f"{time.time()}\n")
    end = time.monotonic() + HOLD_S
    while not (gate / f"{point}{RELEASE}").exists() and time.monotonic() < end:
        time.sleep(POLL_S)


def arm(gate: str) -> None:
    """In a trainer rank's process: hold the sender at each of `POINTS` once, until the harness releases it
    (see the module doc): after its next chunk is answered (a chunk that raised or was refused does not
    hold it), and before its next finish."""
    gate_path = Path(gate)

    def after_first_chunk(orig: Callable[..., Any]) -> Callable[..., Any]:
        held: list[bool] = []

        def send_chunk(channel, client, tensors, info, sync):  # type: ignore[no-untyped-def]
            answer = orig(channel, client, tensors, info, sync)
            if not held:
                held.append(True)
                hold(gate_path, AFTER_FIRST_CHUNK)
            return answer

        return send_chunk

    def before_finish(orig: Callable[..., Any]) -> Callable[..., Any]:
        held: list[bool] = []

        def finish_update(client, sync, weight_version):  # type: ignore[no-untyped-def]
            if not held:
                held.append(True)
                hold(gate_path, BEFORE_FINISH)
            return orig(client, sync, weight_version)

        return finish_update

    _previous["send_chunk"] = seams.replace("send_chunk", after_first_chunk)
    _previous["finish_update"] = seams.replace("finish_update", before_finish)


def disarm() -> None:
    """In a trainer rank's process: put back what ran at each seam before `arm` (nothing when not armed)."""
    while _previous:
        seam, previous = _previous.popitem()
        seams.put_back(seam, previous)


def ask_while_held(
    gate: Path,
    refs: Sequence[Any],
    clients: Sequence[EngineClient],
    capabilities: Capabilities,
    prompt: list[int],
    sync: int,
    timeout: float,
) -> list[list[MidSessionAsk]] | None:
    """Wait (at most `timeout` seconds in all) for the sender to hold at each of `POINTS` in turn, or for
    every ref of the ranks' sync calls to be done; at each point reached, ask every engine of `clients`
    (`ask_engine`) and release it. A point the sender passed without holding (it holds at a later one first:
    no chunk was answered) is not asked. Returns each engine's asks, in engine order and point order (None when
    the sender never held). Always writes every point's release before returning."""
    end = time.monotonic() + timeout
    asks: list[list[MidSessionAsk]] = [[] for _ in clients]
    try:
        for i, point in enumerate(POINTS):
            # a later point held first: the sender never reached this one (every chunk refused), so it is
            # not asked here (waiting for it kept the sender at the later point until `HOLD_S` ran out)
            while not any((gate / f"{later}{HELD}").exists() for later in POINTS[i:]):
                done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_S)
                if len(done) == len(refs) or time.monotonic() > end:
                    return asks if asks[0] else None
            if not (gate / f"{point}{HELD}").exists():
                continue
            for mine, client in zip(asks, clients, strict=True):
                twin = client.twin()
                try:
                    mine.append(ask_engine(twin, capabilities, prompt, sync, point))
                finally:
                    twin.close()
            (gate / f"{point}{RELEASE}").write_text("")
        return asks
    finally:
        for point in POINTS:
            (gate / f"{point}{RELEASE}").write_text("")


def ask_engine(
    client: EngineClient, capabilities: Capabilities, prompt: list[int], sync: int, point: str
) -> MidSessionAsk:
    """One engine's answers at `point` of an open session: GET /weight_info; then, where the kind refuses
    completions during a session, the status of a one-token completion of `prompt` at temperature 1 (0 for
    no answer); else GET /is_paused (it serves between chunks: its generation must be paused). What was
    refused or went wrong goes into the ask's `note`."""
    ask = MidSessionAsk(point=point)
    notes = []
    try:
        ask.weight_version = client.weight_version(sync=sync)
    except EngineRejected as e:
        notes.append(excerpt(str(e), NOTE_CHARS))  # "<route> -> <status>: <body>"
    if capabilities.refuses_completions_in_session:
        if prompt:
            try:
                client.generate(prompt, ASK_TEMPERATURE, sync=sync)
                ask.completion = 200
            except EngineRejected as e:
                ask.completion = e.status
                notes.append(excerpt(str(e), NOTE_CHARS))
    else:
        try:
            ask.paused = client.is_paused(sync=sync)
        except EngineRejected as e:
            notes.append(excerpt(str(e), NOTE_CHARS))
    ask.note = "; ".join(notes)
    return ask

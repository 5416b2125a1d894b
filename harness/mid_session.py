"""The engine asked while an update session is open: the re-sync is held after its first chunk.

Between /start_weight_update and /finish_weight_update an engine holds half-updated weights. What an RL
trainer relies on then, and no read after a finished sync can see:

- the engine still reports the weight version committed before the session (`GET /weight_info`): in vLLM
  only a finish commits one (a start's `weight_version` is read, not committed). Async RL keys rollouts,
  staleness and importance weights on it; a version committed at the start claims weights that are not
  loaded yet (`checks.engine_state.check_weight_version`);
- an engine whose kind refuses completions during a session (`Capabilities.refuses_completions_in_session`:
  the embedded engine's 409) refuses one then, rather than serving a rollout from half-updated weights;
  an engine that serves between chunks (vLLM) has its generation paused by the sender (`GET /is_paused`
  is true): on vLLM 0.32 a completion scheduled mid-session killed the engine core ("Cannot copy out of
  meta tensor": its layers not yet reloaded are on the meta device), so it is not asked one
  (`checks.engine_state.check_completions_in_session`).

How: before the re-sync (index `syncs`, which changes the version but not the weights), every trainer rank
runs `arm(gate)`, which wraps the `send_chunk` seam (`reference_impl.seams`; only the sender sends chunks):
once its first chunk of the sync is answered, the sender writes `gate/held` and waits, at most `HOLD_S`,
for `gate/release`. The harness (`ask_while_held`) waits for `held` or for every rank's end (a sync that
failed before its first answer is not asked), asks each engine through a twin of its client (a refusal
asked for is not a failed call of the run, so it stays out of the HTTP log) and writes `release`; after
the sync, `disarm` puts the seam back. The gate is two files in the scenario's trace directory, which the
trainer ranks share with the harness (their progress lines live there too).

The held sync is judged like every other sync, and not timed (`SyncRecord.held`): the summary's steady
columns leave it out (`harness.results`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray

from reference_impl import seams
from reference_impl.engine.base import Capabilities
from reference_impl.transport.client import EngineClient, EngineRejected

HELD, RELEASE = "held", "release"
HOLD_S = 120.0  # seconds the sender waits for the release at most, then goes on (the harness never came)
POLL_S = 0.002  # seconds between looks at the gate's files, on either side
ASK_TEMPERATURE = 1.0

_previous: list[Callable[..., Any]] = []  # what ran at `send_chunk` before `arm` (in a trainer rank)


def gate_dir(trace_dir: Path, sync: int) -> Path:
    """The gate of sync `sync` in the scenario's trace directory, made empty (a gate left by an earlier run of
    the same scenario id is cleared)."""
    gate = trace_dir / f"held-sync{sync}"
    gate.mkdir(parents=True, exist_ok=True)
    for name in (HELD, RELEASE):
        (gate / name).unlink(missing_ok=True)
    return gate


def arm(gate: str) -> None:
    """In a trainer rank's process: hold the sender once, after its next chunk is answered, until the harness
    writes `gate/release` (see the module doc). A chunk that raised or was refused does not hold it."""
    gate_path = Path(gate)

    def make(orig: Callable[..., Any]) -> Callable[..., Any]:
        _previous.append(orig)
        held: list[bool] = []

        def send_chunk(channel, client, tensors, info, sync):  # type: ignore[no-untyped-def]
            answer = orig(channel, client, tensors, info, sync)
            if not held:
                held.append(True)
                (gate_path / HELD).write_text(f"{time.time()}\n")
                end = time.monotonic() + HOLD_S
                while not (gate_path / RELEASE).exists() and time.monotonic() < end:
                    time.sleep(POLL_S)
            return answer

        return send_chunk

    seams.replace("send_chunk", make)


def disarm() -> None:
    """In a trainer rank's process: put back what ran at `send_chunk` before `arm` (nothing when not armed)."""
    if _previous:
        seams.put_back("send_chunk", _previous.pop())


def ask_while_held(
    gate: Path,
    refs: Sequence[Any],
    clients: Sequence[EngineClient],
    capabilities: Capabilities,
    prompt: list[int],
    sync: int,
    timeout: float,
) -> list[dict[str, Any]] | None:
    """Wait (at most `timeout` seconds) until the sender holds at `gate` or every ref of the ranks' sync
    calls is done; when it holds, ask each engine of `clients` (`ask_engine`) and return their answers, in
    engine order (None when it never held). Always writes `gate/release` before returning."""
    end = time.monotonic() + timeout
    try:
        while not (gate / HELD).exists():
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=POLL_S)
            if len(done) == len(refs) or time.monotonic() > end:
                return None
        answers = []
        for client in clients:
            twin = client.twin()
            try:
                answers.append(ask_engine(twin, capabilities, prompt, sync))
            finally:
                twin.close()
        return answers
    finally:
        (gate / RELEASE).write_text("")


def ask_engine(client: EngineClient, capabilities: Capabilities, prompt: list[int], sync: int) -> dict[str, Any]:
    """One engine's answers while a session is open: `mid_session_version` (GET /weight_info; None when it
    did not answer 200), `mid_session_completion` (the status of a one-token completion of `prompt` at
    temperature 1, asked only where the kind refuses them then; None when not asked, 0 for no answer),
    `mid_session_paused` (GET /is_paused, asked where the kind serves between chunks instead: its
    generation must be paused; None when not asked or no answer) and `mid_session_note` (what was refused or
    went wrong). The `SyncRecord` / `EngineSync` fields of the same names."""
    out: dict[str, Any] = {
        "mid_session_version": None,
        "mid_session_completion": None,
        "mid_session_paused": None,
        "mid_session_note": "",
    }
    notes = []
    try:
        out["mid_session_version"] = client.weight_version(sync=sync)
    except EngineRejected as e:
        notes.append(f"/weight_info -> {e.status}: {' '.join(e.body.split())[:200]}")
    if capabilities.refuses_completions_in_session and prompt:
        try:
            client.generate(prompt, ASK_TEMPERATURE, sync=sync)
            out["mid_session_completion"] = 200
        except EngineRejected as e:
            out["mid_session_completion"] = e.status
            notes.append(f"/v1/completions -> {e.status}: {' '.join(e.body.split())[:200]}")
    elif not capabilities.refuses_completions_in_session:
        try:
            out["mid_session_paused"] = client.is_paused(sync=sync)
        except EngineRejected as e:
            notes.append(f"/is_paused -> {e.status}: {' '.join(e.body.split())[:200]}")
    out["mid_session_note"] = "; ".join(notes)
    return out

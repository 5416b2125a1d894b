"""Waiting on a scenario's ranks without outliving its engine: `ray.get` in slices that ends as soon as one
rank fails or the engine's server process is gone.

A plain `ray.get(refs, timeout)` on every rank waits for the slowest one: when the engine is killed in the
middle of a chunk, the sender may wait in a broadcast nobody receives until the transfer group's own
timeout, and the scenario would end as a DEADLOCK at its deadline with nothing said about the engine.
`wait_watched` asks the engine's actor between slices whether its server still runs (`EngineWatch`) and
raises `EngineExited` with an `ErrorRecord` naming the engine, how it ended and the end of its log; a rank
whose task failed is raised at once, not after the other ranks' deadline.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from harness.driver_ray import ray_lost
from harness.interrupts import raise_if_signalled
from harness.record import ErrorRecord
from reference_impl.transport.progress import read_progress
from reference_impl.transport.sync import SENDER

SLICE_S = 1.0  # seconds between liveness checks while ranks are busy
ASK_TIMEOUT_S = 5.0  # how long the engine's actor may take to answer (it is idle during syncs)
NAME_TIMEOUT_S = 30.0  # the same, when the scenario has ended (`EngineWatch.name_the_engine`)
LOG_TAIL = 3000  # characters of the engine's log kept with its exit


class EngineExited(Exception):
    """The engine's server process ended while the runner waited on something else; `error` says how."""

    def __init__(self, error: ErrorRecord) -> None:
        super().__init__(error.message)
        self.error = error


def how_it_ended(returncode: int) -> str:
    """ "killed by SIGKILL" for a negative status (the signal), else "exited with status N"."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-returncode).name}"
        return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


def exit_error(pid: int | None, returncode: int, log_tail: str, what: str) -> ErrorRecord:
    """The `ErrorRecord` of an engine server that ended while `what` was in flight: its first line names the
    engine, how it ended and the last line of its log; the record's traceback holds the log's end."""
    lines = [line for line in log_tail.splitlines() if line.strip()]
    last = f"; its log ends: {lines[-1].strip()[:300]}" if lines else "; its log is empty"
    return ErrorRecord(
        where="engine",
        rank=None,
        type="EngineExited",
        message=f"the engine server (pid {pid}) was {how_it_ended(returncode)} while {what} was in flight{last}",
        traceback=log_tail[-LOG_TAIL:],
    )


class EngineWatch:
    """Whether a scenario's engine server still runs, asked of its `EngineActor` (`exit_status`); what the
    sender was doing comes from its progress line in `trace_dir` (`transport.progress`)."""

    def __init__(self, actor: Any, pid: int | None, trace_dir: Path | None = None) -> None:
        self.actor, self.pid, self.trace_dir = actor, pid, trace_dir

    def __call__(self, what: str, timeout_s: float = ASK_TIMEOUT_S, sender: bool = True) -> ErrorRecord | None:
        """None while the server runs (or its actor does not answer within `timeout_s` seconds, or this driver's
        Ray is lost meanwhile: `driver_ray.ray_lost`, looked at every second), else the `ErrorRecord` of its end
        with `what` (and, with `sender`, the sender's last phase) as what was in flight."""
        ref = self.actor.exit_status.remote(LOG_TAIL)
        deadline = time.monotonic() + timeout_s
        try:
            while not ray.wait([ref], timeout=max(0.0, min(1.0, deadline - time.monotonic())))[0]:
                if time.monotonic() >= deadline or ray_lost():
                    return None
            returncode, tail = ray.get(ref)
        except (ray.exceptions.RayError, TimeoutError):
            return None
        if returncode is None:
            return None
        phase = read_progress(self.trace_dir).get(f"rank{SENDER}") if self.trace_dir and sender else None
        return exit_error(self.pid, returncode, tail, f"{what} (sender: {phase})" if phase else what)

    def name_the_engine(self, errors: list[ErrorRecord], what: str, sender: bool = True) -> None:
        """Put the engine's end first in `errors` when its server is gone and no error says so yet (a rank
        that failed because the engine died is then listed after it). `what` and `sender` as for a call."""
        if any(e.type == "EngineExited" for e in errors) or ray_lost():  # no actor answers without its Ray
            return
        # Once the scenario has ended nothing waits on this answer: a loaded host may take its actor longer
        # than the polls' `ASK_TIMEOUT_S` to answer, and an unnamed engine death reads as a trainer crash.
        error = self(what, timeout_s=NAME_TIMEOUT_S, sender=sender)
        if error is not None:
            errors.insert(0, error)


def wait_watched(
    refs: list[Any], timeout: float, what: str, watch: Callable[[str], ErrorRecord | None] | None = None
) -> list[Any]:
    """`ray.get(refs)` within `timeout` seconds, in slices of `SLICE_S`; before each slice, a SIGTERM or SIGINT
    whose KeyboardInterrupt Python dropped is raised again (`harness.interrupts.raise_if_signalled`).

    Raises:
        KeyboardInterrupt: this process got SIGTERM or SIGINT and its KeyboardInterrupt was lost.
        ray.exceptions.RayError: a ref's task failed (as soon as it did, not after the others).
        EngineExited: `watch(what)` found the engine's server gone while refs were pending.
        ray.exceptions.GetTimeoutError: refs still pending after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    results: dict[Any, Any] = {}
    pending = list(refs)
    while pending:
        raise_if_signalled()
        left = deadline - time.monotonic()
        if left <= 0:
            raise ray.exceptions.GetTimeoutError(f"{what}: {len(pending)} of {len(refs)} results pending")
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(SLICE_S, left))
        for ref in ready:
            results[ref] = ray.get(ref)  # a failed task raises here, before the others end
        if pending and watch is not None:
            error = watch(what)
            if error is not None:
                raise EngineExited(error)
    return [results[ref] for ref in refs]

"""Which trainer ranks failed a call, and why: a rank's exception, or the death of its process.

When a rank's process dies mid-collective, its peers fail first, with gloo's "Connection reset by peer"
(`rank_logs.lost_a_peer`), which names neither the dead rank nor its cause; Ray resolves the dead rank's own
call, an `ActorDiedError`, once its raylet has seen the process end. `rank_failures` waits for that a moment
and gives deaths apart, each with the cause from the rank's own log (`rank_logs.with_death_cause`) and its
last phase (`transport.progress`), so the session records the dead rank first
(`harness.session.ScenarioSession.get`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from harness import rank_logs
from harness.record import DIED, ErrorRecord, error_from
from reference_impl.transport.progress import read_progress

# Seconds the ranks' other calls get to resolve once the first failure is a peer's follow-on error: a dead
# actor's call resolves within a second of its death here.
PEER_DEATH_WAIT_S = 5.0


def rank_failures(
    refs: list[Any], log_path: Callable[[int], str | None], trace_dir: Path
) -> tuple[list[ErrorRecord], list[ErrorRecord]]:
    """The errors of the ranks whose call (`refs[i]` is rank i's) has finished by raising, in rank order (one
    still running has not failed), as (ranks whose process died, the others). A dead rank's error carries the
    cause its log at `log_path(i)` gives and its last phase from `trace_dir`. When the first failure is a
    peer's follow-on error and no death is seen yet, the others are waited for until one is, up to
    `PEER_DEATH_WAIT_S` seconds."""
    failed = _rank_errors(refs, log_path, trace_dir)
    deadline = time.monotonic() + PEER_DEATH_WAIT_S
    while failed and rank_logs.lost_a_peer(failed[0]) and not any(e.type == DIED for e in failed):
        pending = [ref for ref in refs if not ray.wait([ref], timeout=0)[0]]
        left = deadline - time.monotonic()
        if not pending or left <= 0:
            break
        ray.wait(pending, num_returns=1, timeout=left)
        failed = _rank_errors(refs, log_path, trace_dir)
    return [e for e in failed if e.type == DIED], [e for e in failed if e.type != DIED]


def _rank_errors(refs: list[Any], log_path: Callable[[int], str | None], trace_dir: Path) -> list[ErrorRecord]:
    out = []
    phases: dict[str, str] | None = None
    for i, ref in enumerate(refs):
        if not ray.wait([ref], timeout=0)[0]:
            continue
        try:
            ray.get(ref, timeout=1)
        except Exception as inner:
            error = error_from(inner, i, "trainer")
            if isinstance(inner, ray.exceptions.ActorDiedError):
                phases = read_progress(trace_dir) if phases is None else phases
                path = log_path(i)
                error = rank_logs.with_death_cause(error, rank_logs.read_tail(path), path, phases.get(f"rank{i}"))
            out.append(error)
    return out

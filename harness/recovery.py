"""After a failed sync: is the engine still alive, and does one clean sync bring it back?

Two steps the session takes when a sync failed (`harness.session.ScenarioSession.run_syncs`):
`engine_died` asks every engine's /health after a rank raised, so that a verdict names an engine's death
rather than the broken transfer group it left behind in the trainer; `recover` asks each engine for
/health and one completion, undoes the fault, and runs one clean sync of the unchanged weights, judged like
every other sync. What they find goes into `RunRecord.recovery` (`check_recovery` and the CRASH checks
read it); neither decides a verdict itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import ray

from harness.outcome import sync_failed
from harness.record import RecoveryRecord, RunRecord
from reference_impl.transport.client import EngineRejected

if TYPE_CHECKING:
    from harness.session import ScenarioSession

RESTORE_SEAMS = "reference_impl.seams:restore_all"  # undoes a fault armed for one sync


class Health(Protocol):
    def health(self) -> int: ...


def engine_log_tail(engines: Sequence[Any], engine: int = 0) -> str:
    """The tail of engine `engine`'s log, read through its `EngineActor` handle (Ray, 30 s at most); when the
    actor itself is gone, a line saying why there is none."""
    try:
        return str(ray.get(engines[engine].log_tail.remote(), timeout=30))
    except Exception as e:  # the actor itself may be gone
        return f"(no log tail: {type(e).__name__}: {e})"


def engine_died(record: RunRecord, checkers: Sequence[Health], log_tail: Callable[[int], str], after: int) -> bool:
    """After a rank raised in sync `after`, or the clean sync after it failed: when some engine no longer
    answers /health (`checkers[i].health()` is not 200; 0 is no response), record that as the failed sync's
    recovery (`record.recovery`: that engine's index, its status and `log_tail(i)`), so the verdict names the
    engine's death rather than the broken transfer group it left behind in the trainer. Returns whether an
    engine died; never after a deadlock (`record.deadlock`), which its own check names."""
    if record.deadlock:
        return False
    for i, checker in enumerate(checkers):
        status = checker.health()
        if status != 200:
            tail = log_tail(i)
            record.recovery = RecoveryRecord(after_sync=after, health_status=status, engine_log_tail=tail, engine=i)
            return True
    return False


def session_engine_died(session: ScenarioSession, after: int) -> bool:
    """`engine_died` over a live scenario's record, engine clients and engine actors (their log tails)."""
    return engine_died(session.record, session.checkers, functools.partial(engine_log_tail, session.engines), after)


def recover(session: ScenarioSession, after: int) -> None:
    """After the failed sync `after`: is every engine alive (/health, one completion), and does one clean sync
    of the unchanged weights, with every fault undone, leave them holding the expected state? The answers go
    into `record.recovery` (the first engine that failed, else engine 0); the clean sync into `record.syncs`
    (judged like every other sync). An engine that no longer answers gets its log's tail recorded instead,
    also when it dies during the clean sync (`engine_died`). Raises `ScenarioFailed` (harness.session) when
    the clean sync's ranks raised or passed their deadline, after recording an engine's death if there was
    one."""
    from harness.session import ScenarioFailed

    record = session.record
    rec = RecoveryRecord(after_sync=after)
    record.recovery = rec
    for i, checker in enumerate(session.checkers):
        rec.engine, rec.health_status, rec.completion_status = i, checker.health(), None
        if rec.health_status == 200 and session.prompts:
            try:
                first = session.prompts[0]
                checker.prompt_logprobs(first.input_ids, 1.0, first.image_url, chat_content=first.chat_content)
                rec.completion_status = 200
            except EngineRejected as e:
                rec.completion_status = e.status
        if rec.health_status != 200 or rec.completion_status not in (None, 200):
            rec.engine_log_tail = engine_log_tail(session.engines, i)
            return
    rec.engine = 0
    if session.fault is not None and session.fault.trainer is not None:
        session.on_ranks("run_in_process", RESTORE_SEAMS, what="undo the fault before recovery", timeout=60)
    index = record.syncs[-1].index + 1 if record.syncs else 0
    # An engine that dies in the clean sync leaves it unfinished, a rank raising, or the harness's read refused.
    try:
        clean = session.sync(index, perturbed=False)
    except EngineRejected as e:
        record.notes.append(f"the clean sync stopped: the harness's {e.route} got {e.status} from the engine")
        session_engine_died(session, after)
        return
    except ScenarioFailed:
        session_engine_died(session, after)
        raise
    clean.recovery = True
    rec.clean_sync = index
    rec.clean_sync_finished = not sync_failed(record, clean)
    if not rec.clean_sync_finished:
        session_engine_died(session, after)

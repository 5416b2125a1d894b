"""Which processes may serve the next scenario (`harness.outcome`): the trainer ranks as they are only after
a scenario that ran through without a fault (after a fault, or a failed sync followed by a clean recovery
sync, once the runner has them show the fault undone); the engines after any scenario that ran through or
recovered cleanly, their restart undoing an engine fault hook; nothing after an error, or a failed sync
without a clean recovery sync."""

from __future__ import annotations

import pytest

from harness.outcome import (
    OUT_OF_STEP_GRACE_S,
    STOP_GRACE_S,
    ended_clean,
    engines_reusable,
    in_flight_at_death,
    in_step,
    stop_grace_s,
)
from harness.record import ErrorRecord, HttpCall, RecoveryRecord, RunRecord
from tests.checks.records import make_record


def test_a_run_through_without_a_fault_reuses_ranks_and_engines() -> None:
    rec = make_record()
    assert ended_clean(rec, healthy=True)
    assert engines_reusable(rec, healthy=True)
    assert stop_grace_s(rec, healthy=True) == STOP_GRACE_S


@pytest.mark.parametrize("fault", ["gqa_split_wrong", "finalize_per_chunk"])  # trainer side, engine side
def test_a_fault_that_ran_through_keeps_the_engines_for_a_restart_but_not_the_ranks_as_they_are(fault: str) -> None:
    rec = make_record()
    rec.scenario.fault = fault
    assert not ended_clean(rec, healthy=True)
    assert engines_reusable(rec, healthy=True)


@pytest.mark.parametrize("defect", ["unhealthy", "non-200", "unfinished", "missing sync", "recovery"])
def test_a_scenario_that_did_not_run_through_ends_both(defect: str) -> None:
    rec = make_record()
    rec.scenario.fault = "wrong_dtype"  # trainer side: only the run's own course decides
    healthy = defect != "unhealthy"
    if defect == "non-200":
        rec.http.append(HttpCall(route="/update_weights", status=400, ms=1.0, sync=1, chunk=0))
    elif defect == "unfinished":
        rec.syncs[1].finished = False
    elif defect == "missing sync":
        rec.syncs.pop()
    elif defect == "recovery":
        rec.recovery = RecoveryRecord(after_sync=1)
    assert not engines_reusable(rec, healthy=healthy)
    # an engine left out of step may wait in a request that never returns: its server is not given the grace
    assert stop_grace_s(rec, healthy=healthy) == OUT_OF_STEP_GRACE_S < STOP_GRACE_S
    rec.scenario.fault = None
    assert not ended_clean(rec, healthy=healthy)


def _recovered() -> tuple[RunRecord, RecoveryRecord]:
    """Sync 1 refused by the engine (a 400 to one chunk), then the clean recovery sync 2, every call 200."""
    rec = make_record()
    rec.scenario.fault = "tied_lm_head_sent"
    rec.http.append(HttpCall(route="/update_weights", status=400, ms=1.0, sync=1, chunk=0))
    rec.syncs[2].recovery = True
    rec.recovery = RecoveryRecord(
        after_sync=1, health_status=200, completion_status=200, clean_sync=2, clean_sync_finished=True
    )
    return rec, rec.recovery


def test_a_failed_sync_with_a_clean_recovery_sync_leaves_every_process_in_step() -> None:
    rec, _ = _recovered()
    assert in_step(rec, healthy=True) and engines_reusable(rec, healthy=True)
    assert stop_grace_s(rec, healthy=True) == STOP_GRACE_S
    assert not ended_clean(rec, healthy=True)  # the ranks still show the fault undone first


@pytest.mark.parametrize(
    "defect", ["unhealthy", "error", "engine gone", "not finished", "non-200 in it", "no such sync"]
)
def test_a_recovery_sync_that_was_not_clean_leaves_nothing_in_step(defect: str) -> None:
    rec, recovery = _recovered()
    healthy = defect != "unhealthy"
    if defect == "error":
        rec.errors.append(ErrorRecord(where="trainer", rank=0, type="RuntimeError", message="gloo timeout"))
    elif defect == "engine gone":  # no /health answer: no recovery sync was tried
        rec.syncs.pop()
        recovery.health_status, recovery.clean_sync, recovery.clean_sync_finished = 0, None, False
    elif defect == "not finished":
        recovery.clean_sync_finished = False
    elif defect == "non-200 in it":
        rec.http.append(HttpCall(route="/update_weights", status=500, ms=1.0, sync=2, chunk=1))
    elif defect == "no such sync":
        recovery.clean_sync = 5
    assert not in_step(rec, healthy=healthy)
    assert not engines_reusable(rec, healthy=healthy)


def test_the_sync_in_flight_at_an_engines_death_is_the_one_whose_call_found_nobody() -> None:
    rec = make_record(syncs=3)  # syncs 0-3
    assert in_flight_at_death(rec, 0) == "the scenario"  # nothing failed
    for index in (0, 1, 2):  # every sync refused a chunk (a 4xx), the engine still alive
        rec.http.append(HttpCall(route="/update_weights", status=400, ms=1.0, sync=index, chunk=1))
    assert in_flight_at_death(rec, 0) == "sync 0"  # no call went unanswered: the first failed sync
    rec.http.append(HttpCall(route="/start_weight_update", status=0, ms=40.0, sync=3, engine=1))
    assert in_flight_at_death(rec, 0) == "sync 0"  # another engine's unanswered call says nothing of engine 0
    assert in_flight_at_death(rec, 1) == "sync 3"
    rec.http.append(HttpCall(route="/start_weight_update", status=0, ms=40.0, sync=3, engine=0))
    rec.http.append(HttpCall(route="/weight_checker", status=0, ms=1.0, sync=None, engine=0))  # the harness's read
    assert in_flight_at_death(rec, 0) == "sync 3"

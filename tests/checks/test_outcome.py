"""Which processes may serve the next scenario (`harness.outcome`): the trainer ranks as they are only after
a scenario that ran through without a fault (after a fault, once the runner has them show it undone); the
engines after any scenario that ran through, their restart undoing an engine fault hook; nothing after an
error or a sync that failed."""

from __future__ import annotations

import pytest

from harness.outcome import ended_clean, engines_reusable
from harness.record import HttpCall, RecoveryRecord
from tests.checks.records import make_record


def test_a_run_through_without_a_fault_reuses_ranks_and_engines() -> None:
    rec = make_record()
    assert ended_clean(rec, healthy=True)
    assert engines_reusable(rec, healthy=True)


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
    rec.scenario.fault = None
    assert not ended_clean(rec, healthy=healthy)

"""Which processes may serve the next scenario (`harness.outcome`): the trainer ranks only after a scenario
that ran through without a fault; the engines also after a fault injected into the trainer ranks alone,
never after an engine-side fault, an error or a sync that failed."""

from __future__ import annotations

import pytest

from harness.outcome import ended_clean, engines_reusable
from harness.record import HttpCall, RecoveryRecord
from tests.checks.records import make_record


def test_a_run_through_without_a_fault_reuses_ranks_and_engines() -> None:
    rec = make_record()
    assert ended_clean(rec, healthy=True)
    assert engines_reusable(rec, healthy=True, engine_fault=False)


def test_a_trainer_side_fault_keeps_the_engines_and_ends_the_ranks() -> None:
    rec = make_record()
    rec.scenario.fault = "gqa_split_wrong"
    assert not ended_clean(rec, healthy=True)
    assert engines_reusable(rec, healthy=True, engine_fault=False)


def test_an_engine_side_fault_ends_both() -> None:
    rec = make_record()
    rec.scenario.fault = "finalize_per_chunk"
    assert not ended_clean(rec, healthy=True)
    assert not engines_reusable(rec, healthy=True, engine_fault=True)


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
    assert not engines_reusable(rec, healthy=healthy, engine_fault=False)
    rec.scenario.fault = None
    assert not ended_clean(rec, healthy=healthy)

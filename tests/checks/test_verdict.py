"""The verdict: every check runs, the most severe failure decides, the scenario's `expect` is met or not."""

from __future__ import annotations

import pytest

from harness.checks import (
    CHECKS,
    PRIORITY,
    CheckResult,
    expectation_met,
    expected_verdict,
    first_failure,
    judge,
    judged,
    overall_verdict,
)
from harness.record import VERDICTS, RunRecord

from .records import reject_chunk, rejection


def test_passing_record_passes(record: RunRecord) -> None:
    verdict, results = judge(record)
    assert verdict == "PASS"
    assert len(results) == len(CHECKS) == 26
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    # no failed sync, no group, engine TP 1, no resource samples
    assert [r.name for r in results if r.skipped] == ["recovery", "group_invariance", "engine_tp_shards", "resources"]
    assert expectation_met(record, verdict)


def test_priority_covers_every_verdict() -> None:
    assert set(PRIORITY) == set(VERDICTS)
    assert PRIORITY.index("NAME_ERROR") < PRIORITY.index("HTTP_ERROR")
    assert PRIORITY[-1] == "PASS"
    assert PRIORITY[-2] == "RESOURCE_LEAK"  # any other failure explains growth; a leak explains none


def test_check_result_rejects_unknown_verdict() -> None:
    with pytest.raises(ValueError, match="unknown verdict 'BROKEN'"):
        CheckResult(name="x", ok=False, verdict_on_fail="BROKEN")


def test_overall_verdict_is_the_most_severe_failure_and_skips_do_not_count() -> None:
    results = [
        CheckResult(name="a", ok=False, verdict_on_fail="PARITY_FAIL", message="p"),
        CheckResult(name="b", ok=False, verdict_on_fail="HTTP_ERROR", message="h1"),
        CheckResult(name="c", ok=True, verdict_on_fail="CRASH", skipped=True, reason="explained"),
        CheckResult(name="d", ok=False, verdict_on_fail="HTTP_ERROR", message="h2"),
    ]
    assert overall_verdict(results) == "HTTP_ERROR"
    assert first_failure(results, "HTTP_ERROR") == results[1]
    assert first_failure(results, "CRASH") is None
    assert overall_verdict(results[2:3]) == "PASS"


def test_record_round_trips_through_json_with_its_rejections(record: RunRecord) -> None:
    reject_chunk(record, sync=0, chunk=0, status=400, rejections=[rejection("x", "name", "unknown parameter")])
    again = RunRecord.model_validate_json(record.model_dump_json())
    assert again.http == record.http and again.http[2].rejections[0].kind == "name"
    assert judge(again)[0] == judge(record)[0] == "NAME_ERROR"
    out = judged(record)
    assert out.verdict == "NAME_ERROR" and len(out.checks) == len(CHECKS) and record.verdict == ""


def test_priority_name_over_http_over_chunks(record: RunRecord) -> None:
    reject_chunk(record, sync=0, chunk=0, status=400, rejections=[rejection("x", "name")])
    verdict, results = judge(record)
    failing = {r.verdict_on_fail for r in results if r.failed}
    assert {"NAME_ERROR", "HTTP_ERROR", "CHUNK_MISMATCH"} <= failing
    assert verdict == "NAME_ERROR"
    assert first_failure(results, verdict).name == "names"


def test_expectation_met_uses_scenario_expect(record: RunRecord) -> None:
    record.scenario.expect = "CHUNK_MISMATCH"
    assert expected_verdict(record) == "CHUNK_MISMATCH"
    assert not expectation_met(record, "PASS")
    assert expectation_met(record, "CHUNK_MISMATCH")
    record.scenario.expect = "PASS"
    assert expectation_met(record, "PASS")


def test_a_check_that_raises_is_a_crash_naming_it_and_the_other_checks_still_judge(
    record: RunRecord, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A check that cannot judge a record once ended the whole run (OverflowError in a log-prob check): every
    # scenario after it went unjudged. Now it is this scenario's CRASH, and the other checks' results stand.
    from harness.checks import verdict

    def check_boom(rec: RunRecord) -> CheckResult:
        raise OverflowError("math range error")

    monkeypatch.setattr(verdict, "CHECKS", (*verdict.CHECKS, check_boom))
    got, results = judge(record)
    assert got == "CRASH" and len(results) == 27
    crash = first_failure(results, "CRASH")
    assert crash is not None and crash.name == "boom"
    assert "check_boom raised OverflowError: math range error (test_verdict.py:" in crash.message
    assert all(r.ok for r in results if r.name != "boom")

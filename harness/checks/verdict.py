"""One verdict from all checks: `judge` runs every check of `CHECKS` and picks the most severe failure::

    CONFIG_ERROR > DEADLOCK > CRASH > NAME_ERROR > HTTP_ERROR > CHUNK_MISMATCH > COVERAGE_GAP
    > PARITY_FAIL > PASS

NAME_ERROR outranks HTTP_ERROR because an engine that cannot place a name answers non-200 too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from harness.checks.base import CheckResult
from harness.checks.engine_state import check_engine_caches, check_weight_version
from harness.checks.logprobs import check_logprobs, check_logprobs_expected, check_resync_unchanged
from harness.checks.names import check_coverage, check_names
from harness.checks.parity import (
    check_group,
    check_parity_cross_mode,
    check_parity_expected,
    check_parity_sent,
    check_parity_sync0,
    check_requested_mode,
    check_sent_layout,
)
from harness.checks.transfer import (
    check_chunks,
    check_config,
    check_crash,
    check_deadlock,
    check_http_status,
    check_recovery,
    check_syncs_ran,
    check_transfer_init,
)
from harness.record import RunRecord

# Overall verdict priority, most severe first; PASS when nothing failed.
PRIORITY: tuple[str, ...] = (
    "CONFIG_ERROR",
    "DEADLOCK",
    "CRASH",
    "NAME_ERROR",
    "HTTP_ERROR",
    "CHUNK_MISMATCH",
    "COVERAGE_GAP",
    "PARITY_FAIL",
    "PASS",
)

CHECKS: tuple[Callable[[RunRecord], CheckResult], ...] = (
    check_config,
    check_deadlock,
    check_transfer_init,
    check_recovery,
    check_crash,
    check_sent_layout,
    check_http_status,
    check_names,
    check_chunks,
    check_coverage,
    check_parity_sync0,
    check_parity_sent,
    check_parity_expected,
    check_parity_cross_mode,
    check_requested_mode,
    check_syncs_ran,
    check_group,
    check_logprobs,
    check_logprobs_expected,
    check_resync_unchanged,
    check_weight_version,
    check_engine_caches,
)


def overall_verdict(results: Iterable[CheckResult]) -> str:
    """The most severe failing verdict by `PRIORITY`, or PASS."""
    failing = {result.verdict_on_fail for result in results if result.failed}
    return next((verdict for verdict in PRIORITY if verdict in failing), "PASS")


def first_failure(results: Iterable[CheckResult], verdict: str) -> CheckResult | None:
    """The first failing check whose verdict is `verdict` (the one that decided the run)."""
    return next((r for r in results if r.failed and r.verdict_on_fail == verdict), None)


def judge(record: RunRecord) -> tuple[str, list[CheckResult]]:
    """Run every check on the record; return the overall verdict and all results."""
    results = [check(record) for check in CHECKS]
    return overall_verdict(results), results


def judged(record: RunRecord) -> RunRecord:
    """A copy of the record with `verdict` and `checks` filled in from `judge` (record unchanged)."""
    verdict, results = judge(record)
    return record.model_copy(update={"verdict": verdict, "checks": [r.model_dump() for r in results]})


def expected_verdict(record: RunRecord) -> str:
    """The verdict the scenario expects (``expect:``), PASS by default."""
    return record.scenario.expect


def expectation_met(record: RunRecord, verdict: str | None = None) -> bool:
    """Whether the record's verdict (`verdict`, else judged now) is the one the scenario expects and, when
    the scenario also expects a note (`expect_note`), some check's message or reason says it."""
    results = None
    if verdict is None:
        verdict, results = judge(record)
    if verdict != expected_verdict(record):
        return False
    note = record.scenario.expect_note
    if not note:
        return True
    if results is None:
        results = judge(record)[1]
    return any(note in r.message or note in r.reason for r in results)

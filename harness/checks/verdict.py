"""One verdict from all checks: `judge` runs every check of `CHECKS` and picks the most severe failure::

    CONFIG_ERROR > DEADLOCK > CRASH > NAME_ERROR > HTTP_ERROR > CHUNK_MISMATCH > COVERAGE_GAP
    > PARITY_FAIL > RESOURCE_LEAK > PASS

NAME_ERROR outranks HTTP_ERROR because an engine that cannot place a name answers non-200 too.

Several engine replicas (`engines` > 1): every check judges every engine, each on the record as that
engine saw it (`RunRecord.engine_view`: its calls, the sender's account of it, what the harness measured
on it). A check that fails alike for every engine (the run, the trainer, the sender) says so once; one
that fails differently names the first engine that failed ("engine 1: ...") and which others did.

RESOURCE_LEAK comes last: every other failure can cause growth (a rejected chunk held by its exception's
traceback, a crashed rank's buffers), none is explained by a leak, and a leak is judged only over syncs
that ran, so a run that failed otherwise is named by that failure.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

from harness.checks.base import CheckResult, excerpt, failed
from harness.checks.engine_state import (
    check_completions_in_session,
    check_engine_caches,
    check_engine_fresh,
    check_weight_version,
)
from harness.checks.engine_tp import check_engine_tp_shards
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
from harness.checks.resources import check_resources
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
from harness.record import INTERRUPTED, RunRecord

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
    "RESOURCE_LEAK",
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
    check_engine_fresh,
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
    check_completions_in_session,
    check_engine_caches,
    check_engine_tp_shards,
    check_resources,
)


def overall_verdict(results: Iterable[CheckResult]) -> str:
    """The most severe failing verdict by `PRIORITY`, or PASS."""
    failing = {result.verdict_on_fail for result in results if result.failed}
    return next((verdict for verdict in PRIORITY if verdict in failing), "PASS")


def first_failure(results: Iterable[CheckResult], verdict: str) -> CheckResult | None:
    """The first failing check whose verdict is `verdict` (the one that decided the run)."""
    return next((r for r in results if r.failed and r.verdict_on_fail == verdict), None)


def guarded(check: Callable[[RunRecord], CheckResult], record: RunRecord) -> CheckResult:
    """`check(record)`, or, where the check itself raised, a CRASH result naming the check and its exception:
    a check that cannot judge a record must not end the run (every scenario after it unjudged and "not run")
    nor let the scenario PASS. Corrupted weights once made a log-prob difference that overflowed `math.exp`
    inside a check."""
    try:
        return check(record)
    except Exception as e:  # any exception of a check is reported, never raised
        name = check.__name__.removeprefix("check_")
        where = traceback.extract_tb(e.__traceback__)[-1]
        return failed(
            name,
            "CRASH",
            f"the harness's check {check.__name__} raised {type(e).__name__}: {excerpt(str(e))} "
            f"({Path(where.filename).name}:{where.lineno}); the record is kept and the other checks ran",
        )


def judge(record: RunRecord) -> tuple[str, list[CheckResult]]:
    """Run every check on the record (on every engine's view of it, `judge_engines`), each `guarded`; return
    the overall verdict and all results."""
    if record.engine_count <= 1:
        results = [guarded(check, record) for check in CHECKS]
    else:
        views = [record.engine_view(i) for i in range(record.engine_count)]
        results = [judge_engines(functools.partial(guarded, check), views) for check in CHECKS]
    return overall_verdict(results), results


def judge_engines(check: Callable[[RunRecord], CheckResult], views: list[RunRecord]) -> CheckResult:
    """One check over every engine replica's view (`views[i]` = `RunRecord.engine_view(i)`): engine 0's
    result when no engine fails it; the failure itself when every failing engine fails it alike and all
    engines fail it; otherwise the first failing engine's failure, prefixed "engine i: ", with the other
    failing engines named at the end."""
    results = [check(view) for view in views]
    failing = [(i, r) for i, r in enumerate(results) if r.failed]
    if not failing:
        return results[0]
    first_engine, first = failing[0]
    if len(failing) == len(results) and len({r.message for _, r in failing}) == 1:
        return first
    others = [i for i, _ in failing[1:]]
    also = f" (also failing on engine{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    return first.model_copy(update={"message": f"engine {first_engine}: {first.message}{also}"})


def judged(record: RunRecord) -> RunRecord:
    """A copy of the record with `verdict` and `checks` filled in from `judge` (record unchanged)."""
    verdict, results = judge(record)
    return record.model_copy(update={"verdict": verdict, "checks": [r.model_dump() for r in results]})


def expected_verdict(record: RunRecord) -> str:
    """The verdict the scenario expects (``expect:``), PASS by default."""
    return record.scenario.expect


def interrupted(record: RunRecord) -> bool:
    """Whether Ctrl-C or a signal stopped the scenario (the runner's `KeyboardInterrupt` among its errors,
    `harness.interrupts.interrupted_error`): its record holds what it had, and its verdict says nothing of
    the code under test."""
    return any(e.where == "runner" and e.type == INTERRUPTED for e in record.errors)


def expectation_met(record: RunRecord, verdict: str | None = None) -> bool:
    """Whether the record's verdict (`verdict`, else judged now) is the one the scenario expects and, when
    the scenario also expects a note (`expect_note`), some check's message or reason says it. Never for an
    `interrupted` scenario: a fault that expects CRASH is not caught by a Ctrl-C."""
    if interrupted(record):
        return False
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

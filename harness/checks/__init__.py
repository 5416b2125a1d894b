"""Pure checks: one `RunRecord` in, `CheckResult`s and one verdict out.

Every check reads only the record (no I/O, no processes, no clocks), so a saved `records/<scenario>.json`
can be re-judged anywhere, and reads data only: the engine's answers arrive as `Rejection`s, parsed once
by the update client with the engine kind's parser (`EngineKind.parse_rejections`). Each check
answers one question and, when it fails, says which sync / chunk / tensor / route was the *first* to go
wrong and by how much. By concern: `transfer` (config, deadlock, crash, HTTP status, chunks, syncs ran),
`names` (names, coverage), `parity` (checksums, export modes, groups), `logprobs` (log-prob parity and
re-sync), `engine_state` (weight version, completions during a session, caches), `engine_tp` (each engine
TP rank's shards), `verdict` (the order of verdicts and `judge`); `base` holds `CheckResult` and message
words.
"""

from __future__ import annotations

from harness.checks.base import CheckResult
from harness.checks.engine_state import (
    check_completions_in_session,
    check_engine_caches,
    check_engine_fresh,
    check_weight_version,
)
from harness.checks.engine_tp import check_engine_tp_shards
from harness.checks.logprobs import (
    LOGPROB_BUDGETS,
    check_logprobs,
    check_logprobs_expected,
    check_resync_unchanged,
    logprob_parity,
)
from harness.checks.names import check_coverage, check_names
from harness.checks.parity import (
    check_group,
    check_parity_cross_mode,
    check_parity_expected,
    check_parity_sent,
    check_parity_sync0,
    check_requested_mode,
    check_sent_layout,
    group_differences,
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
from harness.checks.verdict import (
    CHECKS,
    PRIORITY,
    expectation_met,
    expected_verdict,
    first_failure,
    interrupted,
    judge,
    judged,
    overall_verdict,
)

__all__ = [
    "CHECKS",
    "LOGPROB_BUDGETS",
    "PRIORITY",
    "CheckResult",
    "check_chunks",
    "check_completions_in_session",
    "check_config",
    "check_coverage",
    "check_crash",
    "check_deadlock",
    "check_engine_caches",
    "check_engine_fresh",
    "check_engine_tp_shards",
    "check_group",
    "check_http_status",
    "check_logprobs",
    "check_logprobs_expected",
    "check_names",
    "check_parity_cross_mode",
    "check_parity_expected",
    "check_parity_sent",
    "check_parity_sync0",
    "check_recovery",
    "check_requested_mode",
    "check_resync_unchanged",
    "check_sent_layout",
    "check_syncs_ran",
    "check_transfer_init",
    "check_weight_version",
    "expectation_met",
    "expected_verdict",
    "first_failure",
    "group_differences",
    "interrupted",
    "judge",
    "judged",
    "logprob_parity",
    "overall_verdict",
]

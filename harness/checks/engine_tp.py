"""An engine with TP ranks: after every sync each rank holds vLLM's partition of the expected state
(PARITY_FAIL).

vLLM's TP workers each receive every chunk whole and keep their own piece of each tensor
(`reference_impl.engine.embedded.tp` says why the embedded engine mirrors that). A rank that keeps the
wrong piece can still leave a rebuilt full model right (the pieces tile the tensor another way), so the
ranks are judged one by one: each rank's shards, in vLLM names (`SyncRecord.engine_tp_checksums`), against
what vLLM's partition of the expected state gives that rank, computed by the harness on its own
(`harness.oracles.tp_shards`, `SyncRecord.expected_tp_checksums`). An engine that reports nothing per
tensor (vLLM) is judged on its log-probs instead.
"""

from __future__ import annotations

from harness.checks.base import CheckResult, engine_reports_tensors, failed, oracle_failure, passed, skipped
from harness.checks.parity import first_difference
from harness.record import RunRecord

VERDICT = "PARITY_FAIL"


def check_engine_tp_shards(record: RunRecord) -> CheckResult:
    """After every sync every TP rank of the engine holds, bit for bit, vLLM's partition of the expected
    state for that rank; the message names the sync, the rank and the first vLLM parameter that differs."""
    name = "engine_tp_shards"
    if record.scenario.engine_tp <= 1:
        return skipped(name, VERDICT, "engine TP 1: the engine has no TP ranks")
    if not engine_reports_tensors(record):
        why = "the engine reports no per-rank shards: log-prob parity judges what its ranks hold"
        return skipped(name, VERDICT, why)
    why = oracle_failure(record, name)
    if why is not None:
        return skipped(name, VERDICT, why)
    judged = [s for s in record.syncs if s.expected_tp_checksums]
    if not judged:
        return skipped(name, VERDICT, "no expected TP shards recorded")
    for s in judged:
        if not s.engine_tp_checksums:
            tp = record.scenario.engine_tp
            return failed(name, VERDICT, f"sync {s.index}: the engine reported no TP shards (engine_tp {tp})")
        for rank in sorted(s.expected_tp_checksums, key=int):
            diff = first_difference(
                s.expected_tp_checksums[rank],
                s.engine_tp_checksums.get(rank, {}),
                "vLLM's partition of the expected state",
                f"TP rank {rank}",
            )
            if diff:
                return failed(name, VERDICT, f"sync {s.index}: TP rank {rank}: {diff}")
    return passed(name, VERDICT)

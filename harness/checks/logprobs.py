"""Log-prob parity: after every sync the engine's prompt log-probs match the trainer's within the dtype's
budget, and a re-sync of unchanged weights leaves the engine's log-probs exactly as they were."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from harness.checks.base import CheckResult, engine_reports_tensors, failed, oracle_failure, passed, skipped
from harness.record import RunRecord

# Log-prob budgets by checkpoint dtype. fp32 on CPU: trainer (fused, chunked, fp32 logits from the
# hidden states) and engine (full logits, log_softmax) differ only by summation order, ~1e-6 (at most
# 9.5e-7 over every sync of the 200-sync soaks, dense and MoE); 1e-4 leaves room for long prompts.
# bf16: both forwards run in bf16 but the trainer's fused path multiplies in fp32 and the engine's lm_head
# in bf16; logits of magnitude ~10 carry ~0.04 of rounding (8-bit mantissa), so max |diff| <= 0.1 and
# NeMo-RL's mean exp|diff| <= 1.02 (they flag ~1.05 as a broken sync).
LOGPROB_BUDGETS: dict[str, dict[str, float]] = {
    "float32": {"max_abs": 1e-4, "mean_exp_abs": 1.0001},
    "bfloat16": {"max_abs": 0.1, "mean_exp_abs": 1.02},
}


# The largest difference a comparison reports: the record is JSON, which has no infinity (pydantic writes
# inf as null, and a null in a record read back is no number for a budget).
WORST = sys.float_info.max


def _abs_diff(a: float, b: float) -> float:
    """|a - b|, with NaN (a side that computed NaN, or inf - inf) and inf as `WORST`: the worst difference,
    never one that compares as neither larger nor smaller."""
    d = abs(a - b)
    return WORST if math.isnan(d) or math.isinf(d) else d


def _exp(d: float) -> float:
    """exp(d), `WORST` past the largest float (`math.exp` raises OverflowError from d = 709.8 on)."""
    return math.exp(d) if d < 709.0 else WORST


def logprob_parity(trainer: Sequence[Sequence[float]], engine: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Differences between trainer and engine log-probs of the same prompts (pure): tokens, max_abs,
    mean_abs, mean_exp_abs (mean of exp|diff|, NeMo-RL's token_mult_prob_error) and the first position where
    they differ most. Log-probs are natural-log probabilities, one list of floats per
    prompt. Weights the sync corrupted can make a difference of thousands (or NaN): exp of it, and a NaN or
    infinite difference, read `WORST`, never an OverflowError.

    Raises:
        ValueError: the two sides have different prompt counts or lengths.
    """
    if len(trainer) != len(engine) or any(len(a) != len(b) for a, b in zip(trainer, engine, strict=False)):
        raise ValueError(
            f"trainer and engine log-probs do not line up: {[len(a) for a in trainer]} vs {[len(b) for b in engine]}"
        )
    diffs = [
        (_abs_diff(a, b), p, i, a, b)
        for p, (ta, tb) in enumerate(zip(trainer, engine, strict=True))
        for i, (a, b) in enumerate(zip(ta, tb, strict=True))
    ]
    if not diffs:
        return {"tokens": 0, "max_abs": 0.0, "mean_abs": 0.0, "mean_exp_abs": 1.0, "first_diff": ""}
    worst = max(diffs)
    return {
        "tokens": len(diffs),
        "max_abs": worst[0],
        "mean_abs": min(WORST, sum(d[0] / len(diffs) for d in diffs)),
        "mean_exp_abs": min(WORST, sum(_exp(d[0]) / len(diffs) for d in diffs)),
        "first_diff": f"prompt {worst[1]} position {worst[2] + 1}: trainer {worst[3]:.6f} engine {worst[4]:.6f}",
    }


def _over_budget(record: RunRecord, name: str, field: str, budget: dict[str, float], versus: str) -> CheckResult:
    """The first sync whose log-prob comparison `field` ("logprobs" | "logprobs_expected") is over `budget`."""
    verdict = "PARITY_FAIL"
    why = oracle_failure(record, name)
    if why is not None:
        return skipped(name, verdict, why)
    measured = [s for s in record.syncs if getattr(s, field)]
    if not measured or not budget:
        return skipped(name, verdict, "no log-prob measurement in this record")
    for s in measured:
        lp = getattr(s, field)
        if lp["max_abs"] > budget["max_abs"] or lp["mean_exp_abs"] > budget["mean_exp_abs"]:
            return failed(
                name,
                verdict,
                f"sync {s.index}: {versus} log-prob max |diff| {lp['max_abs']:.3g} (budget {budget['max_abs']:.3g}), "
                f"mean exp|diff| {lp['mean_exp_abs']:.6f} (budget {budget['mean_exp_abs']:.6g}); worst at "
                f"{lp['first_diff']} (temperature {lp.get('temperature')})",
            )
    return passed(name, verdict)


def check_logprobs(record: RunRecord) -> CheckResult:
    """After every sync, the engine's log-probs on the fixed prompts match the trainer's own (its Megatron
    forward) within the budget (`trainer_logprob_budget`: the dtype's, plus a model family's known gap).
    On an engine that reports nothing per tensor (vLLM) a finished sync with no log-prob comparison at all
    fails: log-probs are the only evidence of what it holds."""
    name = "logprob_parity"
    if not engine_reports_tensors(record):
        bare = next((s for s in record.syncs if s.finished and not (s.logprobs or s.logprobs_expected)), None)
        if bare is not None:
            why = oracle_failure(record, name) or oracle_failure(record, "logprob_expected")
            cause = f"{why}; and " if why else "no log-prob comparison, and "
            nothing_else = "this engine reports nothing else about the weights it holds"
            return failed(name, "PARITY_FAIL", f"sync {bare.index}: {cause}{nothing_else}")
    budget = record.trainer_logprob_budget or record.logprob_budget
    return _over_budget(record, name, "logprobs", budget, "trainer vs engine")


def check_logprobs_expected(record: RunRecord) -> CheckResult:
    """After every sync, the engine's log-probs match a transformers forward over the expected state (the
    checkpoint with the trainer's steps applied, `harness.oracles.expected`) within the dtype's budget: a
    third view that shares no code with the trainer or the export."""
    budget = record.logprob_budget
    return _over_budget(record, "logprob_expected", "logprobs_expected", budget, "expected state vs engine")


def check_resync_unchanged(record: RunRecord) -> CheckResult:
    """A sync of unchanged weights leaves the engine's log-probs exactly as they were."""
    name, verdict = "resync_logprobs_unchanged", "PARITY_FAIL"
    for prev, s in zip(record.syncs, record.syncs[1:], strict=False):
        if s.perturbed or s.recovery or not s.engine_logprobs or not prev.engine_logprobs:
            continue  # a recovery sync follows a failed one: the engine's log-probs are expected to move
        if s.engine_logprobs != prev.engine_logprobs:
            diff = logprob_parity(prev.engine_logprobs, s.engine_logprobs)
            return failed(
                name,
                verdict,
                f"sync {s.index} re-sent unchanged weights but the engine's "
                f"log-probs moved by up to {diff['max_abs']:.3g} ({diff['first_diff']})",
            )
        return passed(name, verdict)
    return skipped(name, verdict, "no re-sync of unchanged weights with log-probs in this record")

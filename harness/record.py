"""The run record: everything observed in one scenario.

This is the contract between the processes that run a scenario (trainer ranks, engine, runner) and
the pure checks that judge it (`harness.checks`). Every field is plain data so a record round-trips
through JSON (`records/<scenario>.json`) without loss; checks never look anywhere else.

Names of the phases of one sync are fixed (`PHASES`) and used alike in code, records, tables and
plots: gather (TP/PP/EP shards -> full tensors on the owning rank), convert (Megatron -> HF names
and layouts), transfer (chunks over the transfer group), load (engine copies received tensors into
its parameters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from harness.scenario import Scenario
from reference_impl.engine.base import Capabilities
from reference_impl.transport.observed import ChunkRecord, HttpCall, SyncReport, TensorLayout

__all__ = [
    "PHASES",
    "VERDICTS",
    "ChunkRecord",
    "ErrorRecord",
    "HttpCall",
    "OracleFailure",
    "RecoveryRecord",
    "RunRecord",
    "SyncRecord",
    "TensorLayout",
]

PHASES: tuple[str, ...] = ("gather", "convert", "transfer", "load")

VERDICTS: tuple[str, ...] = (
    "PASS",
    "CONFIG_ERROR",
    "HTTP_ERROR",
    "CHUNK_MISMATCH",
    "NAME_ERROR",
    "COVERAGE_GAP",
    "PARITY_FAIL",
    "DEADLOCK",
    "CRASH",
)


class ErrorRecord(BaseModel):
    """An exception seen anywhere in the scenario, with where it happened."""

    where: str  # "trainer", "engine", "runner"
    rank: int | None = None  # trainer global rank, None for engine/runner
    type: str  # exception class name, e.g. "KeyError"
    message: str
    traceback: str = ""


class OracleFailure(BaseModel):
    """One of the harness's own oracles could not run (the expected state, the trainer-side forward, the
    log-prob comparison, the second export path, the group comparison). It is never a verdict of the
    system under test: the check it belongs to says "oracle could not run" with this reason."""

    check: str  # the check the oracle serves, e.g. "logprob_parity"
    sync: int | None = None  # the sync it was run for, None when not per sync
    reason: str  # exception class and message


class RecoveryRecord(BaseModel):
    """After a failed sync: was the engine alive, and did one clean sync of the unchanged weights (every
    fault undone) leave it holding the expected state (`harness.session.ScenarioSession.recover`)?"""

    after_sync: int
    health_status: int = 0  # GET /health; 0 when no answer
    completion_status: int | None = None  # one prompt-log-prob completion; None when not tried
    engine_log_tail: str = ""  # when the engine no longer answers
    clean_sync: int | None = None  # the recovery sync's index in `syncs`
    clean_sync_finished: bool = False  # it ran start -> updates -> finish with every call answered 200


class SyncRecord(SyncReport):
    """One weight update (start -> update x chunks -> finish): the sender's `SyncReport` with phases and
    wall time merged over ranks, and what the harness measured after it."""

    index: int  # 0 = first sync (engine starts from dummy weights)
    weight_version: int
    rank: int = 0  # the sender's
    chunks_sent: int = 0  # chunks the sender sent (broadcast / handle hand-off finished)
    chunks_received: int = 0  # chunks the engine answered 200
    engine_checksums: dict[str, str] = Field(default_factory=dict)  # HF name -> engine after finish
    # HF name -> checksum of the state every export must produce after this sync (`harness.oracles.expected`).
    expected_checksums: dict[str, str] = Field(default_factory=dict)
    perturbed: bool = True  # the trainer's weights changed since the previous sync (False: a re-sync)
    recovery: bool = False  # the clean sync after a failed one (`RunRecord.recovery`)
    engine_weight_version: str | None = None  # GET /weight_info after the finish (None: not asked)
    # The probe served through the engine's caches after this sync: generated token, its log-prob on the
    # engine and under the expected state (`harness.session.ScenarioSession.measure_probe`).
    probe: dict[str, Any] = Field(default_factory=dict)
    # Log-prob parity after this sync (`harness.checks.logprob_parity`): forward, temperature, tokens,
    # max_abs, mean_abs, mean_exp_abs (NeMo-RL's mean exp|diff|), first_diff. `logprobs`: the trainer's
    # Megatron forward vs the engine; `logprobs_expected`: a transformers forward over the expected state
    # vs the engine.
    logprobs: dict[str, Any] = Field(default_factory=dict)
    logprobs_expected: dict[str, Any] = Field(default_factory=dict)
    engine_logprobs: list[list[float]] = Field(default_factory=list)  # per fixed prompt, after this sync


class RunRecord(BaseModel):
    """Everything observed in one scenario. Written as JSON, read by `harness.checks`."""

    scenario_id: str
    scenario: Scenario
    run_id: str = ""
    started_at: float = 0.0  # unix seconds
    ended_at: float = 0.0
    config_error: str | None = None
    deadlock: bool = False
    deadlock_at: str = ""  # what was in flight when the deadline passed ("sync 0", "perturb 2", ...)
    progress: dict[str, str] = Field(default_factory=dict)  # process label -> its last phase, at the deadline
    stacks: list[str] = Field(default_factory=list)  # stack dump files (deadlocks)
    http: list[HttpCall] = Field(default_factory=list)
    errors: list[ErrorRecord] = Field(default_factory=list)
    oracle_failures: list[OracleFailure] = Field(default_factory=list)
    recovery: RecoveryRecord | None = None
    syncs: list[SyncRecord] = Field(default_factory=list)
    requested_export_mode: str = ""  # export mode the scenario asked for
    engine_capabilities: Capabilities | None = None  # what the scenario's engine can report (None: not run)
    checkpoint_checksums: dict[str, str] = Field(default_factory=dict)  # ground truth, HF names
    checkpoint_layout: dict[str, TensorLayout] = Field(default_factory=dict)  # HF name -> shape and dtype
    engine_shards: list[str] = Field(default_factory=list)  # every engine parameter shard (HF names)
    # Both exports of one trainer state (after the last sync): mode -> HF name -> checksum.
    cross_mode_checksums: dict[str, dict[str, str]] = Field(default_factory=dict)
    # Scenarios of one group (`Scenario.group_key`) must leave bit-identical engine weights; filled
    # when the whole group has run: the other members compared, and every difference found.
    group_members: list[str] = Field(default_factory=list)
    group_differences: list[str] = Field(default_factory=list)
    logprob_budget: dict[str, float] = Field(default_factory=dict)  # max_abs / mean_exp_abs allowed
    # The same for the trainer's Megatron forward vs the engine: `logprob_budget` plus the model family's
    # known, sourced gap (`ModelFamily.trainer_logprob_gap`), when it has one.
    trainer_logprob_budget: dict[str, float] = Field(default_factory=dict)
    verdict: str = ""
    checks: list[dict[str, Any]] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    def save(self, path: Path) -> None:
        """Write the record as JSON (atomically: temp file then rename)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.model_dump_json(indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        """Read a record written by `save`."""
        return cls.model_validate(json.loads(path.read_text()))

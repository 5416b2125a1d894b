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


class HttpCall(BaseModel):
    """One HTTP call from the trainer's update client to the engine."""

    route: str
    status: int  # HTTP status; 0 when no response arrived (connection error)
    ms: float  # wall milliseconds from request to response
    sync: int | None = None  # sync index, None for calls outside a sync (init, checksum)
    chunk: int | None = None  # chunk index within the sync for /update_weights
    error: str | None = None  # response body (truncated) when status != 200


class ErrorRecord(BaseModel):
    """An exception seen anywhere in the scenario, with where it happened."""

    where: str  # "trainer", "engine", "runner"
    rank: int | None = None  # trainer global rank, None for engine/runner
    type: str  # exception class name, e.g. "KeyError"
    message: str
    traceback: str = ""


class ChunkRecord(BaseModel):
    """One chunk (bucket) of one sync: what was planned, sent and acknowledged."""

    index: int
    names: list[str]  # HF names planned into this chunk, in order
    bytes: int  # planned payload bytes
    sent: bool = False  # the trainer's sender finished its broadcast / handle hand-off
    received: bool = False  # the engine answered 200 to this chunk's /update_weights
    note: str = ""  # why a chunk was not sent, when the sender knows (e.g. the engine ended the session)


class SyncRecord(BaseModel):
    """One weight update: start -> update x chunks -> finish."""

    index: int  # 0 = first sync (engine starts from dummy weights)
    weight_version: int
    mode: str  # export mode that actually ran: "raw" | "bridge"
    chunks_planned: int = 0
    chunks_sent: int = 0
    chunks_received: int = 0
    chunks: list[ChunkRecord] = Field(default_factory=list)
    bytes: int = 0  # payload bytes sent in this sync
    phases: dict[str, float] = Field(default_factory=dict)  # PHASES -> seconds (max over ranks)
    total_s: float = 0.0  # wall seconds from the first gather to the engine's finish answer
    names_sent: list[str] = Field(default_factory=list)
    names_accepted: list[str] = Field(default_factory=list)
    names_rejected: dict[str, str] = Field(default_factory=dict)  # HF name -> engine's reason
    sent_checksums: dict[str, str] = Field(default_factory=dict)  # HF name -> checksum of sent bytes
    engine_checksums: dict[str, str] = Field(default_factory=dict)  # HF name -> engine after finish
    engine_update_counts: dict[str, int] = Field(default_factory=dict)  # engine slot -> updates
    finished: bool = False  # /finish_weight_update answered 200
    perturbed: bool = True  # the trainer's weights changed since the previous sync (False: a re-sync)
    # Log-prob parity after this sync (`harness.checks.logprob_parity`): forward, temperature, tokens,
    # max_abs, mean_abs, mean_exp_abs (NeMo-RL's mean exp|diff|), first_diff.
    logprobs: dict[str, Any] = Field(default_factory=dict)
    engine_logprobs: list[list[float]] = Field(default_factory=list)  # per fixed prompt, after this sync


class RunRecord(BaseModel):
    """Everything observed in one scenario. Written as JSON, read by `harness.checks`."""

    scenario_id: str
    scenario: dict[str, Any]
    run_id: str = ""
    started_at: float = 0.0  # unix seconds
    ended_at: float = 0.0
    config_error: str | None = None
    deadlock: bool = False
    stacks: list[str] = Field(default_factory=list)  # stack dump files (deadlocks)
    http: list[HttpCall] = Field(default_factory=list)
    errors: list[ErrorRecord] = Field(default_factory=list)
    syncs: list[SyncRecord] = Field(default_factory=list)
    requested_mode: str = ""  # export mode the scenario asked for
    checkpoint_checksums: dict[str, str] = Field(default_factory=dict)  # ground truth, HF names
    engine_slots: list[str] = Field(default_factory=list)  # every engine parameter slot (HF names)
    tied_embeddings: bool = False
    # Both exports of one trainer state (after the last sync): mode -> HF name -> checksum.
    cross_mode_checksums: dict[str, dict[str, str]] = Field(default_factory=dict)
    # Scenarios of one group (scenario["group_key"]) must leave bit-identical engine weights; filled
    # when the whole group has run: the other members compared, and every difference found.
    group_members: list[str] = Field(default_factory=list)
    group_differences: list[str] = Field(default_factory=list)
    logprob_budget: dict[str, float] = Field(default_factory=dict)  # max_abs / mean_exp_abs allowed
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

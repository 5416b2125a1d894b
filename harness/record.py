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
    "ProcessSample",
    "ResourceSample",
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
    "RESOURCE_LEAK",
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


class ProcessSample(BaseModel):
    """One process of a scenario (a trainer rank, the engine server) measured once, with its descendants
    (e.g. a Python resource tracker, vLLM's engine core): the sums over that process tree."""

    pid: int
    alive: bool = True  # False: the process was gone when sampled (the other fields are 0)
    procs: int = 0  # processes in the tree (the process itself and its descendants)
    rss_bytes: int = 0  # resident set size (psutil `memory_info().rss`), bytes
    threads: int = 0  # OS threads (psutil `num_threads()`)
    fds: int = 0  # open file descriptors (psutil `num_fds()`)
    shm: list[str] = Field(default_factory=list)  # /dev/shm segments the tree maps or holds open, by name


class ResourceSample(BaseModel):
    """What the scenario's processes and the host's `/dev/shm` held right after one sync (and its
    log-prob comparison) ended; taken by the runner's per-sync hook (`harness.soak.sample_resources`)."""

    sync: int  # the sync just finished (0-based; the re-sync is index `syncs`)
    t: float  # unix seconds
    processes: dict[str, ProcessSample] = Field(default_factory=dict)  # "rank0", ..., "engine"
    # The scenario's segments: those its processes held at this or an earlier sample that are still in
    # /dev/shm (a segment closed but never unlinked stays counted), and their bytes.
    shm_segments: int = 0
    shm_bytes: int = 0
    # Every segment in the host's /dev/shm and their bytes (other programs' too: reported, not judged).
    host_shm_segments: int = 0
    host_shm_bytes: int = 0


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
    # Log-prob parity after this sync (`harness.checks.logprob_parity`): forward, temperature, tokens,
    # max_abs, mean_abs, mean_exp_abs (NeMo-RL's mean exp|diff|), first_diff.
    logprobs: dict[str, Any] = Field(default_factory=dict)
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
    resources: list[ResourceSample] = Field(default_factory=list)  # one per sync when sampled (soak)
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

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
import os
import traceback
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from harness.scenario import Scenario
from reference_impl.engine.base import Capabilities
from reference_impl.transport.observed import ChunkRecord, EngineAccount, HttpCall, SyncReport, TensorLayout

__all__ = [
    "INTERRUPTED",
    "PHASES",
    "VERDICTS",
    "ChunkRecord",
    "EngineSync",
    "ErrorRecord",
    "HttpCall",
    "MidSessionAsk",
    "OracleFailure",
    "ProcessSample",
    "RecoveryRecord",
    "ResourceSample",
    "RunRecord",
    "SyncRecord",
    "TensorLayout",
    "TransferGroupRecord",
    "wall_split",
]

PHASES: tuple[str, ...] = ("gather", "convert", "transfer", "load")

# `ErrorRecord.type` of the runner's error for a scenario stopped by Ctrl-C or a signal
# (`harness.interrupts.interrupted_error`, `harness.checks.interrupted`)
INTERRUPTED = "KeyboardInterrupt"

# The parts of one scenario's wall time (`RunRecord.wall` keys, summary columns of the same names).
WALL_PARTS: tuple[str, ...] = ("setup_s", "syncs_s", "checks_s", "teardown_s")


def wall_split(marks: dict[str, float], checks_s: float) -> dict[str, float]:
    """A scenario's wall time in parts (`harness.record.WALL_PARTS`), seconds, from `time.perf_counter`
    marks "start", "syncs" (absent when setup failed), "teardown" and "end", and the time the session spent
    in checks while it synced (`ScenarioSession.checks_s`), which is taken out of the syncs' part."""
    syncs_at = marks.get("syncs", marks["teardown"])
    return {
        "setup_s": syncs_at - marks["start"],
        "syncs_s": max(0.0, marks["teardown"] - syncs_at - checks_s),
        "checks_s": checks_s,
        "teardown_s": marks["end"] - marks["teardown"],
    }


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


DIED = "ActorDiedError"  # `ErrorRecord.type` of a trainer rank whose process died (Ray's error for its call)


class ErrorRecord(BaseModel):
    """An exception seen anywhere in the scenario, with where it happened."""

    where: str  # "trainer", "engine", "runner"
    rank: int | None = None  # trainer global rank, None for engine/runner
    type: str  # exception class name, e.g. "KeyError"
    message: str
    traceback: str = ""


def error_from(exc: BaseException, rank: int | None, where: str) -> ErrorRecord:
    """An `ErrorRecord` of `exc` (Ray's wrapper unwrapped: the actor's own exception class and text)."""
    cause = getattr(exc, "cause", None) or exc
    return ErrorRecord(
        where=where,
        rank=rank,
        type=type(cause).__name__,
        message=str(cause)[:4000],
        traceback="".join(traceback.format_exception(exc))[-8000:],
    )


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
    engine: int = 0  # the engine replica whose liveness answers are these (the first one that failed, if any)


class TransferGroupRecord(BaseModel):
    """The transfer group as the sender set it up: where the engines met it and the rank each engine was
    given (`reference_impl.transport.group`; several engine replicas and engine TP in one group)."""

    master_address: str  # the sender's node address the engines were sent (127.0.0.1 on one node)
    world_size: int  # ranks in the group: the sender plus every engine worker
    rank_offsets: list[int] = Field(default_factory=list)  # per engine, as sent in its init_info
    engine_ranks: list[int] = Field(default_factory=list)  # per engine: its workers in the group (its TP)
    engine_urls: list[str] = Field(default_factory=list)  # per engine: its base URL
    token_required: bool = False  # every engine route asked for the run's bearer token


class MidSessionAsk(BaseModel):
    """What one engine answered while the sender was held at `point` of an open update session
    (`harness.mid_session`)."""

    point: str  # "after_first_chunk" (its answer in) | "before_finish" (every chunk answered, no finish sent)
    weight_version: str | None = None  # GET /weight_info (None: no answer)
    completion: int | None = None  # the status of a completion asked then (None: not asked; 0: no answer)
    paused: bool | None = None  # GET /is_paused, asked where no completion is (None: not asked or no answer)
    note: str = ""  # what the engine refused or what went wrong asking


class EngineSync(EngineAccount):
    """One engine replica in one sync (records with several engines): the sender's account of it
    (`observed.EngineAccount`) and what the harness measured on it after the sync, field for field as
    `SyncRecord` holds them for a single engine."""

    engine_checksums: dict[str, str] = Field(default_factory=dict)
    engine_tp_checksums: dict[str, dict[str, str]] = Field(default_factory=dict)
    engine_weight_version: str | None = None
    served_weight_version: str | None = None
    mid_session: list[MidSessionAsk] = Field(default_factory=list)
    probe: dict[str, Any] = Field(default_factory=dict)
    logprobs: dict[str, Any] = Field(default_factory=dict)
    logprobs_expected: dict[str, Any] = Field(default_factory=dict)
    engine_logprobs: list[list[float]] = Field(default_factory=list)


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
    # The harness's own clock: seconds from handing every rank its sync call to the last rank's report
    # (`harness.session.ScenarioSession.sync`); None in records made before it was measured.
    harness_s: float | None = None
    recovery: bool = False  # the clean sync after a failed one (`RunRecord.recovery`)
    engine_weight_version: str | None = None  # GET /weight_info after the finish (None: not asked)
    # The weight version the engine's completion after this sync is tagged with (the probe's answer; None: the
    # engine tags none, as vLLM, or no probe was served). Async RL drops or reweights rollouts by it.
    served_weight_version: str | None = None
    # What the engine answered at each point the sender was held with the update session open while the harness
    # asked it (`harness.mid_session`: after the first chunk was answered, and before the finish); see `held`.
    mid_session: list[MidSessionAsk] = Field(default_factory=list)
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
    # An engine with TP ranks and per-tensor reports: each rank's shards after this sync (TP rank -> vLLM name
    # -> checksum), and what vLLM's partition of the expected state gives each rank (`oracles.tp_shards`).
    engine_tp_checksums: dict[str, dict[str, str]] = Field(default_factory=dict)
    expected_tp_checksums: dict[str, dict[str, str]] = Field(default_factory=dict)
    # Several engine replicas: each one's part of this sync (the fields above are then all engines together
    # for the sender's account, and engine 0's for what the harness measured). Empty with one engine.
    engines: list[EngineSync] = Field(default_factory=list)  # type: ignore[assignment]

    @property
    def held(self) -> bool:
        """The sender was held mid-session while the harness asked the engine (`mid_session`): the sync is judged
        like every other, not timed (its wall time holds the asks)."""
        return bool(self.mid_session)

    @property
    def clocked_s(self) -> float:
        """The sync's seconds on the harness's own clock (`harness_s`: the ranks' sync call, from handing it out
        to the last report), less the hold-up of hashing what was sent for the record (`hashing_s`, which the
        sender measures and leaves out of its own `total_s`); the trainer's `total_s` in records made before the
        harness clocked syncs. What the summary's first and steady times are made of: a trainer timer that
        leaves part of the sync out cannot shorten them."""
        return self.total_s if self.harness_s is None else max(0.0, self.harness_s - self.hashing_s)

    def engine_view(self, engine: int) -> SyncRecord:
        """This sync as engine replica `engine` saw it: the sender's account of that engine and what the
        harness measured on it in the fields a single-engine record uses (itself when the sync has no
        per-engine part)."""
        if not self.engines:
            return self
        e = self.engines[engine]
        got = set(e.chunks_received)
        return self.model_copy(
            update={
                "chunks": [c.model_copy(update={"received": c.index in got}) for c in self.chunks],
                "chunks_received": len(e.chunks_received),
                "names_accepted": list(e.names_accepted),
                "names_rejected": dict(e.names_rejected),
                "engine_update_counts": dict(e.engine_update_counts),
                "finished": e.finished,
                "engine_checksums": dict(e.engine_checksums),
                "engine_tp_checksums": {r: dict(v) for r, v in e.engine_tp_checksums.items()},
                "engine_weight_version": e.engine_weight_version,
                "served_weight_version": e.served_weight_version,
                "mid_session": [a.model_copy() for a in e.mid_session],
                "probe": dict(e.probe),
                "logprobs": dict(e.logprobs),
                "logprobs_expected": dict(e.logprobs_expected),
                "engine_logprobs": [list(p) for p in e.engine_logprobs],
                "engines": [],
            }
        )


class Bound(BaseModel):
    """The same-run bound of the scenario's last sync (`reference_impl.transport.bound`), seconds: the bare
    gather (all-gathers and hand-offs of the same shards) and the bare wire (broadcasts of the same chunk
    sizes over the same transfer group, or copies into the same segment; None where the channel has none).
    Each is the fastest of the measurement's repeats, all of which ``gather_repeats_s`` and ``wire_repeats_s``
    keep in the order they ran (empty in records that predate them): the bound's own noise, which a regression
    report widens an efficiency row's band by."""

    gather_s: float
    wire_s: float | None = None
    gather_repeats_s: list[float] = Field(default_factory=list)
    wire_repeats_s: list[float] = Field(default_factory=list)

    @property
    def total_s(self) -> float | None:
        """`gather_s + wire_s`; None without a wire bound."""
        return None if self.wire_s is None else self.gather_s + self.wire_s

    @property
    def max_total_s(self) -> float | None:
        """The slowest repeat of the gather plus that of the wire; None without repeats of either."""
        if not self.gather_repeats_s or not self.wire_repeats_s:
            return None
        return max(self.gather_repeats_s) + max(self.wire_repeats_s)


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
    progress: dict[str, str] = Field(default_factory=dict)  # process label -> last phase, at a deadline or interrupt
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
    # Each engine replica's checksums (HF names) before sync 0, where the engine reports them: a tensor that
    # already held the checkpoint's bytes then is one that sync 0 cannot show moved (`check_engine_fresh`).
    engine_start_checksums: list[dict[str, str]] = Field(default_factory=list)
    # What a fresh engine of each replica's checkpoint and seed holds (`harness.oracles.fresh`), and each
    # replica's weight version before sync 0: an engine that did not start fresh differs (`check_engine_fresh`).
    engine_fresh_checksums: list[dict[str, str]] = Field(default_factory=list)
    engine_start_versions: list[str] = Field(default_factory=list)
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
    # Where the scenario's wall time went, seconds (`WALL_PARTS`): setup (checkpoint, processes, engine start,
    # trainer build, connect), syncs (syncs and trainer steps, the recovery's included), checks (the
    # harness's own reads of the engine, probes, log-prob views, oracles, judging), teardown (stops).
    wall: dict[str, float] = Field(default_factory=dict)
    resources: list[ResourceSample] = Field(default_factory=list)  # one per sync when sampled (soak)
    verdict: str = ""
    checks: list[dict[str, Any]] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    transfer_group: TransferGroupRecord | None = None  # non-colocate: the group the sender set up
    bound: Bound | None = None  # the last sync's same-run bound (None: not measured, see `notes`)

    @property
    def engine_count(self) -> int:
        """Engine replicas this record speaks of (the scenario's `engines`)."""
        return self.scenario.engines

    def engine_view(self, engine: int) -> RunRecord:
        """The record as engine replica `engine` saw it: its calls only (`HttpCall.engine`) and every sync's
        `SyncRecord.engine_view`, with one engine (what every check reads). Itself with one engine."""
        if self.engine_count <= 1:
            return self
        return self.model_copy(
            update={
                "http": [c for c in self.http if c.engine == engine],
                "syncs": [s.engine_view(engine) for s in self.syncs],
                "engine_start_checksums": self.engine_start_checksums[engine : engine + 1],
                "engine_fresh_checksums": self.engine_fresh_checksums[engine : engine + 1],
                "engine_start_versions": self.engine_start_versions[engine : engine + 1],
            }
        )

    def save(self, path: Path) -> None:
        """Write the record as JSON (atomically: a temp file of this process's own, then a rename)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")  # two processes saving one record never share it
        tmp.write_text(self.model_dump_json(indent=1))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        """Read a record written by `save`."""
        return cls.model_validate(json.loads(path.read_text()))

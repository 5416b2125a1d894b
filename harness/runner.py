"""Runs scenarios: Ray placement, lifecycle, deadlines, cleanup; fills one `RunRecord` per scenario.

Engines: `embedded` (ours, reports per-slot update counts and checksums in HF names) or `vllm` (real
vLLM from its own environment, `reference_impl.engine.vllm`): with vLLM the record has no engine
slots, counts or checksums, so coverage is judged from the names sent and engine parity from log-probs
(`harness.checks`).

Placement (non-colocate): one placement group per trainer world, one bundle per trainer rank, and a
separate bundle for the engine actor, which owns the engine server process. On a GPU host each bundle
also holds one GPU; a colocated engine shares the sender's bundle and GPU (half each). Trainer actors (one per
rank, `reference_impl.trainer.worker.TrainerWorker`) are reused across scenarios of the same world
size; a scenario that crashes or passes its deadline gets its processes killed and the next scenario
gets fresh ones. Every record is written as soon as its scenario ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from harness.checks import LOGPROB_BUDGETS, group_differences, judged, logprob_parity
from harness.faults import FAULTS
from harness.record import ErrorRecord, RunRecord, SyncRecord
from harness.scenario import Scenario, validate
from reference_impl.engine import rejection_parser
from reference_impl.engine.process import free_port
from reference_impl.forward.reference import fixed_prompts
from reference_impl.models.checkpoint import checkpoint_checksums, make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import UpdateClient
from reference_impl.transport.observed import HttpCall, SyncReport

SETUP_TIMEOUT_S = 900.0
FORWARDED_ENV = ("WSH_VLLM_PYTHON", "WSH_HF_CACHE", "WSH_CACHE", "VLLM_CPU_KVCACHE_SPACE")
# Seconds from launch to /health 200: the embedded engine loads a small model; vLLM starts an engine
# core, profiles memory and warms up (18-55 s on 2 shared cores, much more under load).
ENGINE_START_TIMEOUT_S = {"embedded": 300.0, "vllm": 900.0}
ENGINE_NOTES = {
    "vllm": (
        "engine vllm: no per-slot update counts or HF-name checksums (vLLM answers {message}; its "
        "/weight_checker keys are vLLM names and cannot see prepacked linear weights on CPU): coverage is "
        "judged from the names sent against the checkpoint, engine-side parity from log-probs"
    )
}


def ensure_ray(address: str | None = None) -> None:
    """Start (or join, with `address`) Ray once per driver process, without the dashboard."""
    if ray.is_initialized():
        return
    env_vars = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
    # What validation read in this driver must be what the engine actors read (also on a joined cluster).
    env_vars |= {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env = {"env_vars": env_vars}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=False)
    else:
        ray.init(num_cpus=64, include_dashboard=False, runtime_env=env, log_to_driver=False, configure_logging=False)


def use_gpus() -> bool:
    """Whether the Ray cluster has GPUs (then trainer ranks and engines are placed on them)."""
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


def order_for_reuse(scenarios: list[Scenario]) -> list[Scenario]:
    """Scenarios grouped by trainer world size (stable within a group), so each pool is made once."""
    first_seen: dict[int, int] = {}
    for i, sc in enumerate(scenarios):
        first_seen.setdefault(sc.world_size, i)
    return sorted(scenarios, key=lambda sc: first_seen[sc.world_size])


def shutdown_ray() -> None:
    """Stop the Ray instance this driver started (its worker processes end with it)."""
    if ray.is_initialized():
        ray.shutdown()


@ray.remote(num_cpus=0.5)
class EngineActor:
    """Owns one engine server process (started in `start`, ended in `stop`)."""

    def __init__(self) -> None:
        self.proc = None

    def start(
        self,
        checkpoint: str,
        seed: int,
        log_path: str,
        fault: str | None = None,
        engine: str = "embedded",
        dtype: str = "float32",
    ) -> str:
        """Start the scenario's engine (`embedded` or `vllm`) and return its base URL."""
        if engine == "vllm":
            from reference_impl.engine.vllm.launcher import VllmEngineProcess

            # The harness's gloo backend (wsh-vllm-plugin) on every host: the sender speaks the harness's
            # wire format, not vLLM's packed NCCL protocol.
            self.proc = VllmEngineProcess(checkpoint, seed, log_path, dtype=dtype, backend="gloo")
            return self.proc.start()
        from reference_impl.engine.embedded.launcher import EngineProcess

        self.proc = EngineProcess(checkpoint, seed, log_path, fault=fault)
        return self.proc.start()

    def pid(self) -> int | None:
        return self.proc.pid() if self.proc else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@dataclass
class TrainerPool:
    """Trainer actors of one world size, in one placement group (bundle i = rank i, last = engine)."""

    world_size: int
    pg: PlacementGroup
    actors: list[Any] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # OS pids of the rank processes (stack dumps)

    @classmethod
    def create(cls, world_size: int) -> TrainerPool:
        """Place `world_size` trainer ranks plus an engine bundle and start the rank actors."""
        from reference_impl.trainer.worker import TrainerWorker

        # Bundle r = trainer rank r; the last bundle is the engine's when not colocated. Bundles have 2
        # CPUs so a colocated engine (fractional share) fits beside rank 0.
        gpus = use_gpus()
        # On a GPU host every bundle also holds one GPU: rank r's, and the engine's own when not colocated.
        bundle = {"CPU": 2, "GPU": 1} if gpus else {"CPU": 2}
        pg = placement_group([bundle] * (world_size + 1), strategy="PACK")
        ray.get(pg.ready(), timeout=120)
        port = free_port()
        # Half a GPU per rank leaves the other half of bundle 0's GPU to a colocated engine.
        worker_cls = ray.remote(num_cpus=1, num_gpus=0.5 if gpus else 0)(TrainerWorker)
        actors = [
            worker_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
            ).remote(r, world_size, "127.0.0.1", port)
            for r in range(world_size)
        ]
        pids = ray.get([a.pid.remote() for a in actors], timeout=SETUP_TIMEOUT_S)
        return cls(world_size=world_size, pg=pg, actors=actors, pids=pids)

    def engine_strategy(self, colocate: bool) -> PlacementGroupSchedulingStrategy:
        """Scheduling for the engine actor: the sender's bundle when colocated (trainer and engine share
        its devices), else a bundle of its own."""
        bundle = 0 if colocate else self.world_size
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)

    @staticmethod
    def engine_gpus(colocate: bool) -> float:
        """GPUs the engine actor asks for (its server process inherits them): the other half of the
        sender's GPU when colocated, a whole one otherwise; 0 on a CPU host."""
        if not use_gpus():
            return 0.0
        return 0.5 if colocate else 1.0

    def kill(self) -> None:
        """End every rank process and free the placement group."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        remove_placement_group(self.pg)


def dump_stacks(pids: dict[str, int | None], out_dir: Path, timeout_s: float = 30.0) -> list[str]:
    """Python stacks of every process in `pids` (label -> pid) into `out_dir/<label>.txt` with
    `py-spy dump --subprocesses` (vLLM's server has its engine core and worker as children); returns the
    files written. A process py-spy cannot read gets its error in the file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    files = []
    for label, pid in pids.items():
        if pid is None:
            continue
        try:
            proc = subprocess.run(
                [py_spy, "dump", "--subprocesses", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s
            )
            text = proc.stdout + (f"\n[py-spy exit {proc.returncode}] {proc.stderr}" if proc.returncode else "")
        except (OSError, subprocess.TimeoutExpired) as e:
            text = f"py-spy dump --pid {pid} failed: {e}"
        path = out_dir / f"{label}.txt"
        path.write_text(f"# {label} pid {pid}\n{text}")
        files.append(str(path))
    return files


def kill_server_group(pid: int | None) -> None:
    """SIGKILL the process group of a vLLM server that its engine actor did not stop (the actor was
    killed first: the server runs in its own session, so nothing else ends it). Only a live group
    leader whose command line is vLLM's API server is touched; on another Ray node nothing is found."""
    if pid is None:
        return
    with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
        proc = psutil.Process(pid)
        if os.getpgid(pid) == pid and "vllm.entrypoints.openai.api_server" in " ".join(proc.cmdline()):
            os.killpg(pid, signal.SIGKILL)


class ScenarioFailed(Exception):
    """Raised inside `run_scenario` to stop a scenario early; its errors are already recorded."""


def _error_from(exc: BaseException, rank: int | None, where: str) -> ErrorRecord:
    cause = getattr(exc, "cause", None) or exc
    return ErrorRecord(
        where=where,
        rank=rank,
        type=type(cause).__name__,
        message=str(cause)[:4000],
        traceback="".join(traceback.format_exception(exc))[-8000:],
    )


@dataclass
class Runner:
    """Runs scenarios one after another into `out_dir` (records/, logs/)."""

    out_dir: Path
    run_id: str
    on_record: Callable[[RunRecord], None] | None = None
    pools: dict[int, TrainerPool] = field(default_factory=dict)

    def pool(self, world_size: int) -> TrainerPool:
        """The reusable pool for `world_size`. Only one pool lives at a time: idle rank processes still
        cost CPU on a small host, so a pool of another size is ended first (run scenarios grouped by
        world size, as `order_for_reuse` does)."""
        if world_size not in self.pools:
            for other in list(self.pools):
                self.drop_pool(other)
            self.pools[world_size] = TrainerPool.create(world_size)
        return self.pools[world_size]

    def drop_pool(self, world_size: int) -> None:
        """Kill a pool whose processes may be in a bad state."""
        pool = self.pools.pop(world_size, None)
        if pool is not None:
            pool.kill()

    def close(self) -> None:
        """Kill every pool."""
        for ws in list(self.pools):
            self.drop_pool(ws)

    def _get(self, refs: list[Any], timeout: float, record: RunRecord, what: str) -> list[Any]:
        """ray.get every ref; errors and timeouts are recorded, then ScenarioFailed is raised."""
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            record.deadlock = True
            record.notes.append(f"{what}: no progress within {timeout:.0f} s")
            raise ScenarioFailed(what) from None
        except ray.exceptions.RayError as e:
            # Find which rank failed: the first ref whose get raises.
            for i, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=1)
                except Exception as inner:
                    record.errors.append(_error_from(inner, i, "trainer"))
                    break
            else:
                record.errors.append(_error_from(e, None, "trainer"))
            raise ScenarioFailed(what) from e

    def run_scenario(self, sc: Scenario) -> RunRecord:
        """Validate, run and judge one scenario; the record is written before returning."""
        record = RunRecord(
            scenario_id=sc.id, scenario=sc.as_dict(), run_id=self.run_id, started_at=time.time(), requested_mode=sc.mode
        )
        problem = validate(sc)
        if problem:
            record.config_error = problem
            return self._finish(record)
        engine = None
        checker: UpdateClient | None = None
        healthy = False
        pids: dict[str, int | None] = {}
        try:
            spec = load_model(sc.model)
            record.tied_embeddings = spec.facts().tied_embeddings
            ckpt = make_checkpoint(spec, sc.seed, sc.dtype)
            record.checkpoint_checksums = checkpoint_checksums(ckpt)
            ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
            deadline = sc.deadline_s or 120.0 + ckpt_bytes / 20e6
            pool = self.pool(sc.world_size)
            log_path = self.out_dir / "logs" / (sc.id.replace("/", "__") + ".engine.log")
            fault = FAULTS[sc.fault] if sc.fault else None
            engine = EngineActor.options(
                scheduling_strategy=pool.engine_strategy(sc.colocate), num_gpus=pool.engine_gpus(sc.colocate)
            ).remote()
            setup_refs = [a.setup.remote(sc.as_dict(), str(ckpt)) for a in pool.actors]
            engine_fault = fault.name if fault and fault.side == "engine" else None
            url = self._get(
                [engine.start.remote(str(ckpt), sc.engine_seed, str(log_path), engine_fault, sc.engine, sc.dtype)],
                ENGINE_START_TIMEOUT_S[sc.engine],
                record,
                "engine start",
            )[0]
            pids = {f"rank{r}": pid for r, pid in enumerate(pool.pids)}
            pids["engine"] = ray.get(engine.pid.remote(), timeout=30)
            self._get(setup_refs, SETUP_TIMEOUT_S, record, "trainer setup")
            if fault and fault.apply is not None:
                self._get([a.run_in_process.remote(fault.apply) for a in pool.actors], 60, record, "apply fault")
                record.notes.append(f"fault injected: {fault.name} ({fault.description})")
            checker = UpdateClient(url, parse_rejections=rejection_parser(sc.engine))
            reports_tensors = sc.engine == "embedded"  # slots, counts and HF-name checksums (module doc)
            if reports_tensors:
                record.engine_slots = checker.slots()
            else:
                record.notes.append(ENGINE_NOTES[sc.engine])
            connect = [a.connect_engine.remote(url, sc.colocate, sc.engine) for a in pool.actors]
            for calls in self._get(connect, deadline, record, "connect engine"):
                record.http.extend(calls)
            record.logprob_budget = dict(LOGPROB_BUDGETS[sc.dtype]) if sc.logprobs else {}
            prompts = fixed_prompts(json.loads((ckpt / "config.json").read_text())) if sc.logprobs else []
            # syncs #0..N-1, then one more that re-sends unchanged weights (its log-probs must not move).
            for i in range(sc.syncs + 1):
                resync = i == sc.syncs
                if 0 < i < sc.syncs:
                    self._get([a.perturb.remote(i, sc.seed) for a in pool.actors], deadline, record, f"perturb {i}")
                refs = [a.sync.remote(i, i, sc.mode, sc.bucket_bytes) for a in pool.actors]
                per_rank = self._get(refs, deadline, record, f"sync {i}")
                sync = self._merge_sync(i, per_rank, record)
                sync.perturbed = not resync
                if reports_tensors:
                    sync.engine_checksums = checker.checksums()
                record.syncs.append(sync)
                if prompts:
                    self._measure_logprobs(sync, pool, checker, prompts, sc.temperature, deadline, record)
            for mode in ("raw", "bridge"):
                sums = self._get(
                    [a.export_checksums.remote(mode) for a in pool.actors], deadline, record, f"export {mode}"
                )
                record.cross_mode_checksums[mode] = sums[0]
            healthy = True
        except ScenarioFailed:
            if record.deadlock:
                record.stacks = dump_stacks(pids, self.out_dir / "stacks" / sc.id.replace("/", "__"))
        except Exception as e:
            record.errors.append(_error_from(e, None, "runner"))
        finally:
            if checker is not None:  # the harness's own calls (checksums, log-probs), also on failure
                record.http.extend(checker.calls)
                checker.close()
            if engine is not None:
                with contextlib.suppress(Exception):
                    ray.get(engine.stop.remote(), timeout=30)
                ray.kill(engine, no_restart=True)
                if sc.engine == "vllm":
                    kill_server_group(pids.get("engine"))
            if not healthy or sc.fault:  # a fault's patches live in these processes: never reuse them
                self.drop_pool(sc.world_size)
        return self._finish(record)

    def _measure_logprobs(
        self,
        sync: SyncRecord,
        pool: TrainerPool,
        checker: UpdateClient,
        prompts: list[Any],
        temperature: float,
        deadline: float,
        record: RunRecord,
    ) -> None:
        """Trainer log-probs (sender's reference forward over what it sent) vs the engine's, on the fixed
        prompts; the comparison goes into `sync.logprobs`."""
        trainer = self._get(
            [pool.actors[0].trainer_logprobs.remote(temperature)],
            deadline,
            record,
            f"trainer log-probs after sync {sync.index}",
        )[0]
        if "skipped" in trainer:
            record.notes.append(f"sync {sync.index}: no log-prob comparison: {trainer['skipped']}")
            return
        engine = [checker.prompt_logprobs(p.input_ids, temperature, p.image_url, sync=sync.index) for p in prompts]
        sync.engine_logprobs = engine
        sync.logprobs = logprob_parity(trainer["prompts"], engine) | {
            "forward": trainer["forward"],
            "temperature": temperature,
        }

    @staticmethod
    def _merge_sync(index: int, per_rank: list[tuple[SyncReport, list[HttpCall]]], record: RunRecord) -> SyncRecord:
        """One `SyncRecord` from every rank's report: the sender's (rank 0) observations; gather and convert
        as the slowest rank's, transfer and load as the sender's; the sender's calls go into the record."""
        reports = [report for report, _ in per_rank]
        sender = reports[0]
        record.http.extend(per_rank[0][1])
        phases = {k: max(r.phases.get(k, 0.0) for r in reports) for k in ("gather", "convert")}
        phases.update({k: sender.phases.get(k, 0.0) for k in ("transfer", "load")})
        return SyncRecord(
            **sender.model_dump(exclude={"rank", "phases", "total_s"}),
            index=index,
            weight_version=index,
            chunks_sent=sum(c.sent for c in sender.chunks),
            chunks_received=sum(c.received for c in sender.chunks),
            phases=phases,
            total_s=max(r.total_s for r in reports),
        )

    def finish_group(self, members: list[RunRecord]) -> list[RunRecord]:
        """Compare a finished group's members (`checks.group_differences`), store what was found in each
        record, judge and save them again; returns the updated records."""
        diffs = group_differences(members)
        out = []
        for rec in members:
            rec.group_members = [m.scenario_id for m in members if m is not rec]
            rec.group_differences = diffs
            rec = judged(rec)
            rec.save(self.record_path(rec.scenario_id))
            out.append(rec)
        return out

    def record_path(self, scenario_id: str) -> Path:
        """Where a scenario's record is written."""
        return self.out_dir / "records" / (scenario_id.replace("/", "__") + ".json")

    def _finish(self, record: RunRecord) -> RunRecord:
        record.ended_at = time.time()
        record = judged(record)
        record.save(self.record_path(record.scenario_id))
        if self.on_record:
            self.on_record(record)
        return record

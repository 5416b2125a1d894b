"""Runs scenarios: setup, cleanup, groups; fills and writes one `RunRecord` per scenario.

Where the processes run is `harness.placement` (Ray, trainer pools, the engine actor); what happens while
a scenario runs (its syncs, deadlines and oracles) is `harness.session`. What the engine
can report comes from its adapter's capabilities (`reference_impl.engine`), recorded in the run record:
an engine with per-tensor reports (the embedded one) gives update counts per shard and HF-name
checksums after every sync; one without (vLLM) is judged on the names sent and on log-probs
(`harness.checks`). A scenario that crashes or passes its deadline gets its processes killed and the
next scenario gets fresh ones. Every record is written as soon as its scenario ends.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray

from harness.checks import group_differences, judged
from harness.faults import FAULTS
from harness.placement import SETUP_TIMEOUT_S, EngineActor, TrainerPool
from harness.record import OracleFailure, RunRecord
from harness.scenario import Scenario
from harness.session import ScenarioFailed, ScenarioSession, error_from, oracle_into
from harness.stacks import dump_stacks
from harness.validate import validate
from reference_impl.engine import engine_kind
from reference_impl.forward.hf import fixed_prompts
from reference_impl.forward.prompts import probe_prompt
from reference_impl.models.checkpoint import checkpoint_checksums, checkpoint_layout, make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient
from reference_impl.transport.observed import HttpCall, TensorLayout
from reference_impl.worker import TrainerSetup


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

    def run_scenario(self, sc: Scenario, config_error: str | None = None, validated: bool = False) -> RunRecord:
        """Run and judge one scenario; the record is written before returning. Unless `validated` (the
        caller already ran `harness.validate.validate` and passes its answer as `config_error`), the
        scenario is validated here first."""
        record = RunRecord(
            scenario_id=sc.id,
            scenario=sc,
            run_id=self.run_id,
            started_at=time.time(),
            requested_export_mode=sc.export_mode,
        )
        problem = config_error if validated else validate(sc)
        if problem:
            record.config_error = problem
            return self._finish(record)
        kind = engine_kind(sc.engine)
        record.engine_capabilities = kind.capabilities
        if kind.note:
            record.notes.append(kind.note)
        engine = None
        checker: EngineClient | None = None
        healthy = False
        pids: dict[str, int | None] = {}
        try:
            spec = load_model(sc.model)
            ckpt = make_checkpoint(spec, sc.seed, sc.dtype)
            record.checkpoint_checksums = checkpoint_checksums(ckpt)
            record.checkpoint_layout = {
                n: TensorLayout(shape=shape, dtype=dtype) for n, (shape, dtype) in checkpoint_layout(ckpt).items()
            }
            ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
            deadline = sc.deadline_s or 120.0 + ckpt_bytes / 20e6
            pool = self.pool(sc.world_size)
            log_path = self.out_dir / "logs" / (sc.id.replace("/", "__") + ".engine.log")
            fault = FAULTS[sc.fault] if sc.fault else None
            engine = EngineActor.options(
                scheduling_strategy=pool.engine_strategy(sc.colocate), num_gpus=pool.engine_gpus(sc.colocate)
            ).remote()
            trace = self.trace_dir(sc.id)
            shutil.rmtree(trace, ignore_errors=True)
            setup = TrainerSetup(sc.model, str(ckpt), sc.dtype, sc.tp, sc.pp, sc.ep, sc.etp, trace_dir=str(trace))
            setup_refs = [a.setup.remote(setup) for a in pool.actors]
            hook = fault.hook if fault is not None else None
            start = engine.start.remote(sc.engine, str(ckpt), sc.engine_seed, str(log_path), sc.dtype, hook)
            session = ScenarioSession(sc, record, kind, pool, engine, deadline, trace, ckpt, fault)
            url = session.get([start], kind.start_timeout_s, "engine start")[0]
            checker = session.checker = EngineClient(url, parse_rejections=kind.parse_rejections)
            pids = {f"rank{r}": pid for r, pid in enumerate(pool.pids)}
            pids["engine"] = ray.get(engine.pid.remote(), timeout=30)
            session.get(setup_refs, SETUP_TIMEOUT_S, "trainer setup")
            if fault is not None and fault.trainer is not None and sc.fault_sync is None:
                session.on_ranks("run_in_process", fault.trainer, what="apply fault", timeout=60)
                record.notes.append(f"fault injected: {fault.name} ({fault.description})")
            if kind.capabilities.per_tensor_reports:
                record.engine_shards = checker.shards()
            session.connect()
            if sc.logprobs:
                config = json.loads((ckpt / "config.json").read_text())
                session.prompts = fixed_prompts(config)
                session.probe = probe_prompt(config)
            session.run_syncs()
            session.cross_export()
            healthy = True
        except ScenarioFailed:
            if record.deadlock:
                record.stacks = dump_stacks(pids, self.out_dir / "stacks" / sc.id.replace("/", "__"))
        except Exception as e:
            record.errors.append(error_from(e, None, "runner"))
        finally:
            if checker is not None:  # the harness's own calls (checksums, log-probs), also on failure
                record.http.extend(checker.calls)
                checker.close()
            if not healthy:
                self._recover_calls(record)
            if engine is not None:
                with contextlib.suppress(Exception):
                    ray.get(engine.stop.remote(), timeout=30)
                ray.kill(engine, no_restart=True)
                kind.reap(pids.get("engine"))
            if not healthy or sc.fault:  # a fault's patches live in these processes: never reuse them
                self.drop_pool(sc.world_size)
        return self._finish(record)

    def trace_dir(self, scenario_id: str) -> Path:
        """Where a scenario's ranks keep their progress lines and call logs."""
        return self.out_dir / "trace" / scenario_id.replace("/", "__")

    def _recover_calls(self, record: RunRecord) -> None:
        """Add the calls the ranks logged (`rank<r>.calls.jsonl`) that never came back to the runner (a sync
        that hung or raised): nothing recorded is lost when a scenario fails."""
        seen = {(c.rank, c.t, c.route, c.sync, c.chunk) for c in record.http}
        for log in sorted(self.trace_dir(record.scenario_id).glob("*.calls.jsonl")):
            for line in log.read_text().splitlines():
                call = HttpCall.model_validate_json(line)
                if (call.rank, call.t, call.route, call.sync, call.chunk) not in seen:
                    record.http.append(call)
        record.http.sort(key=lambda c: c.t)

    def finish_group(self, members: list[RunRecord]) -> list[RunRecord]:
        """Compare a finished group's members (`checks.group_differences`), store what was found in each
        record, judge and save them again; returns the updated records."""
        failures: list[OracleFailure] = []
        diffs = oracle_into(failures, "group_invariance", lambda: group_differences(members)) or []
        out = []
        for rec in members:
            rec.group_members = [m.scenario_id for m in members if m is not rec]
            rec.group_differences = diffs
            rec.oracle_failures.extend(failures)
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

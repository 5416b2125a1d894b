"""Runs scenarios: lifecycle, deadlines, cleanup; fills one `RunRecord` per scenario.

Where the processes run is `harness.placement` (Ray, trainer pools, the engine actor). What the engine
can report comes from its adapter's capabilities (`reference_impl.engine`), recorded in the run record:
an engine with per-tensor reports (the embedded one) gives update counts per shard and HF-name
checksums after every sync; one without (vLLM) is judged on the names sent and on log-probs
(`harness.checks`). A scenario that crashes or passes its deadline gets its processes killed and the
next scenario gets fresh ones. Every record is written as soon as its scenario ends.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from harness.checks import LOGPROB_BUDGETS, check_transfer_init, group_differences, judged, logprob_parity
from harness.faults import FAULTS
from harness.oracles.expected import ExpectedState
from harness.placement import SETUP_TIMEOUT_S, EngineActor, TrainerPool
from harness.record import ErrorRecord, OracleFailure, RunRecord, SyncRecord
from harness.scenario import Scenario
from harness.stacks import dump_stacks
from harness.validate import validate
from reference_impl.engine import engine_kind
from reference_impl.forward.hf import fixed_prompts
from reference_impl.models.checkpoint import checkpoint_checksums, checkpoint_layout, make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient
from reference_impl.transport.observed import HttpCall, SyncReport, TensorLayout
from reference_impl.transport.progress import read_progress
from reference_impl.worker import TrainerSetup


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
            self._deadline_passed(record, what, timeout)
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
            engine_fault = fault.hook if fault and fault.side == "engine" else None
            url = self._get(
                [engine.start.remote(sc.engine, str(ckpt), sc.engine_seed, str(log_path), sc.dtype, engine_fault)],
                kind.start_timeout_s,
                record,
                "engine start",
            )[0]
            pids = {f"rank{r}": pid for r, pid in enumerate(pool.pids)}
            pids["engine"] = ray.get(engine.pid.remote(), timeout=30)
            self._get(setup_refs, SETUP_TIMEOUT_S, record, "trainer setup")
            if fault and fault.side == "trainer" and fault.apply is not None:
                self._get([a.run_in_process.remote(fault.apply) for a in pool.actors], 60, record, "apply fault")
                record.notes.append(f"fault injected: {fault.name} ({fault.description})")
            checker = EngineClient(
                url,
                parse_rejections=kind.parse_rejections,
                image_prompts_via_chat=kind.capabilities.image_prompts_via_chat,
            )
            reports_tensors = kind.capabilities.per_tensor_reports
            if reports_tensors:
                record.engine_shards = checker.shards()
            connect = [a.connect_engine.remote(url, sc.engine, sc.colocate) for a in pool.actors]
            for calls in self._get(connect, deadline, record, "connect engine"):
                record.http.extend(calls)
            if not check_transfer_init(record).ok:  # nothing sent after this would reach the engine
                record.notes.append("stopped after connect: the engine joined more than one transfer group")
                raise ScenarioFailed("connect engine")
            record.logprob_budget = dict(LOGPROB_BUDGETS[sc.dtype]) if sc.logprobs else {}
            prompts = fixed_prompts(json.loads((ckpt / "config.json").read_text())) if sc.logprobs else []
            temperature = sc.temperature(kind.capabilities.prompt_logprobs_honour_temperature)
            # syncs #0..N-1, then one more that re-sends unchanged weights (its log-probs must not move).
            # The expected state is the harness's oracle (checkpoint + the trainer's elementwise step).
            expected = self._oracle(record, "parity_expected", None, lambda: ExpectedState(ckpt, sc.seed))
            for i in range(sc.syncs + 1):
                resync = i == sc.syncs
                if 0 < i < sc.syncs:
                    refs = [a.perturb.remote(i, sc.seed) for a in pool.actors]
                    if expected is not None:  # while the ranks step
                        expected = self._oracle(record, "parity_expected", i, functools.partial(expected.advance, i))
                    self._get(refs, deadline, record, f"perturb {i}")
                refs = [a.sync.remote(i, i, sc.export_mode, sc.chunk_bytes) for a in pool.actors]
                expected_sums = (  # while the ranks sync
                    self._oracle(record, "parity_expected", i, expected.checksums) if expected is not None else None
                )
                per_rank = self._get(refs, deadline, record, f"sync {i}")
                sync = self._merge_sync(i, per_rank, record)
                sync.perturbed = not resync
                sync.expected_checksums = expected_sums or {}
                if reports_tensors:
                    sync.engine_checksums = checker.checksums()
                record.syncs.append(sync)
                if prompts:
                    self._measure_logprobs(sync, pool, checker, prompts, temperature, deadline, record)
            for mode in ("raw", "bridge"):  # a second export path of the same state: an oracle
                sums = self._oracle(
                    record,
                    "parity_cross_mode",
                    None,
                    lambda m=mode: self._get_oracle(
                        [a.export_checksums.remote(m) for a in pool.actors], deadline, record, f"export {m}"
                    ),
                )
                if sums is None:
                    break
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

    def _measure_logprobs(
        self,
        sync: SyncRecord,
        pool: TrainerPool,
        checker: EngineClient,
        prompts: list[Any],
        temperature: float,
        deadline: float,
        record: RunRecord,
    ) -> None:
        """Trainer log-probs (the sender's transformers forward over what it sent) vs the engine's, on the
        fixed prompts; the comparison goes into `sync.logprobs`. The trainer-side forward and the comparison
        are oracles: when one cannot run, that is recorded for the log-prob check, never raised."""
        trainer = self._oracle(
            record,
            "logprob_parity",
            sync.index,
            lambda: self._get_oracle(
                [pool.actors[0].trainer_logprobs.remote(temperature)],
                deadline,
                record,
                f"trainer log-probs after sync {sync.index}",
            )[0],
        )
        if trainer is None:
            return
        if "skipped" in trainer:
            record.notes.append(f"sync {sync.index}: no log-prob comparison: {trainer['skipped']}")
            return
        engine = [
            checker.prompt_logprobs(p.input_ids, temperature, p.image_url, sync=sync.index, chat_content=p.chat_content)
            for p in prompts
        ]
        sync.engine_logprobs = engine
        parity = self._oracle(record, "logprob_parity", sync.index, lambda: logprob_parity(trainer["prompts"], engine))
        if parity is not None:
            sync.logprobs = parity | {"forward": trainer["forward"], "temperature": temperature}

    @staticmethod
    def _oracle(record: RunRecord, check: str, sync: int | None, fn: Callable[[], Any]) -> Any:
        """Run one of the harness's own oracles; when it raises, record an `OracleFailure` for `check` (the
        check then says "oracle could not run") and return None: an oracle never makes a verdict of the
        system under test. A deadline passing inside it is still a DEADLOCK (`ScenarioFailed`)."""
        return Runner._oracle_into(record.oracle_failures, check, fn, sync)

    @staticmethod
    def _oracle_into(failures: list[OracleFailure], check: str, fn: Callable[[], Any], sync: int | None = None) -> Any:
        """`_oracle` that appends its failure to `failures`."""
        try:
            return fn()
        except ScenarioFailed:
            raise
        except Exception as e:
            cause = getattr(e, "cause", None) or e
            text = " ".join(str(cause).split())[:500] or "(no message)"
            failures.append(OracleFailure(check=check, sync=sync, reason=f"{type(cause).__name__}: {text}"))
            return None

    def _get_oracle(self, refs: list[Any], timeout: float, record: RunRecord, what: str) -> list[Any]:
        """ray.get for an oracle's remote call: a timeout is a DEADLOCK as in `_get`; an exception in the
        actor is raised as it is (for `_oracle` to record), not recorded as the rank's crash."""
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self._deadline_passed(record, what, timeout)
            raise ScenarioFailed(what) from None

    def _deadline_passed(self, record: RunRecord, what: str, timeout: float) -> None:
        """Mark a DEADLOCK in `what` and keep every rank's last phase (`transport.progress`)."""
        record.deadlock = True
        record.deadlock_at = what
        record.notes.append(f"{what}: no progress within {timeout:.0f} s")
        record.progress = read_progress(self.trace_dir(record.scenario_id))

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
        failures: list[OracleFailure] = []
        diffs = self._oracle_into(failures, "group_invariance", lambda: group_differences(members)) or []
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

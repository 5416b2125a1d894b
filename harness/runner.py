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

import json
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import ray

from harness import interrupts, shm
from harness.checks import group_differences, judged
from harness.driver_ray import ray_lost
from harness.engines import EngineKey, EngineShelf, end_engines
from harness.faults import FAULTS
from harness.fork_servers import ForkServers
from harness.oracles.digest import checkpoint_digests
from harness.outcome import (
    OUT_OF_STEP_GRACE_S,
    ended_clean,
    engines_reusable,
    in_flight_at_death,
    in_step,
    stop_grace_s,
    sync_failed,
)
from harness.placement import SETUP_TIMEOUT_S, EngineActor, TrainerPool, multi_node, use_gpus
from harness.record import OracleFailure, RunRecord, error_from, wall_split
from harness.recovery import RESTORE_SEAMS
from harness.scenario import Scenario
from harness.session import ScenarioFailed, ScenarioSession, SyncHook, oracle_into
from harness.stacks import dump_stacks
from harness.validate import validate
from harness.watch import EngineWatch, wait_watched
from reference_impl.engine import engine_kind
from reference_impl.fork_client import ForkServerAddress
from reference_impl.forward.hf import fixed_prompts
from reference_impl.forward.prompts import probe_prompt
from reference_impl.models.checkpoint import checkpoint_layout, make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient
from reference_impl.transport.observed import HttpCall, TensorLayout
from reference_impl.transport.progress import read_progress
from reference_impl.worker import TrainerSetup


@dataclass
class Runner:
    """Runs scenarios one after another into `out_dir` (records/, logs/). `token` is the run's bearer token:
    every engine server asks for it on every route (`wsh_vllm_plugin.auth`), and only the harness and the
    sender have it; it is made here, once per run, and never written anywhere."""

    out_dir: Path
    run_id: str
    on_record: Callable[[RunRecord], None] | None = None
    after_sync: SyncHook | None = None
    pools: dict[int, TrainerPool] = field(default_factory=dict)  # by world size, the least recently used first
    # Pools of other world sizes kept alive for a later scenario. An idle rank costs about 0.6% of a core and
    # 0.6 GB plus its last model; a pool start costs a Ray worker per rank and the Megatron import in each
    # (about 8 s on a 2-core host). Worth it where scenarios of several world sizes alternate (the tests).
    idle_pools: int = 0
    shelf: EngineShelf = field(default_factory=EngineShelf)  # engines of scenarios that ended in step, restarted later
    # Processes started ahead of need (none on a GPU host, where a pool holds its GPUs): one pool per world size
    # in `spare_pools`, its ranks warm (`TrainerWorker.warm`), and one non-colocated engine (one replica, TP 1) of
    # kind `spare_engine`, which must restart in place. A scenario that would start a pool or such an engine
    # (the first of its kind, or the one after a scenario that ended its processes) takes the spare, which
    # imported while earlier scenarios ran, and a new spare starts once that scenario is set up
    # (`start_spare_pools`, `_start_spare_engine`), at the lowest CPU priority. A spare rank holds about 0.8 GB,
    # a spare embedded engine about 0.7 GB. Worth it where scenarios end their processes often (the fault tests).
    spare_pools: tuple[int, ...] = ()
    spare_engine: str | None = None
    spares: dict[int, TrainerPool] = field(default_factory=dict)
    spare_engines: dict[EngineKey, tuple[Any, Any]] = field(default_factory=dict)  # key -> (actor, start ref)
    _spares_started: int = 0
    # Where new ranks and engine servers fork from (`harness.fork_servers`): `fork_server`, an owner's fork server
    # for the embedded engine's servers (a test session shares its own), else one started at the first such
    # engine; `fork_engines` / `fork_ranks` False: those start as new interpreters. Stopped in `close`.
    fork_server: InitVar[ForkServerAddress | None] = None
    fork_engines: InitVar[bool] = True
    fork_ranks: InitVar[bool] = True
    forks: ForkServers = field(init=False)
    # the running scenario's engine actors and kind, from their start until its cleanup shelved or ended them
    live_engines: tuple[list[Any], str] | None = field(default=None, init=False)
    token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    def __post_init__(self, fork_server: ForkServerAddress | None, fork_engines: bool, fork_ranks: bool) -> None:
        self.forks = ForkServers(self.out_dir / "logs", fork_engines, fork_server, fork_ranks)

    def pool(self, world_size: int) -> TrainerPool:
        """The reusable pool for `world_size`. Besides it, at most `idle_pools` pools of other world sizes
        stay alive, the least recently used ended first; on a GPU host none (an idle pool holds its GPUs).
        With the default 0, a pool of another size is ended before this one starts: run scenarios grouped
        by world size, as `order_for_reuse` does."""
        if world_size in self.pools:
            self.pools[world_size] = self.pools.pop(world_size)  # the most recently used last
        else:
            keep = 0 if use_gpus() else self.idle_pools
            while len(self.pools) > keep:
                self.drop_pool(next(iter(self.pools)))
            pool = self.spares.pop(world_size, None)
            if pool is None:
                pool = TrainerPool.create(world_size, fork_server=self.forks.for_ranks())
            else:
                pool.restore_priority()  # its ranks may still be importing, at the lowest priority
            self.pools[world_size] = pool
        return self.pools[world_size]

    def start_spare_pools(self) -> None:
        """Start a warm pool (`TrainerPool.create(warm=True)`) of each world size in `spare_pools` that has none;
        none on a GPU host. The runner calls it once a scenario's own ranks and engines are set up: Ray starts
        only a few worker processes at a time (about one per CPU), so spares asked for earlier would hold back
        the scenario's own engine actor."""
        if use_gpus():
            return
        for ws in self.spare_pools:
            if ws not in self.spares:
                self.spares[ws] = TrainerPool.create(ws, warm=True, fork_server=self.forks.for_ranks())

    def drop_pool(self, world_size: int) -> None:
        """Kill a pool whose processes may be in a bad state, and the shelved engines in its placement group."""
        self.shelf.drop(lambda k: k.colocate and k.world_size == world_size)
        pool = self.pools.pop(world_size, None)
        if pool is not None:
            pool.kill()

    def close(self, fork_servers: bool = True) -> None:
        """End every shelved and spare engine and kill every pool, spares too; then, with `fork_servers`, this
        runner's fork servers (without: the caller stops them, `forks.stop`, once its Ray is down)."""
        try:
            self.shelf.close()
            for ws in list(self.pools):
                self.drop_pool(ws)
            for key in list(self.spare_engines):
                actor, _ = self.spare_engines.pop(key)
                end_engines([actor], [None], key.engine)
            while self.spares:
                self.spares.popitem()[1].kill()
        finally:
            if fork_servers:
                self.forks.stop()

    def run_scenario(self, sc: Scenario, config_error: str | None = None, validated: bool = False) -> RunRecord:
        """Run and judge one scenario; the record is written before returning. Unless `validated` (the
        caller already ran `harness.validate.validate` and passes its answer as `config_error`), the
        scenario is validated here first.

        Raises:
            KeyboardInterrupt: Ctrl-C or a signal (`harness.interrupts`), once the scenario's record, with the
                interrupt among its errors, is written, its trainer pool dropped and its engines ended where the
                cleanup did not reach them (`live_engines`).
        """
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
        try:
            self._run(sc, record)
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, or one Python had dropped, raised again by a wait
            with interrupts.held():  # a second Ctrl-C waits for the record and the processes (a third: at once)
                signum = interrupts.delivered()  # from the scenario's body or its cleanup alike
                if not record.progress:  # as read at a deadline, else now: where each rank was, a hang's first clue
                    record.progress = read_progress(self.trace_dir(sc.id))
                record.errors.append(interrupts.interrupted_error(e, record, signum))
                self._finish(record)  # what the scenario had is kept, judged, before the interrupt goes on
                self.drop_pool(sc.world_size)  # a cleanup cut short may have kept ranks out of step
                engines, self.live_engines = self.live_engines, None
                if engines is not None:  # the cleanup was cut short before it shelved or ended them
                    end_engines(engines[0], [None] * len(engines[0]), engines[1], OUT_OF_STEP_GRACE_S)
            raise
        return self._finish(record)

    def _run(self, sc: Scenario, record: RunRecord) -> None:
        """Set up, run and end `sc`'s processes and session into `record` (not yet judged)."""
        kind = engine_kind(sc.engine)
        record.engine_capabilities = kind.capabilities
        if kind.note:
            record.notes.append(kind.note)
        engines: list[object] = []
        checkers: list[EngineClient] = []
        session: ScenarioSession | None = None
        healthy = reusable = False
        marks = {"start": time.perf_counter()}
        pids: dict[str, int | None] = {}
        try:
            spec = load_model(sc.model)
            ckpt = make_checkpoint(spec, sc.seed, sc.dtype)
            record.checkpoint_checksums = checkpoint_digests(ckpt)  # from the files' bytes
            record.checkpoint_layout = {
                n: TensorLayout(shape=shape, dtype=dtype) for n, (shape, dtype) in checkpoint_layout(ckpt).items()
            }
            ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
            deadline = sc.deadline_s or 120.0 + ckpt_bytes / 20e6
            pool = self.pool(sc.world_size)
            fault = FAULTS[sc.fault] if sc.fault else None
            trace = self.trace_dir(sc.id)
            shutil.rmtree(trace, ignore_errors=True)
            setup = TrainerSetup(sc.model, str(ckpt), sc.dtype, sc.tp, sc.pp, sc.ep, sc.etp, trace_dir=str(trace))
            setup_refs = [a.setup.remote(setup) for a in pool.actors]
            hook = fault.hook if fault is not None else None
            reachable = multi_node()  # engines another node must reach bind to their node's address
            key = EngineKey.of(sc, reachable)
            # a fault hook is applied (and later undone) at a restart
            reusable = kind.restartable(sc.colocate, sc.engine_tp, use_gpus())
            engines, urls = self._restarted(key, sc, ckpt, record, hook) if reusable else ([], [])
            self.live_engines = (engines, sc.engine)
            if not engines:
                options = pool.engine_options(sc.colocate, sc.engine_tp)
                fork_server = self.forks.for_engines(kind, record)
                engines = [EngineActor.options(**options).remote() for _ in range(sc.engines)]
                self.live_engines = (engines, sc.engine)
                starts = [  # every replica from dummy weights of its own seed
                    e.start.remote(
                        sc.engine,
                        str(ckpt),
                        sc.engine_seed + i,
                        str(self.engine_log(sc.id, i)),
                        sc.dtype,
                        hook,
                        sc.colocate,
                        sc.engine_tp,
                        reachable,
                        self.token,
                        fork_server=fork_server,
                    )
                    for i, e in enumerate(engines)
                ]
            session = ScenarioSession(sc, record, kind, pool, engines, deadline, trace, ckpt, fault)
            if not urls:
                urls = session.get(starts, kind.start_timeout_s, "engine start")
            checkers = session.checkers = [
                EngineClient(
                    url,
                    parse_rejections=kind.parse_rejections,
                    engine=i,
                    token=self.token,
                    image_prompts_via_chat=kind.capabilities.image_prompts_via_chat,
                )
                for i, url in enumerate(urls)
            ]
            session.checker = checkers[0]
            pids = {f"rank{r}": pid for r, pid in enumerate(pool.pids)}
            for i, e in enumerate(engines):
                pids[engine_label(i)] = ray.get(e.pid.remote(), timeout=30)
            session.pids, session.after_sync = pids, self.after_sync
            session.watches = [EngineWatch(e, pids[engine_label(i)], trace) for i, e in enumerate(engines)]
            session.get(setup_refs, SETUP_TIMEOUT_S, "trainer setup")
            # while this scenario syncs, for a later one
            self.start_spare_pools()
            self._start_spare_engine(key, sc, ckpt, pool, record)
            if fault is not None and fault.trainer is not None and sc.fault_sync is None:
                session.on_ranks("run_in_process", fault.trainer, what="apply fault", timeout=60)
                record.notes.append(f"fault injected: {fault.name} ({fault.description})")
            if kind.capabilities.per_tensor_reports:
                record.engine_shards = checkers[0].shards()
            session.connect(pool.sender_address(), self.token)
            session.shm_at_connect = shm.held_by_tree(pids.values())
            if sc.logprobs:
                config = json.loads((ckpt / "config.json").read_text())
                session.prompts = fixed_prompts(config)
                session.probe = probe_prompt(config)
            marks["syncs"] = time.perf_counter()
            session.run_syncs()
            session.measure_bound()
            session.cross_export()
            healthy = True
        except ScenarioFailed:
            if record.deadlock:
                record.stacks = dump_stacks(pids, self.out_dir / "stacks" / sc.id.replace("/", "__"))
        except Exception as e:
            record.errors.append(error_from(e, None, "runner"))
        finally:
            marks["teardown"] = time.perf_counter()
            for checker in checkers:  # the harness's own calls (checksums, log-probs), also on failure
                record.http.extend(checker.calls)
                checker.close()
            if not healthy:
                self._recover_calls(record)
            # A dead engine first, also when the syncs ended without a rank raising (a colocated sender
            # records its calls to a dead engine as status 0 and returns): its end is the cause to name.
            # What was in flight: `outcome.in_flight_at_death`.
            failed = [s.index for s in record.syncs if sync_failed(record, s)]
            for i, engine_watch in enumerate(session.watches if session is not None else []):
                engine_watch.name_the_engine(record.errors, in_flight_at_death(record, i), sender=not failed)
            clean = ended_clean(record, healthy)  # else the ranks and engines may hold what went wrong
            if not clean and session is not None and in_step(record, healthy):  # ran through or recovered cleanly
                clean = self._fault_undone(session, record)
            engine_pids = [pids.get(engine_label(i)) for i in range(len(engines))]
            if reusable and engines_reusable(record, healthy):
                self.shelf.put(key, engines, engine_pids)
            elif engines:
                end_engines(engines, engine_pids, sc.engine, stop_grace_s(record, healthy))
            self.live_engines = None
            if not clean:
                self.drop_pool(sc.world_size)
                # what its dead ranks left in /dev/shm: held at a resource sample, or when the sender connected (a
                # segment replaced before sync 0's sample and never unlinked is seen only then)
                held = shm.held_in(record.resources) | (session.shm_at_connect if session is not None else set())
                shm.unlink(held)
            marks["end"] = time.perf_counter()
            record.wall = wall_split(marks, session.checks_s if session is not None else 0.0)

    def _fault_undone(self, session: ScenarioSession, record: RunRecord) -> bool:
        """Whether a scenario that faulted or failed a sync, and still ended in step (`outcome.in_step`: it ran
        through, or a clean recovery sync followed the failed one), leaves trainer ranks fit for the next
        scenario, after undoing its trainer-side patches in every rank (`RESTORE_SEAMS`): every rank's seams run
        what they ran when the rank started (`TrainerWorker.replaced_seams`) and the scenario's processes held
        no shared-memory segment, at a resource sample or now, that they did not hold when the sender connected
        (one closed but never unlinked is only seen at a sample). Kept ranks then drop what the scenario set
        up. A note says what was decided and why; a rank that does not answer counts as unfit. Starting a pool
        (a Ray worker, torch and Megatron imports per rank) is most of a small scenario's setup, so such a
        scenario no longer costs the next one that."""
        actors, rank_pids = session.pool.actors, session.pool.pids
        after = "the fault" if record.scenario.fault else "the failed sync"
        if ray_lost():  # no rank can be asked (`driver_ray.ray_lost`); each ray.get below waited up to 60 s
            record.notes.append(f"trainer ranks not reused after {after}: this driver's Ray was lost")
            return False
        if len(session.pool.local_processes()) != len(actors):  # /proc of another node cannot be read here
            record.notes.append(f"trainer ranks not reused after {after}: not all of them run on this host")
            return False
        try:  # plain ray.get: nothing asked here after the scenario's end may change its record's verdict
            if session.fault is not None and session.fault.trainer is not None:
                ray.get([a.run_in_process.remote(RESTORE_SEAMS) for a in actors], timeout=60)
            per_rank = ray.get([a.replaced_seams.remote() for a in actors], timeout=60)
            held = shm.held_in(record.resources) | shm.held_by_tree(rank_pids)  # at a sample, or now
            # What the scenario set up in them (model, channel, its segments) ends with it, not at the next setup.
            ray.get([a.teardown.remote() for a in actors], timeout=60)
        except Exception as e:
            what = f"{type(e).__name__}: {str(e)[:200]}"
            record.notes.append(f"trainer ranks not reused: undoing {after} failed ({what})")
            return False
        replaced = sorted({name for names in per_rank for name in names})
        extra = sorted(held - session.shm_at_connect)
        if replaced or extra:
            why = [f"seams still replaced: {', '.join(replaced)}"] if replaced else []
            why += [f"segments made since the sender connected: {', '.join(extra)}"] if extra else []
            record.notes.append(f"trainer ranks not reused after {after} ({'; '.join(why)})")
            return False
        record.notes.append(
            f"trainer ranks reused after {after} (pid {', '.join(map(str, rank_pids))}): every seam runs what it "
            "ran when the rank started, and no segment is held that was not held when the sender connected"
        )
        return True

    def _restarted(
        self, key: EngineKey, sc: Scenario, ckpt: Path, record: RunRecord, hook: str | None
    ) -> tuple[list[Any], list[str]]:
        """Shelved engines of `key` restarted in place as fresh engines of this scenario (`ckpt`, each replica's
        own seed, its own log, the scenario's engine fault `hook` applied first, as at a start), and their
        URLs; ([], []) when none is shelved or a restart failed (those are ended, said in a note, and the caller
        starts new ones)."""
        shelved = self.shelf.take(key)
        spare = shelved is None and key in self.spare_engines
        if spare:
            shelved = self._take_spare_engine(key, record)
        if shelved is None:
            return [], []
        engines, pids = shelved
        self.live_engines = (engines, sc.engine)  # off the shelf: an interrupt from here on ends them
        restarts = [
            e.restart.remote(str(ckpt), sc.engine_seed + i, str(self.engine_log(sc.id, i)), sc.engine_tp, hook)
            for i, e in enumerate(engines)
        ]
        try:
            urls = wait_watched(restarts, engine_kind(sc.engine).start_timeout_s, "an engine restart")
        except Exception as e:
            record.notes.append(f"a shelved engine did not restart ({type(e).__name__}: {str(e)[:300]}); started anew")
            end_engines(engines, pids, sc.engine, OUT_OF_STEP_GRACE_S)  # discarded: a restart may be stuck mid-way
            return [], []
        record.notes.append(
            ("spare engine process taken" if spare else "engine process reused")
            + f": restarted in place as a fresh engine (pid {', '.join(map(str, pids))}; "
            "this scenario's dummy weights, no transfer group, empty caches"
            + (f"; fault hook {hook} applied before it was built)" if hook else ")")
        )
        return engines, list(urls)

    def _take_spare_engine(self, key: EngineKey, record: RunRecord) -> tuple[list[Any], list[int | None]] | None:
        """The spare engine of `key` (`spare_engine`), once its start has ended, as ([actor], [server pid]); None
        when its start failed (it is ended, said in a note)."""
        actor, start = self.spare_engines.pop(key)
        self.live_engines = ([actor], key.engine)  # taken: an interrupt from here on ends it
        try:
            ray.get(actor.restore_priority.remote(), timeout=30)  # it may still be starting, at lowest priority
            wait_watched([start], engine_kind(key.engine).start_timeout_s, "the spare engine's start")
            ray.get(actor.restore_priority.remote(), timeout=30)  # and the threads it started meanwhile
            pid = ray.get(actor.pid.remote(), timeout=30)
        except Exception as e:
            record.notes.append(f"the spare engine did not start ({type(e).__name__}: {str(e)[:300]}); started anew")
            end_engines([actor], [None], key.engine, OUT_OF_STEP_GRACE_S)
            return None
        return [actor], [pid]

    def _start_spare_engine(
        self, key: EngineKey, sc: Scenario, ckpt: Path, pool: TrainerPool, record: RunRecord
    ) -> None:
        """Start the spare engine of `key` when `key` is the spare's placement (kind `spare_engine`, not colocated,
        one replica, TP 1, restartable here) and none is started: from dummy weights of the scenario's engine
        seed on its checkpoint (a spare is always restarted as the next scenario's fresh engine before it
        serves), at the lowest priority until it is taken, its log in `logs/spare-<n>.engine.log`."""
        if (
            use_gpus()
            or key in self.spare_engines
            or (key.engine, key.colocate, key.engine_tp, key.engines) != (self.spare_engine, False, 1, 1)
            or not engine_kind(key.engine).restartable(False, 1, False)
        ):
            return
        self._spares_started += 1
        log = self.out_dir / "logs" / f"spare-{self._spares_started}.engine.log"
        fork_server = self.forks.for_engines(engine_kind(key.engine), record)
        actor = EngineActor.options(**pool.engine_options(False, 1)).remote()
        start = actor.start.remote(
            sc.engine,
            str(ckpt),
            sc.engine_seed,
            str(log),
            sc.dtype,
            reachable=key.reachable,
            token=self.token,
            low_priority=True,
            fork_server=fork_server,
        )
        self.spare_engines[key] = (actor, start)

    def engine_log(self, scenario_id: str, engine: int) -> Path:
        """Where engine replica `engine`'s server log goes (`<scenario>.engine.log`, `<scenario>.engine1.log`, ...)."""
        return self.out_dir / "logs" / (scenario_id.replace("/", "__") + f".{engine_label(engine)}.log")

    def trace_dir(self, scenario_id: str) -> Path:
        """Where a scenario's ranks keep their progress lines and call logs."""
        return self.out_dir / "trace" / scenario_id.replace("/", "__")

    def _recover_calls(self, record: RunRecord) -> None:
        """Add the calls the ranks logged (`rank<r>.calls.jsonl`) that never came back to the runner (a sync
        that hung or raised): nothing recorded is lost when a scenario fails."""
        seen = {(c.rank, c.engine, c.t, c.route, c.sync, c.chunk) for c in record.http}
        for log in sorted(self.trace_dir(record.scenario_id).glob("*.calls.jsonl")):
            for line in log.read_text().splitlines():
                call = HttpCall.model_validate_json(line)
                if (call.rank, call.engine, call.t, call.route, call.sync, call.chunk) not in seen:
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
        t0 = time.perf_counter()
        record = judged(record)
        if record.wall:
            record.wall["checks_s"] += time.perf_counter() - t0
        record.save(self.record_path(record.scenario_id))
        if self.on_record:
            self.on_record(record)
        return record


def engine_label(engine: int) -> str:
    """How engine replica `engine` is named in stacks, logs and process tables: "engine" for the first (the
    only one of most scenarios), "engine1", "engine2", ... for the others."""
    return "engine" if engine == 0 else f"engine{engine}"

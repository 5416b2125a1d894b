"""Where a scenario's processes run: Ray, the trainer pools and the engine actors.

Placement: one placement group per trainer world, one bundle per trainer rank; trainer actors (one per
rank, `reference_impl.worker.TrainerWorker`) are reused across scenarios of the same world size. Each
engine replica has an engine actor that owns its server process: non-colocate, an actor of its own (on a
GPU host with one GPU per engine TP rank); colocated, in the sender's bundle (half its GPU on a GPU host).

Nodes: on a Ray cluster whose nodes offer the custom resources `wsh_trainer_node` / `wsh_engine_node`
(`TRAINER_NODE`, `ENGINE_NODE`), the trainer ranks go where the first is and the engines where the second
is (each asks for a sliver of it). On a cluster of more than one node the engines must be reachable from
the trainer's node: an engine server then binds to its own node's address, and only with the run's bearer
token (`wsh_vllm_plugin.auth`), and the transfer group's store is hosted at the sender's node address;
on one node everything stays on 127.0.0.1.
"""

from __future__ import annotations

import atexit
import contextlib
from dataclasses import dataclass, field
from typing import Any

import psutil
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from harness import shm
from harness.driver_ray import ray_lost
from harness.scenario import Scenario
from reference_impl.engine import engine_kind
from reference_impl.engine.process import STOP_GRACE_S, EngineStartError, ServerProcess, free_port
from reference_impl.fork_client import ForkServerAddress
from reference_impl.priority import lowest_priority, raise_threads_to

SETUP_TIMEOUT_S = 900.0
TRAINER_NODE = "wsh_trainer_node"  # a node offering this custom resource hosts the trainer ranks
ENGINE_NODE = "wsh_engine_node"  # a node offering this custom resource hosts the engines
NODE_SLICE = 0.001  # what one actor or bundle asks of a node resource (any number of them fit)
LOOPBACK = "127.0.0.1"


def use_gpus() -> bool:
    """Whether the Ray cluster has GPUs (then trainer ranks and engines are placed on them)."""
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


def node_resource(name: str) -> dict[str, float]:
    """{name: NODE_SLICE} when the cluster offers the custom resource `name`, else {} (anywhere)."""
    return {name: NODE_SLICE} if ray.is_initialized() and ray.cluster_resources().get(name, 0) > 0 else {}


def multi_node() -> bool:
    """Whether the Ray cluster has more than one live node (engines must then be reachable across nodes)."""
    return ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) > 1


def order_for_reuse(scenarios: list[Scenario]) -> list[Scenario]:
    """Scenarios grouped by trainer world size (stable within a group), so each pool is made once."""
    first_seen: dict[int, int] = {}
    for i, sc in enumerate(scenarios):
        first_seen.setdefault(sc.world_size, i)
    return sorted(scenarios, key=lambda sc: first_seen[sc.world_size])


# Threaded (several calls at once): `stop` must not wait behind a `start` or `restart` still waiting for the
# server's /health (an interrupted run would wait for the start to finish, up to its timeout, before the
# server got its SIGTERM), nor `exit_status` and `log_tail` behind them.
@ray.remote(num_cpus=0.5, max_concurrency=4)
class EngineActor:
    """Owns one engine server process (started in `start`, ended in `stop`, also while `start` still waits
    for it: the start then raises `EngineStartError`)."""

    def __init__(self) -> None:
        self.proc: ServerProcess | None = None
        self.stopped = False  # `stop` was called: a start that comes or runs after it ends its server at once
        atexit.register(self._stop_at_exit)

    def _stop_at_exit(self) -> None:
        """Where this actor's worker process exits through Python (a SIGTERM to every process of a job reaches
        the Ray worker, whose handler raises SystemExit: the runner can no longer ask it to stop), its server
        ends too and its temp folder goes (`ServerProcess.stop`); before, the folder stayed in /tmp. `ray.kill`
        ends the worker without this, after the runner's own `stop`."""
        if self.proc is not None:
            self.proc.stop(1.0)

    def start(
        self,
        engine: str,
        checkpoint: str,
        seed: int,
        log_path: str,
        dtype: str,
        fault_hook: str | None = None,
        colocate: bool = False,
        tp: int = 1,
        reachable: bool = False,
        token: str | None = None,
        low_priority: bool = False,
        fork_server: ForkServerAddress | None = None,
    ) -> str:
        """Start the scenario's engine (an engine kind of `reference_impl.engine`) for a colocated or a
        separate sender (`colocate`) with `tp` TP ranks and return its base URL. `reachable`: other nodes must
        reach it, so it binds to this node's address (with `token`, which every route then asks for); else to
        127.0.0.1. `low_priority`: the server starts at the lowest priority, SCHED_IDLE at nice 19 (a spare
        started ahead of need, where the priority can be given back, `priority.lowest_priority`;
        `restore_priority` gives it back). `fork_server`: where a kind that can forks its server
        (`EngineKind.forks_from_fork_server`), when this actor runs on its node.

        Raises:
            EngineStartError: the server exited or did not answer /health within its kind's start timeout, or
                `stop` was called before or while it started.
            ValueError: `reachable` without a token.
        """
        kind = engine_kind(engine)
        host = ray.util.get_node_ip_address() if reachable else LOOPBACK
        self.proc = kind.server(
            checkpoint,
            seed,
            log_path,
            dtype,
            fault_hook,
            colocate,
            tp=tp,
            host=host,
            token=token,
            fork_server=fork_server,
        )
        if self.stopped:  # `stop` ran before there was a server to stop: this start raises, its server ended
            self.proc.stop()
        # A thread's nice is per thread and a child starts with its parent thread's: only the server is lowered.
        with lowest_priority() if low_priority else contextlib.nullcontext():
            return self.proc.start(kind.start_timeout_s)

    def restore_priority(self) -> None:
        """Give every thread of the engine server and of its descendants this actor's priority (Ray's worker
        priority): a server started with `low_priority` runs at the lowest priority. Threads it may not change
        are left as they are."""
        pid = self.proc.pid() if self.proc else None
        if pid is None:
            return
        nice = psutil.Process().nice()
        with contextlib.suppress(psutil.Error):
            server = psutil.Process(pid)
            for proc in [server, *server.children(recursive=True)]:
                raise_threads_to(proc.pid, nice)

    def restart(self, checkpoint: str, seed: int, log_path: str, tp: int = 1, fault: str | None = None) -> str:
        """Make the running server a fresh engine of `checkpoint` with the dummy weights of `seed` (its kind's
        `ServerProcess.restart`; only kinds with `Capabilities.restart_in_place`), with fault hook `fault`
        (`MODULE:FUNCTION`) applied first when given; returns its base URL.

        Raises:
            EngineStartError: never started, or the server refused or failed the restart.
        """
        if self.proc is None:
            raise EngineStartError("the engine was never started; start it instead of restarting it")
        return self.proc.restart(checkpoint, seed, log_path, tp, fault)

    def pid(self) -> int | None:
        return self.proc.pid() if self.proc else None

    def log_tail(self) -> str:
        """The last lines of the engine server's log."""
        return self.proc.log_tail() if self.proc else "(engine never started)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End the engine server (`ServerProcess.stop`: SIGTERM, SIGKILL after `grace_s` seconds), also one
        whose start is still waiting for it, or has not launched it yet (that start then raises)."""
        self.stopped = True
        if self.proc is not None:
            self.proc.stop(grace_s)

    def exit_status(self, tail_chars: int = 3000) -> tuple[int | None, str]:
        """(the server's exit status, None while it runs or before it started; the last `tail_chars`
        characters of its log once it has ended, else "")."""
        popen = self.proc.proc if self.proc is not None else None
        if popen is None or popen.poll() is None:
            return None, ""
        return popen.returncode, self.proc.log_tail(tail_chars) if self.proc is not None else ""


@dataclass
class TrainerPool:
    """Trainer actors of one world size, in one placement group (bundle i = rank i)."""

    world_size: int
    pg: PlacementGroup
    actors: list[Any] = field(default_factory=list)
    pid_refs: list[Any] = field(default_factory=list)  # each actor's `pid()` call, asked at creation
    log_refs: list[Any] = field(default_factory=list)  # each actor's `log_path()` call, asked at creation
    _pids: list[int] | None = None

    @classmethod
    def create(cls, world_size: int, warm: bool = False, fork_server: ForkServerAddress | None = None) -> TrainerPool:
        """Place `world_size` trainer ranks (on the trainer node, when the cluster names one) and start the rank
        actors; with `warm`, each rank then imports what its first setup would (`TrainerWorker.warm`, not
        waited for: a later call to the rank runs after it). With `fork_server` (role
        `reference_impl.trainer.forked_rank`), each rank's Ray worker is forked from it, where it already imported
        that, instead of starting as a new interpreter (`forked_rank.py_executable`; a rank on a host without that
        fork server starts as a new interpreter)."""
        from reference_impl.trainer.forked_rank import py_executable
        from reference_impl.worker import TrainerWorker

        # Bundle r = trainer rank r. Bundles have 2 CPUs so a colocated engine (fractional share) fits beside
        # rank 0.
        gpus = use_gpus()
        # On a GPU host every bundle also holds one GPU: rank r's (half of bundle 0's for a colocated engine).
        bundle = ({"CPU": 2, "GPU": 1} if gpus else {"CPU": 2}) | node_resource(TRAINER_NODE)
        pg = placement_group([bundle] * world_size, strategy="PACK")
        ray.get(pg.ready(), timeout=120)
        # Rank 0 binds the store's port while the engines start (not waited for, below): a port from the OS's
        # ephemeral range could meanwhile be handed to an engine's own listener (EADDRINUSE, seen with vLLM).
        port = free_port()
        # Half a GPU per rank leaves the other half of bundle 0's GPU to a colocated engine.
        worker_cls = ray.remote(num_cpus=1, num_gpus=0.5 if gpus else 0)(TrainerWorker)
        # Forked only where the fork server runs (a rank elsewhere may not even have its paths), never with GPUs.
        # Merged with the job's runtime environment (`ensure_ray`): its environment variables stay.
        runtime_envs: list[dict[str, str] | None] = [None] * world_size
        if fork_server is not None and not gpus:
            from ray.util import placement_group_table

            nodes = placement_group_table(pg)["bundles_to_node_id"] if fork_server.node_id is not None else {}
            forked = {"py_executable": py_executable(fork_server)}
            runtime_envs = [forked if fork_server.node_id in (None, nodes.get(r)) else None for r in range(world_size)]
        actors = [
            worker_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
                runtime_env=runtime_envs[r],
            ).remote(r, world_size, "127.0.0.1", port)
            for r in range(world_size)
        ]
        # Not waited for here: the rank processes start (a Ray worker, torch and Megatron imports) while the
        # caller starts the scenario's engines.
        pool = cls(
            world_size=world_size,
            pg=pg,
            actors=actors,
            pid_refs=[a.pid.remote() for a in actors],
            log_refs=[a.log_path.remote() for a in actors],
        )
        if warm:  # after `pid`: a rank runs its calls in order, and `restore_priority` needs the pids meanwhile
            for a in actors:
                a.warm.remote()
        return pool

    @property
    def pids(self) -> list[int]:
        """OS pids of the rank processes (stack dumps, resource samples); waits for the ranks to have started.

        Raises:
            ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError: a rank did not start.
            KeyboardInterrupt: a signal whose KeyboardInterrupt Python dropped (`harness.watch.wait_watched`).
        """
        if self._pids is None:
            from harness.watch import wait_watched  # it imports the sender (torch); an engine actor imports this module

            self._pids = list(wait_watched(self.pid_refs, SETUP_TIMEOUT_S, "the trainer ranks' start"))
        return self._pids

    def log_path(self, rank: int) -> str | None:
        """Where rank `rank`'s standard error goes (`TrainerWorker.log_path`, told at its start), or None when it
        did not tell within a second (it died before, or never started)."""
        if rank >= len(self.log_refs):
            return None
        try:
            return ray.get(self.log_refs[rank], timeout=1)
        except ray.exceptions.RayError:  # GetTimeoutError among them
            return None

    def engine_options(self, colocate: bool, tp: int = 1) -> dict[str, Any]:
        """Ray options of one engine actor (its server process inherits its devices): colocated, the sender's
        bundle and the other half of its GPU; else an actor of its own on the engine node (when the cluster
        names one) with one GPU per engine TP rank on a GPU host."""
        gpus = use_gpus()
        if colocate:
            return {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0),
                "num_gpus": 0.5 if gpus else 0.0,
            }
        return {"num_gpus": float(tp) if gpus else 0.0, "resources": node_resource(ENGINE_NODE)}

    def sender_address(self) -> str:
        """The address engines reach the sender (rank 0) at: its node's address on a cluster of several
        nodes, 127.0.0.1 on one."""
        if not multi_node():
            return LOOPBACK
        from ray.util import placement_group_table

        node_id = placement_group_table(self.pg)["bundles_to_node_id"][0]
        node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
        return str(node["NodeManagerAddress"])

    def kill(self) -> None:
        """End every rank process and free the placement group, then unlink the shared-memory segments the
        ranks held, or made (`shm.left_by`: one made after the last look, or whose rank a signal ended first),
        that are still there: a killed sender never unlinks its own (`harness.shm`). Where this driver's Ray
        was lost under the run (`driver_ray.ray_lost`), no Ray call would return: the ranks on this host are
        killed by pid, and the run's close ends the rest (`driver_ray.end_leftovers`)."""
        # A rank that has not told its pid within a second has not started (a forked one may wait for its fork
        # server's imports): it holds no segment, and ray.kill alone ends it.
        ranks = self.local_processes(wait_s=1.0)
        pids = {p.pid for p in ranks} | set(self._pids or ())  # a rank a signal ended first is among those told
        held = set().union(*(shm.held_by(p.pid) for p in ranks))
        if ray_lost():
            for proc in ranks:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        else:
            for a in self.actors:
                ray.kill(a, no_restart=True)
            remove_placement_group(self.pg)
        self.actors = []
        if held or shm.made_by(pids):
            psutil.wait_procs(ranks, timeout=10)
            shm.unlink(held | shm.left_by(pids))

    def restore_priority(self) -> None:
        """Give every thread of every rank the priority of the rank's main thread (Ray's worker priority): a warm
        pool's ranks import in a thread at the lowest priority (`TrainerWorker.warm`), which is then raised, so
        a rank taken while it still imports finishes at its own priority. Where that is not allowed
        (`priority.can_raise_priority`) nothing changes."""
        for proc in self.local_processes():
            with contextlib.suppress(psutil.Error):
                raise_threads_to(proc.pid, proc.nice())

    def local_processes(self, wait_s: float = 10.0) -> list[psutil.Process]:
        """The rank processes that run on this host (a Ray worker of `TrainerWorker` with that pid), of the ranks
        that told their pid within `wait_s` seconds."""
        out: list[psutil.Process] = []
        if self._pids is not None:
            pids = self._pids
        else:
            told, _ = ray.wait(list(self.pid_refs), num_returns=len(self.pid_refs), timeout=wait_s)
            pids = []
            for ref in told:
                with contextlib.suppress(Exception):  # a rank that died before it told: ray.kill alone ends it
                    pids.append(ray.get(ref))
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if "TrainerWorker" in " ".join(proc.cmdline()):
                    out.append(proc)
        return out

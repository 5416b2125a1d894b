"""Where a scenario's processes run: Ray, the trainer pools and the engine actor.

Placement (non-colocate): one placement group per trainer world, one bundle per trainer rank, and a
separate bundle for the engine actor, which owns the engine server process. On a GPU host each bundle
also holds one GPU; a colocated engine shares the sender's bundle and GPU (half each). Trainer actors
(one per rank, `reference_impl.worker.TrainerWorker`) are reused across scenarios of the same world
size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from harness.scenario import Scenario
from reference_impl.engine import engine_kind
from reference_impl.engine.process import ServerProcess, free_port

SETUP_TIMEOUT_S = 900.0
FORWARDED_ENV = ("WSH_VLLM_PYTHON", "WSH_HF_CACHE", "WSH_CACHE", "VLLM_CPU_KVCACHE_SPACE")


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
        self.proc: ServerProcess | None = None

    def start(
        self, engine: str, checkpoint: str, seed: int, log_path: str, dtype: str, fault_hook: str | None = None
    ) -> str:
        """Start the scenario's engine (an engine kind of `reference_impl.engine`) and return its base URL.

        Raises:
            EngineStartError: the server exited or did not answer /health within its kind's start timeout.
        """
        kind = engine_kind(engine)
        self.proc = kind.server(checkpoint, seed, log_path, dtype, fault_hook)
        return self.proc.start(kind.start_timeout_s)

    def pid(self) -> int | None:
        return self.proc.pid() if self.proc else None

    def log_tail(self) -> str:
        """The last lines of the engine server's log."""
        return self.proc.log_tail() if self.proc else "(engine never started)"

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
        from reference_impl.worker import TrainerWorker

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



"""Engine servers kept between scenarios: which may serve a later scenario, and how every one is ended.

Starting an engine costs a process start (Ray actor, interpreter, torch and FastAPI imports, the model
build): about 6 s for a tiny model on a 2-core host (vLLM: 15-20 s), most of a small scenario's wall time.
An engine kind with `Capabilities.restart_in_place` can instead become a fresh engine of the next
scenario's checkpoint and seed in the same process (`ServerProcess.restart`; the embedded engine: a new
model with that seed's dummy weights, new state, empty caches, no transfer backend, nothing of the old app
kept; vLLM on the placements `EngineKind.restartable` allows: the same model with new dummy weights of that
seed, no transfer group, empty caches, so its `EngineKey` holds the model and dtype too), so the
runner shelves such an engine after a scenario that ran through (no error, every sync run and answered
200) or recovered cleanly from a failed sync (`harness.outcome.in_step`) and restarts it for the next
scenario of the same `EngineKey`, also after a fault: the restart undoes an engine fault hook and refuses
when the engine's seams do not all run what they ran before it (the runner then starts a new engine;
`harness.outcome.engines_reusable`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from harness.driver_ray import ray_lost
from harness.scenario import Scenario
from reference_impl.engine import engine_kind
from reference_impl.engine.process import STOP_GRACE_S


@dataclass(frozen=True)
class EngineKey:
    """What an engine server must share with a scenario to serve it: its kind, TP ranks and replica count,
    where it is placed (colocated engines live in the trainer pool's placement group, so also the pool's
    world size), whether other nodes reach it (the address it bound to), and for a kind whose restart keeps
    its model (`EngineKind.restart_keeps_model`: vLLM) the model and dtype."""

    engine: str
    colocate: bool
    world_size: int  # of the pool whose placement group holds a colocated engine; 0 when not colocated
    engine_tp: int
    engines: int
    reachable: bool
    model: str = ""  # the model and dtype, where the kind's restart keeps its model (vLLM); else ""
    dtype: str = ""

    @classmethod
    def of(cls, sc: Scenario, reachable: bool) -> EngineKey:
        """The key of scenario `sc`'s engines."""
        same_model = engine_kind(sc.engine).restart_keeps_model
        return cls(
            sc.engine,
            sc.colocate,
            sc.world_size if sc.colocate else 0,
            sc.engine_tp,
            sc.engines,
            reachable,
            sc.model if same_model else "",
            sc.dtype if same_model else "",
        )


def end_engines(engines: Sequence[Any], pids: Sequence[int | None], engine: str, grace_s: float = STOP_GRACE_S) -> None:
    """Stop every engine server (SIGTERM to its process group, SIGKILL after `grace_s` seconds; 30 s for all),
    kill their actors, and let the kind reap what it leaves (`EngineKind.reap`, e.g. vLLM's engine core).
    `pids[i]` is engine `i`'s server pid (None if unknown); the runner's `grace_s` is
    `harness.outcome.stop_grace_s`. Where this driver's Ray was lost under the run (`driver_ray.ray_lost`),
    its actors cannot be asked: the servers are left to the run's close (`driver_ray.end_leftovers`)."""
    if ray_lost():
        return
    stops = [e.stop.remote(grace_s) for e in engines]
    with contextlib.suppress(Exception):
        ray.get(stops, timeout=30)
    kind = engine_kind(engine)
    for e, pid in zip(engines, pids, strict=True):
        ray.kill(e, no_restart=True)
        kind.reap(pid)


@dataclass
class EngineShelf:
    """Idle engine servers of scenarios that ended in step (`harness.outcome.in_step`), at most one set per
    `EngineKey` and `max_idle` sets in all (an idle engine process holds about 0.7 GB with torch loaded; two
    serve a matrix, which alternates colocated and separate engines), with their server pids."""

    idle: dict[EngineKey, tuple[list[Any], list[int | None]]] = field(default_factory=dict)
    max_idle: int = 2

    def take(self, key: EngineKey) -> tuple[list[Any], list[int | None]] | None:
        """The idle engines (actors, server pids) of `key`, now no longer on the shelf; None when there are none."""
        return self.idle.pop(key, None)

    def put(self, key: EngineKey, engines: list[Any], pids: list[int | None]) -> None:
        """Shelve `engines` (whose scenario ended in step) for a later scenario of `key`; a set already there
        is ended first."""
        self._end(key)
        while len(self.idle) >= self.max_idle:
            self._end(next(iter(self.idle)))  # the longest idle (dicts keep insertion order)
        self.idle[key] = (engines, pids)

    def drop(self, which: Callable[[EngineKey], bool]) -> None:
        """End every idle set whose key `which` selects (e.g. the colocated engines of a pool being killed)."""
        for key in [k for k in self.idle if which(k)]:
            self._end(key)

    def _end(self, key: EngineKey) -> None:
        if key in self.idle:
            engines, pids = self.idle.pop(key)
            end_engines(engines, pids, key.engine)

    def close(self) -> None:
        """End every idle engine."""
        self.drop(lambda _: True)

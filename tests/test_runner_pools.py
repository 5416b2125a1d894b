"""`Runner.pool`: which trainer pools stay alive between scenarios (`Runner.idle_pools`) and which are started
ahead of need (`Runner.spare_pools`), checked against the order of pool starts and ends written out by hand,
with `TrainerPool.create` replaced by a recorder (no Ray)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.runner import Runner


@dataclass
class FakePool:
    world_size: int
    log: list[str]

    def kill(self) -> None:
        self.log.append(f"end {self.world_size}")

    def restore_priority(self) -> None:
        self.log.append(f"priority {self.world_size}")


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    events: list[str] = []

    def create(world_size: int, warm: bool = False, fork_server: object = None) -> FakePool:
        events.append(f"{'warm ' if warm else ''}start {world_size}")
        return FakePool(world_size, events)

    monkeypatch.setattr("harness.runner.TrainerPool.create", create)
    monkeypatch.setattr("harness.runner.use_gpus", lambda: False)
    monkeypatch.setattr("harness.fork_servers.ForkServers.for_ranks", lambda self: None)
    return events


def test_one_idle_pool_is_kept_and_the_least_recently_used_is_ended(tmp_path: Path, log: list[str]) -> None:
    runner = Runner(out_dir=tmp_path, run_id="t", idle_pools=1)
    for ws in (1, 2, 1, 2, 4, 1, 4):
        runner.pool(ws)
    # 1 and 2 alternate in two pools; 4 ends 1 (used before 2's last use) before it starts; 1 then ends 2
    assert log == ["start 1", "start 2", "end 1", "start 4", "end 2", "start 1"]
    assert list(runner.pools) == [1, 4]  # least recently used first


def test_without_idle_pools_a_pool_of_another_size_is_ended_first(tmp_path: Path, log: list[str]) -> None:
    runner = Runner(out_dir=tmp_path, run_id="t")
    for ws in (1, 1, 2, 1):
        runner.pool(ws)
    assert log == ["start 1", "end 1", "start 2", "end 2", "start 1"]


def test_a_gpu_host_keeps_no_idle_pool(tmp_path: Path, log: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("harness.runner.use_gpus", lambda: True)  # an idle pool would hold its GPUs
    runner = Runner(out_dir=tmp_path, run_id="t", idle_pools=1)
    for ws in (1, 2):
        runner.pool(ws)
    assert log == ["start 1", "end 1", "start 2"]


def test_a_spare_pool_replaces_one_that_was_ended_and_a_new_spare_starts(tmp_path: Path, log: list[str]) -> None:
    """With `spare_pools=(1,)`: a warm spare of 1 rank starts once asked for (the runner asks once a scenario's
    own processes are set up). A pool of 1 that a scenario ended (`drop_pool`) is replaced by the spare, given
    its priority back (its ranks import at the lowest priority), and the next ask starts a new spare; a pool of
    2 never comes from a spare."""
    runner = Runner(out_dir=tmp_path, run_id="t", spare_pools=(1,))
    first = runner.pool(1)
    runner.start_spare_pools()
    assert log == ["start 1", "warm start 1"]
    runner.start_spare_pools()  # one spare per world size
    assert runner.pool(1) is first and log == ["start 1", "warm start 1"]  # in use: no spare taken
    spare = runner.spares[1]
    runner.drop_pool(1)  # a scenario ended its ranks
    assert runner.pool(1) is spare and 1 not in runner.spares
    runner.start_spare_pools()
    assert log == ["start 1", "warm start 1", "end 1", "priority 1", "warm start 1"]
    runner.pool(2)
    assert log[-2:] == ["end 1", "start 2"]  # no idle pool kept: the pool of 1 ends, the spare of 1 stays
    assert list(runner.spares) == [1]
    runner.close()
    assert log[-2:] == ["end 2", "end 1"]  # the spare is ended with the rest
    assert runner.spares == {}


def test_a_gpu_host_starts_no_spare(tmp_path: Path, log: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("harness.runner.use_gpus", lambda: True)  # a spare would hold its GPUs
    runner = Runner(out_dir=tmp_path, run_id="t", spare_pools=(1, 2))
    runner.pool(1)
    runner.start_spare_pools()
    assert log == ["start 1"] and runner.spares == {}

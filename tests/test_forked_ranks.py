"""Trainer ranks whose Ray workers fork from a fork server (`reference_impl.trainer.forked_rank`, Ray's
`py_executable`) against ranks Ray starts as new interpreters, the reference: the same view of their environment,
priority, threads and process group, the fork server's imports already done, and Ray kills and watches the forked
process as it does its own worker. A rank on a host without that fork server starts as a new interpreter. Every
scenario test runs forked ranks (the runner's default), so what a rank computes is judged there."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray

from harness.placement import TrainerPool
from reference_impl.cuda import cuda_available
from reference_impl.fork_client import ForkServerAddress, ready
from reference_impl.fork_server import ForkServer
from reference_impl.trainer.forked_rank import ROLE

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(cuda_available(), reason="ranks are not forked on a host with CUDA devices (see forked_rank)"),
]


@pytest.fixture(scope="module")
def rank_fork_server(runner: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    """A rank fork server of this module's own (the session's runner, whose Ray the ranks run on, has another)."""
    server = ForkServer.start(ROLE, tmp_path_factory.mktemp("rank-fork") / "rank-fork-server.log")
    yield server
    server.stop()


def _view(worker: Any) -> dict[str, Any]:
    """What a rank sees of its own process (run inside it by `__ray_call__`)."""
    import faulthandler

    import torch

    from reference_impl import fork_client, fork_server

    with open("/proc/self/oom_score_adj") as f:
        oom_score_adj = int(f.read())
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        "env": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "PYTHONFAULTHANDLER")},
        "ray_job": os.environ.get("RAY_JOB_ID") is not None,
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "oom_score_adj": oom_score_adj,  # Ray's workers: 1000, the first the kernel ends when memory runs out
        "group_leader": os.getpgid(0) == os.getpid(),
        "cwd": os.getcwd(),
        "torch_threads": torch.get_num_threads(),
        "faulthandler": faulthandler.is_enabled(),
        "pythonpath_on_sys_path": all(p in sys.path for p in pythonpath),
        "sys_path_head": sys.path[: 1 + len(pythonpath)],
        "script": os.path.basename(sys.argv[0]),
        "stdout_in_ray_logs": "/logs/" in os.path.realpath("/proc/self/fd/1"),
        "node": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
        "stand_in": fork_server.forked_for,
        "fallback": os.environ.get(fork_client.FALLBACK_VAR),
        "megatron_imported": "megatron.bridge" in sys.modules,
    }


def _views(pool: TrainerPool) -> list[dict[str, Any]]:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # `_view` travels by value: ranks cannot import it
    return ray.get([a.__ray_call__.remote(_view) for a in pool.actors], timeout=120)


def _gone_within(pid: int, seconds: float) -> bool:
    try:
        psutil.Process(pid).wait(seconds)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


def test_a_forked_rank_sees_what_a_new_interpreter_rank_sees(rank_fork_server: ForkServer) -> None:
    # each pool's ranks answered only once their process group of 2 formed (`TrainerWorker.__init__`)
    forked = TrainerPool.create(2, fork_server=rank_fork_server.address)
    new = TrainerPool.create(2)
    try:
        forked_views, new_views = _views(forked), _views(new)
        for view in forked_views:
            rank = psutil.Process(view["pid"])
            assert rank.ppid() == rank_fork_server.proc.pid
            assert "TrainerWorker" in " ".join(rank.cmdline())
            stand_in = psutil.Process(view["stand_in"])  # what the raylet started: it waits for the rank
            assert any(Path(a).name == "fork_client.py" for a in stand_in.cmdline())  # its `py_executable`
            assert "raylet" in " ".join(psutil.Process(stand_in.ppid()).cmdline())
            assert view["megatron_imported"]  # the fork server's imports, not the rank's
        for view in new_views:
            assert view["stand_in"] is None and not view["megatron_imported"]
            assert "raylet" in " ".join(psutil.Process(psutil.Process(view["pid"]).ppid()).cmdline())
        differ = {"pid", "stand_in", "megatron_imported"}
        assert [{k: v for k, v in f.items() if k not in differ} for f in forked_views] == [
            {k: v for k, v in n.items() if k not in differ} for n in new_views
        ]
        assert forked_views[0]["nice"] > 0 and forked_views[0]["oom_score_adj"] > 0  # Ray's, not the driver's
    finally:
        forked.kill()
        new.kill()


def test_ray_kills_and_watches_a_forked_rank_as_its_own_worker(rank_fork_server: ForkServer) -> None:
    pool = TrainerPool.create(3, fork_server=rank_fork_server.address)
    try:
        (killed, ended, terminated) = _views(pool)
        # SIGKILL to the rank: Ray sees its actor die; its stand-in ends with it
        os.kill(killed["pid"], signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(pool.actors[0].pid.remote(), timeout=60)
        assert _gone_within(killed["stand_in"], 10)
        # ray.kill: Ray ends the process it knows, the forked one, and the stand-in follows
        ray.kill(pool.actors[1], no_restart=True)
        assert _gone_within(ended["pid"], 30) and _gone_within(ended["stand_in"], 10)
        # SIGTERM to the stand-in (what the raylet started) reaches the rank, which ends as Ray's worker does on it
        os.kill(terminated["stand_in"], signal.SIGTERM)
        assert _gone_within(terminated["pid"], 30) and _gone_within(terminated["stand_in"], 10)
        assert rank_fork_server.proc.poll() is None  # Ray ended the rank, not its fork server
    finally:
        pool.kill()


def test_a_rank_on_a_host_without_its_fork_server_starts_as_a_new_interpreter(tmp_path: Path, runner: Any) -> None:
    elsewhere = ForkServerAddress(str(tmp_path / "no-such-folder" / "fork.sock"), sys.executable)
    pool = TrainerPool.create(1, fork_server=elsewhere)
    try:
        (view,) = _views(pool)
        assert view["stand_in"] is None and not view["megatron_imported"]
        assert view["fallback"] is not None and "no fork server listens" in view["fallback"]
        assert "raylet" in " ".join(psutil.Process(psutil.Process(view["pid"]).ppid()).cmdline())
    finally:
        pool.kill()


def test_a_launcher_does_not_wait_for_a_fork_server_that_was_killed_while_it_imported(tmp_path: Path) -> None:
    server = ForkServer.start(ROLE, tmp_path / "rank-fork-server.log", wait=False)
    try:
        while not (server.folder / "pid").exists():
            assert server.proc.poll() is None
            time.sleep(0.05)
        server.proc.kill()  # SIGKILL: no cleanup, its folder stays without a "ready"
        server.proc.wait()
        started = time.monotonic()
        assert not ready(server.address, timeout_s=60)
        assert time.monotonic() - started < 5
    finally:
        server.stop()


@pytest.mark.parametrize(("code", "status", "printed"), [(None, 0, ""), (0, 0, ""), (3, 3, ""), ("bad", 1, "bad\n")])
def test_a_forked_process_exits_as_an_interpreter_does(
    code: object, status: int, printed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # the fork server's own exit read `sys.exit()` (code None) as 1 where an interpreter exits 0
    from reference_impl.fork_server import exit_code

    assert exit_code(SystemExit(code)) == status
    assert capsys.readouterr().err == printed

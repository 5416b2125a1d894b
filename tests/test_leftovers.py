"""What a run leaves behind when it ends in the middle of starting processes (`harness.driver_ray`): a
parent still starting children when it is killed, and a process of the run's Ray re-parented before the
harness looks. Both are what an interrupt in the middle of `ray.init` leaves: the raylet starts its agents
a while after it runs, and an agent outlives a raylet killed before it. And what an engine server leaves in
the temp folder once stopped (`ServerProcess.server_temp_dir`; vLLM's side in
`tests/vllm_engine/test_servers.py`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from harness import driver_ray
from reference_impl.engine.embedded.launcher import EngineProcess, EngineStartError
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model

# A parent that starts a sleeping child every 20 ms, for as long as it runs.
SPAWNER = """
import subprocess, sys, time
while True:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    time.sleep(0.02)
"""

# A parent that starts one sleeping child and exits: the child is re-parented (to init or a subreaper).
ORPHANER = """
import subprocess, sys
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(120)"],
    start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
print(child.pid, flush=True)
"""


def _marked(marker: str) -> list[psutil.Process]:
    """Live processes whose environment carries TEST_MARKER=`marker` (found without the harness's code)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("TEST_MARKER") == marker and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _gone_within(procs: list[psutil.Process], within: float = 10.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=within)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_parent_still_starting_children_is_ended_with_every_child_it_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No Ray of this driver in the sweep: the test session's own Ray (conftest) must survive the test.
    monkeypatch.setattr(driver_ray, "_ray_tag", None)
    marker = uuid.uuid4().hex
    parent = subprocess.Popen([sys.executable, "-c", SPAWNER], env={**os.environ, "TEST_MARKER": marker})
    try:
        end = time.monotonic() + 30
        while len(_marked(marker)) < 4 and time.monotonic() < end:  # it is well under way
            time.sleep(0.05)
        assert len(_marked(marker)) >= 4
        driver_ray.end_leftovers([psutil.Process(parent.pid)], grace_s=0.1)
        parent.wait(timeout=10)  # reaped by the function's wait: its status is lost
        assert not psutil.pid_exists(parent.pid)
        left = _gone_within(_marked(marker))
        assert left == [], [p.pid for p in left]
    finally:
        for proc in _marked(marker):
            proc.kill()


def test_a_process_of_the_drivers_ray_is_found_after_it_was_re_parented(monkeypatch: pytest.MonkeyPatch) -> None:
    tag = f"test-{uuid.uuid4().hex}"
    monkeypatch.setattr(driver_ray, "_ray_tag", tag)
    other = f"test-{uuid.uuid4().hex}"  # another driver's Ray: never touched
    runs = {}
    for value in (tag, other):
        out = subprocess.run(
            [sys.executable, "-c", ORPHANER],
            env={**os.environ, driver_ray.RAY_TAG_VAR: value},
            capture_output=True,
            text=True,
            check=True,
        )
        runs[value] = psutil.Process(int(out.stdout))
    try:
        assert runs[tag].ppid() != os.getpid() and runs[tag].pid in {p.pid for p in driver_ray.ray_processes()}
        driver_ray.end_leftovers([], grace_s=0.0)
        assert _gone_within([runs[tag]]) == []  # by its SIGTERM or its SIGKILL
        assert runs[other].is_running()
    finally:
        for proc in runs.values():
            if proc.is_running():
                proc.kill()


def test_without_a_ray_of_its_own_the_driver_finds_no_ray_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver_ray, "_ray_tag", None)
    assert driver_ray.ray_processes() == []


def test_an_engine_server_writes_to_a_temp_folder_of_its_own_that_stop_removes(tmp_path: Path) -> None:
    # Before, every embedded engine left its port file's folder in /tmp and every vLLM its ZMQ sockets and
    # its `vllm_dist_*` file: hundreds per test session.
    proc = EngineProcess(str(make_checkpoint(load_model("qwen3"), 1234)), 4321, str(tmp_path / "engine.log"))
    try:
        proc.start(120)
        assert proc.proc is not None
        env = psutil.Process(proc.proc.pid).environ()  # as the kernel has it, not as the launcher meant it
        temp = Path(env["TMPDIR"])
        assert temp.parent == Path(tempfile.gettempdir()) and (temp / "port").is_file()
    finally:
        proc.stop()
    assert not temp.exists()


@pytest.mark.parametrize("kind", ["embedded", "vllm"])
def test_a_server_built_and_never_started_leaves_no_log_file(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, a server given no log path made its temp log file (and leaked its descriptor) when built: every
    # test session left two empty /tmp/tmp*.vllm.log files from servers whose command line alone was read.
    from reference_impl.engine.vllm.launcher import VllmEngineProcess

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    proc = EngineProcess("/ckpt", 7, None) if kind == "embedded" else VllmEngineProcess("/ckpt", 7, None)
    assert proc.log_tail() == "(no log)" and list(tmp_path.iterdir()) == []
    log = proc.log_path  # asked for: made then, once, in the temp folder
    assert log.parent == tmp_path and log.is_file() and proc.log_path == log
    assert list(tmp_path.iterdir()) == [log]


def test_a_server_stopped_before_it_had_a_process_never_starts_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `EngineActor.stop` may run in another thread before `start` launched the server: that start must launch
    # nothing, not leave a server (or a temp folder) nobody will stop.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    proc = EngineProcess(str(make_checkpoint(load_model("qwen3"), 1234)), 4321, str(tmp_path / "engine.log"))
    proc.stop()
    with pytest.raises(EngineStartError, match="stopped while it started"):
        proc.start(120)
    assert proc.proc is None and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_stop_in_the_middle_of_a_launch_returns_with_nothing_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine actor is threaded, and `end_engines` kills it once its `stop` returned. A stop that came while
    # `start` was between its temp folder and its spawn used to return at once, the process not yet spawned:
    # killed then, the actor left a temp folder in /tmp (a fork server's spawn makes one for the exit status
    # after the stop removed the first). Now `stop` waits for the spawn and ends what it started. The spawn is
    # slowed here, as a loaded host slows it, so that the stop lands inside it.
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    proc = EngineProcess(str(make_checkpoint(load_model("qwen3"), 1234)), 4321, str(tmp_path / "engine.log"))
    spawning, stopped = threading.Event(), threading.Event()
    spawned_after_stop: list[bool] = []
    real_spawn = proc.spawn

    def slow_spawn(*args: object) -> object:
        spawning.set()
        time.sleep(1.0)
        spawned_after_stop.append(stopped.is_set())
        return real_spawn(*args)

    monkeypatch.setattr(proc, "spawn", slow_spawn)
    failed: list[BaseException] = []

    def start() -> None:
        try:
            proc.start(120)
        except BaseException as e:
            failed.append(e)

    starting = threading.Thread(target=start)
    starting.start()
    assert spawning.wait(30)
    proc.stop()
    stopped.set()
    left = sorted(p.name for p in temp.iterdir())  # what the actor, killed now, would leave behind
    starting.join(120)
    assert spawned_after_stop == [False]  # a kill once `stop` returned can no longer leave a process behind
    assert left == [], left
    assert proc.proc is not None and proc.proc.poll() is not None  # the stop ended the process the spawn started
    assert len(failed) == 1 and isinstance(failed[0], EngineStartError), failed
    assert sorted(p.name for p in temp.iterdir()) == []


def test_an_engine_actor_stopped_while_its_server_starts_ends_that_start(tmp_path: Path) -> None:
    # An interrupted run stops its engines while their start still waits for /health. When the actor ran one
    # call at a time, `stop` waited behind `start` until the server answered (or the start timed out), and an
    # interrupt during a start took that long to end the run. The start must now fail, its server ended.
    import ray

    from harness.driver_ray import ensure_ray
    from harness.placement import EngineActor

    ensure_ray()
    ckpt = make_checkpoint(load_model("qwen3"), 1234)
    actor = EngineActor.remote()  # type: ignore[attr-defined]
    try:
        start = actor.start.remote("embedded", str(ckpt), 4321, str(tmp_path / "engine.log"), "float32")
        time.sleep(0.5)  # the server is launched, or about to be; either way it must not come up
        ray.get(actor.stop.remote(), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError, match="EngineStartError"):
            ray.get(start, timeout=120)
        pid = ray.get(actor.pid.remote(), timeout=30)
        assert pid is None or not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        ray.kill(actor, no_restart=True)


def test_an_engine_actor_whose_worker_gets_a_sigterm_ends_its_server_and_its_temp_folder(tmp_path: Path) -> None:
    # A SIGTERM to every process of a job reaches the engine actor's Ray worker, which exits through SystemExit:
    # nothing asked it to stop its server, and the server's temp folder stayed in /tmp (one per engine).
    import ray

    from harness.driver_ray import ensure_ray
    from harness.placement import EngineActor

    ensure_ray()
    ckpt = make_checkpoint(load_model("qwen3"), 1234)
    actor = EngineActor.remote()  # type: ignore[attr-defined]
    try:
        ray.get(actor.start.remote("embedded", str(ckpt), 4321, str(tmp_path / "engine.log"), "float32"), timeout=180)
        server = psutil.Process(ray.get(actor.pid.remote(), timeout=30))
        temp = Path(server.environ()["TMPDIR"])
        worker = psutil.Process(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30))
        assert temp.name.startswith("wsh-server-") and temp.is_dir()
        worker.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs([server, worker], timeout=30)
        assert alive == [], alive
        assert not temp.exists()
    finally:
        ray.kill(actor, no_restart=True)


def test_a_process_of_the_drivers_ray_nobody_ended_gets_a_sigterm_not_the_whole_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a SIGTERM in the middle of ray.init leaves: node processes ray.shutdown does not know of. They end on
    # a SIGTERM; before, the run's exit waited the whole grace for them and then killed them.
    tag = f"test-{uuid.uuid4().hex}"
    monkeypatch.setattr(driver_ray, "_ray_tag", tag)
    node = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], env={**os.environ, driver_ray.RAY_TAG_VAR: tag}
    )
    try:
        end = time.monotonic() + 30
        while node.pid not in {p.pid for p in driver_ray.ray_processes()} and time.monotonic() < end:
            time.sleep(0.05)  # its environment is readable once it runs
        killed = driver_ray.end_leftovers([psutil.Process(node.pid)], grace_s=60.0)
        assert killed == []  # it ended on the SIGTERM, within the grace, not by the SIGKILL after it
        assert not psutil.pid_exists(node.pid)  # ended, and reaped by the wait
    finally:
        node.kill()


def test_ray_is_lost_once_its_gcs_server_refuses_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    # A SIGTERM to every process of a job stops the GCS server listening (its process lingers): a Ray call then
    # waited 60 s until the driver's Ray ended the process with status 1, before the run's close wrote anything.
    import socket

    monkeypatch.setattr(driver_ray, "_gcs_address", None)
    assert not driver_ray.ray_lost()  # no Ray started or joined
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setattr(driver_ray, "_gcs_address", f"127.0.0.1:{server.getsockname()[1]}")
        assert not driver_ray.ray_lost()
    assert driver_ray.ray_lost()  # the port now refuses
    # shutdown_ray SIGKILLs a lost Ray's GCS server and raylet first (here they would be this test session's own)
    killed: list[str] = []
    monkeypatch.setattr(driver_ray.ray, "shutdown", lambda: killed.append("ray.shutdown"))
    monkeypatch.setattr(driver_ray, "_kill_core", lambda: killed.append("core"))
    driver_ray.shutdown_ray()
    assert killed == ["core", "ray.shutdown"]
    assert not driver_ray.ray_lost()  # a Ray this driver stopped itself is not lost


def test_an_engine_watch_stops_asking_once_ray_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    # After a SIGTERM to every process the engine actor cannot answer, and naming the engine's end waited its
    # whole 30 s for it, half the driver's Ray's own 60 s before it ends the process.
    import ray

    from harness import watch
    from harness.driver_ray import ensure_ray

    ensure_ray()

    @ray.remote(num_cpus=0)
    class Silent:
        def exit_status(self, tail_chars: int) -> tuple[int | None, str]:
            time.sleep(120)
            return None, ""

    actor = Silent.remote()  # type: ignore[attr-defined]
    try:
        monkeypatch.setattr(watch, "ray_lost", lambda: True)
        t0 = time.monotonic()
        assert watch.EngineWatch(actor, 1234)("sync 0", timeout_s=30) is None
        assert time.monotonic() - t0 < 5
    finally:
        ray.kill(actor, no_restart=True)


def _make_a_segment_and_let_go(worker: object) -> str:
    """Run in a rank (`__ray_call__`): make a colocate chunk segment as a sender does, then let go of it (unmapped,
    its descriptor closed, Python's resource tracker told to forget it) without unlinking it, as a sender a
    signal ends between its last look and its cleanup leaves it: held by nothing, made by the rank."""
    from multiprocessing import resource_tracker

    from reference_impl.transport.handles import SharedMemoryBuffer

    buf = SharedMemoryBuffer(4096)
    segment, buf._shm = buf.shm, None
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    segment.close()
    return segment.name


@pytest.mark.e2e
@pytest.mark.parametrize("lost", [False, True], ids=["through-ray", "ray-lost"])
def test_a_killed_pool_unlinks_the_segments_its_ranks_made_and_no_longer_hold(
    runner: object, lost: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A segment a sender made after the run's last look at what it holds, or whose rank a SIGTERM to every process
    # ended first, was held by nobody when the pool was killed, and stayed in /dev/shm (1 MiB, once).
    import ray
    from ray.util import remove_placement_group

    from harness import placement
    from harness.shm import SHM_DIR

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the function travels by value
    pool = placement.TrainerPool.create(1, fork_server=runner.forks.for_ranks())  # type: ignore[attr-defined]
    actors, pg, name = list(pool.actors), pool.pg, ""
    try:
        name = ray.get(actors[0].__ray_call__.remote(_make_a_segment_and_let_go), timeout=120)
        rank = psutil.Process(pool.pids[0])
        assert (SHM_DIR / name).exists() and name.startswith(f"wsh_chunk_{rank.pid:08x}")
        monkeypatch.setattr(placement, "ray_lost", lambda: lost)  # lost: the ranks are killed by pid
        pool.kill()
        assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
        assert not (SHM_DIR / name).exists()
    finally:
        if lost:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(pg)
        if name:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()

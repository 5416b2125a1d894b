"""Hard kills at seeded random points: the engine (SIGKILL, in the middle of a chunk), one trainer rank
(SIGKILL, in the middle of the PP hand-off to the sender) and the harness itself (SIGINT / SIGTERM to
`python -m harness run`). Every scenario that runs to its end has a verdict within its deadline + 30 s and
a valid record on disk; no process of the run and no shared-memory segment of the run is left.

"In the middle of a chunk" is made exact without touching the system under test: the victim is stopped
(SIGSTOP) as soon as the sender's progress line reaches the chosen chunk; with the victim frozen the sender
cannot get past its next call on that victim, and the line it then shows is what was in flight when the
SIGKILL came. Processes are told apart by pid (runner-driven kills) or by an environment marker every
process of a harness subprocess inherits; only those are ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import yaml
from harness_cli import harness_run, sigint_not_ignored

from harness import shm
from harness.record import RunRecord
from harness.scenario import Scenario
from harness.soak import sample_resources
from reference_impl.engine.process import SERVER_TEMP_ROOT_VAR
from reference_impl.fork_server import FORKED_LINE

pytestmark = pytest.mark.e2e

DEADLINE_S = 40.0
GONE_WITHIN_S = 30.0
# `nox -s tests` runs the seeds that cover every kind once: engine kills at PP 1 and 2 in either placement
# (0-3), rank kills of either rank in either placement that the seeds draw (0, 1, 5: rank 0 colocated and
# not, rank 1 not), each of the three signals (0-2). WSH_HARD_KILL_SEEDS=all (`nox -s hard_kills`) runs all.
ALL_SEEDS = os.environ.get("WSH_HARD_KILL_SEEDS") == "all"
ENGINE_SEEDS = range(8) if ALL_SEEDS else (0, 1, 2, 3)
RANK_SEEDS = range(6) if ALL_SEEDS else (0, 1, 5)
HARNESS_SEEDS = range(6) if ALL_SEEDS else (0, 1, 2)


# ------------------------------------------------------------------------------------------------ helpers


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: set[int], within: float = GONE_WITHIN_S) -> list[str]:
    """The processes of `pids` still alive after `within` seconds, with their command lines."""
    end = time.monotonic() + within
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.5)
    left = []
    for pid in pids:
        if _alive(pid):
            try:
                proc = psutil.Process(pid)
                left.append(f"{pid} (parent {proc.ppid()}): {' '.join(proc.cmdline()).strip()[:150]}")
            except psutil.NoSuchProcess:
                continue
    return left


def _launcher(server: psutil.Process, logs: Path) -> int:
    """The pid of an engine server's launcher (its Ray actor): its parent, or, for a server forked by a fork server
    (`reference_impl.fork_server`), the launcher its log names (`FORKED_LINE`; a spare's log is its start's, in
    `logs`)."""
    line = FORKED_LINE.format(pid=server.pid, fork_server=server.ppid(), launcher="")
    for log in logs.glob("*.log"):
        for text in log.read_text(errors="replace").splitlines():
            if text.startswith(line):
                return int(text.removeprefix(line))
    return server.ppid()


def _segments_left(held: set[str], within: float = GONE_WITHIN_S) -> set[str]:
    """Those of the run's segments (`held`: held or made by its processes) still in /dev/shm after
    `within` seconds. The host's /dev/shm is shared with other programs: only the run's own are judged."""
    end = time.monotonic() + within
    while time.monotonic() < end and shm.present(held):
        time.sleep(0.5)
    return set(shm.present(held))


def _progress(trace: Path, label: str) -> str:
    try:
        return (trace / f"{label}.txt").read_text().strip()
    except OSError:
        return ""


def _settled(trace: Path, label: str, quiet_s: float = 0.4, within: float = 10.0) -> str:
    """`label`'s progress line once it has not changed for `quiet_s` seconds."""
    last, since, end = _progress(trace, label), time.monotonic(), time.monotonic() + within
    while time.monotonic() < end:
        time.sleep(0.02)
        now = _progress(trace, label)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


class Killer(threading.Thread):
    """Waits until `trigger(progress of the sender, progress of rank 1)` holds, then SIGSTOPs `stop_pid()`,
    lets the sender settle, and SIGKILLs `kill_pid()` (SIGCONT to the stopped one if it is another)."""

    def __init__(
        self,
        trace: Path,
        trigger: Callable[[str, str], bool],
        pids: dict[str, int | None],
        stop: str,
        kill: str,
    ) -> None:
        super().__init__(daemon=True)
        self.trace, self.trigger, self.pids, self.stop_label, self.kill_label = trace, trigger, pids, stop, kill
        self.in_flight = ""
        self.killed_at: float | None = None

    def run(self) -> None:
        end = time.monotonic() + 300
        while time.monotonic() < end:
            if self.pids and self.trigger(_progress(self.trace, "rank0"), _progress(self.trace, "rank1")):
                break
            time.sleep(0.001)
        else:
            return
        stop_pid, kill_pid = self.pids[self.stop_label], self.pids[self.kill_label]
        assert stop_pid is not None and kill_pid is not None
        os.kill(stop_pid, signal.SIGSTOP)
        self.in_flight = _settled(self.trace, "rank0")
        os.kill(kill_pid, signal.SIGKILL)
        self.killed_at = time.monotonic()
        if stop_pid != kill_pid:
            os.kill(stop_pid, signal.SIGCONT)


def _run_with_kill(runner, sc: Scenario, make_killer: Callable[[Path, dict[str, int | None]], Killer]):
    """Run `sc` on the shared runner while a `Killer` works; returns (record, killer, the run's pids)."""
    pids: dict[str, int | None] = {}
    seen: set[int] = set()

    def capture(record: RunRecord, sync: int, scenario_pids: dict[str, int | None]) -> None:
        pids.update(scenario_pids)
        for pid in scenario_pids.values():  # the engine's launcher (its Ray actor) and descendants too
            if pid is None:
                continue
            seen.add(pid)
            try:
                proc = psutil.Process(pid)
                seen.update(c.pid for c in proc.children(recursive=True))
                if "engine" in scenario_pids and pid == scenario_pids["engine"]:
                    seen.add(_launcher(proc, runner.engine_log(sc.id, 0).parent))
            except psutil.NoSuchProcess:
                continue
        sample_resources(record, sync, scenario_pids)

    killer = make_killer(runner.trace_dir(sc.id), pids)
    previous, runner.after_sync = runner.after_sync, capture
    try:
        killer.start()
        rec = runner.run_scenario(sc)
    finally:
        runner.after_sync = previous
    ended = time.monotonic()
    killer.join(timeout=5)
    sender = _progress(runner.trace_dir(sc.id), "rank0")
    assert killer.killed_at is not None, f"the kill never came (sender at {sender})"
    assert ended - killer.killed_at <= sc.deadline_s + 30, ended - killer.killed_at
    assert RunRecord.load(runner.record_path(sc.id)).verdict == rec.verdict  # on disk, valid
    assert _wait_gone(seen) == []
    held = {n for s in rec.resources for p in s.processes.values() for n in p.shm}
    assert not sc.colocate or held, "a colocated sender holds its segment"
    assert _segments_left(held | shm.made_by(seen)) == set()  # made by a process now gone, also unheld
    return rec, killer


# ---------------------------------------------------------------------------------------- engine, SIGKILL


@pytest.mark.parametrize("seed", ENGINE_SEEDS)
def test_engine_killed_mid_chunk_is_a_crash_naming_the_engine(runner, seed: int) -> None:
    rng = random.Random(1000 + seed)
    sync, chunk = rng.randint(1, 2), rng.randint(0, 8)
    sc = Scenario(
        model="qwen3",
        pp=rng.choice([1, 2]),
        colocate=rng.choice([False, True]),
        syncs=3,
        chunk_bytes=65536,
        logprobs=False,
        deadline_s=DEADLINE_S,
        suffix=f"kill-engine-{seed}",
    )
    # the sender's lines: its main thread's (exporting, collecting) and its send thread's (on the wire)
    pattern = re.compile(rf"^(?:sync-send_0: )?sync {sync}: (collecting chunk|chunk) (\d+) of", re.M)

    def reached(sender: str, _: str) -> bool:
        return any(int(m.group(2)) >= chunk for m in pattern.finditer(sender))

    rec, killer = _run_with_kill(runner, sc, lambda trace, pids: Killer(trace, reached, pids, "engine", "engine"))
    # Stopped with a chunk on the wire, or, when the trigger's chunk was the sync's last and its answer came
    # before the stop, with the finish in flight (the send thread's line is gone once every chunk answered).
    on_the_wire = rf"^sync-send_0: sync {sync}: chunk \d+ of (at least )?\d+ on the wire"
    finishing = rf"^sync {sync}: /finish_weight_update in flight"
    assert re.search(on_the_wire, killer.in_flight, re.M) or re.search(finishing, killer.in_flight, re.M), (
        killer.in_flight
    )
    assert rec.verdict == "CRASH", [c for c in rec.checks if not c["ok"]]
    crash = next(c for c in rec.checks if c["name"] == "crash")
    assert crash["message"].startswith("engine raised EngineExited: the engine server (pid "), crash["message"]
    assert "was killed by SIGKILL while" in crash["message"] and f"sync {sync}" in crash["message"]
    log = runner.out_dir / "logs" / (sc.id.replace("/", "__") + ".engine.log")
    assert rec.errors[0].where == "engine" and rec.errors[0].traceback == log.read_text()[-3000:]  # its log's end
    assert "its log ends: " in crash["message"] or "its log is empty" in crash["message"]


# ------------------------------------------------------------------------------------------- rank, SIGKILL


@pytest.mark.parametrize("seed", RANK_SEEDS)
def test_rank_killed_mid_gather_ends_as_crash_or_deadlock(runner, seed: int) -> None:
    rng = random.Random(2000 + seed)
    sync, victim = rng.randint(1, 2), rng.choice(["rank0", "rank1"])
    sc = Scenario(
        model="qwen3",
        pp=2,
        colocate=rng.choice([False, True]),
        syncs=3,
        chunk_bytes=65536,
        logprobs=False,
        deadline_s=DEADLINE_S,
        suffix=f"kill-rank-{seed}",
    )
    delay_s = rng.uniform(0.0, 0.01)
    seen_at: list[float] = []

    def reached(_: str, stage1: str) -> bool:
        # stage 1 handing its tensors in the chosen sync, or in a later one where the killer thread, polling
        # every millisecond on a loaded host, missed that sync's hand-off (a few milliseconds)
        handing = re.match(r"sync (\d+): handing its tensors", stage1)
        if not seen_at and handing and int(handing.group(1)) >= sync:
            seen_at.append(time.monotonic())
        return bool(seen_at) and time.monotonic() - seen_at[0] >= delay_s

    rec, killer = _run_with_kill(runner, sc, lambda trace, pids: Killer(trace, reached, pids, "rank1", victim))
    # The stop lands in the chosen sync, or, on a loaded host where stage 1's hand-off (a few milliseconds) ended
    # before the stop did, later: in a later sync, in the trainer step before one (the sender waits there for the
    # stopped stage's step to return), or between a sync and the next (the ranks wait there for the harness: its
    # reads of the engine, arming the re-sync's mid-session hold); never after the last sync.
    landed = re.match(r"(sync|step) (\d+): (finished|checksums of what was sent)?", killer.in_flight)
    assert landed and sync <= int(landed.group(2)) <= sc.syncs, killer.in_flight  # syncs 0..sc.syncs, steps 1..
    assert not (landed.group(3) and int(landed.group(2)) == sc.syncs), killer.in_flight  # not after the last
    assert rec.verdict in ("CRASH", "DEADLOCK"), [c for c in rec.checks if not c["ok"]]
    deciding = next(c for c in rec.checks if not c["ok"] and not c["skipped"] and c["verdict_on_fail"] == rec.verdict)
    if rec.verdict == "CRASH":
        assert deciding["message"].startswith("rank "), deciding["message"]


# ------------------------------------------------------------------------------------ the harness, signals


def _marked(marker: str, temp_dirs: set[Path] | None = None) -> set[int]:
    """Pids of the live processes carrying `marker`; into `temp_dirs`, the folder each was given for its engine
    servers' temp folders (`SERVER_TEMP_ROOT_VAR`: the engine actors' Ray workers have it)."""
    found = set()
    for proc in psutil.process_iter(["pid"]):
        try:
            env = proc.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if proc.pid != os.getpid() and env.get("WSH_RUN_MARKER") == marker:
            found.add(proc.pid)
            if temp_dirs is not None and SERVER_TEMP_ROOT_VAR in env:
                temp_dirs.add(Path(env[SERVER_TEMP_ROOT_VAR]))
    return found


class Holdings(threading.Thread):
    """Every process carrying `marker`, every /dev/shm segment one of them held and every folder one of them was
    given for its engine servers' temp folders (`ServerProcess.server_temp_dir`), polled until `done`."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker, self.done = marker, threading.Event()
        self.pids: set[int] = set()
        self.held: set[str] = set()
        self.temp_dirs: set[Path] = set()

    def run(self) -> None:
        while not self.done.wait(0.3):
            for pid in _marked(self.marker, self.temp_dirs):
                self.pids.add(pid)
                self.held |= shm.held_by(pid)


def _scenario_started(run_dir: Path, timeout_s: float = 120.0) -> None:
    """Wait until the run's first scenario has its trace folder (Ray is up and its processes run)."""
    end = time.monotonic() + timeout_s
    while not any((run_dir / "trace").glob("*")):
        assert time.monotonic() < end, f"no scenario started within {timeout_s:.0f} s"
        time.sleep(0.2)


ONCE_RAY_RUNS = {  # seed -> the signal sent once a scenario runs
    "sigterm-once-ray-runs": "SIGTERM to the harness",
    "sigterm-to-the-group-once-ray-runs": "SIGTERM to the process group",
    "sigterm-to-every-process-once-ray-runs": "SIGTERM to every process",
}


@pytest.mark.parametrize("seed", [*HARNESS_SEEDS, *ONCE_RAY_RUNS])
def test_harness_signalled_leaves_records_and_nothing_else(tmp_path: Path, seed: int | str) -> None:
    # Random moments from Ray's start to the second scenario, and a SIGTERM once a scenario runs: there, the
    # failure handler ray.init installs for SIGTERM used to abort the harness before its cleanup; sent to the
    # whole process group (a CI runner's cancel), it also reached Ray's GCS server, which shut down, and the
    # driver's Ray ended the process with status 1 after 60 s, before the close wrote any summary. Sent to every
    # process (a batch scheduler's cancel), it stops the GCS server in any case: the close then ends the run's
    # processes by pid instead of through Ray (`driver_ray.ray_lost`).
    rng = random.Random(3000 + seed if isinstance(seed, int) else 0)
    how = (
        ONCE_RAY_RUNS[seed]
        if isinstance(seed, str)
        else ["SIGINT to the process group (Ctrl-C)", "SIGTERM to the harness", "SIGINT to the harness"][seed % 3]
    )
    entries = [
        {"model": "qwen3", "colocate": colocate, "syncs": 2, "chunk_bytes": 65536, "deadline_s": DEADLINE_S}
        for colocate in (True, False)
    ]
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(yaml.safe_dump(entries))
    marker = f"hard-kill-{os.getpid()}-{seed}"
    with sigint_not_ignored():
        proc = subprocess.Popen(
            harness_run(matrix, tmp_path, "--run-id", "signalled"),
            env={**os.environ, "WSH_RUN_MARKER": marker},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    watcher = Holdings(marker)
    watcher.start()
    if isinstance(seed, str):
        _scenario_started(tmp_path / "signalled")
    else:
        time.sleep(rng.uniform(2.0, 16.0))  # from Ray's start to the second scenario
    ours = _marked(marker)
    running = proc.poll() is None  # else the run ended before the signal (a fast host): nothing to interrupt
    if how.endswith("(Ctrl-C)"):
        os.killpg(proc.pid, signal.SIGINT)
    elif how == "SIGTERM to the process group":
        os.killpg(proc.pid, signal.SIGTERM)
    elif how == "SIGTERM to every process":
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM if "SIGTERM" in how else signal.SIGINT)
    signalled = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{how}: the harness did not exit within 60 s: {out[-3000:]}")
    assert time.monotonic() - signalled <= 30 + DEADLINE_S, how
    # The signal ended it: a run that ignored it would end 0 once its scenarios ran (Python's exit after an
    # uncaught KeyboardInterrupt, which SIGTERM also raises here, is -SIGINT).
    assert not running or proc.returncode != 0, (how, proc.returncode, out[-2000:])
    if isinstance(seed, str):  # past ray.init, the harness's own handler: a SIGTERM'd process's status
        assert proc.returncode == 143, (how, proc.returncode, out[-2000:])
        assert out.rstrip().endswith("interrupted by SIGTERM") and "Traceback" not in out, out[-2000:]
        assert "CRASH (interrupted)" in (tmp_path / "signalled" / "summary.md").read_text(), out[-2000:]
    for path in sorted((tmp_path / "signalled" / "records").glob("*.json")):
        assert RunRecord.load(path).verdict, path  # every finished scenario: a valid, judged record
    # and every scenario that started (its ranks made its trace folder), the interrupted one too
    traced = {p.name for p in (tmp_path / "signalled" / "trace").glob("*")}
    recorded = {p.stem for p in (tmp_path / "signalled" / "records").glob("*.json")}
    assert traced <= recorded, (how, sorted(traced - recorded), out[-2000:])
    watcher.done.set()
    watcher.join(timeout=5)
    ours |= _marked(marker) | watcher.pids
    assert _wait_gone(ours) == [], (how, out[-2000:])
    assert _marked(marker) == set(), how
    # held by one of the run's processes at a look, or made by one (a segment made after the last look)
    assert _segments_left(watcher.held | shm.made_by(ours)) == set(), how
    # the run's folder of its engine servers' temp folders (a SIGTERM to every process ended an engine actor's
    # worker before it removed its server's folder, 1 of 6 runs: the folder stayed in /tmp)
    assert watcher.temp_dirs or not isinstance(seed, str), "no engine actor seen once a scenario ran"
    assert {d for d in watcher.temp_dirs if d.exists()} == set(), how

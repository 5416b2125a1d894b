"""Embedded engine servers forked from a fork server (`reference_impl.fork_server`) against the
same servers started as new interpreters (`python -m reference_impl.engine.embedded`, `subprocess.Popen`), the
reference: the same answers, the same view of their environment, priority and process group, the same exit
statuses, and they end with their launcher as a new interpreter does. A fork server ends with its owner, and a
launcher that cannot reach one starts a new interpreter."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from harness_cli import sigint_not_ignored

from reference_impl.engine.embedded.launcher import EngineProcess, EngineStartError
from reference_impl.fork_client import STATUS_LOST_S, ForkServerAddress
from reference_impl.fork_server import FORKED_LINE
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.priority import lowest_priority

from .engines import CKPT_SEED, ENGINE_SEED

PROMPT = [3, 17, 42, 5, 99, 7]
# A fault hook that changes nothing: it writes what the server sees of its process to the log, as JSON.
PROBE_HOOK = '''
import json, os, signal, sys, tempfile

def report():
    """probe: reports the process's view of itself"""
    view = {
        "probe": os.environ.get("WSH_PROBE"),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "tmpdir_is_own": os.path.basename(tempfile.gettempdir()).startswith("wsh-server-"),
        "cwd": os.getcwd(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "idle": os.sched_getscheduler(0) == os.SCHED_IDLE,
        "group_leader": os.getpgid(0) == os.getpid(),
        "session_leader": os.getsid(0) == os.getpid(),
        "stdin": os.path.realpath("/proc/self/fd/0"),
        "hook_dir_on_path": os.path.dirname(__file__) in sys.path,
        "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
    }
    print("PROBE " + json.dumps(view, sort_keys=True), file=sys.stderr, flush=True)
'''


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return str(make_checkpoint(load_model("qwen3"), seed=CKPT_SEED))


@contextlib.contextmanager
def _server(
    checkpoint: str, log: Path, fork_server: ForkServerAddress | None, fault: str | None = None
) -> Iterator[EngineProcess]:
    with EngineProcess(checkpoint, ENGINE_SEED, str(log), fault=fault, fork_server=fork_server) as proc:
        proc.start(timeout_s=120)
        assert proc.forked == (fork_server is not None), proc.log_tail()
        yield proc


def _answers(url: str) -> dict[str, Any]:
    r = httpx.post(
        url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "logprobs": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    info = httpx.get(url + "/weight_info", timeout=30).json()
    return {"prompt_logprobs": choice["prompt_logprobs"], "logprobs": choice["logprobs"], "weight_info": info}


def _probe(log: Path) -> dict[str, Any]:
    lines = [line for line in log.read_text().splitlines() if line.startswith("PROBE ")]
    assert len(lines) == 1, log.read_text()[-3000:]
    return json.loads(lines[0].removeprefix("PROBE "))


def test_a_forked_server_answers_as_a_new_interpreter_does(
    checkpoint: str, fork_server: ForkServerAddress, tmp_path: Path
) -> None:
    with (
        _server(checkpoint, tmp_path / "new.log", None) as new,
        _server(checkpoint, tmp_path / "forked.log", fork_server) as forked,
    ):
        assert _answers(forked.url) == _answers(new.url)
        assert forked.proc is not None and psutil.Process(forked.proc.pid).ppid() != os.getpid()
        named = FORKED_LINE.format(pid=forked.proc.pid, fork_server=psutil.Process(forked.proc.pid).ppid(), launcher="")
        assert f"{named}{os.getpid()}" in forked.log_tail()  # it says whose it is
        codes = []
        for proc in (new, forked):  # Ctrl-C ends both the same way
            assert proc.proc is not None
            os.kill(proc.proc.pid, signal.SIGINT)
            codes.append(proc.proc.wait(30))
        assert codes[1] == codes[0], codes


def test_a_forked_server_sees_its_launchers_environment_priority_and_group(
    checkpoint: str, fork_server: ForkServerAddress, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started the way the runner starts a spare (in a thread at the lowest priority) with a variable only the
    launcher has, the probe's folder on PYTHONPATH and SIGINT ignored (as a shell starts a background job): a
    forked server sees what a new interpreter sees."""
    (tmp_path / "probe_hook.py").write_text(PROBE_HOOK)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("WSH_PROBE", "from the launcher")
    views: dict[str, dict[str, Any]] = {}

    def start(name: str, fs: ForkServerAddress | None) -> None:
        with lowest_priority() as lowered, _server(checkpoint, tmp_path / f"{name}.log", fs, "probe_hook:report"):
            assert lowered
            views[name] = _probe(tmp_path / f"{name}.log")

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for name, fs in (("new", None), ("forked", fork_server)):
            t = threading.Thread(target=start, args=(name, fs))
            t.start()
            t.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert views["forked"] == views["new"]
    assert views["new"] == {
        "probe": "from the launcher",
        "omp_threads": "1",
        "tmpdir_is_own": True,
        "cwd": os.getcwd(),
        "nice": 19,
        "idle": True,
        "group_leader": True,
        "session_leader": True,
        "stdin": "/dev/null",
        "hook_dir_on_path": True,
        "sigint_ignored": True,
    }


def test_a_forked_server_that_fails_or_is_killed_has_the_exit_status_of_a_new_interpreter(
    checkpoint: str, fork_server: ForkServerAddress, tmp_path: Path
) -> None:
    errors = {}
    for name, fs in (("new", None), ("forked", fork_server)):
        proc = EngineProcess(
            checkpoint, ENGINE_SEED, str(tmp_path / f"{name}.log"), fault="no_module:hook", fork_server=fs
        )
        with proc, pytest.raises(EngineStartError) as err:
            proc.start(timeout_s=120)
        forked_line = re.escape(FORKED_LINE.format(pid="N", fork_server="N", launcher="N")).replace("N", r"\d+")
        errors[name] = re.sub(forked_line + "\n", "", str(err.value))
    assert errors["forked"] == errors["new"]
    assert errors["new"].startswith("engine exited with 2: __main__.py: error: --fault: cannot import 'no_module'")
    with _server(checkpoint, tmp_path / "killed.log", fork_server) as proc:
        assert proc.proc is not None and proc.proc.poll() is None
        os.kill(proc.proc.pid, signal.SIGKILL)
        assert proc.proc.wait(10) == -signal.SIGKILL
    # a status whose folder was removed (the server's temp folder) cannot come: the end reads as lost at once, not
    # after STATUS_LOST_S (15 s; a test that removed the session's server temp root made every stop wait for it)
    with _server(checkpoint, tmp_path / "unwritable.log", fork_server) as proc:
        assert proc.proc is not None and proc.temp_dir is not None
        shutil.rmtree(proc.temp_dir)
        os.kill(proc.proc.pid, signal.SIGTERM)
        assert proc.proc.wait(STATUS_LOST_S / 3) == -signal.SIGKILL
    # a status the fork server writes late (busy with a client that has not sent its request yet) is still read;
    # launched handling SIGINT, as from a terminal (from a pytest that ignores it, the server would ignore it too)
    with (
        sigint_not_ignored(),
        _server(checkpoint, tmp_path / "late.log", fork_server) as proc,
        socket.socket(socket.AF_UNIX) as idle,
    ):
        assert proc.proc is not None
        idle.connect(fork_server.socket)
        os.kill(proc.proc.pid, signal.SIGINT)
        threading.Timer(3.0, idle.close).start()
        assert proc.proc.wait(30) == -signal.SIGINT


LAUNCHER = """
import sys, time
from reference_impl.fork_client import STATUS_LOST_S, ForkServerAddress
from reference_impl.engine.embedded.launcher import EngineProcess
proc = EngineProcess(sys.argv[2], 4321, sys.argv[3], fork_server=ForkServerAddress(sys.argv[1], sys.executable))
proc.start(120)
print(proc.pid(), proc.forked, proc.temp_dir, flush=True)
time.sleep(600)
"""

OWNER = """
from reference_impl.fork_server import ForkServer
ForkServer.start("reference_impl.engine.embedded.forked")
"""


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.2)
                continue
        return True
    return False


def test_a_forked_server_ends_with_its_launcher_and_a_fork_server_with_its_owner(
    checkpoint: str, fork_server: ForkServerAddress, tmp_path: Path
) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, fork_server.socket, checkpoint, str(tmp_path / "e.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        pid, forked, temp = launcher.stdout.readline().split()
        assert forked == "True" and psutil.Process(int(pid)).ppid() != launcher.pid
    finally:
        launcher.kill()
        launcher.wait()
    try:
        assert _gone_within(int(pid), 10), "a forked server outlived its launcher"
    finally:
        shutil.rmtree(temp, ignore_errors=True)  # what its launcher's stop would have removed
    # an owner killed while its fork server still imports (it then never sees its owner alive)
    owner = subprocess.Popen([sys.executable, "-c", OWNER])
    try:
        deadline = time.monotonic() + 60
        servers: list[psutil.Process] = []
        while not servers and time.monotonic() < deadline:
            time.sleep(0.05)
            # a child seen between its fork and its exec still has the owner's command line
            servers = [c for c in psutil.Process(owner.pid).children() if "--socket" in _cmdline(c)]
        assert servers, "the owner started no fork server"
        folder = Path(servers[0].cmdline()[servers[0].cmdline().index("--socket") + 1]).parent
    finally:
        owner.kill()
        owner.wait()
    assert not (folder / "ready").exists(), "the fork server had finished importing: kill its owner sooner"
    try:
        assert _gone_within(servers[0].pid, 60), "a fork server outlived its owner"
        assert not folder.exists(), "a fork server whose owner ended left its folder"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_malformed_request_is_refused_before_anything_is_forked(fork_server: ForkServerAddress) -> None:
    server = psutil.Process(int(Path(fork_server.socket).with_name("ready").read_text()))
    before = {c.pid for c in server.children()}
    cases = {
        b"not json\n": "JSONDecodeError",
        b'["args"]\n': "a launch request is a JSON object",
        b'{"args": "--seed 1"}\n': "field 'args' must be a list",
    }
    for body, why in cases.items():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(fork_server.socket)
            s.sendall(body)
            answer = json.loads(s.makefile().readline())
        assert "pid" not in answer and why in answer["error"], answer
    assert {c.pid for c in server.children()} <= before


def test_a_launcher_that_cannot_use_a_fork_server_starts_a_new_interpreter(checkpoint: str, tmp_path: Path) -> None:
    """Another Python, or a socket nobody listens on: the server starts as a new process, the second with a line
    in its log saying why."""
    (tmp_path / "fork.sock").touch()
    other_python = ForkServerAddress(str(tmp_path / "fork.sock"), "/usr/bin/python3-elsewhere")
    assert not other_python.usable()
    dead = ForkServerAddress(str(tmp_path / "fork.sock"), sys.executable)
    proc = EngineProcess(checkpoint, ENGINE_SEED, str(tmp_path / "dead.log"), fork_server=dead)
    with proc:
        proc.start(timeout_s=120)
        assert not proc.forked and proc.proc is not None and psutil.Process(proc.proc.pid).ppid() == os.getpid()
    assert "did not answer" in proc.log_tail() and "started as a new process" in proc.log_tail()

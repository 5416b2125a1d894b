"""A fork server: one process that has imported what its children import forks each new process, instead of a new
interpreter importing it all again. Two roles use it (`--role`, a module with `preload()` and `run(args)`):
embedded engine servers (`reference_impl.engine.embedded.forked`) and trainer ranks, the Ray workers of
`reference_impl.worker.TrainerWorker` (`reference_impl.trainer.forked_rank`).

A new embedded engine server spends almost all of its start importing torch, transformers, the model classes,
FastAPI and uvicorn (about 6 s of CPU on a 2-core host); a new trainer rank imports torch, megatron-core and
Megatron-Bridge (about 7-9 s of CPU). The fork server (`python -m reference_impl.fork_server --role MODULE`) imports
those once (`MODULE.preload()`), then waits on a Unix socket; each launch request is answered by `os.fork()`: the
child becomes the process asked for (`MODULE.run(args)`), with the launcher's environment, working folder,
standard input, output and error (passed as descriptors over the socket, `SCM_RIGHTS`) and CPU priority, in a
session (process group) of its own, as `subprocess.Popen` with `start_new_session=True` would start it. It is the
pattern of Python's `multiprocessing` fork server (`set_forkserver_preload`): the fork server itself never runs a
torch operation or starts a thread, so each child starts from a process with one thread and no intra-op thread
pool.

What differs from a process started with `subprocess.Popen`, and how each is kept equal:
- its parent is the fork server, not the launcher: an engine server's `--exit-with-parent PID` watches the launcher
  by pid and start time (`forked_for`, `engine.embedded.cli`), so it still ends with the launcher; the fork server
  reaps it and writes its exit status (`Popen.returncode`'s convention: -N for signal N) to the file the launcher
  named, which `ForkedProcess.poll` reads;
- its environment is the launcher's from `os.environ` on (what `/proc/<pid>/environ` shows is the fork
  server's, which the kernel keeps from the exec), Python's cached temp folder is cleared so `TMPDIR` counts,
  and `sys.path` starts with the entry the interpreter would put first (the role's `run`: the working folder for
  `python -m`, the script's folder for a script) and the `PYTHONPATH` entries the fork server lacks (a fault
  hook's module, say); modules the fork server imported stay as they were imported, and the fork server's own
  first `sys.path` entry (its working folder) stays after them;
- its CPU priority is the launcher's calling thread's (nice and SCHED_IDLE or not, `priority`), as a child of
  that thread would have, and its `oom_score_adj` the launcher's;
- it runs its `atexit` handlers as an interpreter does, but the fork server's start-up options
  (`PYTHONHASHSEED`, `-X` options) are what it keeps.

`ForkServer` starts and stops one (its owner: the harness run, `harness.runner.Runner`, or a test session);
`ForkServerAddress` is what a launcher in another process needs, and a launcher that cannot use it (another
node, another Python) starts its process as a new interpreter as before. `python reference_impl/fork_server.py
--exec SOCKET SCRIPT ARGS...` is such a launcher for a program that starts a Python script by its interpreter's
path (Ray's `py_executable`, `forked_rank`): it stays as the launched process's stand-in (its exit status is the
child's, a SIGTERM, SIGINT or SIGHUP it gets goes to the child; the child does not end with it) and imports
nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import faulthandler
import importlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

forked_for: int | None = None  # in a forked process: its launcher's pid (set by `_child`); None in any other process
# a forked process's first line on its standard error (its parent is not its launcher: it says who is)
FORKED_LINE = "wsh: process {pid} forked by fork server {fork_server} for launcher {launcher}"
STD_FDS = (0, 1, 2)  # the launcher's descriptors a child gets as its standard input, output and error
REQUEST_LIMIT = 1 << 20  # bytes of one launch request (argv and environment as JSON)
STATUS_WAIT_S = 2.0  # seconds `poll` waits for an ended child's status (its fork server reaps every 0.2 s)
# seconds after which an ended child's status counts as lost: its fork server reaps between requests, and one
# request may hold it for up to ANSWER_TIMEOUT_S
STATUS_LOST_S = 15.0
ANSWER_TIMEOUT_S = 10.0  # seconds a launch request and its answer may take on the socket (a fork takes milliseconds)
REQUEST_FIELDS = {
    "args": list,
    "env": dict,
    "cwd": str,
    "status_path": str,
    "nice": int,
    "idle": bool,
    "oom_score_adj": int,
    "launcher": int,
}
START_TIMEOUT_S = 120.0  # seconds `ForkServer.start` waits for the socket (the imports: 5-9 s of CPU)
# seconds `exec_forked` waits for a fork server that still imports before it starts a new interpreter: well below
# Ray's `worker_register_timeout_seconds` (60 s), after which the raylet kills a worker that has not registered
EXEC_WAIT_S = 30.0


class ForkServerError(RuntimeError):
    """The fork server did not start, or refused or failed a launch, or cannot be used (the message says why)."""


@dataclass(frozen=True)
class ForkServerAddress:
    """Where a launcher reaches a fork server: its Unix `socket`, the interpreter it runs (`python`, a launcher
    with another `sys.executable` cannot use it) and the Ray node it runs on (`node_id`, None outside Ray: a
    launcher on another node cannot use it)."""

    socket: str
    python: str
    node_id: str | None = None

    def usable(self) -> bool:
        """Whether a launcher in this process can fork its process here: same interpreter, same Ray node (when
        the address names one) and the socket still there."""
        if self.python != sys.executable or not os.path.exists(self.socket):
            return False
        if self.node_id is None:
            return True
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_node_id() == self.node_id


class ForkedProcess:
    """A process forked by a fork server, seen as `subprocess.Popen` sees its child: `pid`, `returncode`, `poll`,
    `wait`. Its exit status is what the fork server wrote to `status_path` once it reaped it; `poll` waits up to
    `STATUS_WAIT_S` for it once the process has ended, and answers None if it is still not written (a fork server
    held by a slow client). A process that ended without a status once its fork server has ended too (nobody reaps
    it then), or `STATUS_LOST_S` after its end, reads as -SIGKILL."""

    def __init__(self, pid: int, status_path: Path, fork_server_pid: int) -> None:
        self.pid, self.status_path = pid, status_path
        self.returncode: int | None = None
        self._started = start_time(pid)  # a pid reused by another process later has another start time
        self._fork_server = (fork_server_pid, start_time(fork_server_pid))
        self._ended_at: float | None = None  # when `poll` first saw it ended without a status

    def _reaper_gone(self) -> bool:
        """Whether the fork server that forked it has ended (it then reaps and reports nothing more)."""
        return start_time(self._fork_server[0]) != self._fork_server[1]

    def _status(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(self.status_path.read_text())
        return None

    def poll(self) -> int | None:
        """The exit status once the process has ended and its fork server has written it, else None."""
        if self.returncode is None:
            self.returncode = self._status()
        if self.returncode is not None or (self._started is not None and start_time(self.pid) == self._started):
            return self.returncode
        self._ended_at = self._ended_at or time.monotonic()
        deadline = time.monotonic() + STATUS_WAIT_S
        while self.returncode is None and time.monotonic() < deadline:
            if self._reaper_gone():
                break  # nobody reaps it now
            time.sleep(0.05)
            self.returncode = self._status()
        if self.returncode is None and (self._reaper_gone() or time.monotonic() - self._ended_at > STATUS_LOST_S):
            self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to end; returns its exit status. Without `timeout` it sleeps until the process has
        ended (`os.pidfd_open`), with one it looks every 0.05 s.

        Raises:
            subprocess.TimeoutExpired: still running after `timeout` seconds.
        """
        if timeout is None and self.poll() is None:
            with contextlib.suppress(OSError):  # already ended: poll below
                fd = os.pidfd_open(self.pid)
                try:
                    if start_time(self.pid) == self._started:  # the same process, not one that reused its pid
                        waiter = select.poll()
                        waiter.register(fd, select.POLLIN)
                        waiter.poll()
                finally:
                    os.close(fd)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def fork(
    address: ForkServerAddress,
    args: list[str],
    env: dict[str, str],
    cwd: str | None,
    fds: tuple[int, int, int],
    status_path: Path,
) -> ForkedProcess:
    """Ask the fork server at `address` for a process of its role with arguments `args` (`run(args)` of its role
    module), environment `env`, working folder `cwd`, the descriptors `fds` as its standard input, output and
    error (this process may close its own afterwards), the calling thread's CPU priority and this process's
    `oom_score_adj` (Ray's workers have 1000: the kernel ends them first when memory runs out); its exit status
    will be written to `status_path`.

    Raises:
        ForkServerError: the fork server refused or cannot be reached.
    """
    try:
        request = {
            "args": list(args),
            "env": env,
            "cwd": os.path.abspath(cwd or os.getcwd()),  # a child of this process would start here
            "status_path": os.path.abspath(status_path),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),  # this thread's (Linux keeps nice per thread)
            "idle": os.sched_getscheduler(0) == os.SCHED_IDLE,
            "oom_score_adj": _oom_score_adj(),
            "launcher": os.getpid(),
        }
        payload = json.dumps(request).encode() + b"\n"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(ANSWER_TIMEOUT_S)
            s.connect(address.socket)
            socket.send_fds(s, [payload[:1]], list(fds))  # the descriptors travel with the first byte
            s.sendall(payload[1:])
            answer = json.loads(_read_line(s))
    except (OSError, ValueError) as e:
        raise ForkServerError(f"the fork server at {address.socket} did not answer: {type(e).__name__}: {e}") from e
    if "pid" not in answer:
        raise ForkServerError(f"the fork server refused: {answer.get('error', answer)}")
    return ForkedProcess(int(answer["pid"]), status_path, int(answer["fork_server"]))


def _oom_score_adj() -> int:
    """This process's /proc/self/oom_score_adj (0 where it cannot be read)."""
    try:
        return int(Path("/proc/self/oom_score_adj").read_text())
    except (OSError, ValueError):
        return 0


def _read_line(s: socket.socket, buf: bytes = b"") -> bytes:
    while not buf.endswith(b"\n"):
        part = s.recv(65536)
        if not part:
            break
        buf += part
        if len(buf) > REQUEST_LIMIT:
            raise ValueError(f"more than {REQUEST_LIMIT} bytes without a newline")
    return buf


class ForkServer:
    """One fork server process, owned by the process that starts it (`start`) and ended by it (`stop`); it also
    ends by itself once its owner is gone. Processes it forked are their launchers' to stop."""

    def __init__(self, proc: subprocess.Popen[bytes], folder: Path, address: ForkServerAddress) -> None:
        self.proc, self.folder, self.address = proc, folder, address

    @classmethod
    def start(
        cls,
        role: str,
        log_path: Path | None = None,
        node_id: str | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> ForkServer:
        """Start a fork server for `role` (a module with `preload()` and `run(args)`, e.g.
        `reference_impl.engine.embedded.forked`) with this interpreter and, with `wait`, wait until it has preloaded
        and listens (without: return at once; a launcher then waits for it, `ready`); its output goes to `log_path`
        (else nowhere). `node_id`: the Ray node it runs on, for `ForkServerAddress`.
        `env`: added to this process's environment for it (what its children's `/proc/<pid>/environ` then shows,
        e.g. a tag that finds them; OMP_NUM_THREADS is 1 unless given). It runs in a session of its own (an
        interrupt to its owner's process group leaves it, and the processes it forked, to their owners) and ends
        once its owner has.

        Raises:
            ForkServerError: it exited or did not listen within `START_TIMEOUT_S` seconds (its log tail in the
                message when it has a log); on any error or interrupt while it starts, it is stopped first.
        """
        from reference_impl.engine.process import popen_in_session

        folder = Path(tempfile.mkdtemp(prefix="wsh-fork-"))
        sock = folder / "fork.sock"
        owner = f"{os.getpid()}:{start_time(os.getpid())}"
        argv = [sys.executable, "-m", __name__, "--role", role, "--socket", str(sock), "--exit-with-parent", owner]
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        try:
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
            proc = popen_in_session(argv, log_path or os.devnull, child_env)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        server = cls(proc, folder, ForkServerAddress(str(sock), sys.executable, node_id))
        if not wait:
            return server
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not (folder / "ready").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:] if log_path is not None else "(no log)"
                    raise ForkServerError(f"the fork server did not start (exit status {proc.poll()}): {tail}")
                time.sleep(0.05)
        except BaseException:
            server.stop()
            raise
        return server

    def stop(self, grace_s: float = 10.0, children_grace_s: float = 0.0) -> None:
        """End the fork server by its pid (SIGTERM, SIGKILL after `grace_s` seconds) and remove its socket's folder.
        `children_grace_s`: first wait up to that long for the processes it forked to end (their launchers end
        them; meanwhile it reaps them and writes their exit statuses)."""
        if children_grace_s > 0:
            import psutil

            with contextlib.suppress(psutil.Error):
                psutil.wait_procs(psutil.Process(self.proc.pid).children(), timeout=children_grace_s)
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _child(role: ModuleType, request: dict[str, Any], fds: list[int], ready: int) -> None:
    """In the forked child: become the process `request` asks for (`role.run(args)`); never returns. Writes a byte
    to the pipe `ready` once it leads a session of its own (its launcher may then signal its group)."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a new interpreter's handlers, not the fork server's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        os.write(ready, b"x")
        os.close(ready)
        # on the module the child's code imports (this code runs as `__main__` of `python -m`, another module object)
        from reference_impl import fork_server

        fork_server.forked_for = request["launcher"]
        with contextlib.suppress(OSError):  # a launcher below this process's priority: take what may be taken
            os.setpriority(os.PRIO_PROCESS, 0, int(request["nice"]))
        if request["idle"]:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        with contextlib.suppress(OSError):  # raising it needs no privilege, lowering it does
            Path("/proc/self/oom_score_adj").write_text(str(request["oom_score_adj"]))
        for target, fd in zip(STD_FDS, fds, strict=True):
            os.dup2(fd, target)
        for fd in set(fds) - set(STD_FDS):
            os.close(fd)
        line = FORKED_LINE.format(pid=os.getpid(), fork_server=os.getppid(), launcher=request["launcher"])
        print(line, file=sys.stderr, flush=True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        # PYTHONPATH's entries first, as the interpreter puts them (the role puts its own first entry before them)
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:0] = extra
        importlib.invalidate_caches()  # modules added since the fork server looked (a hook written for a test)
        if os.environ.get("PYTHONFAULTHANDLER"):
            faulthandler.enable()
        role.run(list(request["args"]))
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:  # as an interpreter ends on an uncaught SIGINT: killed by it (-2)
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):  # as an interpreter ends: its atexit handlers (Ray's shutdown)
            atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _write_status(path: str, code: int) -> None:
    with contextlib.suppress(OSError):
        tmp = f"{path}.tmp"
        Path(tmp).write_text(str(code))
        os.replace(tmp, path)


def serve(role: ModuleType, sock_path: Path, parent: tuple[int, str | None] | None) -> None:
    """`role.preload()`, listen on `sock_path`, fork one process per request, reap them and write their exit
    statuses; return once `parent` (pid, start time) has ended (at once when it already had). Single-threaded on
    purpose: a fork copies only the calling thread."""
    try:  # the folder goes also when its owner ended without `stop` (SIGTERM ends it through SystemExit, `main`)
        (sock_path.parent / "pid").write_text(str(os.getpid()))  # `ready` tells a fork server that was killed
        role.preload()
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:  # a fork copies only the calling thread: locks the others held would stay held
            raise ForkServerError(f"{role.__name__}.preload() left {threads} threads; forking needs one")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(sock_path))
        os.chmod(sock_path, 0o600)
        listener.listen(16)
        (sock_path.parent / "ready").write_text(str(os.getpid()))
        _serve(role, listener, parent)
    finally:
        shutil.rmtree(sock_path.parent, ignore_errors=True)


def _request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The launch request on `conn` and the three descriptors that came with it, checked field by field
    (`REQUEST_FIELDS`) before anything is forked. The descriptors are closed when it raises.

    Raises:
        ValueError: not JSON, a field missing or of another type, or not three descriptors.
    """
    first, fds, _, _ = socket.recv_fds(conn, REQUEST_LIMIT, len(STD_FDS))
    try:
        request = json.loads(_read_line(conn, first))
        if not isinstance(request, dict):
            raise ValueError("a launch request is a JSON object")
        for name, kind in REQUEST_FIELDS.items():
            if not isinstance(request.get(name), kind):
                raise ValueError(f"field {name!r} must be a {kind.__name__}")
        if len(fds) != len(STD_FDS):
            raise ValueError(f"a launch request brings {len(STD_FDS)} descriptors, not {len(fds)}")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def _fork_one(role: ModuleType, request: dict[str, Any], fds: list[int], conn: socket.socket, close: list[Any]) -> int:
    """Fork the process of `request`; returns its pid once it leads its own session (`close`: what the child must
    not keep). A child whose pid cannot be told to its launcher is killed (the launcher then starts its own)."""
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            for c in close:
                c.close()
        finally:
            _child(role, request, fds, ready_w)
    os.close(ready_w)
    try:
        with os.fdopen(ready_r, "rb") as ready:
            ready.read(1)  # the child's setsid (or its end)
        conn.sendall(json.dumps({"pid": pid, "fork_server": os.getpid()}).encode() + b"\n")
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        raise
    return pid


def _serve(role: ModuleType, listener: socket.socket, parent: tuple[int, str | None] | None) -> None:
    statuses: dict[int, str] = {}  # pid -> where its exit status goes
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while parent is None or (parent[1] is not None and start_time(parent[0]) == parent[1]):
        for _ in sel.select(timeout=0.2):
            conn, _ = listener.accept()
            with conn:
                try:
                    conn.settimeout(ANSWER_TIMEOUT_S)
                    request, fds = _request(conn)
                    try:
                        pid = _fork_one(role, request, fds, conn, [sel, listener, conn])
                    finally:
                        for fd in fds:
                            os.close(fd)
                    statuses[pid] = request["status_path"]
                except (OSError, ValueError) as e:
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        while True:  # every child ended by now, also one killed because its launcher never heard of it
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in statuses:
                _write_status(statuses.pop(pid), os.waitstatus_to_exitcode(status))


def start_time(pid: int) -> str | None:
    """`pid`'s start time (field 22 of /proc/<pid>/stat), None once it has ended: a pid reused by another process
    has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in "ZX" else fields[19]


def ready(address: ForkServerAddress, timeout_s: float = START_TIMEOUT_S) -> bool:
    """Wait until the fork server at `address` listens (True), has ended (its folder or its process is gone: False)
    or `timeout_s` passed (False): a fork server started without waiting (`ForkServer.start(wait=False)`) may
    still import."""
    folder = Path(address.socket).parent
    deadline = time.monotonic() + timeout_s
    while not (folder / "ready").exists():
        if not folder.exists() or time.monotonic() > deadline or not _alive(folder / "pid"):
            return False
        time.sleep(0.05)
    return True


def _alive(pid_file: Path) -> bool:
    """Whether the process whose pid `pid_file` holds still runs (True while the file is not written yet)."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return True
    return start_time(pid) is not None


FALLBACK_VAR = "WSH_FORK_FALLBACK"  # in a process `exec_forked` started as a new interpreter: why it did
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what a stand-in passes on to its child


def exec_forked(sock: str, argv: list[str]) -> None:
    """Launch `python argv...` (`argv[0]` a script's path) as a child of the fork server at `sock` with this
    process's environment, working folder, standard descriptors, priority and `oom_score_adj`, and stand in for it
    until it ends: a SIGTERM, SIGINT or SIGHUP to this process goes to it, and this process exits with its status
    (128 + N for signal N, as a shell reports it). A fork server that still imports is waited for up to
    `EXEC_WAIT_S` (`ready`). Where it cannot be used (none at `sock` on this host, interpreter options before the
    script, a refusal), this process becomes `python argv...` itself (`os.execv`; `FALLBACK_VAR` in its
    environment and a line on standard error say why). Never returns."""
    address = ForkServerAddress(sock, sys.executable)
    status_path = Path(sock).parent / f"status-{os.getpid()}-{uuid.uuid4().hex}"
    pidfd = -1

    def forward(signum: int, _: Any) -> None:
        with contextlib.suppress(OSError):  # it has ended: nothing to pass on
            signal.pidfd_send_signal(pidfd, signum)

    try:
        if not os.path.isfile(argv[0]):
            raise ForkServerError(f"{argv[0]!r} is not a script (interpreter options are a new interpreter's)")
        if not ready(address, EXEC_WAIT_S):
            raise ForkServerError(f"no fork server listens at {sock} on this host")
        # a signal that comes while the child is forked waits until it can be passed on
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
        proc = fork(address, argv, dict(os.environ), os.getcwd(), STD_FDS, status_path)
    except ForkServerError as e:
        print(f"wsh: {e}; started as a new interpreter", file=sys.stderr, flush=True)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
        os.execve(sys.executable, [sys.executable, *argv], {**os.environ, FALLBACK_VAR: str(e)})
    with contextlib.suppress(OSError):  # it may have ended already: `wait` reads its status
        pidfd = os.pidfd_open(proc.pid)
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
    code = proc.wait()
    with contextlib.suppress(OSError):
        status_path.unlink()
    os._exit(code if code >= 0 else 128 - code)


def main(argv: list[str] | None = None) -> None:
    """`python -m reference_impl.fork_server --role MODULE --socket PATH [--exit-with-parent PID:START_TIME]` (a
    fork server), or `python reference_impl/fork_server.py --exec SOCKET SCRIPT ARGS...` (`exec_forked`)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--exec"] and len(argv) >= 3:
        exec_forked(argv[1], argv[2:])
    ap = argparse.ArgumentParser(description="fork server: forks preloaded processes of one role")
    ap.add_argument("--role", required=True, help="module with preload() and run(args): the processes it forks")
    ap.add_argument("--socket", type=Path, required=True, help="the Unix socket to listen on")
    ap.add_argument("--exit-with-parent", default=None, help="PID:START_TIME: end once that process has ended")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `serve` removes its folder on the way out
    parent = None
    if args.exit_with_parent is not None:
        pid, _, started = args.exit_with_parent.partition(":")
        parent = (int(pid), started or None)
    serve(importlib.import_module(args.role), args.socket, parent)


if __name__ == "__main__":
    main()

"""A fork server for embedded engine servers: one process that has imported what a server imports forks each
new server, instead of a new interpreter importing it all again.

A new embedded engine server spends almost all of its start importing torch, transformers (whose masking
utilities import `torch._dynamo`), the model classes, FastAPI and uvicorn: about 6 s of CPU and 8 s of wall on a
2-core host, for a few tenths of a second of building the model and binding its port. The fork server
(`python -m reference_impl.engine.embedded.fork_server`) imports those once (`PRELOAD`, the model class of every
registered model), then waits on a Unix socket; each launch request is answered by `os.fork()`: the child
becomes the server (`cli.main` with the launcher's arguments), with the launcher's environment, working
folder, log file and CPU priority, in a session (process group) of its own, as `subprocess.Popen` with
`start_new_session=True` would start it. It is the pattern of Python's `multiprocessing` fork server
(`set_forkserver_preload`): the fork server itself never runs a torch operation or starts a thread, so each
child starts from a process with one thread and no intra-op thread pool.

What differs from a server started with `subprocess.Popen`, and how each is kept equal:
- its parent is the fork server, not the launcher: the server's `--exit-with-parent PID` watches the launcher by
  pid and start time (`cli`), so it still ends with the launcher; the fork server reaps it and writes its exit
  status (`Popen.returncode`'s convention: -N for signal N) to the file the launcher named, which
  `ForkedProcess.poll` reads;
- its environment is the launcher's from `os.environ` on (what `/proc/<pid>/environ` shows is the fork
  server's, which the kernel keeps from the exec), Python's cached temp folder is cleared so `TMPDIR` counts,
  and `sys.path` starts with its working folder and the `PYTHONPATH` entries the fork server lacks (a fault
  hook's module, say); modules the fork server imported stay as they were imported;
- its CPU priority is the launcher's calling thread's (nice and SCHED_IDLE or not, `priority`), as a child of
  that thread would have.

`ForkServer` starts and stops one (its owner: the harness run, `harness.runner.Runner`, or a test session);
`ForkServerAddress` is what a launcher in another process needs (`EngineProcess(fork_server=...)`), and a
launcher that cannot use it (another node, another Python) starts its server with `subprocess.Popen` as
before.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reference_impl.engine.process import popen_in_session

SERVER_MODULE = "reference_impl.engine.embedded"  # what `python -m` runs for a spawned server (`launcher`)
PRELOAD = (
    "reference_impl.engine.embedded.cli",
    "reference_impl.forward.prompts",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.lifespan.on",
    "uvicorn.loops.asyncio",
    "anyio._core._sockets",
)
forked_for: int | None = None  # in a forked server: its launcher's pid (set by `_child`); None in any other process
# a forked server's first log line (its parent is not its launcher: it says who is)
FORKED_LINE = "wsh engine: server {pid} forked by fork server {fork_server} for launcher {launcher}"
REQUEST_LIMIT = 1 << 20  # bytes of one launch request (argv and environment as JSON)
STATUS_WAIT_S = 2.0  # seconds `poll` waits for an ended server's status (its fork server reaps every 0.2 s)
# seconds after which an ended server's status counts as lost: its fork server reaps between requests, and one
# request may hold it for up to ANSWER_TIMEOUT_S
STATUS_LOST_S = 15.0
ANSWER_TIMEOUT_S = 10.0  # seconds a launch request and its answer may take on the socket (a fork takes milliseconds)
REQUEST_FIELDS = {"args": list, "env": dict, "cwd": str, "log_path": str, "status_path": str, "nice": int, "idle": bool}
START_TIMEOUT_S = 120.0  # seconds `ForkServer.start` waits for the socket (the imports: about 5 s of CPU)


class ForkServerError(RuntimeError):
    """The fork server did not start, or refused or failed a launch (the message says why)."""


@dataclass(frozen=True)
class ForkServerAddress:
    """Where a launcher reaches a fork server: its Unix `socket`, the interpreter it runs (`python`, a launcher
    with another `sys.executable` cannot use it) and the Ray node it runs on (`node_id`, None outside Ray: a
    launcher on another node cannot use it)."""

    socket: str
    python: str
    node_id: str | None = None

    def usable(self) -> bool:
        """Whether a launcher in this process can fork its server here: same interpreter, same Ray node (when
        the address names one) and the socket still there."""
        if self.python != sys.executable or not os.path.exists(self.socket):
            return False
        if self.node_id is None:
            return True
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_node_id() == self.node_id


class ForkedProcess:
    """A server forked by a fork server, seen as `subprocess.Popen` sees its child: `pid`, `returncode`, `poll`,
    `wait`. Its exit status is what the fork server wrote to `status_path` once it reaped it; `poll` waits up to
    `STATUS_WAIT_S` for it once the server has ended, and answers None if it is still not written (a fork server held
    by a slow client). A server that ended without a status once its fork server has ended too (nobody reaps it
    then), or `STATUS_LOST_S` after its end, reads as -SIGKILL."""

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
        """The exit status once the server has ended and its fork server has written it, else None."""
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
        """Wait for the server to end; returns its exit status.

        Raises:
            subprocess.TimeoutExpired: still running after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def fork(
    address: ForkServerAddress, argv: list[str], env: dict[str, str], cwd: str | None, log_path: Path, status_path: Path
) -> ForkedProcess:
    """Ask the fork server at `address` for a server of `argv` (`[python, "-m", SERVER_MODULE, *args]`, as
    `launcher.EngineProcess.launch` gives it) with environment `env`, working folder `cwd`, its output appended to
    `log_path`, and the calling thread's CPU priority; its exit status will be written to `status_path`.

    Raises:
        ForkServerError: `argv` is not an embedded engine server's, or the fork server refused or cannot be
            reached.
    """
    if argv[:3] != [address.python, "-m", SERVER_MODULE]:
        raise ForkServerError(f"a fork server starts `{address.python} -m {SERVER_MODULE}` only, not {argv[:3]}")
    try:
        request = {
            "args": argv[3:],
            "env": env,
            "cwd": os.path.abspath(cwd or os.getcwd()),  # a child of this process would start here
            "log_path": os.path.abspath(log_path),
            "status_path": os.path.abspath(status_path),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),  # this thread's (Linux keeps nice per thread)
            "idle": os.sched_getscheduler(0) == os.SCHED_IDLE,
            "launcher": os.getpid(),
        }
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(ANSWER_TIMEOUT_S)
            s.connect(address.socket)
            s.sendall(json.dumps(request).encode() + b"\n")
            answer = json.loads(_read_line(s))
    except (OSError, ValueError) as e:
        raise ForkServerError(f"the fork server at {address.socket} did not answer: {type(e).__name__}: {e}") from e
    if "pid" not in answer:
        raise ForkServerError(f"the fork server refused: {answer.get('error', answer)}")
    return ForkedProcess(int(answer["pid"]), status_path, int(answer["fork_server"]))


def _read_line(s: socket.socket) -> bytes:
    buf = b""
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
    ends by itself once its owner is gone. Servers it forked are their launchers' to stop."""

    def __init__(self, proc: subprocess.Popen[bytes], folder: Path, address: ForkServerAddress) -> None:
        self.proc, self.folder, self.address = proc, folder, address

    @classmethod
    def start(
        cls, log_path: Path | None = None, node_id: str | None = None, env: dict[str, str] | None = None
    ) -> ForkServer:
        """Start a fork server with this interpreter and wait until it has imported `PRELOAD` and listens; its
        output goes to `log_path` (else nowhere). `node_id`: the Ray node it runs on, for `ForkServerAddress`.
        `env`: added to this process's environment for it (what its children's `/proc/<pid>/environ` then shows,
        e.g. a tag that finds them; OMP_NUM_THREADS is 1 unless given, as the servers' default `--threads`). It
        runs in a session of its own (an interrupt to its owner's process group leaves it, and the servers it
        forked, to their owners) and ends once its owner has.

        Raises:
            ForkServerError: it exited or did not listen within `START_TIMEOUT_S` seconds (its log tail in the
                message when it has a log); on any error or interrupt while it starts, it is stopped first.
        """
        folder = Path(tempfile.mkdtemp(prefix="wsh-fork-"))
        sock = folder / "fork.sock"
        owner = f"{os.getpid()}:{start_time(os.getpid())}"
        argv = [sys.executable, "-m", __name__, "--socket", str(sock), "--exit-with-parent", owner]
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        try:
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
            proc = popen_in_session(argv, log_path or os.devnull, child_env)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        server = cls(proc, folder, ForkServerAddress(str(sock), sys.executable, node_id))
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

    def stop(self, grace_s: float = 10.0) -> None:
        """End the fork server by its pid (SIGTERM, SIGKILL after `grace_s` seconds) and remove its socket's folder."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def preload() -> None:
    """Import what an embedded engine server imports: `PRELOAD` and the transformers model class of every
    registered model (transformers imports them lazily, by attribute)."""
    import transformers

    from reference_impl.models.registry import available_models, load_model

    for name in PRELOAD:
        importlib.import_module(name)
    for arch in sorted({load_model(m).hf_architecture for m in available_models()}):
        getattr(transformers, arch)


def _child(request: dict[str, Any], ready: int) -> None:
    """In the forked child: become the server `request` asks for; never returns. Writes a byte to the pipe `ready`
    once it leads a session of its own (its launcher may then signal its group)."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a new interpreter's handlers, not the fork server's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        os.write(ready, b"x")
        os.close(ready)
        # on the module the server imports (this code runs as `__main__` of `python -m`, another module object)
        from reference_impl.engine.embedded import fork_server

        fork_server.forked_for = request["launcher"]
        with contextlib.suppress(OSError):  # a launcher below this process's priority: take what may be taken
            os.setpriority(os.PRIO_PROCESS, 0, int(request["nice"]))
        if request["idle"]:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        fd = os.open(request["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        line = FORKED_LINE.format(pid=os.getpid(), fork_server=os.getppid(), launcher=request["launcher"])
        print(line, file=sys.stderr, flush=True)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        # sys.path as `python -m` builds it: the working folder first, then PYTHONPATH's entries
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:0] = [os.getcwd(), *extra]
        importlib.invalidate_caches()  # modules added since the fork server looked (a hook written for a test)
        if os.environ.get("PYTHONFAULTHANDLER"):
            faulthandler.enable()
        import reference_impl.engine.embedded
        from reference_impl.engine.embedded.cli import main

        # as `python -m` sets it (argparse names the program after it in its messages)
        sys.argv = [str(Path(reference_impl.engine.embedded.__file__).with_name("__main__.py")), *request["args"]]

        main(list(request["args"]))
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


def serve(sock_path: Path, parent: tuple[int, str | None] | None) -> None:
    """Preload, listen on `sock_path`, fork one server per request, reap them and write their exit statuses;
    return once `parent` (pid, start time) has ended (at once when it already had). Single-threaded on purpose:
    a fork copies only the calling thread."""
    try:  # the folder goes also when its owner ended without `stop` (SIGTERM ends it through SystemExit, `main`)
        preload()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(sock_path))
        os.chmod(sock_path, 0o600)
        listener.listen(16)
        (sock_path.parent / "ready").write_text(str(os.getpid()))
        _serve(listener, parent)
    finally:
        shutil.rmtree(sock_path.parent, ignore_errors=True)


def _request(conn: socket.socket) -> dict[str, Any]:
    """The launch request on `conn`, checked field by field (`REQUEST_FIELDS`) before anything is forked.

    Raises:
        ValueError: not JSON, or a field missing or of another type.
    """
    request = json.loads(_read_line(conn))
    if not isinstance(request, dict):
        raise ValueError("a launch request is a JSON object")
    for name, kind in (*REQUEST_FIELDS.items(), ("launcher", int)):
        if not isinstance(request.get(name), kind):
            raise ValueError(f"field {name!r} must be a {kind.__name__}")
    return request


def _fork_one(request: dict[str, Any], conn: socket.socket, close: list[Any]) -> int:
    """Fork the server of `request`; returns its pid once it leads its own session (`close`: what the child must
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
            _child(request, ready_w)
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


def _serve(listener: socket.socket, parent: tuple[int, str | None] | None) -> None:
    statuses: dict[int, str] = {}  # pid -> where its exit status goes
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while parent is None or (parent[1] is not None and start_time(parent[0]) == parent[1]):
        for _ in sel.select(timeout=0.2):
            conn, _ = listener.accept()
            with conn:
                try:
                    conn.settimeout(ANSWER_TIMEOUT_S)
                    request = _request(conn)
                    pid = _fork_one(request, conn, [sel, listener, conn])
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


def main(argv: list[str] | None = None) -> None:
    """`python -m reference_impl.engine.embedded.fork_server --socket PATH [--exit-with-parent PID:START_TIME]`."""
    ap = argparse.ArgumentParser(description="fork server for embedded engine servers")
    ap.add_argument("--socket", type=Path, required=True, help="the Unix socket to listen on")
    ap.add_argument("--exit-with-parent", default=None, help="PID:START_TIME: end once that process has ended")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `serve` removes its folder on the way out
    parent = None
    if args.exit_with_parent is not None:
        pid, _, started = args.exit_with_parent.partition(":")
        parent = (int(pid), started or None)
    serve(args.socket, parent)


if __name__ == "__main__":
    main()

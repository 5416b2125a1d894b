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
- its SIGINT is ignored where the launcher ignores it (an ignored signal survives exec: a shell starts its
  background jobs so), else Python's `KeyboardInterrupt`, as a new interpreter's;
- it runs its `atexit` handlers as an interpreter does, but the fork server's start-up options
  (`PYTHONHASHSEED`, `-X` options) are what it keeps.

`ForkServer` starts and stops one (its owner: the harness run, `harness.runner.Runner`, or a test session). A
launcher reaches it through `reference_impl.fork_client` (`ForkServerAddress`, `fork`, `ForkedProcess`, and the
stand-in `python reference_impl/fork_client.py SOCKET SCRIPT ARGS...`), which imports nothing beyond the
standard library.
"""

from __future__ import annotations

import argparse
import atexit
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
from pathlib import Path
from types import ModuleType
from typing import Any

from reference_impl.fork_client import (
    ANSWER_TIMEOUT_S,
    REQUEST_LIMIT,
    START_TIMEOUT_S,
    STD_FDS,
    ForkServerAddress,
    ForkServerError,
    _read_line,
    start_time,
)

forked_for: int | None = None  # in a forked process: its launcher's pid (set by `_child`); None in any other process
# a forked process's first line on its standard error (its parent is not its launcher: it says who is)
FORKED_LINE = "wsh: process {pid} forked by fork server {fork_server} for launcher {launcher}"
REQUEST_FIELDS = {
    "args": list,
    "env": dict,
    "cwd": str,
    "status_path": str,
    "nice": int,
    "idle": bool,
    "oom_score_adj": int,
    "sigint_ignored": bool,
    "launcher": int,
}


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
        # a new interpreter's SIGINT: ignored where its launcher ignores it (inherited across exec), else
        # KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler)
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
        code = exit_code(e)
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


def exit_code(e: SystemExit) -> int:
    """The status an interpreter exits with for `e`: its int code; 0 for None (`sys.exit()`); 1 for anything
    else, which is printed to stderr first (`sys.exit("message")`)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


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


def main(argv: list[str] | None = None) -> None:
    """`python -m reference_impl.fork_server --role MODULE --socket PATH [--exit-with-parent PID:START_TIME]` (a
    fork server; a launcher's stand-in is `reference_impl.fork_client`'s `main`)."""
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
    status = 0
    try:
        serve(importlib.import_module(args.role), args.socket, parent)
    except SystemExit as e:  # SIGTERM; `serve` has removed its folder
        status = exit_code(e)
    # What is left is the interpreter's finalization of what `preload` imported (torch, megatron-core, transformers:
    # 1-1.7 s on this host, at every stop, once per run and per test session), which frees nothing a process's end
    # does not; the fork server holds no other state to flush. An error from `serve` still exits as Python does.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()

"""The launcher's side of a fork server (`reference_impl.fork_server`, which forks preloaded processes of one role):
what a process that asks a fork server for a new process needs. It imports nothing beyond the standard library,
so that it also runs as a script without the repository on `sys.path`.

`ForkServerAddress` is what a launcher in another process needs, and a launcher that cannot use it (another
node, another Python) starts its process as a new interpreter as before. `fork` asks the fork server for a
process of its role with the arguments, environment, working folder and standard input, output and error its
launcher gives (the descriptors pass over the socket, `SCM_RIGHTS`), the launcher's CPU priority and its
`oom_score_adj`, and answers a `ForkedProcess`, seen as `subprocess.Popen` sees its child: its parent is the
fork server, which reaps it and writes its exit status (`Popen.returncode`'s convention: -N for signal N) to the
file the launcher named, which `ForkedProcess.poll` reads. `ready` waits for a fork server that was started
without waiting for its imports.

`python reference_impl/fork_client.py SOCKET SCRIPT ARGS...` (`exec_forked`) is such a launcher for a program
that starts a Python script by its interpreter's path (Ray's `py_executable`, `forked_rank`): it stays as the
launched process's stand-in (its exit status is the child's, a SIGTERM, SIGINT or SIGHUP it gets goes to the
child; the child does not end with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STD_FDS = (0, 1, 2)  # the launcher's descriptors a child gets as its standard input, output and error
REQUEST_LIMIT = 1 << 20  # bytes of one launch request (argv and environment as JSON)
STATUS_WAIT_S = 2.0  # seconds `poll` waits for an ended child's status (its fork server reaps every 0.2 s)
# seconds after which an ended child's status counts as lost: its fork server reaps between requests, and one
# request may hold it for up to ANSWER_TIMEOUT_S
STATUS_LOST_S = 15.0
ANSWER_TIMEOUT_S = 10.0  # seconds a launch request and its answer may take on the socket (a fork takes milliseconds)
START_TIMEOUT_S = 120.0  # seconds `ForkServer.start` and `ready` wait for the socket (the imports: 5-9 s of CPU)
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
    it then) or the status's folder is gone (nowhere to write it), or `STATUS_LOST_S` after its end, reads as
    -SIGKILL."""

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
            if self._reaper_gone() or self._status_unwritable():
                break  # nobody reaps it now, or its status has nowhere to go
            time.sleep(0.05)
            self.returncode = self._status()
        lost = self._reaper_gone() or self._status_unwritable() or time.monotonic() - self._ended_at > STATUS_LOST_S
        if self.returncode is None and lost:
            self.returncode = -signal.SIGKILL
        return self.returncode

    def _status_unwritable(self) -> bool:
        """Whether the folder its status goes to is gone (something removed the temp folder that held it): the
        fork server cannot write it there, so waiting `STATUS_LOST_S` for it is in vain."""
        return not self.status_path.parent.is_dir()

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
    error (this process may close its own afterwards), the calling thread's CPU priority, this process's
    `oom_score_adj` (Ray's workers have 1000: the kernel ends them first when memory runs out) and whether it
    ignores SIGINT; its exit status will be written to `status_path`.

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
            # an ignored SIGINT survives exec: a new interpreter then keeps it ignored instead of raising
            # KeyboardInterrupt (a shell starts its background jobs so)
            "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
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
    """`python reference_impl/fork_client.py SOCKET SCRIPT ARGS...` (`exec_forked`): the stand-in a rank actor's
    `py_executable` names (`reference_impl.trainer.forked_rank`)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(f"usage: {sys.executable} {__file__} SOCKET SCRIPT ARGS...", file=sys.stderr)
        sys.exit(2)
    exec_forked(argv[0], argv[1:])


if __name__ == "__main__":
    main()

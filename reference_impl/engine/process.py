"""What every engine server launcher shares: start a server process, wait for GET /health, stop it.

`ServerProcess` owns one server process (`EngineProcess` for the embedded engine, `VllmEngineProcess`
for vLLM). It starts the process in a session (process group) of its own with its output in a log
file, waits until `/health` answers 200, and stops the whole group by its pid (SIGTERM, then SIGKILL
after a grace period): vLLM's API server has an engine-core child, and nothing of either may outlive
the launcher's `stop`. Each server also gets a temp folder of its own (`TMPDIR`), removed by `stop`:
what it writes there (the embedded engine's port file; vLLM's `vllm_dist_*` init files and ZMQ sockets,
which a stopped vLLM leaves behind) goes with it. What the group made in `/dev/shm` while it started
(vLLM's message queue between the engine core and its worker processes, a 160 MiB `psm_*` segment; at TP > 1
its workers' `vllm_dist_*-cpushm_*` segments) is noted once it answers /health, and `stop` unlinks what of
it is still there once the group is gone: processes ended by a signal often never unlink their own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, Self

import httpx

from reference_impl import shm_segments

LOOPBACK = "127.0.0.1"


class ProcessHandle(Protocol):
    """What a launcher keeps of its server process: `subprocess.Popen`'s `pid`, `returncode`, `poll` and `wait`
    (a server forked by a fork server has the same, `reference_impl.fork_client.ForkedProcess`)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class EngineStartError(RuntimeError):
    """The engine process exited or did not answer /health in time (message holds its log tail)."""


RESERVED_PORTS = (20000, 32768)  # [low, high): above Ray's worker ports (10002-19999), below Linux's ephemeral range


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return RESERVED_PORTS[1]


def free_port(host: str = LOOPBACK, attempts: int = 64) -> int:
    """A free TCP port on `host` (127.0.0.1 by default) that no process asking the OS for any free port
    (binding port 0: vLLM, Ray, gloo) can be handed before its owner binds it: one from `RESERVED_PORTS`
    below the host's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), picked at random and checked free by
    binding it. Its owner binds it later, while other processes start (the trainer ranks' store, bound by
    rank 0 while the scenario's engines start; vLLM's HTTP port, bound after seconds of imports).

    Raises:
        OSError: no free port found in `attempts` tries, or the ephemeral range starts below 20000.
    """
    import random

    low, high = RESERVED_PORTS[0], min(RESERVED_PORTS[1], _ephemeral_low())
    if high <= low:
        raise OSError(f"the ephemeral port range starts at {high}: no port below it above {low} to reserve")
    for port in random.sample(range(low, high), min(attempts, high - low)):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind((host, port))
            return port
    raise OSError(f"no free port in {low}-{high - 1} on {host} after {attempts} tries")


def wait_for_health(
    proc: ProcessHandle,
    base_url: Callable[[], str | None],
    timeout_s: float,
    log_tail: Callable[[], str],
    what: str = "engine",
    poll_s: float = 0.1,
    headers: dict[str, str] | None = None,
) -> str:
    """Poll GET `<base_url()>/health` until it answers 200; returns that base URL. `base_url()` may
    return None while the address is not known yet (e.g. before a port file is written). `headers` go
    with every poll (the run's bearer token, `wsh_vllm_plugin.auth`).

    Raises:
        EngineStartError: `proc` exited, or no 200 within `timeout_s` seconds (the caller stops it).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineStartError(f"{what} exited with {proc.returncode}: {log_tail()}")
        url = base_url()
        if url is not None:
            try:
                if httpx.get(url + "/health", timeout=5, headers=headers).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(poll_s)
    raise EngineStartError(f"{what} did not answer /health within {timeout_s:.0f} s: {log_tail()}")


def popen_in_session(
    argv: list[str], log_path: Path | str, env: dict[str, str], cwd: str | None = None
) -> subprocess.Popen[bytes]:
    """`argv` started in a session (process group) of its own with environment `env` in `cwd`, its standard input
    /dev/null and its output (stdout and stderr) appended to `log_path`."""
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


# The folder engine servers' temp folders are made in, where set (`ServerProcess.server_temp_dir`): a harness run
# gives its engine actors one of its own (`harness.driver_ray.ensure_ray`) and removes it at its close.
SERVER_TEMP_ROOT_VAR = "WSH_SERVER_TEMP_ROOT"
STOP_GRACE_S = 10.0  # seconds a server has between SIGTERM and SIGKILL by default (`ServerProcess.stop`)


class ServerProcess(ABC):
    """One engine server process, started in its own process group and stopped with it.

    Subclasses say how to launch (`launch`: argv, environment, working folder and how to learn the base
    URL) and how they are called in messages (`what`).
    """

    what = "engine"
    poll_s = 0.1  # seconds between /health polls
    restart_route: str | None = None  # the route of an in-place restart (`restart`); None: this kind has none

    def __init__(
        self, log_path: str | None, log_suffix: str = ".engine.log", host: str = LOOPBACK, token: str | None = None
    ) -> None:
        """`host`: the address the server binds to (127.0.0.1 unless another node must reach it, and then only
        with a `token`). `token`: the run's bearer token every route asks for (`wsh_vllm_plugin.auth`; given to
        the server in its environment), None for none.

        Raises:
            ValueError: a `host` other than 127.0.0.1 without a token.
        """
        if host != LOOPBACK and not token:
            raise ValueError(f"an engine server bound to {host} (reachable from other hosts) needs a bearer token")
        self._log_path = Path(log_path) if log_path else None
        self._log_suffix = log_suffix
        self.proc: ProcessHandle | None = None
        self.url = ""
        self.host, self.token = host, token
        self.temp_dir: Path | None = None  # the server's TMPDIR while it runs (made by `start`, removed by `stop`)
        # the /dev/shm segments its process group held when it first answered /health (unlinked by `stop`)
        self.started_segments: set[str] = set()
        self.ended = False  # `stop` ended this start's process group (set by `stop`, cleared by `start`)
        self.stop_requested = False  # `stop` came before `start` had a process: `start` then starts none
        # held by `start` from its launch to its spawn, and by `stop` while it looks for the process: a stop from
        # another thread (the engine actor is threaded) finds the process, or the start then starts none and makes
        # no temp folder; before, the actor could be killed once `stop` returned, between the folder and the spawn
        self._launching = threading.RLock()

    @property
    def log_path(self) -> Path:
        """The server's log file: the path given, or (given None) a temp file made when first asked for, so
        that a server built and never started (its `command` read, say) leaves no file behind."""
        if self._log_path is None:
            fd, name = tempfile.mkstemp(suffix=self._log_suffix)
            os.close(fd)
            self._log_path = Path(name)
        return self._log_path

    @log_path.setter
    def log_path(self, path: Path) -> None:
        self._log_path = path

    def token_env(self) -> dict[str, str]:
        """What the server's environment carries for the bearer-token check ({} without a token)."""
        from wsh_vllm_plugin.auth import TOKEN_ENV

        return {TOKEN_ENV: self.token} if self.token else {}

    def server_temp_dir(self) -> Path:
        """The server's own temp folder (its TMPDIR), made on first use and removed by `stop`; its name is
        short (vLLM's ZMQ socket paths live in it, and those are limited to 107 bytes). It is made in the folder
        `SERVER_TEMP_ROOT_VAR` names where the environment sets it (a harness run's own, which the run's close
        removes with whatever a server ended by a signal left in it), else in the system's temp folder."""
        if self.temp_dir is None:
            root = os.environ.get(SERVER_TEMP_ROOT_VAR) or None
            if root is not None:
                os.makedirs(root, mode=0o700, exist_ok=True)
            self.temp_dir = Path(tempfile.mkdtemp(prefix="wsh-server-", dir=root))
        return self.temp_dir

    @abstractmethod
    def launch(self) -> tuple[list[str], dict[str, str], str | None, Callable[[], str | None]]:
        """(argv, environment, working folder or None, base-URL getter that returns None until known).
        `start` sets the environment's TMPDIR to `server_temp_dir()` after this."""

    def start(self, timeout_s: float = 180.0) -> str:
        """Launch the server and wait for GET /health 200; returns the base URL.

        Raises:
            EngineStartError: the process exited, or no /health 200 within `timeout_s` seconds (the
                process group is stopped before raising), or `stop` came first (from another thread).
        """
        with self._launching:
            if self.stop_requested:  # a `stop` from another thread came before there was a process
                raise EngineStartError(f"{self.what} was stopped while it started")
            try:
                argv, env, cwd, url = self.launch()
                self.url, self.started_segments = "", set()  # not serving yet: a failed start's stop reads the group
                self.ended = False
                env = {**env, "TMPDIR": str(self.server_temp_dir())}
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                self.proc = self.spawn(argv, env, cwd)
            except BaseException:
                self.stop()  # the temp folder made for it, and what a failed spawn may have started
                raise
        try:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
            self.url = wait_for_health(self.proc, url, timeout_s, self.log_tail, self.what, self.poll_s, headers)
        except EngineStartError:
            self.stop()
            raise
        self.started_segments = shm_segments.held_by_group(self.proc.pid)
        return self.url

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None) -> ProcessHandle:
        """Start the server process of `argv` in a session (process group) of its own, its output appended to
        `log_path`, its standard input /dev/null. This one runs `subprocess.Popen`; a kind may start it another
        way that keeps those facts (`embedded.launcher.EngineProcess` with a fork server)."""
        return popen_in_session(argv, self.log_path, env, cwd)

    def restart(
        self,
        checkpoint: str,
        seed: int,
        log_path: str,
        tp: int = 1,
        fault: str | None = None,
        timeout_s: float = 300.0,
    ) -> str:
        """Make the running server a fresh engine of `checkpoint` with the dummy weights of `seed` and `tp` TP
        ranks, its output going to `log_path` from now on (`POST <restart_route>` with those fields; what the
        server keeps and drops is its kind's: `embedded.restart`, `wsh_vllm_plugin.restart`); returns its base
        URL (unchanged). `fault`: a fault hook `MODULE:FUNCTION` applied before the build, as at a start (only
        kinds that load hooks). Only kinds with `Capabilities.restart_in_place` have a `restart_route`.

        Raises:
            EngineStartError: this kind cannot restart in place, the server is not running, it refused (an
                update session open, a checkpoint or TP it cannot take, a fault hook it could not undo) or
                failed, or did not answer within `timeout_s` seconds; its answer or log tail is in the message.
        """
        if self.restart_route is None:
            raise EngineStartError(f"{type(self).__name__} cannot restart in place; stop it and start a new one")
        if self.proc is None or self.proc.poll() is not None or not self.url:
            raise EngineStartError(f"the {self.what} server is not running; start it instead of restarting it")
        body = {
            "checkpoint": checkpoint,
            "seed": seed,
            "tensor_parallel_size": tp,
            "log_path": log_path,
            "fault": fault,
        }
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        try:
            resp = httpx.post(self.url + self.restart_route, json=body, headers=headers, timeout=timeout_s)
        except httpx.HTTPError as e:
            raise EngineStartError(
                f"{self.what} restart got no answer: {type(e).__name__}: {e}: {self.log_tail()}"
            ) from e
        if resp.status_code != 200:
            raise EngineStartError(f"{self.what} restart answered {resp.status_code}: {resp.text[:2000]}")
        self.log_path = Path(log_path)
        return self.url

    def pid(self) -> int | None:
        """The server's pid (leader of its process group), None before start."""
        return self.proc.pid if self.proc else None

    def __enter__(self) -> Self:
        """`with server:` stops the server (`stop`) when the block ends, also on an exception or Ctrl-C: the
        server runs in a session of its own, so a caller that dies without stopping it leaves its whole group
        running (a vLLM server holds its port and gigabytes of memory until killed). Start it inside the block."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """End the server's whole process group by its pid (SIGTERM, SIGKILL after `grace_s` seconds), then
        remove its temp folder and unlink the /dev/shm segments the group made while it started
        (`started_segments`; for a server that never answered /health, those its group holds now: nothing
        was handed to it yet). Segments it was handed later (a colocated sender's) are never touched."""
        with self._launching:  # a start in the middle of its launch: its process, or none ever
            if self.proc is None:
                self.stop_requested = True
        own = self.started_segments
        try:
            if self.proc is not None and not self.url and not self.ended:  # the leader may be gone, its group not
                with contextlib.suppress(Exception):  # what cannot be read is not removed; the group still ends
                    own = own | shm_segments.held_by_group(self.proc.pid)
            self._kill_group(grace_s)
        finally:
            if self.temp_dir is not None:
                shutil.rmtree(self.temp_dir, ignore_errors=True)
                self.temp_dir = None
            shm_segments.unlink(own)
            self.started_segments = set()
            # a second stop (a failed start stops itself, then its caller stops it) must not signal, or read the
            # segments of, a group whose leader's pid may since have gone to another process
            self.ended = self.proc is not None

    def _kill_group(self, grace_s: float) -> None:
        if self.proc is None or self.ended:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
        with contextlib.suppress(ProcessLookupError):  # whatever of the group is still there
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)

    def log_tail(self, n: int = 4000) -> str:
        """The last `n` characters of the server's log ("(no log)" when it cannot be read or was never made)."""
        if self._log_path is None:
            return "(no log)"
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

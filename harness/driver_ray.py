"""This driver's own Ray: its start, its processes, its loss, its stop, and what a run leaves running.

- `ensure_ray` starts Ray once per driver (or joins a cluster) with the harness's SIGTERM handling kept
  through `ray.init`, and its node processes in process groups of their own; every process that Ray starts
  carries this driver's tag (`RAY_TAG_VAR`), so `ray_processes` finds them wherever they were re-parented.
- `ray_lost` says when that Ray's GCS server stopped under the run (a signal to every process of a job):
  every call that needs it then waits until the driver's Ray ends the process, so the cleanup ends the
  run's processes by pid instead.
- `shutdown_ray` stops it; `end_leftovers` ends whatever the run started that is still running, and
  `remove_server_temp_root` the folder its engine servers made their temp folders in.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psutil
import ray

from harness import interrupts
from reference_impl.engine.process import SERVER_TEMP_ROOT_VAR

FORWARDED_ENV = ("WSH_VLLM_PYTHON", "WSH_HF_CACHE", "WSH_CACHE", "VLLM_CPU_KVCACHE_SPACE")


RAY_TAG_VAR = "WSH_RAY_OWNER"  # set while this driver starts Ray: every process Ray starts inherits it
_ray_tag: str | None = None  # the value this driver gave it, once it started a Ray of its own


@contextlib.contextmanager
def _putting_back_sigterm_handler() -> Iterator[Callable[[int, FrameType | None], Any] | None]:
    """Install this process's Python SIGTERM handler again after the block (also at the C level, where a Ray
    call replaced it without Python knowing); yields that handler, or None where there is none to put back (not
    the main thread, or no Python function: a driver without one of its own, such as a test session, keeps what
    Ray installs)."""
    handler = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield None
        return
    try:
        yield handler
    finally:
        signal.signal(signal.SIGTERM, handler)


@contextlib.contextmanager
def _replaced(owner: Any, name: str, replacement: Callable[[Any], Any]) -> Iterator[None]:
    """For the block, `owner.name` is `replacement(original)`; then the original again. Nothing changes where
    `owner` has no `name` (a Ray that does not have it: the harness then behaves as before)."""
    if not hasattr(owner, name):
        yield
        return
    original = getattr(owner, name)
    setattr(owner, name, replacement(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def _without_failure_signal_handler() -> Iterator[None]:
    """For the block (a `ray.init`): this driver's core worker starts without Ray's C++ failure signal handler
    (Ray's own switch, `RAY_DISABLE_FAILURE_SIGNAL_HANDLER`, read by the driver's connect from
    `ray._private.ray_constants`; set here on that module alone, so the node processes and workers Ray starts
    keep theirs, with their stack traces on a crash). That handler takes SIGTERM too: one that came in the
    last second of `ray.init` printed "SIGTERM received" and ended a run, closed by then, with SIGABRT (134)
    instead of 143; and `ray.shutdown` took it down by leaving SIGTERM to its default action. A Ray without
    the switch starts as before."""
    with _replaced(ray._private.ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", lambda _: True):
        yield


@contextlib.contextmanager
def _rays_sigterm_handlers_left_out() -> Iterator[None]:
    """For the block (a `ray.init`): Ray installs none of its Python SIGTERM handlers in this driver (worker.py
    `init`: `sys.exit(15)`; node.py, once its node processes start: `sys.exit(1)` after ending them; both
    through `ray._private.utils.set_sigterm_handler`, which does nothing here meanwhile), so the driver's own
    handler stays in place (the signal is held through the driver's connect: `_driver_connect_held`). A Ray
    without that function installs them as before."""
    with _replaced(ray._private.utils, "set_sigterm_handler", lambda _: lambda handler: None):
        yield


@contextlib.contextmanager
def _driver_connect_held() -> Iterator[None]:
    """For the block (a `ray.init`): a first SIGTERM or SIGINT that comes while Ray connects this driver
    (`ray._private.worker.connect`, which makes its core worker) is held until the connect has returned
    (`harness.interrupts.held`), and raised there. Raised in the middle of it, it left a core worker half made,
    and the run, once closed, died at its exit (SIGSEGV, 4 of 5 moments 4.6-4.7 s into a run). Elsewhere in
    `ray.init` the signal is raised at once: there Ray may be waiting for a GCS server the same signal stopped
    (a SIGTERM to every process), which held it for 60 s before Ray ended the process with status 1. A Ray
    without that function connects as before."""

    def held(connect: Callable[..., Any]) -> Callable[..., Any]:
        def held_connect(*args: Any, **kwargs: Any) -> Any:
            with interrupts.held():
                return connect(*args, **kwargs)

        return held_connect

    with _replaced(ray._private.worker, "connect", held):
        yield


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """Keep this process's own SIGTERM handler through the block (a `ray.init`), and put it back after.
    `ray.init` installs its own handlers for SIGTERM in the driver: Python ones (ray/_private/worker.py `init`:
    `sys.exit(15)`; ray/_private/node.py, once its node processes start: `sys.exit(1)` after ending them) and a
    C++ failure signal handler that prints "SIGTERM received" and aborts the process. The harness's handler
    (`harness.interrupts.install`: SIGTERM ends a run like Ctrl-C) must stay the one that runs. Only a Python
    function is kept: a driver without one of its own (a test session) keeps what Ray installs.

    With a handler of its own, the driver's core worker starts without the C++ handler
    (`_without_failure_signal_handler`), Ray's Python handlers are not installed
    (`_rays_sigterm_handlers_left_out`), and a first SIGTERM or SIGINT that comes while Ray connects the
    driver is held until the connect has returned (`_driver_connect_held`). Where `ray.init` fails instead (a
    SIGTERM to every process also reached its GCS server, and Ray gave up on it), or a Ray handler installed
    some other way exited, a wakeup descriptor (`signal.set_wakeup_fd`, which sees every signal a Python handler
    took) tells that a SIGTERM came, and the harness's handler is called: the run ends as after any SIGTERM
    (KeyboardInterrupt("signal 15"), exit status 143). Such a SystemExit was dropped by Python where it landed
    in an at-fork hook (Ray forks its processes), and the run went on and exited 0; where a Ray handler
    returned, its signal is raised once the block ends."""
    with _putting_back_sigterm_handler() as handler:
        if handler is None:
            yield
            return
        seen, wakeup = socket.socketpair()
        seen.setblocking(False)
        wakeup.setblocking(False)
        previous = signal.set_wakeup_fd(wakeup.fileno(), warn_on_full_buffer=False)
        try:
            try:
                with _without_failure_signal_handler(), _rays_sigterm_handlers_left_out(), _driver_connect_held():
                    yield
            except (SystemExit, Exception):  # a Ray handler's exit, or Ray gave up: its GCS server got the signal too
                if _took_sigterm(seen):
                    handler(signal.SIGTERM, None)  # the harness's handler raises KeyboardInterrupt, keeps the signal
                raise
            if _took_sigterm(seen):  # a Ray handler ran and its SystemExit was dropped
                handler(signal.SIGTERM, None)
        finally:
            signal.set_wakeup_fd(previous)
            seen.close()
            wakeup.close()


@contextlib.contextmanager
def _node_processes_in_their_own_group() -> Iterator[None]:
    """Ray's node processes (GCS server, raylet, their agents and, through the raylet, every worker) started
    in the block lead a process group of their own instead of sharing the driver's. A SIGTERM to the driver's
    process group (`kill -TERM -PGID`, a CI runner's or a batch scheduler's cancel) then reaches the driver and
    not its GCS server: that server shut down on it, and the driver's Ray waited 60 s for it and ended the
    process with status 1 ("Failed to connect to GCS within 60 seconds") before the run could close, so no
    summary was written. Ray blocks only SIGINT in its node processes (ray/_private/services.py
    `start_ray_process`, whose `ConsolePopen` this wraps, adding Popen's `process_group=0`). They still end with
    the driver: Ray starts them with the kernel's parent-death signal, and the run's close ends them."""
    services = ray._private.services
    base = getattr(services, "ConsolePopen", None)
    if base is None or not isinstance(base, type) or not issubclass(base, subprocess.Popen):
        yield  # a Ray that starts its processes otherwise: they share the driver's group, as before
        return

    class OwnGroupPopen(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroupPopen
    try:
        yield
    finally:
        services.ConsolePopen = base


def _took_sigterm(seen: socket.socket) -> bool:
    """Whether the wakeup descriptor's other end `seen` holds SIGTERM's number (one byte per signal taken)."""
    taken = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := seen.recv(4096):
            taken += chunk
    return signal.SIGTERM in taken


def _refused_for_its_token(error: BaseException) -> bool:
    """Whether `ray.init` failed because the cluster asked for Ray's token: Ray 2.60 raises a ConnectionError from
    a RuntimeError whose text holds the AuthenticationError's traceback ("InvalidAuthToken")."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def ensure_ray(address: str | None = None) -> None:
    """Start (or join, with `address`) Ray once per driver process, without the dashboard. A Ray this
    driver starts carries `RAY_TAG_VAR` in the environment of every process it starts (its node
    processes, their agents and workers, what those start), so `ray_processes` still finds them after an
    interrupted `ray.init` or once their parent is gone and they were re-parented.

    Raises:
        ValueError: the cluster at `address` asks for Ray's authentication token and this driver has none
            (`RAY_AUTH_MODE` unset: a `ray start --head` of Ray 2.60 turns token authentication on by itself)."""
    global _ray_tag
    if ray.is_initialized():
        return
    env_vars = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1"}
    # What validation read in this driver must be what the engine actors read (also on a joined cluster).
    env_vars |= {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env = {"env_vars": env_vars}
    if address:
        try:
            with _keeping_sigterm_handler():
                ray.init(address=address, runtime_env=env, log_to_driver=False)
        except (ray.exceptions.AuthenticationError, ConnectionError) as e:  # the fix is one variable
            if not _refused_for_its_token(e):
                raise
            raise ValueError(
                f"the Ray cluster at {address} asks for Ray's token and this driver sends none: export "
                "RAY_AUTH_MODE=token, as for the cluster's nodes (the token in ~/.ray/auth_token)"
            ) from None
        _note_gcs()
        return
    # Only for the length of ray.init: processes the driver starts itself later must not carry it.
    _ray_tag = _ray_tag or f"{os.getpid()}-{uuid.uuid4().hex}"
    env_vars[SERVER_TEMP_ROOT_VAR] = str(server_temp_root())
    previous = os.environ.get(RAY_TAG_VAR)
    os.environ[RAY_TAG_VAR] = _ray_tag
    try:
        with _keeping_sigterm_handler(), _node_processes_in_their_own_group():
            ray.init(
                num_cpus=64, include_dashboard=False, runtime_env=env, log_to_driver=False, configure_logging=False
            )
        _note_gcs()
    finally:
        if previous is None:
            os.environ.pop(RAY_TAG_VAR, None)
        else:
            os.environ[RAY_TAG_VAR] = previous


_server_temp_root: Path | None = None  # the folder of this driver's engine servers' temp folders, once named


def server_temp_root() -> Path:
    """The folder in which the engine servers of this driver's own Ray make their temp folders (its workers'
    `SERVER_TEMP_ROOT_VAR`; `ServerProcess.server_temp_dir` makes it when a first server starts, so a driver that
    starts none leaves none), named on first use. A server stopped as planned removes its own folder; one whose
    actor's worker was killed before it could (a SIGTERM to every process of a job) left it in /tmp, where
    only its name said whose it was: the run's close removes this folder with all it holds
    (`remove_server_temp_root`), and so does this driver's exit, for a driver that never closes a run."""
    global _server_temp_root
    if _server_temp_root is None:
        _server_temp_root = Path(tempfile.gettempdir()) / f"wsh-run-{uuid.uuid4().hex[:16]}"
        atexit.register(remove_server_temp_root)
    return _server_temp_root


def remove_server_temp_root() -> None:
    """Remove `server_temp_root` and what is in it, once this driver's engine servers have ended (a run's
    close, after `end_leftovers`; this driver's exit). Nothing happens where no server made it."""
    if _server_temp_root is not None:
        shutil.rmtree(_server_temp_root, ignore_errors=True)


def ray_tag_env() -> dict[str, str]:
    """The environment entry that makes a process this driver starts itself count as one of its Ray's
    (`ray_processes`): {RAY_TAG_VAR: tag} once this driver started a Ray of its own, else {}. The runner's fork
    servers get it, so the engine servers and trainer ranks they fork are found wherever they were re-parented."""
    return {RAY_TAG_VAR: _ray_tag} if _ray_tag is not None else {}


def ray_processes() -> list[psutil.Process]:
    """Every live process (other than this one) of a Ray this driver started (`ensure_ray`), found by the
    environment tag it inherited, wherever it has been re-parented; empty when this driver started none.
    Processes whose environment cannot be read (another user's) are never among them."""
    if _ray_tag is None:
        return []
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and proc.environ().get(RAY_TAG_VAR) == _ray_tag:
                found.append(proc)
    return found


_gcs_address: str | None = None  # host:port of the GCS server of the Ray this driver started or joined


def ray_lost() -> bool:
    """Whether the GCS server of this driver's Ray refuses connections: a signal to every process of a job (a
    batch scheduler's cancel, `pkill`) reached it too, and it stopped listening (its process lingers). A Ray
    call then waits for it, and 60 s later the driver's Ray ends the process with status 1 ("Failed to connect
    to GCS within 60 seconds"), before the run's close: a cleanup that finds Ray lost ends the run's processes
    by pid instead (`TrainerPool.kill`, `engines.end_engines`). False before Ray started, and where the
    connection neither succeeds nor is refused (a remote GCS that does not answer in 1 s: not known lost)."""
    if _gcs_address is None:
        return False
    host, _, port = _gcs_address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False


def _note_gcs() -> None:
    global _gcs_address
    _gcs_address = ray.get_runtime_context().gcs_address


def shutdown_ray() -> None:
    """Stop the Ray instance this driver started (its worker processes end with it). Also after an
    interrupted `ray.init`: Ray's processes may already run before Ray counts as initialized, and
    `ray.shutdown` ends whatever the driver has started (it does nothing when nothing was).

    A Ray whose driver's core worker was started with Ray's C++ failure signal handler (where
    `_without_failure_signal_handler` could not leave it out) took that handler down in `ray.shutdown` and left
    SIGTERM at the C level to its default action: a SIGTERM late in the run's close killed it at once, before its
    tables. The driver's Python handler is therefore installed again after the shutdown. A Ray stopped here is
    not lost (`ray_lost`): its GCS address is forgotten.

    A signal while `ray.shutdown` runs is delivered once it has returned (`harness.interrupts.deferred`), also a
    second one in a run's close: cut just after Ray shut the driver's core worker down, the shutdown left the
    worker's Python object in place, and Ray's own `sys.excepthook` and exit hook, which use it, ended the
    process with status 1 and no message (3 of 18 double Ctrl-Cs in a close), or waited 60 s for the GCS server
    the close had gone on to stop."""
    global _gcs_address
    if ray_lost():  # its GCS server and raylet ignore the SIGTERM that `ray.shutdown` sends and waits on
        _kill_core()
    with interrupts.deferred(), _putting_back_sigterm_handler():
        ray.shutdown()
    _gcs_address = None


CORE_PROCESSES = ("gcs_server", "raylet")


def _kill_core() -> None:
    """SIGKILL this driver's Ray's GCS server and raylet (found by its tag): once lost (`ray_lost`) they serve
    nothing, and `ray.shutdown` waited for each to ignore its SIGTERM before it killed them (a run ended by a
    SIGTERM to every process took 11-12 s to exit, most of it there)."""
    for proc in ray_processes():
        with contextlib.suppress(psutil.Error):
            if proc.name() in CORE_PROCESSES:
                proc.kill()


def descendants() -> list[psutil.Process]:
    """This process's descendants (once Ray runs: its node processes, their workers, the engine servers
    those start); empty when they cannot be read."""
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


LEFTOVER_GRACE_S = 2.0  # seconds from the SIGTERM to the SIGKILL of a process a run left running


def _freeze_trees(roots: list[psutil.Process]) -> dict[int, psutil.Process]:
    """SIGSTOP `roots`, their children, and every process of this driver's Ray (`ray_processes`), collecting
    children again after each stop until no new one appears: a parent still starting children (Ray's raylet
    starts its agents a while after it runs) can start none unseen. Returns the frozen processes by pid (zombies
    and processes gone meanwhile left out; never this process)."""
    frozen: dict[int, psutil.Process] = {}
    seen: set[int] = {os.getpid()}
    todo = [*roots, *ray_processes()]
    while todo:
        proc = todo.pop()
        if proc.pid in seen:
            continue
        seen.add(proc.pid)
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.suspend()
                frozen[proc.pid] = proc
                todo.extend(proc.children())
        if not todo:  # a last sweep: a tagged process re-parented before its parent was frozen
            todo = [p for p in ray_processes() if p.pid not in seen]
    return frozen


def end_leftovers(started: list[psutil.Process], grace_s: float = LEFTOVER_GRACE_S) -> list[int]:
    """End what this driver started and is still running (`started`, with every process of this driver's Ray,
    `ray_processes`, and everything they started): SIGTERM, `grace_s` seconds to end, then SIGKILL; returns
    the pids SIGKILLed. Each step first freezes the whole set (`_freeze_trees`), so nothing started in between is
    left behind re-parented. What is still running here has nobody else to end it: the runner and `ray.shutdown`
    have ended what they knew of (after a run that was not interrupted, nothing is left), and a SIGTERM in the
    middle of `ray.init` leaves the node processes it had started, and the agents the raylet started, unknown
    to `ray.shutdown`; its GCS server ignores a SIGTERM (Ray's own shutdown gives each of its processes 1 s
    after the SIGTERM, then SIGKILLs it: `ray._private.node.Node._kill_process_impl`). Before, they got no
    SIGTERM and were waited for 10 s. `psutil.Process` objects compare by pid and start time, so a pid reused
    by an unrelated process meanwhile is never touched."""
    asked = _freeze_trees(started)
    for proc in asked.values():
        with contextlib.suppress(psutil.Error):
            proc.terminate()  # delivered once it runs again
            proc.resume()
    _, alive = psutil.wait_procs([*started, *asked.values()], timeout=grace_s)
    killed = []
    for proc in _freeze_trees(alive).values():
        with contextlib.suppress(psutil.Error):
            proc.kill()
            killed.append(proc.pid)
    return killed

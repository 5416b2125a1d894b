"""What both engine launchers share: a free port, the wait for GET /health, and the start error.

`embedded.launcher.EngineProcess` and `vllm.launcher.VllmEngineProcess` start a server process and
call `wait_for_health` until it answers 200, it exits, or the time is up.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import httpx


class EngineStartError(RuntimeError):
    """The engine process exited or did not answer /health in time (message holds its log tail)."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_health(
    proc: subprocess.Popen[bytes],
    base_url: Callable[[], str | None],
    timeout_s: float,
    log_tail: Callable[[], str],
    what: str = "engine",
    poll_s: float = 0.1,
) -> str:
    """Poll GET `<base_url()>/health` until it answers 200; returns that base URL. `base_url()` may
    return None while the address is not known yet (e.g. before a port file is written).

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
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(poll_s)
    raise EngineStartError(f"{what} did not answer /health within {timeout_s:.0f} s: {log_tail()}")

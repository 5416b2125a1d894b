"""Start and stop the embedded engine server as a child process (what the engine's Ray actor owns).

`EngineProcess.start()` runs `python -m reference_impl.engine.embedded` on 127.0.0.1 (or, with a bearer
token, the address another node reaches it at) with port 0 (the server writes the port it bound to a
port file), waits until it answers GET /health, and returns
its base URL. `stop()` ends it by its pid (`engine.process.ServerProcess`). The server also watches
its launcher (`--exit-with-parent`): a killed launcher never leaves a server behind.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from reference_impl.engine.process import EngineStartError, ServerProcess

__all__ = ["EngineProcess", "EngineStartError"]


class EngineProcess(ServerProcess):
    """One embedded engine server process."""

    def __init__(
        self,
        checkpoint: str,
        seed: int,
        log_path: str | None = None,
        threads: int = 1,
        fault: str | None = None,
        tp: int = 1,
        host: str = "127.0.0.1",
        token: str | None = None,
    ) -> None:
        """`fault`: a fault hook `MODULE:FUNCTION` the server loads at start (`--fault`), for the harness's
        mutation tests only. `tp`: its TP ranks in the transfer group (`--tensor-parallel-size`). `host`,
        `token`: where it binds and the bearer token every route asks for (`ServerProcess`).

        Raises:
            ValueError: a `host` other than 127.0.0.1 without a token.
        """
        super().__init__(log_path, host=host, token=token)
        self.checkpoint, self.seed, self.threads, self.fault, self.tp = checkpoint, seed, threads, fault, tp

    def launch(self) -> tuple[list[str], dict[str, str], str | None, Callable[[], str | None]]:
        """The server's argv and environment; its URL is known once it has written its port file."""
        port_file = self.server_temp_dir() / "port"
        argv = [
            sys.executable,
            "-m",
            "reference_impl.engine.embedded",
            "--checkpoint",
            self.checkpoint,
            "--seed",
            str(self.seed),
            "--host",
            self.host,
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--threads",
            str(self.threads),
            "--exit-with-parent",
            str(os.getpid()),
            "--tensor-parallel-size",
            str(self.tp),
        ]
        if self.fault is not None:
            argv += ["--fault", self.fault]
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": str(self.threads), **self.token_env()}

        def url() -> str | None:
            return f"http://{self.host}:{int(port_file.read_text())}" if port_file.exists() else None

        return argv, env, None, url

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
        ranks, its output going to `log_path` from now on (`POST /wsh/restart`, `embedded.restart`); returns
        its base URL (unchanged). Takes about the model build's time instead of a process start. `fault`: a
        fault hook `MODULE:FUNCTION` applied before the build, as `--fault` at a start (a hook the server has
        is undone first).

        Raises:
            EngineStartError: not started, the server refused (an update session open, a fault hook it could
                not undo, a body or hook it could not read) or failed, or did not answer within `timeout_s`
                seconds; the server's answer or log tail is in the message.
        """
        import httpx

        if self.proc is None or self.proc.poll() is not None or not self.url:
            raise EngineStartError("the engine server is not running; start it instead of restarting it")
        body = {
            "checkpoint": checkpoint,
            "seed": seed,
            "tensor_parallel_size": tp,
            "log_path": log_path,
            "fault": fault,
        }
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        try:
            resp = httpx.post(self.url + "/wsh/restart", json=body, headers=headers, timeout=timeout_s)
        except httpx.HTTPError as e:
            raise EngineStartError(f"engine restart got no answer: {type(e).__name__}: {e}: {self.log_tail()}") from e
        if resp.status_code != 200:
            raise EngineStartError(f"engine restart answered {resp.status_code}: {resp.text[:2000]}")
        self.checkpoint, self.seed, self.tp, self.log_path, self.fault = checkpoint, seed, tp, Path(log_path), fault
        return self.url

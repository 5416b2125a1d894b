"""Start and stop the embedded engine server as a child process (what the engine's Ray actor owns).

`EngineProcess.start()` runs `python -m reference_impl.engine.embedded` on 127.0.0.1 (or, with a bearer
token, the address another node reaches it at) with port 0 (the server writes the port it bound to a
port file), waits until it answers GET /health, and returns
its base URL. `stop()` ends it by its pid (`engine.process.ServerProcess`). The server also watches
its launcher (`--exit-with-parent`): a killed launcher never leaves a server behind. Given a fork server
(`fork_client.ForkServerAddress`, role `embedded.forked`) it can use, the server is forked from it instead of
started as a new interpreter: the same server, without importing torch and transformers again
(`reference_impl.fork_server`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from reference_impl.engine.embedded.forked import SERVER_MODULE
from reference_impl.engine.process import EngineStartError, ProcessHandle, ServerProcess

if TYPE_CHECKING:
    from reference_impl.fork_client import ForkServerAddress

__all__ = ["EngineProcess", "EngineStartError"]


class EngineProcess(ServerProcess):
    """One embedded engine server process."""

    restart_route = "/wsh/restart"  # embedded.restart.RESTART_ROUTE (not imported: it pulls in the server)

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
        fork_server: ForkServerAddress | None = None,
    ) -> None:
        """`fault`: a fault hook `MODULE:FUNCTION` the server loads at start (`--fault`), for the harness's
        mutation tests only. `tp`: its TP ranks in the transfer group (`--tensor-parallel-size`). `host`,
        `token`: where it binds and the bearer token every route asks for (`ServerProcess`). `fork_server`: fork
        the server from it where this process can (`ForkServerAddress.usable`), else start it with `Popen`.

        Raises:
            ValueError: a `host` other than 127.0.0.1 without a token.
        """
        super().__init__(log_path, host=host, token=token)
        self.checkpoint, self.seed, self.threads, self.fault, self.tp = checkpoint, seed, threads, fault, tp
        self.fork_server = fork_server
        self.forked = False  # the running server came from the fork server (set by `spawn`)

    def launch(self) -> tuple[list[str], dict[str, str], str | None, Callable[[], str | None]]:
        """The server's argv and environment; its URL is known once it has written its port file."""
        port_file = self.server_temp_dir() / "port"
        argv = [
            sys.executable,
            "-m",
            SERVER_MODULE,
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

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None) -> ProcessHandle:
        """Fork the server from `fork_server` when this process can use it (its output appended to the log, its exit
        status in the server's temp folder), else, or when the fork server refuses or is gone (a line in the
        server's log says why), `ServerProcess.spawn`."""
        from reference_impl.fork_client import ForkServerError, fork

        self.forked = False
        if self.fork_server is not None and self.fork_server.usable():
            try:
                if argv[:3] != [sys.executable, "-m", SERVER_MODULE]:
                    raise ForkServerError(f"a fork server starts `{sys.executable} -m {SERVER_MODULE}` only")
                with open(os.devnull, "rb") as null, open(self.log_path, "ab") as log:
                    fds = (null.fileno(), log.fileno(), log.fileno())
                    proc = fork(self.fork_server, argv[3:], env, cwd, fds, self.server_temp_dir() / "exit-status")
            except ForkServerError as e:
                with open(self.log_path, "a") as log_text:
                    log_text.write(f"{e}; started as a new process\n")
            else:
                self.forked = True
                return proc
        return super().spawn(argv, env, cwd)

    def restart(
        self,
        checkpoint: str,
        seed: int,
        log_path: str,
        tp: int = 1,
        fault: str | None = None,
        timeout_s: float = 300.0,
    ) -> str:
        """`ServerProcess.restart` (`POST /wsh/restart`, `embedded.restart`): a new model of `checkpoint`'s
        architecture with `seed`'s dummy weights, new state and caches, `tp` TP ranks, fault hook `fault`
        applied before the build (a hook the server has is undone first). Takes about the model build's time
        instead of a process start.

        Raises:
            EngineStartError: as `ServerProcess.restart`.
        """
        url = super().restart(checkpoint, seed, log_path, tp, fault, timeout_s)
        self.checkpoint, self.seed, self.tp, self.fault = checkpoint, seed, tp, fault
        return url

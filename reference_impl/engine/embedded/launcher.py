"""Start and stop the embedded engine server as a child process (what the engine's Ray actor owns).

`EngineProcess.start()` runs `python -m reference_impl.engine.embedded.server` on 127.0.0.1 with a
free port, waits until it answers GET /health, and returns its base URL. `stop()` ends it by its pid
(SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from reference_impl.engine.process import EngineStartError, wait_for_health


class EngineProcess:
    """One embedded engine server process."""

    def __init__(
        self,
        checkpoint: str,
        seed: int,
        log_path: str | None = None,
        threads: int = 1,
        fault: str | None = None,
    ) -> None:
        """`fault`: an engine-side fault injection (`--fault NAME`), for the harness's mutation tests only."""
        self.checkpoint, self.seed, self.threads, self.fault = checkpoint, seed, threads, fault
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(suffix=".engine.log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout_s: float = 180.0) -> str:
        """Launch the server and wait for /health; returns the base URL.

        Raises:
            EngineStartError: the process exited, or no /health 200 within `timeout_s`.
        """
        port_file = Path(tempfile.mkdtemp(prefix="wsh-engine-")) / "port"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115  (kept open for the child's lifetime)
        cmd = [
            sys.executable,
            "-m",
            "reference_impl.engine.embedded.server",
            "--checkpoint",
            self.checkpoint,
            "--seed",
            str(self.seed),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--threads",
            str(self.threads),
            "--exit-with-parent",
            str(os.getpid()),
        ]
        if self.fault is not None:
            cmd += ["--fault", self.fault]
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": str(self.threads)}
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

        def url() -> str | None:  # known once the server has written the port it bound
            return f"http://127.0.0.1:{int(port_file.read_text())}" if port_file.exists() else None

        try:
            self.url = wait_for_health(self.proc, url, timeout_s, self._log_tail)
        except EngineStartError:
            self.stop()
            raise
        return self.url

    def pid(self) -> int | None:
        """The server's pid, None before start."""
        return self.proc.pid if self.proc else None

    def stop(self, grace_s: float = 5.0) -> None:
        """End the server by its pid (SIGTERM, SIGKILL after `grace_s`)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(grace_s)

    def _log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

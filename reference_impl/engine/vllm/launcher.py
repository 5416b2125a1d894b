"""Start and stop a real vLLM OpenAI-compatible server as the rollout engine (what the engine actor owns).

`VllmEngineProcess` has the interface of `engine.embedded.launcher.EngineProcess` (`start() -> url`,
`pid()`, `stop()`). It runs, from vLLM's own environment (`env.vllm_python()`)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model CKPT \
        --load-format dummy --seed SEED --dtype DTYPE --skip-tokenizer-init \
        --weight-transfer-config '{"backend": "gloo"}' --host 127.0.0.1 --port PORT ...

`VLLM_SERVER_DEV_MODE=1` registers the RLHF weight-update routes (vLLM `entrypoints/rl`);
`--load-format dummy` starts from random weights, so a sync that moves nothing cannot pass a
log-prob comparison; `--skip-tokenizer-init` because the checkpoints carry no tokenizer (prompts are
token ids). The server runs in its own session and is stopped with `killpg` (it starts an engine-core
process of its own). Transfer backend: "gloo" (this directory's plugin), on every host: the trainer
speaks the harness's wire format (`wsh_vllm_plugin/protocol.py`), not vLLM's packed NCCL protocol.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from reference_impl.engine.process import EngineStartError, free_port, wait_for_health
from reference_impl.engine.vllm.env import vllm_python


class VllmEngineProcess:
    """One vLLM API server process serving `checkpoint` from dummy weights."""

    def __init__(
        self,
        checkpoint: str,
        seed: int,
        log_path: str | None = None,
        dtype: str = "float32",
        backend: str = "gloo",
        max_model_len: int = 1024,
        extra_args: list[str] | None = None,
    ) -> None:
        """`backend`: the weight-transfer backend vLLM is started with ("gloo": wsh-vllm-plugin, what the
        harness's sender speaks). `max_model_len`: tokens; must hold the longest fixed prompt."""
        self.checkpoint, self.seed, self.dtype, self.backend = checkpoint, seed, dtype, backend
        self.max_model_len, self.extra_args = max_model_len, list(extra_args or [])
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(suffix=".vllm.log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def command(self, port: int) -> list[str]:
        """The server's argv (vLLM's python first)."""
        return [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.checkpoint,
            "--load-format",
            "dummy",
            "--seed",
            str(self.seed),
            "--dtype",
            self.dtype,
            "--skip-tokenizer-init",
            "--weight-transfer-config",
            json.dumps({"backend": self.backend}),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            "4",
            "--enforce-eager",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 600.0) -> str:
        """Launch the server and wait for GET /health 200; returns the base URL.

        Raises:
            EngineEnvMissing: no vLLM environment (before anything starts).
            EngineStartError: the process exited, or no /health 200 within `timeout_s` seconds.
        """
        port = free_port()
        cmd = self.command(port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115  (kept open for the child's lifetime)
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "PYTHONFAULTHANDLER": "1",
        }
        # The trainer's environment must not leak into vLLM's interpreter.
        for var in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(var, None)
        self.proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir(), start_new_session=True
        )
        self.url = f"http://127.0.0.1:{port}"
        try:
            return wait_for_health(self.proc, lambda: self.url, timeout_s, self._log_tail, "vLLM", poll_s=0.5)
        except EngineStartError:
            self.stop()
            raise

    def pid(self) -> int | None:
        """The API server's pid (its engine core is a child in the same process group), None before start."""
        return self.proc.pid if self.proc else None

    def stop(self, grace_s: float = 10.0) -> None:
        """End the server's whole process group by its pid: SIGTERM, SIGKILL after `grace_s` seconds."""
        if self.proc is None:
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

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

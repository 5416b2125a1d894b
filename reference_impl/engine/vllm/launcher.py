"""Start and stop a real vLLM OpenAI-compatible server as the rollout engine (what the engine actor owns).

`VllmEngineProcess` is an `engine.process.ServerProcess` (`start() -> url`, `pid()`, `stop()`). It runs,
from vLLM's own environment (`env.vllm_python()`)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model CKPT \
        --load-format dummy --seed SEED --dtype DTYPE [--skip-tokenizer-init] \
        --weight-transfer-config '{"backend": "gloo"}' --host 127.0.0.1 --port PORT ...

`VLLM_SERVER_DEV_MODE=1` registers the RLHF weight-update routes (vLLM `entrypoints/rl`);
`--load-format dummy` starts from random weights, so a sync that moves nothing cannot pass a
log-prob comparison; `--skip-tokenizer-init` where the adapter asks for it (text checkpoints carry no
tokenizer: their prompts are token ids; a VL checkpoint's image prompt goes through vLLM's chat route,
which needs the checkpoint's tokenizer, chat template and processors). The server runs in its own
session and is stopped with `killpg` (it starts an engine-core process of its own; `ServerProcess.stop`
ends the whole group). Transfer backend: "gloo" (this
directory's plugin), on every host: the trainer speaks the harness's wire format
(`wsh_vllm_plugin/protocol.py`), not vLLM's packed NCCL protocol.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

from reference_impl.engine.process import ServerProcess, free_port
from reference_impl.engine.vllm.env import PLUGIN_DIR, vllm_python

AUTH_MIDDLEWARE = "wsh_vllm_plugin.auth.BearerTokenMiddleware"  # every route asks for the run's token
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_threads_bind(tp: int, cpus: list[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tp` CPU workers: the CPUs this process may run on (`cpus`, default its
    affinity), split into `tp` contiguous groups ("0|1" for two workers on two CPUs; CPUs left over by the
    split go unused), or "nobind" when there are fewer CPUs than workers.

    vLLM's default, "auto", binds each worker to a NUMA node of its own and refuses more workers than NUMA
    nodes (`vllm/utils/ompmultiprocessing.py`: "Not enough allowed NUMA nodes to bind threads of 2 local
    CPUWorkers. Allowed NUMA nodes are [0]. Please try to bind threads manually or decrease DP/TP/PP."), so
    on a one-node host TP 2 needs the groups given by hand. vLLM ignores the variable on GPU hosts.
    """
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if len(cpus) < tp:
        return "nobind"
    per = len(cpus) // tp
    return "|".join(",".join(str(c) for c in cpus[r * per : (r + 1) * per]) for r in range(tp))


class VllmEngineProcess(ServerProcess):
    """One vLLM API server process serving `checkpoint` from dummy weights."""

    what = "vLLM"
    poll_s = 0.5

    def __init__(
        self,
        checkpoint: str,
        seed: int,
        log_path: str | None = None,
        dtype: str = "float32",
        backend: str = "gloo",
        max_model_len: int = 1024,
        extra_args: list[str] | None = None,
        tp: int = 1,
        host: str = "127.0.0.1",
        token: str | None = None,
        skip_tokenizer_init: bool = True,
    ) -> None:
        """`backend`: the weight-transfer backend vLLM is started with ("gloo": wsh-vllm-plugin, what the
        harness's sender speaks). `max_model_len`: tokens; must hold the longest fixed prompt. `tp`:
        `--tensor-parallel-size` (each TP worker joins the transfer group). `host`, `token`: where it binds
        and the bearer token every route asks for (`wsh_vllm_plugin.auth`, loaded with `--middleware`).
        `skip_tokenizer_init`: start without tokenizer (token-id prompts only; no chat route).

        Raises:
            ValueError: a `host` other than 127.0.0.1 without a token.
        """
        super().__init__(log_path, log_suffix=".vllm.log", host=host, token=token)
        self.checkpoint, self.seed, self.dtype, self.backend = checkpoint, seed, dtype, backend
        self.max_model_len, self.extra_args, self.tp = max_model_len, list(extra_args or []), tp
        self.skip_tokenizer_init = skip_tokenizer_init

    def command(self, port: int) -> list[str]:
        """The server's argv (vLLM's python first).

        Raises:
            EngineEnvMissing: no vLLM environment (before anything starts).
        """
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
            *(["--skip-tokenizer-init"] if self.skip_tokenizer_init else []),
            "--weight-transfer-config",
            json.dumps({"backend": self.backend}),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            "4",
            "--enforce-eager",
            "--host",
            self.host,
            "--port",
            str(port),
            *(["--tensor-parallel-size", str(self.tp)] if self.tp != 1 else []),
            *(["--middleware", AUTH_MIDDLEWARE] if self.token else []),
            *self.extra_args,
        ]

    def launch(self) -> tuple[list[str], dict[str, str], str | None, Callable[[], str | None]]:
        """vLLM's argv on a free port, its environment (the dev routes on; nothing of the trainer's
        environment leaks into vLLM's interpreter, but this checkout's `wsh_vllm_plugin` comes first on its
        path, so that both sides speak the same protocol file whatever checkout the plugin was installed
        from), started in the temp folder."""
        port = free_port(self.host)
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "PYTHONFAULTHANDLER": "1",
        }
        for var in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(var, None)
        env |= {"PYTHONPATH": str(PLUGIN_DIR)} | self.token_env()
        if self.tp > 1 and THREADS_BIND not in env:
            env[THREADS_BIND] = cpu_threads_bind(self.tp)
        url = f"http://{self.host}:{port}"
        return self.command(port), env, tempfile.gettempdir(), lambda: url

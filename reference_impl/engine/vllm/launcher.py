"""Start and stop a real vLLM OpenAI-compatible server as the rollout engine (what the engine actor owns).

`VllmEngineProcess` is an `engine.process.ServerProcess` (`start() -> url`, `pid()`, `stop()`). It runs,
from vLLM's own environment (`env.vllm_python()`)::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model CKPT \
        --load-format dummy --seed SEED --dtype DTYPE [--skip-tokenizer-init] \
        --weight-transfer-config '{"backend": "gloo"}' --host 127.0.0.1 --port PORT ...

(plus `--worker-extension-cls` and `--middleware` of `wsh_vllm_plugin.restart`, the in-place restart
`VllmEngineProcess.restart` posts to, and the token check's `--middleware` when the run has a token).
`VLLM_SERVER_DEV_MODE=1` registers the RLHF weight-update routes (vLLM `entrypoints/rl`);
`--load-format dummy` starts from random weights, so a sync that moves nothing cannot pass a
log-prob comparison; `--skip-tokenizer-init` where the adapter asks for it (text checkpoints carry no
tokenizer: their prompts are token ids; a VL checkpoint's image prompt goes through vLLM's chat route,
which needs the checkpoint's tokenizer, chat template and processors). The server runs in its own
session and is stopped with `killpg` (it starts an engine-core process of its own; `ServerProcess.stop`
ends the whole group).

Transfer backends (`backend_flags`): vLLM's "nccl" (GPU, non-colocate) and "ipc" (GPU, colocate; the
server then needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1` to unpickle the handles, and leaves room on the
shared GPU for the colocated trainer with `--gpu-memory-utilization`), or this directory's "gloo" (CPU:
vLLM's nccl format over a gloo group). The trainer speaks vLLM's protocol and packed format to all three
(`wsh_vllm_plugin/packed.py`); with `--tensor-parallel-size` N every TP worker joins the transfer group.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import tempfile
from collections.abc import Callable

from reference_impl.engine.process import EngineStartError, ServerProcess, free_port
from reference_impl.engine.vllm.env import plugin_import_dir, vllm_python

AUTH_MIDDLEWARE = "wsh_vllm_plugin.auth.BearerTokenMiddleware"  # every route asks for the run's token
RESTART_MIDDLEWARE = "wsh_vllm_plugin.restart.RestartMiddleware"  # POST /wsh/restart (wsh_vllm_plugin/restart.py)
RESTART_WORKER = "wsh_vllm_plugin.restart.WorkerRestart"  # the worker's part of it (--worker-extension-cls)
THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
BACKENDS = ("gloo", "nccl", "ipc")  # the --weight-transfer-config backends the harness starts vLLM with
# Tokens per KV-cache block of a CPU server. vLLM's CPU platform makes it 128 unless asked
# (vllm/platforms/cpu.py, CpuPlatform.check_and_update_config): a prefix cache then reuses nothing of a prompt
# under 128 tokens, and the harness's cache probe (40 tokens, `forward.prompts.PROBE_TOKENS`) would never be
# served from it, so a prefix cache that outlives an update could not show. At 32 (the smallest the CPU
# attention kernel takes: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])") the probe's first
# 32 tokens are served from the cache when it comes again.
CPU_BLOCK_SIZE = 32
COLOCATE_GPU_MEMORY_UTILIZATION = 0.4  # vLLM's share of a GPU it shares with the trainer's sender rank
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"  # torch's variable; a caller's own value is kept
DYNAMO_DISABLE = "TORCHDYNAMO_DISABLE"  # torch's variable: `torch.compile` returns the function it was given
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"  # vLLM's variable: "0" runs a CPU worker inside the engine core
OMP_THREADS = "OMP_NUM_THREADS"


def inductor_cache_dir() -> str:
    """Where torch's inductor keeps its compiled kernels for vLLM's server: torch's own default for this
    process's temp folder and user (`<tempdir>/torchinductor_<user>`, torch/_inductor/runtime/cache_dir_utils.py
    `default_cache_dir`), as for a vLLM started without the harness. The server's own TMPDIR
    (`ServerProcess.server_temp_dir`) would otherwise hold it and go with every stop: vLLM compiles its
    sampler's `batched_count_greater_than` (vllm/v1/sample/ops/logprobs.py, `torch.compile`) at the first
    request with log-probs, on CPU 16 s with an empty cache on a 2-core host and 7-10 s with a warm one. A CPU
    server runs uncompiled (`TORCHDYNAMO_DISABLE`, see `VllmEngineProcess.launch`) unless its caller turns
    compiling back on; the cache then serves it, and GPU servers always."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError, ModuleNotFoundError):  # a uid with no name (containers): torch's own fallback
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def backend_flags(backend: str, colocate: bool) -> tuple[list[str], dict[str, str]]:
    """The extra server arguments and environment variables of a weight-transfer backend.

    `--weight-transfer-config {"backend": B}` always; backend "ipc" also sets
    `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (vLLM's `IPCWeightTransferUpdateInfo` refuses to unpickle
    `ipc_handles_pickled` without it); a colocated server takes `--gpu-memory-utilization
    COLOCATE_GPU_MEMORY_UTILIZATION` (vLLM's default 0.9 would leave the trainer nothing).

    Raises:
        ValueError: an unknown backend, or "ipc" without colocate / colocate without "ipc".
    """
    if backend not in BACKENDS:
        raise ValueError(f"weight-transfer backend {backend!r} is unknown: use one of {', '.join(BACKENDS)}")
    if (backend == "ipc") != colocate:
        raise ValueError(f"backend {backend!r} with colocate={colocate}: vLLM's ipc backend is the colocate one")
    args = ["--weight-transfer-config", json.dumps({"backend": backend})]
    env: dict[str, str] = {}
    if backend == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if colocate:
        args += ["--gpu-memory-utilization", str(COLOCATE_GPU_MEMORY_UTILIZATION)]
    return args, env


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


def worker_in_engine_core(backend: str, tp: int, environ: dict[str, str] | os._Environ[str] | None = None) -> bool:
    """Whether a server `VllmEngineProcess.launch` starts with weight-transfer backend `backend` and `tp`
    workers, in environment `environ` (default this process's), runs its one worker inside the engine-core
    process: a CPU server ("gloo") at TP 1 whose caller set neither `VLLM_CPU_OMP_THREADS_BIND` nor
    `VLLM_ENABLE_V1_MULTIPROCESSING` to anything but "0" (`launch`). Only such a server restarts in place
    (`wsh_vllm_plugin.restart`: a restart redirects the output of the processes it reaches, and a worker
    process of its own would leave the engine core's in the old log)."""
    env = os.environ if environ is None else environ
    return backend == "gloo" and tp == 1 and THREADS_BIND not in env and env.get(MULTIPROCESSING, "0") == "0"


def cpu_worker_threads(cpus: list[int] | None = None) -> int:
    """The OpenMP threads vLLM's automatic binding gives the one CPU worker of a TP 1 server: the CPUs this
    process may run on (`cpus`, default its affinity) less one reserved for the engine core's scheduler
    (vllm/utils/ompmultiprocessing.py: `reserve_cpu_num` is the local world size on x86 and ARM), at least 1.
    vLLM sets it for a worker process it spawns; a worker inside the engine core gets it from here."""
    n = len(os.sched_getaffinity(0)) if cpus is None else len(cpus)
    return max(1, n - 1)


class VllmEngineProcess(ServerProcess):
    """One vLLM API server process serving `checkpoint` from dummy weights."""

    what = "vLLM"
    poll_s = 0.5
    restart_route = "/wsh/restart"  # wsh_vllm_plugin.restart.RESTART_ROUTE, where `restartable`

    def __init__(
        self,
        checkpoint: str,
        seed: int,
        log_path: str | None = None,
        dtype: str = "float32",
        backend: str = "gloo",
        max_model_len: int = 1024,
        extra_args: list[str] | None = None,
        colocate: bool = False,
        tp: int = 1,
        host: str = "127.0.0.1",
        token: str | None = None,
        skip_tokenizer_init: bool = True,
    ) -> None:
        """`backend`: the weight-transfer backend vLLM is started with (`BACKENDS`; "gloo" is wsh-vllm-plugin's,
        for CPU hosts), `colocate`: the sender shares this server's GPU (`backend_flags`). `max_model_len`:
        tokens; must hold the longest fixed prompt. `tp`: `--tensor-parallel-size` (each TP worker joins the
        transfer group). `host`, `token`: where it binds and the bearer token every route asks for
        (`wsh_vllm_plugin.auth`, loaded with `--middleware`). `skip_tokenizer_init`: start without tokenizer
        (token-id prompts only; no chat route).

        Raises:
            ValueError: a backend / colocate pair `backend_flags` refuses; a `host` other than 127.0.0.1
                without a token.
        """
        super().__init__(log_path, log_suffix=".vllm.log", host=host, token=token)
        self.checkpoint, self.seed, self.dtype, self.backend = checkpoint, seed, dtype, backend
        self.backend_args, self.backend_env = backend_flags(backend, colocate)
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
            *self.backend_args,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            "4",
            "--enforce-eager",
            *(["--block-size", str(CPU_BLOCK_SIZE)] if self.backend == "gloo" else []),
            "--host",
            self.host,
            "--port",
            str(port),
            *(["--tensor-parallel-size", str(self.tp)] if self.tp != 1 else []),
            "--worker-extension-cls",
            RESTART_WORKER,
            # vLLM adds middlewares in this order and the last added runs first: the token check guards
            # the restart route too
            "--middleware",
            RESTART_MIDDLEWARE,
            *(["--middleware", AUTH_MIDDLEWARE] if self.token else []),
            *self.extra_args,
        ]

    @property
    def restartable(self) -> bool:
        """Whether this server can restart in place (`worker_in_engine_core`)."""
        return worker_in_engine_core(self.backend, self.tp)

    def restart(
        self,
        checkpoint: str,
        seed: int,
        log_path: str,
        tp: int = 1,
        fault: str | None = None,
        timeout_s: float = 300.0,
    ) -> str:
        """`ServerProcess.restart` (`POST /wsh/restart`, `wsh_vllm_plugin.restart`): the same model with
        new dummy weights drawn from `seed` through vLLM's own reload path, no transfer group, empty prefix,
        multi-modal and encoder caches, vLLM's initial weight version. `checkpoint` must be of the served
        model (its config.json equal), `tp` the server's, `fault` None. About 1 s for a tiny model on a
        2-core host, against 15-20 s for a new start.

        Raises:
            EngineStartError: not `restartable` (before any request), or as `ServerProcess.restart` (a
                refusal names what to change).
        """
        if not self.restartable:
            raise EngineStartError(
                f"this vLLM server cannot restart in place (backend {self.backend!r}, TP {self.tp}): only a CPU "
                "server at TP 1 with its worker inside the engine core can; stop it and start a new one"
            )
        url = super().restart(checkpoint, seed, log_path, tp, fault, timeout_s)
        self.checkpoint, self.seed = checkpoint, seed
        return url

    def launch(self) -> tuple[list[str], dict[str, str], str | None, Callable[[], str | None]]:
        """vLLM's argv on a free port, its environment (the dev routes on; nothing of the trainer's
        environment leaks into vLLM's interpreter except this checkout's plugin, `env.plugin_import_dir`,
        so that both sides speak the same protocol file whatever checkout the plugin was installed from),
        started in its own temp folder (`ServerProcess.server_temp_dir`, removed at stop) with torch's inductor
        cache outside it (`inductor_cache_dir`), kept between starts.

        On a CPU host (backend "gloo") the server also gets `TORCHDYNAMO_DISABLE=1` unless the caller set it:
        with `--enforce-eager` the model is not compiled; what `torch.compile` still wraps on vLLM's CPU path
        are integer helpers: its sampler's rank count (`batched_count_greater_than`,
        vllm/v1/sample/ops/logprobs.py), compiled at the first request with log-probs (9.8 s of a 2-core host's
        first request with a warm inductor cache, 16 s with an empty one, 0.09 s uncompiled), and at engine
        TP >= 2 the vocab-parallel embedding's mask (`get_masked_input_and_mask`,
        vllm/model_executor/layers/vocab_parallel_embedding.py). Both compute the same integers either way;
        the prompt log-probs and ranks of that first request were equal with and without compiling.

        A CPU server at TP 1 also gets `VLLM_ENABLE_V1_MULTIPROCESSING=0` unless the caller set it. vLLM's CPU
        platform then keeps the one worker inside the engine-core process (`UniProcExecutor`) instead of
        spawning a worker process for it (vllm/platforms/cpu.py `check_and_update_config`); the API server
        still runs the engine core in a process of its own (`AsyncMPClient`). Each of the three interpreters
        spends 6-8 s importing torch and vLLM on a 2-core host, one after the other: a start took 28.4 s with
        the worker process and 20.8 s without (34.8 / 18.1 s in a second pair), with equal prompt log-probs
        and ranks. At TP >= 2 the workers are processes as vLLM runs them, and at TP 1 too when the caller sets
        `VLLM_CPU_OMP_THREADS_BIND` (only vLLM's worker processes apply it).

        vLLM sets `OMP_NUM_THREADS` for a worker process it spawns (its automatic binding: every allowed CPU but
        one); a worker inside the engine core gets the same count here (`cpu_worker_threads`), not the caller's
        value: Ray starts its actors with `OMP_NUM_THREADS=1`, and without the variable the engine core drops
        torch to one thread for serving (vllm/utils/torch_utils.py)."""
        # vLLM binds it only after seconds of imports, while other engines and the trainer ranks start and ask
        # the OS for ports of their own: a port from the ephemeral range could be handed to one of them.
        port = free_port(self.host)
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "PYTHONFAULTHANDLER": "1",
            **self.backend_env,
        }
        for var in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(var, None)
        env |= {"PYTHONPATH": str(plugin_import_dir())} | self.token_env()  # the sender's counterpart plugin
        env.setdefault(INDUCTOR_CACHE, inductor_cache_dir())  # not in the server's TMPDIR, which stop removes
        if self.backend == "gloo":  # a CPU host: see `launch`
            env.setdefault(DYNAMO_DISABLE, "1")
            # a TP 1 worker inside the engine core, unless the caller binds threads (only vLLM's worker
            # processes apply VLLM_CPU_OMP_THREADS_BIND) or asks for vLLM's worker process itself
            if self.tp == 1 and THREADS_BIND not in env and env.setdefault(MULTIPROCESSING, "0") == "0":
                env[OMP_THREADS] = str(cpu_worker_threads())
        if self.tp > 1 and THREADS_BIND not in env:
            env[THREADS_BIND] = cpu_threads_bind(self.tp)
        url = f"http://{self.host}:{port}"
        return self.command(port), env, str(self.server_temp_dir()), lambda: url

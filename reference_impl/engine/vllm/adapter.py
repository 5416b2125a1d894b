"""Real vLLM as an engine kind: its OpenAI API server from its own environment (`launcher.py`, `env.py`)
with the harness's gloo transfer backend (`wsh_vllm_plugin`).

vLLM is the judge of names and layouts, but it reports little: its update routes answer `{"message"}`
(no per-tensor counts or HF-name checksums), it ends the update session when a chunk fails, and it
computes prompt log-probs before any sampling processor (`gpu_model_runner._get_prompt_logprobs_dict`:
"prompt tokens skip sampling processors"), i.e. at temperature 1.0.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Sequence

import psutil

from reference_impl.engine.base import Capabilities, EngineKind, EngineRequest
from reference_impl.engine.vllm.launcher import VllmEngineProcess
from reference_impl.transport.observed import Rejection

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


class VllmEngine(EngineKind):
    """`engine: vllm`."""

    name = "vllm"
    capabilities = Capabilities(
        per_tensor_reports=False,
        session_ends_on_error=True,
        prompt_logprobs_honour_temperature=False,
        colocate=False,
        tensor_parallel=True,
        replicas=True,
    )
    # An engine core that profiles memory and warms up: 18-55 s on 2 shared cores, much more under load.
    start_timeout_s = 900.0
    note = (
        "engine vllm: no per-shard update counts or HF-name checksums (vLLM answers {message}; its "
        "/weight_checker keys are vLLM names and cannot see prepacked linear weights on CPU): coverage is "
        "judged from the names sent against the checkpoint, engine-side parity from log-probs"
    )

    def validate(self, request: EngineRequest) -> str | None:
        """What keeps `request` from running on real vLLM on this host (None when nothing does)."""
        config = request.model.model_config()
        if not request.logprobs:
            return (
                "engine vllm needs logprobs: true: vLLM reports no per-tensor checksums in HF names, so log-prob "
                "parity is the only evidence of what it holds"
            )
        if request.logprob_temperature not in (None, 1.0):
            return (
                f"logprob_temperature {request.logprob_temperature} cannot be compared on vLLM: it computes prompt "
                "log-probs before any sampling processor (gpu_model_runner _get_prompt_logprobs_dict), i.e. at "
                "temperature 1.0; leave logprob_temperature unset or set it to 1.0"
            )
        if request.colocate:
            return (
                "engine vllm runs non-colocate only: its weights travel over the harness's gloo backend "
                "(reference_impl/engine/vllm), and the harness does not drive vLLM's CUDA IPC backend yet: set "
                "colocate: false, or use engine: embedded for colocate"
            )
        problem = super().validate(request)
        if problem:
            return problem
        if config.vision_heads:
            return (
                f"engine vllm cannot check {request.model.name} here: its image prompt needs vLLM's chat route (a "
                "tokenizer and chat template; /v1/completions takes no images), and on CPU vLLM's Qwen3-VL path "
                "imports torchvision, which has no CPU build for torch 2.13 on PyPI: use engine: embedded"
            )
        import torch

        if config.num_experts and not torch.cuda.is_available():
            return (
                f"engine vllm on CPU is not set up for mixture-of-experts models ({request.model.name}): use "
                "engine: embedded here, or a GPU host"
            )
        from reference_impl.engine.vllm.env import EngineEnvMissing, vllm_python

        try:
            vllm_python()
        except EngineEnvMissing as e:
            return str(e)
        return None

    def server(
        self,
        checkpoint: str,
        seed: int,
        log_path: str,
        dtype: str,
        fault_hook: str | None = None,
        *,
        tp: int = 1,
        host: str = "127.0.0.1",
        token: str | None = None,
    ) -> VllmEngineProcess:
        """A `VllmEngineProcess` with the harness's gloo backend (wsh-vllm-plugin) on every host: the
        sender speaks the harness's wire format, not vLLM's packed NCCL protocol."""
        return VllmEngineProcess(checkpoint, seed, log_path, dtype=dtype, backend="gloo", tp=tp, host=host, token=token)

    def parse_rejections(self, route: str, status: int, body: str, sent_names: Sequence[str]) -> list[Rejection]:
        """vLLM's 500 "Call to collective_rpc method failed: ..." prose (`answers`)."""
        from reference_impl.engine.vllm import answers

        return answers.parse_rejections(route, status, body, sent_names)

    def reap(self, pid: int | None) -> None:
        """SIGKILL the process group of a vLLM server that its launcher did not stop (the launcher was
        killed first: the server runs in its own session, so nothing else ends it). Only a live group
        leader whose command line is vLLM's API server is touched; on another Ray node nothing is found."""
        if pid is None:
            return
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            proc = psutil.Process(pid)
            if os.getpgid(pid) == pid and SERVER_MODULE in " ".join(proc.cmdline()):
                os.killpg(pid, signal.SIGKILL)

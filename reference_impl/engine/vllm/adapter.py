"""Real vLLM as an engine kind: its OpenAI API server from its own environment (`launcher.py`, `env.py`),
spoken to in vLLM's own weight-transfer protocol and packed format (`wsh_vllm_plugin/packed.py`): vLLM's
`nccl` backend (non-colocate) and `ipc` backend (colocate) on GPU, unmodified; on CPU, where both need
CUDA, this package's `gloo` backend, which is vLLM's `nccl` backend over a gloo group
(`wsh_vllm_plugin/engine.py`).

vLLM is the judge of names and layouts, but it reports little: its update routes answer `{"message"}`
(no per-tensor counts or HF-name checksums), it ends the update session when a chunk fails, and it
computes prompt log-probs before any sampling processor (`gpu_model_runner._get_prompt_logprobs_dict`:
"prompt tokens skip sampling processors"), i.e. at temperature 1.0.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from reference_impl import shm_segments
from reference_impl.cuda import cuda_available
from reference_impl.engine.base import WIRE_VLLM, Capabilities, EngineKind, EngineRequest, Transfer
from reference_impl.engine.vllm.launcher import VllmEngineProcess
from reference_impl.transport.observed import Rejection

if TYPE_CHECKING:
    from reference_impl.fork_client import ForkServerAddress

# Name prefixes of the /dev/shm segments a vLLM server makes itself: Python's default `SharedMemory` names (its
# `shm_broadcast.MessageQueue`s) and its CPU TP communicator's `vllm_dist_<id>-...-cpushm_<n>`.
VLLM_SEGMENTS = ("psm_", "vllm_dist_")

SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def server_args_for_vl(config: dict[str, Any]) -> list[str]:
    """vLLM server arguments for a Qwen3-VL checkpoint:

    - `--limit-mm-per-prompt`: at most one image and no video per prompt, and vLLM's start-up profile of
      the vision encoder on an image of the fixed prompt's size (vLLM config/multimodal.py
      `ImageDummyOptions`) instead of the processor's largest (max_pixels 16777216, about 16k image
      tokens: minutes of vision encoder on a CPU). What the processor does with an image is unchanged.
    - `--no-mm-device-do-normalize`: the image is normalized by the processor (mean/std of
      `preprocessor_config.json`), not by the model's `FusedMMInputNorm`, whose mean/std are persistent
      buffers: `--load-format dummy` fills them with random values (vLLM dummy_loader.py initializes every
      persistent buffer) and no checkpoint holds them, so no weight update would ever fix them (seen:
      image-prompt log-probs off by 0.51 after a correct sync).

    Raises:
        ValueError: not a Qwen3-VL config (`forward.prompts.image_size`).
    """
    from reference_impl.forward.prompts import image_size

    height, width = image_size(config)
    limits = {"image": {"count": 1, "width": width, "height": height}, "video": 0}
    return ["--limit-mm-per-prompt", json.dumps(limits), "--no-mm-device-do-normalize"]


class VllmEngine(EngineKind):
    """`engine: vllm`."""

    name = "vllm"
    capabilities = Capabilities(
        per_tensor_reports=False,
        session_ends_on_error=True,
        prompt_logprobs_honour_temperature=False,
        colocate=True,  # on GPU only (vLLM's ipc backend is CUDA IPC); `validate` refuses it on CPU
        tensor_parallel=True,
        replicas=True,
        image_prompts_via_chat=True,
        restart_in_place=True,  # a CPU server at TP 1 (`restartable`), same model (wsh_vllm_plugin/restart.py)
    )
    restart_keeps_model = True  # the restart reloads weights; the architecture is the one vLLM built
    # An engine core that profiles memory and warms up: 18-55 s on 2 shared cores, much more under load.
    start_timeout_s = 900.0
    note = (
        "engine vllm: no per-shard update counts or HF-name checksums (vLLM answers {message}; its "
        "/weight_checker keys are vLLM names and cannot see prepacked linear weights on CPU): coverage is "
        "judged from the names sent against the checkpoint, engine-side parity from log-probs"
    )

    def validate(self, request: EngineRequest) -> str | None:
        """What keeps `request` from running on real vLLM on this host (None when nothing does)."""
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
        if request.colocate and not cuda_available():
            return (
                "engine vllm runs colocate only on a GPU host (vLLM's ipc backend shares CUDA buffers; on CPU "
                "its weights travel over a gloo group): set colocate: false, or use engine: embedded for colocate"
            )
        problem = super().validate(request)
        if problem:
            return problem
        from reference_impl.engine.vllm.env import EngineEnvMissing, vllm_python

        try:
            vllm_python()
        except EngineEnvMissing as e:
            return str(e)
        return None

    def transfer(self, colocate: bool, cuda: bool) -> Transfer:
        """vLLM's protocol: `ipc` colocated (GPU), else `nccl` on GPU and this package's `gloo` on CPU."""
        if colocate:
            return Transfer(WIRE_VLLM, "ipc")
        return Transfer(WIRE_VLLM, "nccl" if cuda else "gloo")

    def restartable(self, colocate: bool, engine_tp: int, cuda: bool) -> bool:
        """Only a server whose one worker runs inside the engine core (a CPU server at TP 1,
        `launcher.worker_in_engine_core`): the restart redirects the output of the processes it reaches."""
        from reference_impl.engine.vllm.launcher import worker_in_engine_core

        return worker_in_engine_core(self.transfer(colocate, cuda).backend, engine_tp)

    def server(
        self,
        checkpoint: str,
        seed: int,
        log_path: str,
        dtype: str,
        fault_hook: str | None = None,
        colocate: bool = False,
        *,
        tp: int = 1,
        host: str = "127.0.0.1",
        token: str | None = None,
        fork_server: ForkServerAddress | None = None,
    ) -> VllmEngineProcess:
        """A `VllmEngineProcess` started with the weight-transfer backend `transfer` names for this host
        (`--weight-transfer-config '{"backend": ...}'`); the sender derives its channel from the same call.
        A text checkpoint starts with `--skip-tokenizer-init` (its prompts are token ids); a VL checkpoint
        (its config.json has a `vision_config`) with its tokenizer and processors, for the chat route of the
        image prompt, and `server_args_for_vl`. `tp`: vLLM's TP size (every TP worker joins the group).
        `fork_server` is not used: vLLM runs in an environment of its own and starts as a new process."""
        backend = self.transfer(colocate, cuda_available()).backend
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        vl = "vision_config" in config
        return VllmEngineProcess(
            checkpoint,
            seed,
            log_path,
            dtype=dtype,
            backend=backend,
            colocate=colocate,
            skip_tokenizer_init=not vl,
            extra_args=server_args_for_vl(config) if vl else [],
            tp=tp,
            host=host,
            token=token,
        )

    def parse_rejections(self, route: str, status: int, body: str, sent_names: Sequence[str]) -> list[Rejection]:
        """vLLM's 500 "Call to collective_rpc method failed: ..." prose (`answers`)."""
        from reference_impl.engine.vllm import answers

        return answers.parse_rejections(route, status, body, sent_names)

    def reap(self, pid: int | None) -> None:
        """SIGKILL the process group of a vLLM server that its launcher did not stop (the launcher was
        killed first: the server runs in its own session, so nothing else ends it). Only a live group
        leader whose command line is vLLM's API server is touched; on another Ray node nothing is found.
        The /dev/shm segments of vLLM's own the group holds (`VLLM_SEGMENTS`: its message queues, its TP
        workers' `vllm_dist_*-cpushm_*`) are unlinked once the group is gone (5 s at most); no other name is."""
        if pid is None:
            return
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            proc = psutil.Process(pid)
            if os.getpgid(pid) == pid and SERVER_MODULE in " ".join(proc.cmdline()):
                held = {n for n in shm_segments.held_by_group(pid) if n.startswith(VLLM_SEGMENTS)}
                os.killpg(pid, signal.SIGKILL)
                deadline = time.monotonic() + 5.0
                while shm_segments.group_members(pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                shm_segments.unlink(held)

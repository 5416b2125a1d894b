"""An engine kind is one adapter: how to launch it, what it cannot run, and what it can do.

The harness never compares engine names: it asks the scenario's `EngineKind` (`engine.engine_kind`)
to validate a scenario before anything starts, to make the server process, to turn the engine's
non-200 answers into `Rejection`s, and for its `Capabilities`, which go into the run record so that
checks and tables read what the engine can report instead of which engine it was. Adding an engine
(SGLang, say) is one adapter module registered in `engine/__init__.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from reference_impl.engine.process import ServerProcess
from reference_impl.models.registry import ModelSpec
from reference_impl.transport.observed import Rejection

if TYPE_CHECKING:
    from reference_impl.fork_client import ForkServerAddress


class Capabilities(BaseModel):
    """What an engine kind can do and report; recorded in every run record.

    Attributes:
        per_tensor_reports: /finish_weight_update answers update counts per engine shard and
            /weight_checker answers checksums in HF checkpoint names (so coverage and parity are
            judged on the engine's own report).
        session_ends_on_error: a failed /update_weights ends the update session (vLLM's worker clears
            it in its exception handler), so the sender must not send later chunks of that sync.
        prompt_logprobs_honour_temperature: prompt log-probs are computed at the request's
            temperature (vLLM computes them before any sampling processor, i.e. at 1.0).
        colocate: can take chunks by handle from a trainer on the same devices.
        image_prompts_via_chat: a prompt with an image goes to `/v1/chat/completions` as one chat message
            (text parts and an `image_url` part, rendered by the checkpoint's chat template: vLLM's only
            image route); otherwise to `/v1/completions` as token ids with `multi_modal_data` (the
            embedded engine's extension).
        tensor_parallel: can run with TP > 1 on the engine side.
        replicas: several engines of this kind can be fed by one transfer group.
        fault_hooks: loads a fault hook (`--fault MODULE:FUNCTION`) at start, for mutation tests.
        refuses_completions_in_session: answers a completion with a refusal (409) while an update session is
            open, never from half-updated weights (the embedded engine); the harness then asks for one
            mid-session (`harness.mid_session`). vLLM 0.32 has no such refusal: it schedules requests between
            chunks (one killed its engine core: layers not yet reloaded are on the meta device), so the sender
            pauses its generation around every update (`EngineClient.pauses_generation`).
        restart_in_place: its server process can become a fresh engine of another checkpoint and seed
            without a new process (`ServerProcess.restart`), so a harness may reuse it across scenarios
            (on the placements `EngineKind.restartable` says; of the same model where the kind's
            `restart_keeps_model`).
    """

    model_config = ConfigDict(frozen=True)

    per_tensor_reports: bool
    session_ends_on_error: bool
    prompt_logprobs_honour_temperature: bool
    colocate: bool
    image_prompts_via_chat: bool = False
    tensor_parallel: bool = False
    replicas: bool = False
    fault_hooks: bool = False
    restart_in_place: bool = False
    refuses_completions_in_session: bool = False


WIRE_HARNESS = "harness"  # the harness's own protocol and wire format (wsh_vllm_plugin/protocol.py)
WIRE_VLLM = "vllm_packed"  # vLLM's protocol and packed format (its nccl / ipc backends; wsh_vllm_plugin/packed.py)


@dataclass(frozen=True)
class Transfer:
    """How the trainer's sender reaches an engine on one placement: both sides derive it from the same
    call (`EngineKind.transfer`), the engine's server for its start flags, the sender for its channel.

    Attributes:
        wire: `WIRE_HARNESS` or `WIRE_VLLM`: which protocol and wire format the bodies and bytes follow.
        backend: the transfer backend by the name that wire's `init_info` / the engine's start flags use
            (harness: "gloo" | "nccl" | "shm" | "cuda_ipc"; vLLM: "gloo" (ours, CPU) | "nccl" | "ipc").
    """

    wire: str
    backend: str


@dataclass(frozen=True)
class EngineRequest:
    """What a scenario asks of its engine, as `EngineKind.validate` reads it.

    Attributes:
        model: the model entry (its config says vision tower, experts, ...).
        dtype: the checkpoint's dtype name ("float32" | "bfloat16").
        colocate: the engine shares the sender's devices (chunks by handle).
        logprobs: log-prob parity after every sync is asked for.
        logprob_temperature: the temperature the scenario fixes for the comparison, None for the engine's.
        engines: replicas of this kind fed by one transfer group.
        engine_tp: each replica's tensor parallelism (its ranks in the transfer group).
    """

    model: ModelSpec
    dtype: str
    colocate: bool
    logprobs: bool
    logprob_temperature: float | None
    engines: int = 1
    engine_tp: int = 1


class EngineKind(ABC):
    """One kind of rollout engine (see the module doc). Instances are stateless."""

    name: str
    capabilities: Capabilities
    start_timeout_s: float  # seconds from launch to /health 200 on a loaded 2-core host
    note: str = ""  # a sentence for every record of this engine (what its checks rest on), "" for none
    restart_keeps_model: bool = False  # an in-place restart cannot change the model (only its weights)
    forks_from_fork_server: bool = False  # its servers start from a fork server when given one (`server`)

    def validate(self, request: EngineRequest) -> str | None:
        """None when this engine can run `request` on this host, else one sentence saying what to change.

        The default checks the capabilities (colocate, tensor_parallel, replicas); adapters add their own limits.
        """
        if request.colocate and not self.capabilities.colocate:
            return f"engine {self.name} runs non-colocate only: set colocate: false, or use another engine for colocate"
        if request.engine_tp > 1 and not self.capabilities.tensor_parallel:
            return f"engine {self.name} runs with TP 1 only: set engine_tp: 1"
        if request.engines > 1 and not self.capabilities.replicas:
            return f"engine {self.name} cannot be fed as several replicas by one transfer group: set engines: 1"
        return None

    def transfer(self, colocate: bool, cuda: bool) -> Transfer:
        """The transfer for a placement (`colocate`) on a host with (`cuda`) or without CUDA devices.

        Default (the harness's protocol): colocate by handle ("cuda_ipc" on GPU, "shm" on CPU), else a
        transfer group ("nccl" on GPU, "gloo" on CPU).
        """
        if colocate:
            return Transfer(WIRE_HARNESS, "cuda_ipc" if cuda else "shm")
        return Transfer(WIRE_HARNESS, "nccl" if cuda else "gloo")

    @abstractmethod
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
    ) -> ServerProcess:
        """The (not yet started) server process for `checkpoint` with dummy weights of `seed`, for a
        colocated (`colocate`) or separate sender, with `tp` TP ranks in the transfer group, bound to `host`
        (127.0.0.1 unless another node must reach it), every route asking for `token` when one is given
        (`wsh_vllm_plugin.auth`). `fork_server`: where kinds with `forks_from_fork_server` fork their server
        (`reference_impl.fork_server`); the others start it as before."""

    @abstractmethod
    def parse_rejections(self, route: str, status: int, body: str, sent_names: Sequence[str]) -> list[Rejection]:
        """This engine's non-200 answer to `route` as `Rejection`s (pure). `sent_names` are the HF names of
        the chunk for /update_weights (engine-side names are mapped back to them), empty otherwise."""

    def restartable(self, colocate: bool, engine_tp: int, cuda: bool) -> bool:
        """Whether a server of this kind for a placement (`colocate`, `engine_tp` TP ranks) on a host with
        (`cuda`) or without CUDA devices can restart in place (`ServerProcess.restart`). Default: every one of
        a kind with `Capabilities.restart_in_place`."""
        return self.capabilities.restart_in_place

    def reap(self, pid: int | None) -> None:
        """End what is left of a server whose launcher was killed before its `stop` (default: nothing;
        the embedded server exits with its launcher)."""
        return None

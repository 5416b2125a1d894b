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
    """Register `GlooWeightTransferEngine` under the name "gloo" (no-op when already registered). Logs, once
    per process, which copy of this package vLLM imported (its real path), so a log shows whether the
    server runs the plugin of the checkout that launched it."""
    import os

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.logger import init_logger

    if BACKEND in WeightTransferEngineFactory._registry:
        return
    init_logger("vllm.wsh_plugin").info(
        "wsh_vllm_plugin: backend %r from %s", BACKEND, os.path.dirname(os.path.realpath(__file__))
    )
    # Lazy registration: the engine module (and torch.distributed) is imported only by the worker that
    # creates the engine.
    WeightTransferEngineFactory.register_engine(BACKEND, "wsh_vllm_plugin.engine", "GlooWeightTransferEngine")

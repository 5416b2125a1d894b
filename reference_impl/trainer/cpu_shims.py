"""CPU compatibility shims for megatron-core 0.19.2 and Megatron-Bridge 0.6.2 (the only such module).

Megatron assumes CUDA and Transformer Engine in a few places on the model-build and weight-export
path. Each shim below covers exactly one upstream call, is named after it, and is applied only when
CUDA is absent (`apply_cpu_shims()` is a no-op on a GPU host, except the TE stand-in, which is only
installed when Transformer Engine is not importable). None of them changes numerics: they redirect
device placement to CPU and swap Transformer Engine layer classes for Megatron's local ones.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Callable
from itertools import pairwise

import torch

_APPLIED: list[str] = []


def shim_transformer_engine_import() -> None:
    """`megatron/bridge/peft/lora_layers.py` does `import transformer_engine.pytorch as te` at module
    level and sits on the `AutoBridge` import path. Give that import a stand-in module whose attributes
    are placeholder classes (never instantiated on our path: LoRA is not used). TE stays absent for
    megatron-core, which then falls back to its local layers."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return

    class _Absent:
        def __init__(self, *a: object, **k: object) -> None:
            raise RuntimeError("Transformer Engine is not installed (CPU run); this layer is unavailable")

    def _module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)

        def _getattr(attr: str) -> type:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Absent

        mod.__getattr__ = _getattr  # type: ignore[method-assign]
        mod.__file__ = f"<stand-in for {name}>"
        mod.__path__ = []  # type: ignore[attr-defined]
        mod.__spec__ = None
        return mod

    # megatron-core and megatron.training are imported first, with TE absent, so they pick their local
    # layers; only the megatron.bridge import (whose package __init__ pulls in lora_layers) sees the
    # stand-in, which is removed again right after.
    for dep in (
        "megatron.core",
        "megatron.training",
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.models.vision.vit_layer_specs",
        "megatron.core.transformer.moe.moe_utils",
    ):
        importlib.import_module(dep)

    te = _module("transformer_engine")
    te_pt = _module("transformer_engine.pytorch")
    te.pytorch = te_pt  # type: ignore[attr-defined]
    te_pt.ops = _module("transformer_engine.pytorch.ops")  # type: ignore[attr-defined]
    stand_ins = {
        "transformer_engine": te,
        "transformer_engine.pytorch": te_pt,
        "transformer_engine.pytorch.ops": te_pt.ops,
    }  # type: ignore[attr-defined]
    sys.modules.update(stand_ins)
    try:
        importlib.import_module("megatron.bridge")
    finally:
        for name in stand_ins:  # TE stays absent for everything imported later
            sys.modules.pop(name, None)
    _APPLIED.append("transformer_engine_import")


def shim_model_parallel_cuda_manual_seed() -> None:
    """`tensor_parallel.model_parallel_cuda_manual_seed` asserts on CUDA RNG state (called by
    Megatron-Bridge's provider on model build). On CPU: seed torch's CPU generator and initialise
    the RNG tracker without CUDA states."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random

    def cpu_seed(seed: int, *args: object, **kwargs: object) -> None:
        torch.manual_seed(seed)
        tp_random.initialize_rng_tracker(force_reset=True)

    tp_random.model_parallel_cuda_manual_seed = cpu_seed
    tensor_parallel.model_parallel_cuda_manual_seed = cpu_seed
    from megatron.bridge.models import model_provider

    model_provider.model_parallel_cuda_manual_seed = cpu_seed  # bound by name there
    _APPLIED.append("model_parallel_cuda_manual_seed")


def shim_rng_tracker_fork() -> None:
    """`CudaRNGStatesTracker.fork` swaps CUDA RNG states around dropout/init regions; with no CUDA
    state to swap, make it a no-op context (the model runs in eval with dropout 0)."""
    from megatron.core.tensor_parallel import random as tp_random

    @contextlib.contextmanager
    def fork(self: object, name: str = "model-parallel-rng"):
        yield

    for cls_name in ("CudaRNGStatesTracker",):
        cls = getattr(tp_random, cls_name, None)
        if cls is not None:
            cls.fork = fork
    _APPLIED.append("CudaRNGStatesTracker.fork")


def shim_cuda_current_device() -> None:
    """`torch.cuda.current_device()` is called by rotary embedding, the MoE router and PP p2p buffer
    setup, always as `device=torch.cuda.current_device()` in a factory call; on CPU it raises.
    Answer the CPU device, so those tensors are made where the model lives."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    _APPLIED.append("torch.cuda.current_device")


def shim_tensor_cuda() -> None:
    """`Tensor.cuda()` and `torch.cuda.synchronize()` appear in tied-embedding PP setup
    (`_setup_embeddings_and_output_layer` all-reduces `weight.data.cuda()`) and p2p; on CPU keep the
    tensor where it is and make synchronize a no-op."""
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    _APPLIED.append("Tensor.cuda/torch.cuda.synchronize")


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Maps `device="cuda"` (or a cuda torch.device) in factory calls to CPU."""

    def __torch_function__(self, func: Callable, types: object, args: tuple = (), kwargs: dict | None = None):
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and "cuda" in str(dev):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cuda_factories_to_cpu() -> contextlib.AbstractContextManager:
    """Context in which `torch.*(..., device="cuda")` allocates on CPU: covers
    `transformer/utils.get_default_causal_mask` and `pipeline_parallel/schedules.py` allocations."""
    return _CudaToCpuMode()


def shim_qwen3_vl_local_spec() -> None:
    """Megatron-Bridge's Qwen3-VL names Transformer Engine classes at module level:
    `qwen3_vl_provider.get_gpt_layer_with_transformer_engine_spec`, and in
    `modelling_qwen3_vl/model.py` `get_vit_layer_with_transformer_engine_spec`, `TENorm`,
    `TEColumnParallelLinear`, `TERowParallelLinear`. Swap them for megatron-core's local
    equivalents: `get_gpt_layer_local_spec`, `get_vit_layer_with_local_spec`, `WrappedTorchNorm`,
    `ColumnParallelLinear`, `RowParallelLinear`."""
    from megatron.bridge.models.qwen_vl import qwen3_vl_provider
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as vl_model
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def local_gpt_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, fp8=False, **kw):
        return get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm, normalization="RMSNorm"
        )

    qwen3_vl_provider.get_gpt_layer_with_transformer_engine_spec = local_gpt_spec
    vl_model.get_vit_layer_with_transformer_engine_spec = get_vit_layer_with_local_spec
    vl_model.TENorm = WrappedTorchNorm
    vl_model.TEColumnParallelLinear = ColumnParallelLinear
    vl_model.TERowParallelLinear = RowParallelLinear
    _APPLIED.append("qwen3_vl local spec")


class PackedVisionAttention(torch.nn.Module):
    """Non-causal attention that also takes packed (THD) sequences: softmax attention within each packed
    segment (for Qwen3-VL's vision encoder, one segment per image frame), never across segments.

    Stands in for megatron-core's local `DotProductAttention` as the vision layers' `core_attention`:
    that class asserts `packed_seq_params is None` ("Packed sequence is not supported by
    DotProductAttention"), while Megatron-Bridge's `Qwen3VLVisionModel.forward` always packs (its
    `build_packed_seq_params`, cu_seqlens over t x h x w patches per frame) and `Qwen3VLSelfAttention`
    then calls `core_attention(query, key, value, attention_mask, attn_mask_type=...,
    attention_bias=..., packed_seq_params=...)` with the batch dimension squeezed. Deliberately not a
    `DotProductAttention` subclass: `Qwen3VLSelfAttention` sends unpacked calls of that class to its
    causal fallback. Holds no parameters, so the model's state dict is unchanged.
    """

    def __init__(
        self,
        config: object,
        layer_number: int,
        attn_mask_type: object,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ) -> None:
        super().__init__()
        if "causal" in str(attn_mask_type):
            raise ValueError(f"PackedVisionAttention is non-causal; got attn_mask_type {attn_mask_type}")
        kv_channels = int(config.kv_channels)  # type: ignore[attr-defined]
        self.softmax_scale = float(softmax_scale) if softmax_scale is not None else kv_channels**-0.5

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # q [L, nq, d], k/v [L, nkv, d] -> [L, nq * d]; grouped keys/values repeated per query group.
        if q.shape[1] != k.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=scale
        )
        return out.transpose(0, 1).reshape(q.shape[0], -1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: object = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> torch.Tensor:
        """Packed: query [t, nq, d], key/value [t, nkv, d] -> [t, nq * d]; cu_seqlens_q bounds the
        segments. Unpacked: [s, b, n, d] -> [s, b, nq * d], full attention per batch row.

        Raises:
            ValueError: an attention mask or bias is given (the vision encoder passes neither).
        """
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("PackedVisionAttention takes no attention mask or bias")
        if packed_seq_params is None:
            rows = range(query.shape[1])
            return torch.stack([self._attend(query[:, i], key[:, i], value[:, i], self.softmax_scale) for i in rows], 1)
        bounds = [int(x) for x in packed_seq_params.cu_seqlens_q]  # type: ignore[attr-defined]
        parts = [self._attend(query[a:b], key[a:b], value[a:b], self.softmax_scale) for a, b in pairwise(bounds)]
        return torch.cat(parts)


def shim_vision_dot_product_attention() -> None:
    """`DotProductAttention.forward` (megatron-core local spec) refuses packed sequences, which the
    Qwen3-VL vision encoder always uses. Make the vision layer spec that Megatron-Bridge's
    `modelling_qwen3_vl/model.py` builds (through `get_vit_layer_with_transformer_engine_spec`, already
    swapped for the local spec by `shim_qwen3_vl_local_spec`) use `PackedVisionAttention` as
    core_attention. The language model's attention is untouched."""
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as vl_model

    local_vit_spec = vl_model.get_vit_layer_with_transformer_engine_spec

    def vit_spec_with_packed_attention():  # type: ignore[no-untyped-def]
        spec = local_vit_spec()
        spec.submodules.self_attention.submodules.core_attention = PackedVisionAttention
        return spec

    vl_model.get_vit_layer_with_transformer_engine_spec = vit_spec_with_packed_attention
    _APPLIED.append("vision DotProductAttention (packed)")


def apply_cpu_shims() -> list[str]:
    """Apply every shim needed on this host once; returns the names applied (for the record)."""
    if _APPLIED:
        return list(_APPLIED)
    shim_transformer_engine_import()
    if not torch.cuda.is_available():
        shim_model_parallel_cuda_manual_seed()
        shim_rng_tracker_fork()
        shim_cuda_current_device()
        shim_tensor_cuda()
    shim_qwen3_vl_local_spec()
    shim_vision_dot_product_attention()
    return list(_APPLIED)

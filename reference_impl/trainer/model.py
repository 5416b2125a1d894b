"""Build the Megatron model through Megatron-Bridge's provider (local layer spec) and load a checkpoint.

Calls (Megatron-Bridge 0.6.2): `AutoBridge.from_hf_pretrained(path, torch_dtype=...)`,
`bridge.to_megatron_provider(load_weights=False)`, parallel sizes set on the provider,
`provider.finalize()`, `provider.provide_distributed_model(wrap_with_ddp=False, ...)`,
`bridge.load_hf_weights(model, path)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reference_impl.models.checkpoint import DTYPES
from reference_impl.models.families import model_family
from reference_impl.trainer.cpu_shims import apply_cpu_shims

_FUSIONS_OFF = (
    "gradient_accumulation_fusion",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
)


@dataclass
class TrainerModel:
    """The Megatron model chunks of this rank and the bridge that built them."""

    bridge: Any  # megatron.bridge.AutoBridge
    chunks: list[torch.nn.Module]  # one per virtual stage (always one here)
    config: Any  # the provider (a TransformerConfig)
    model_type: str
    # What an export mode builds once per model and reuses on every sync (the bridge mode's conversion
    # tasks of this rank's PP stage, `export.bridge.stage_tasks`); it lives and dies with the model.
    export_cache: dict[str, Any] = field(default_factory=dict)


def import_megatron() -> None:
    """Import what the first `build_model` in a process imports before it builds anything: the CPU shims
    (`cpu_shims.apply_cpu_shims`, which import Megatron-Bridge and every model bridge it registers) and
    megatron-core's GPT layer specs. Measured on a 2-core host: about 6 s of CPU and 0.8 GB resident in a
    new process, most of a new trainer rank's first setup."""
    apply_cpu_shims()
    import megatron.bridge
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401


def build_model(
    checkpoint: Path,
    model_type: str,
    tp: int,
    pp: int,
    dtype: str,
    ep: int = 1,
    etp: int = 1,
    pad_vocab: bool = False,
) -> TrainerModel:
    """Build this rank's Megatron model shard for TP x PP (x EP x ETP) and load `checkpoint` into it.

    Megatron's parallel state must already be initialised (`parallel.init_model_parallel`). MoE runs
    with the local spec's SequentialMLP (`moe_grouped_gemm=False`) and the `allgather` token
    dispatcher (`alltoall` makes a CUDA stream at construction).
    `dtype` is a name from `checkpoint.DTYPES`; parameters are created in it on CPU (or the current
    CUDA device). The model is put in eval mode (dropout 0; MoE with TP needs it). The families with
    `ModelFamily.local_gpt_layer_spec` get megatron-core's `get_gpt_layer_local_spec`; the others keep
    the spec their Megatron-Bridge provider brings.

    Raises:
        KeyError: `model_type` has no registered model family.
    """
    apply_cpu_shims()
    from megatron.bridge import AutoBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch_dtype = DTYPES[dtype]
    bridge = AutoBridge.from_hf_pretrained(str(checkpoint), torch_dtype=torch_dtype)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = tp
    provider.pipeline_model_parallel_size = pp
    provider.params_dtype = torch_dtype
    provider.pipeline_dtype = torch_dtype
    provider.bf16 = torch_dtype == torch.bfloat16
    provider.fp16 = torch_dtype == torch.float16
    provider.sequence_parallel = False
    provider.use_cpu_initialization = not torch.cuda.is_available()
    # Megatron-LM pads the vocabulary by default; Megatron-Bridge's provider only on request
    # (`should_pad_vocab`): then to a multiple of `make_vocab_size_divisible_by` x TP, the rows past the
    # checkpoint's vocabulary zero-filled at load (`ColumnParallelMapping.hf_to_megatron`, `_pad_right_dim0`).
    provider.should_pad_vocab = pad_vocab
    for name in _FUSIONS_OFF:
        if hasattr(provider, name):
            setattr(provider, name, False)
    num_experts = getattr(provider, "num_moe_experts", None)
    if num_experts:
        provider.expert_model_parallel_size = ep
        provider.expert_tensor_parallel_size = etp
        provider.moe_grouped_gemm = False
        provider.moe_token_dispatcher_type = "allgather"
        provider.variable_seq_lengths = False
    if model_family(model_type).local_gpt_layer_spec:
        provider.transformer_layer_spec = get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
        )
    provider.finalize()
    # Qwen3VLMoEModelProvider.finalize turns sequence parallel on when TP > 1; the local spec's torch
    # LayerNorm refuses it, and the weight-sync path never runs a sequence-parallel forward.
    provider.sequence_parallel = False
    chunks = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=not torch.cuda.is_available()
    )
    bridge.load_hf_weights(chunks, str(checkpoint))
    for c in chunks:
        c.eval()
    return TrainerModel(bridge=bridge, chunks=list(chunks), config=provider, model_type=model_type)

"""Qwen3-VL-MoE (`model_type` "qwen3_vl_moe"): HF `Qwen3VLMoeForConditionalGeneration`.

Raw converter (Megatron-Bridge `Qwen3VLModel` with MoE language model -> HF
`Qwen3VLMoeForConditionalGeneration` checkpoint names).

Vision tower and dense language parts as Qwen3-VL; experts as Qwen3-MoE per expert, then fused per
layer by the post-pass into the checkpoint's stacked tensors. The fused layout, derived from the
checkpoints (checked against the file transformers writes in tests/test_moe_layouts.py):
- released (Qwen/Qwen3-VL-30B-A3B-Instruct; vLLM `qwen3_vl_moe.py` transposes it on load):
  `mlp.experts.gate_up_proj` [E, hidden, 2*moe_inter] = stack_e(cat(gate_e, up_e).T),
  `mlp.experts.down_proj` [E, moe_inter, hidden] = stack_e(down_e.T);
- transformers 5.12.1 `save_pretrained` (its in-memory layout): [E, 2*moe_inter, hidden] =
  stack_e(cat(gate_e, up_e)) and [E, hidden, moe_inter] = stack_e(down_e).
Gate comes before up along the 2*moe_inter axis in both. `ConvertConfig.fused_experts_layout` picks one.

vLLM names: Qwen3-VL's prefix renames over a Qwen3-MoE language model
(`vllm/model_executor/models/qwen3_vl_moe.py`). Checkpoint views: transformers holds the fused experts
transposed against the released layout (`checkpoint_views` module doc); the checkpoint maker writes the
released layout. The trainer keeps the layer spec Megatron-Bridge's Qwen3-VL provider brings.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from reference_impl.models.checkpoint_views import SavedAs, ViewRule, transpose_last_two
from reference_impl.models.families import qwen3, qwen3_moe, qwen3_vl
from reference_impl.models.family import ModelFamily
from reference_impl.models.raw_rules import ConvertConfig, FamilyTable, Rule, prefixed
from reference_impl.models.vllm_names import FamilyNames, expert_rules, under

if TYPE_CHECKING:  # imported where the experts are fused: reading the table (an engine actor does) needs no torch
    import torch

RULES: list[Rule] = qwen3_vl.VISION_RULES + prefixed(qwen3_moe.RULES, "language_model.", qwen3_vl.language_hf)

_PER_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(named: list[tuple[str, torch.Tensor]], config: ConvertConfig) -> list[tuple[str, torch.Tensor]]:
    """Replace each layer's per-expert gate/up/down tensors by the two fused tensors (module doc).

    Raises:
        ValueError: a layer's experts are not exactly 0..E-1 (an expert id is missing or repeated).
    """
    import torch

    layers: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in named:
        m = _PER_EXPERT.match(name)
        if m is None:
            out.append((name, t))
            continue
        layers.setdefault(m.group("layer"), {}).setdefault(m.group("proj"), {})[int(m.group("e"))] = t
    released = config.fused_experts_layout == "released"
    for layer, projs in layers.items():
        for proj, experts in projs.items():
            if sorted(experts) != list(range(config.num_experts)):
                raise ValueError(f"{layer}.{proj}: experts {sorted(experts)} are not 0..{config.num_experts - 1}")
        gate_up = [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], 0) for e in range(config.num_experts)]
        down = [projs["down_proj"][e] for e in range(config.num_experts)]
        if released:
            gate_up, down = [t.T for t in gate_up], [t.T for t in down]
        out.append((f"{layer}.gate_up_proj", torch.stack(gate_up).contiguous()))
        out.append((f"{layer}.down_proj", torch.stack(down).contiguous()))
    return out


NAMES = FamilyNames(
    model_type="qwen3_vl_moe",
    # Qwen3VLMoeForConditionalGeneration subclasses Qwen3VLForConditionalGeneration (qwen3_vl_moe.py) and
    # keeps its hf_to_vllm_mapper (qwen3_vl.py).
    renames=qwen3_vl.QWEN3_VL_RENAMES,
    # The language model is Qwen3MoeLLMForCausalLM (a Qwen3MoeForCausalLM) at `language_model.`.
    stacked=qwen3.stacked_rules("language_model.model."),
    experts=expert_rules("language_model.model."),
    tied_aliases={"lm_head.weight": "model.language_model.embed_tokens.weight"},
    vllm_params=(
        *under("language_model.model.", qwen3.QWEN3_DECODER + qwen3_moe.QWEN3_MOE_BLOCK),
        r"language_model\.lm_head\.weight",
        *under("visual.", qwen3_vl.QWEN3_VL_VISION),
    ),
    source="vllm/model_executor/models/qwen3_vl_moe.py, qwen3_moe.py, qwen3_vl.py, layers/fused_moe/",
)

# Released Qwen3-VL-MoE layout, the one vLLM's qwen3_vl_moe.py loads (is_fused_checkpoint_transposed=True).
VIEWS = (
    ViewRule(
        r"(?P<m>.+\.mlp\.experts\.gate_up_proj)",
        (SavedAs("{m}", transpose_last_two, "released layout [E, hidden, 2*moe_inter], gate first"),),
    ),
    ViewRule(
        r"(?P<m>.+\.mlp\.experts\.down_proj)",
        (SavedAs("{m}", transpose_last_two, "released layout [E, moe_inter, hidden]"),),
    ),
)

FAMILY = ModelFamily(
    "qwen3_vl_moe",
    FamilyTable(RULES, fuse_experts),
    NAMES,
    views=VIEWS,
    is_vl=True,
    released_fused_experts=True,
    scale_down_checks=(qwen3_moe.check_scale_down, qwen3_vl.check_scale_down),
    trainer_logprob_gap=qwen3_vl.MERGER_GELU_GAP,  # the same vision mergers
)

"""Qwen3-MoE (`model_type` "qwen3_moe"): HF `Qwen3MoeForCausalLM`.

Raw converter table (Megatron local spec, SequentialMLP experts -> HF `Qwen3MoeForCausalLM` checkpoint
names). Experts arrive with global ids (`local_experts.G`, G = ep_rank * E/EP + K, gathered over EP) and
leave as the released per-expert names `model.layers.L.mlp.experts.G.{gate,up,down}_proj.weight`
(what transformers 5.12.1 save_pretrained writes too); `mlp.router` -> `mlp.gate`,
`pre_mlp_layernorm` -> `post_attention_layernorm` (Megatron-Bridge `qwen3_moe_bridge.py` pairs).

vLLM names: as Qwen3, plus the router `mlp.gate` and the routed experts
(`vllm/model_executor/models/qwen3_moe.py`, `layers/fused_moe/routed_experts.py`). Checkpoint views:
transformers holds the experts fused, the checkpoint per expert (`checkpoint_views` module doc). The
trainer builds it with megatron-core's local GPT layer spec.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from reference_impl.models.checkpoint_views import SavedAs, ViewRule, expert_gate_rows, expert_slice, expert_up_rows
from reference_impl.models.families import qwen3
from reference_impl.models.family import ModelFamily
from reference_impl.models.raw_rules import FamilyTable, Rule, copy, split_gate_up
from reference_impl.models.vllm_names import EXPERTS_MODULE, FamilyNames, expert_rules, under

if TYPE_CHECKING:
    from reference_impl.models.registry import ModelSpec

LAYER, HF_LAYER = qwen3.LAYER, qwen3.HF_LAYER
EXPERT = LAYER + "mlp.experts.local_experts.{E}."
HF_EXPERT = HF_LAYER + "mlp.experts.{E}."

MOE_RULES: list[Rule] = [
    Rule(LAYER + "mlp.router.weight", HF_LAYER + "mlp.gate.weight", copy),
    Rule(EXPERT + "linear_fc1.weight", [HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight"], split_gate_up),
    Rule(EXPERT + "linear_fc2.weight", HF_EXPERT + "down_proj.weight", copy),
]

RULES: list[Rule] = MOE_RULES + qwen3.RULES

# Parameters of a vLLM `Qwen3MoeSparseMoeBlock` below a decoder's `model.` prefix (`qwen3_moe.py`): router
# `GateLinear` (`mlp.gate`), routed experts (no shared expert in Qwen3-MoE). Layers in `mlp_only_layers` or
# off `decoder_sparse_step` hold a dense `Qwen3MoeMLP` (gate_up_proj/down_proj, in `QWEN3_DECODER`).
QWEN3_MOE_BLOCK = (
    r"layers\.\d+\.mlp\.gate\.weight",
    rf"layers\.\d+\.mlp\.{re.escape(EXPERTS_MODULE)}w(13|2)_weight",
)

NAMES = FamilyNames(
    model_type="qwen3_moe",
    renames=(),  # Qwen3MoeForCausalLM's vLLM module tree has the HF names
    # Qwen3MoeModel.hf_to_vllm_mapper (qwen3_moe.py): q/k/v -> qkv_proj, dense .mlp.gate_proj/up_proj ->
    # gate_up_proj ("experts.gate_up_proj must be handled by MoERunner.load_weights").
    stacked=qwen3.stacked_rules("model."),
    experts=expert_rules("model."),
    tied_aliases={"lm_head.weight": "model.embed_tokens.weight"},
    vllm_params=(*under("model.", qwen3.QWEN3_DECODER + QWEN3_MOE_BLOCK), r"lm_head\.weight"),
    source="vllm/model_executor/models/qwen3_moe.py, layers/fused_moe/routed_experts.py",
)

# transformers 5.12.1 conversion_mapping.py lines 823-837 ("qwen2_moe", aliased by "qwen3_moe"): per-expert
# gate/up are MergeModulelist(dim=0) + Concatenate(dim=1) into gate_up_proj; down is MergeModulelist(dim=0).
VIEWS = (
    ViewRule(
        r"(?P<m>.+\.mlp\.experts)\.gate_up_proj",
        (
            SavedAs("{m}.{e}.gate_proj.weight", expert_gate_rows, "per-expert [moe_inter, hidden]"),
            SavedAs("{m}.{e}.up_proj.weight", expert_up_rows, "per-expert [moe_inter, hidden]"),
        ),
        per_expert=True,
    ),
    ViewRule(
        r"(?P<m>.+\.mlp\.experts)\.down_proj",
        (SavedAs("{m}.{e}.down_proj.weight", expert_slice, "per-expert [hidden, moe_inter]"),),
        per_expert=True,
    ),
)


def check_scale_down(spec: ModelSpec, real: ModelSpec) -> list[str]:
    """Mixture-of-experts facts `spec` (scaled) lost against `real`: experts per token, an even expert
    count (EP 2) >= experts per token, the moe_intermediate_size / hidden_size ratio, and the dense/sparse
    layer pattern (decoder_sparse_step, mlp_only_layers). Empty when all are kept."""
    problems: list[str] = []
    f, r = spec.model_config(), real.model_config()
    if f.experts_per_token != r.experts_per_token:
        problems.append(f"experts per token {f.experts_per_token} differs from real {r.experts_per_token}")
    if f.num_experts % 2 or f.num_experts < f.experts_per_token:
        problems.append(f"{f.num_experts} experts: must be even (EP 2) and >= experts per token")
    if round(f.moe_ffn_hidden_size / f.hidden_size, 3) != round(r.moe_ffn_hidden_size / r.hidden_size, 3):
        problems.append("moe_intermediate_size / hidden_size differs from the real ratio")
    if (f.sparse_step, f.mlp_only_layers) != (r.sparse_step, r.mlp_only_layers):
        problems.append("dense/sparse layer pattern (decoder_sparse_step, mlp_only_layers) differs")
    return problems


FAMILY = ModelFamily(
    "qwen3_moe",
    FamilyTable(RULES),
    NAMES,
    views=VIEWS,
    local_gpt_layer_spec=True,
    scale_down_checks=(check_scale_down,),
)

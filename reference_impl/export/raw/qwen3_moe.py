"""Raw converter table for Qwen3-MoE (Megatron local spec, SequentialMLP experts -> HF
`Qwen3MoeForCausalLM` checkpoint names).

Experts arrive with global ids (`local_experts.G`, G = ep_rank * E/EP + K, gathered over EP) and
leave as the released per-expert names `model.layers.L.mlp.experts.G.{gate,up,down}_proj.weight`
(what transformers 5.12.1 save_pretrained writes too); `mlp.router` -> `mlp.gate`,
`pre_mlp_layernorm` -> `post_attention_layernorm` (Megatron-Bridge `qwen3_moe_bridge.py` pairs).
"""

from __future__ import annotations

from reference_impl.export.raw import qwen3
from reference_impl.export.raw.rules import Rule, copy, split_gate_up

LAYER, HF_LAYER = qwen3.LAYER, qwen3.HF_LAYER
EXPERT = LAYER + "mlp.experts.local_experts.{E}."
HF_EXPERT = HF_LAYER + "mlp.experts.{E}."

MOE_RULES: list[Rule] = [
    Rule(LAYER + "mlp.router.weight", HF_LAYER + "mlp.gate.weight", copy),
    Rule(EXPERT + "linear_fc1.weight", [HF_EXPERT + "gate_proj.weight", HF_EXPERT + "up_proj.weight"], split_gate_up),
    Rule(EXPERT + "linear_fc2.weight", HF_EXPERT + "down_proj.weight", copy),
]

RULES: list[Rule] = MOE_RULES + qwen3.RULES

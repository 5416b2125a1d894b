"""Qwen3 dense (`model_type` "qwen3"): HF `Qwen3ForCausalLM`.

Raw converter table (Megatron local spec -> HF `Qwen3ForCausalLM` names). Layout sources: megatron-core
`SelfAttention` (linear_qkv grouped per query group), `MLP` (linear_fc1 = [gate; up], partition stride
2), HF transformers `modeling_qwen3.py` names.

vLLM names: `Qwen3ForCausalLM`'s vLLM module tree has the HF names; q/k/v and gate/up are stacked by
`Qwen2Model.load_weights` (`vllm/model_executor/models/qwen2.py`, `qwen3.py`). Checkpoint views: none
(every transformers parameter is saved as itself). The trainer builds it with megatron-core's local
GPT layer spec (q/k layernorm, RMSNorm).
"""

from __future__ import annotations

from reference_impl.models.family import ModelFamily
from reference_impl.models.raw_rules import (
    FamilyTable,
    Rule,
    copy,
    output_layer,
    split_gate_up,
    split_qkv,
    trim_vocab,
)
from reference_impl.models.vllm_names import FamilyNames, StackedRule, under

LAYER = "decoder.layers.{L}."
HF_LAYER = "model.layers.{L}."

RULES: list[Rule] = [
    Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", trim_vocab),
    Rule(LAYER + "input_layernorm.weight", HF_LAYER + "input_layernorm.weight", copy),
    Rule(
        LAYER + "self_attention.linear_qkv.weight",
        [
            HF_LAYER + "self_attn.q_proj.weight",
            HF_LAYER + "self_attn.k_proj.weight",
            HF_LAYER + "self_attn.v_proj.weight",
        ],
        split_qkv,
    ),
    Rule(LAYER + "self_attention.linear_proj.weight", HF_LAYER + "self_attn.o_proj.weight", copy),
    Rule(LAYER + "self_attention.q_layernorm.weight", HF_LAYER + "self_attn.q_norm.weight", copy),
    Rule(LAYER + "self_attention.k_layernorm.weight", HF_LAYER + "self_attn.k_norm.weight", copy),
    Rule(LAYER + "pre_mlp_layernorm.weight", HF_LAYER + "post_attention_layernorm.weight", copy),
    Rule(
        LAYER + "mlp.linear_fc1.weight",
        [HF_LAYER + "mlp.gate_proj.weight", HF_LAYER + "mlp.up_proj.weight"],
        split_gate_up,
    ),
    Rule(LAYER + "mlp.linear_fc2.weight", HF_LAYER + "mlp.down_proj.weight", copy),
    Rule("decoder.final_layernorm.weight", "model.norm.weight", copy),
    Rule("output_layer.weight", "lm_head.weight", output_layer),
]


def stacked_rules(scope: str) -> tuple[StackedRule, ...]:
    """`stacked_params_mapping` of `Qwen2Model.load_weights` (`vllm/model_executor/models/qwen2.py`)."""
    rows = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    return tuple(StackedRule(scope, hf_part, vllm_part, shard) for vllm_part, hf_part, shard in rows)


# Parameters of vLLM's Qwen3 decoder below its `model.` prefix (`Qwen2Model` with `Qwen3Attention`'s
# q_norm/k_norm; `qkv_proj` has a bias only with `attention_bias`): `vllm/model_executor/models/qwen3.py`,
# `qwen2.py`.
QWEN3_DECODER = (
    r"embed_tokens\.weight",
    r"layers\.\d+\.self_attn\.qkv_proj\.(weight|bias)",
    r"layers\.\d+\.self_attn\.o_proj\.weight",
    r"layers\.\d+\.self_attn\.[qk]_norm\.weight",
    r"layers\.\d+\.mlp\.gate_up_proj\.weight",
    r"layers\.\d+\.mlp\.down_proj\.weight",
    r"layers\.\d+\.(input|post_attention)_layernorm\.weight",
    r"norm\.weight",
)

NAMES = FamilyNames(
    model_type="qwen3",
    renames=(),  # Qwen3ForCausalLM's vLLM module tree has the HF names
    stacked=stacked_rules("model."),
    experts=(),
    tied_aliases={"lm_head.weight": "model.embed_tokens.weight"},
    vllm_params=(*under("model.", QWEN3_DECODER), r"lm_head\.weight"),
    source="vllm/model_executor/models/qwen3.py, qwen2.py",
)

FAMILY = ModelFamily("qwen3", FamilyTable(RULES), NAMES, local_gpt_layer_spec=True)

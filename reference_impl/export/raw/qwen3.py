"""Raw converter table for Qwen3 dense (Megatron local spec -> HF `Qwen3ForCausalLM` names).

Layout sources: megatron-core `SelfAttention` (linear_qkv grouped per query group), `MLP`
(linear_fc1 = [gate; up], partition stride 2), HF transformers `modeling_qwen3.py` names.
"""

from __future__ import annotations

from reference_impl.export.raw.rules import Rule, copy, output_layer, split_gate_up, split_qkv, trim_vocab

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

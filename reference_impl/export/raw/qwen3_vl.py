"""Raw converter table for Qwen3-VL dense (Megatron-Bridge `Qwen3VLModel`, local spec -> HF
`Qwen3VLForConditionalGeneration` checkpoint names).

The language model reuses the Qwen3 table under `language_model.` (HF: `model.language_model.`,
`lm_head.` at top level). The vision tower is named as the HF checkpoint names it:
`vision_model.decoder.layers.N` -> `model.visual.blocks.N` (input_layernorm -> norm1,
pre_mlp_layernorm -> norm2, linear_qkv -> attn.qkv with the per-head layout regrouped, linear_proj ->
attn.proj), `merger.patch_norm` -> `merger.norm`, `deepstack_merger_list.K.patch_norm` ->
`deepstack_merger_list.K.norm`, `patch_embed.proj`, `pos_embed` (transformers 5.12.1
`modeling_qwen3_vl.py`; Megatron-Bridge `qwen3_vl_bridge.py` names the same pairs).
"""

from __future__ import annotations

from reference_impl.export.raw import qwen3
from reference_impl.export.raw.rules import Rule, copy, merge_vision_qkv, prefixed


def language_hf(name: str) -> str:
    """HF name of a Qwen3 text-model name inside Qwen3-VL (`model.` -> `model.language_model.`)."""
    return name if name.startswith("lm_head.") else "model.language_model." + name.removeprefix("model.")


VB = "vision_model.decoder.layers.{L}."
HF_VB = "model.visual.blocks.{L}."
DS = "vision_model.decoder.deepstack_merger_list.{K}."
HF_DS = "model.visual.deepstack_merger_list.{K}."

VISION_RULES: list[Rule] = [
    Rule("vision_model.patch_embed.proj.{p}", "model.visual.patch_embed.proj.{p}", copy),
    Rule("vision_model.pos_embed.weight", "model.visual.pos_embed.weight", copy),
    Rule(VB + "input_layernorm.{p}", HF_VB + "norm1.{p}", copy),
    Rule(VB + "self_attention.linear_qkv.{p}", HF_VB + "attn.qkv.{p}", merge_vision_qkv),
    Rule(VB + "self_attention.linear_proj.{p}", HF_VB + "attn.proj.{p}", copy),
    Rule(VB + "pre_mlp_layernorm.{p}", HF_VB + "norm2.{p}", copy),
    Rule(VB + "mlp.linear_fc1.{p}", HF_VB + "mlp.linear_fc1.{p}", copy),
    Rule(VB + "mlp.linear_fc2.{p}", HF_VB + "mlp.linear_fc2.{p}", copy),
    Rule(DS + "patch_norm.{p}", HF_DS + "norm.{p}", copy),
    Rule(DS + "linear_fc{N}.{p}", HF_DS + "linear_fc{N}.{p}", copy),
    Rule("vision_model.merger.patch_norm.{p}", "model.visual.merger.norm.{p}", copy),
    Rule("vision_model.merger.linear_fc{N}.{p}", "model.visual.merger.linear_fc{N}.{p}", copy),
]

RULES: list[Rule] = VISION_RULES + prefixed(qwen3.RULES, "language_model.", language_hf)

"""Qwen3-VL dense (`model_type` "qwen3_vl"): HF `Qwen3VLForConditionalGeneration`.

Raw converter table (Megatron-Bridge `Qwen3VLModel`, local spec -> HF `Qwen3VLForConditionalGeneration`
checkpoint names). The language model reuses the Qwen3 table under `language_model.` (HF:
`model.language_model.`, `lm_head.` at top level). The vision tower is named as the HF checkpoint names
it: `vision_model.decoder.layers.N` -> `model.visual.blocks.N` (input_layernorm -> norm1,
pre_mlp_layernorm -> norm2, linear_qkv -> attn.qkv with the per-head layout regrouped, linear_proj ->
attn.proj), `merger.patch_norm` -> `merger.norm`, `deepstack_merger_list.K.patch_norm` ->
`deepstack_merger_list.K.norm`, `patch_embed.proj`, `pos_embed` (transformers 5.12.1
`modeling_qwen3_vl.py`; Megatron-Bridge `qwen3_vl_bridge.py` names the same pairs).

vLLM names: `Qwen3VLForConditionalGeneration.hf_to_vllm_mapper` renames the prefixes, the language model
is a Qwen3 at `language_model.` (`vllm/model_executor/models/qwen3_vl.py`). Checkpoint views: none.
The trainer keeps the layer spec Megatron-Bridge's Qwen3-VL provider brings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reference_impl.models.families import qwen3
from reference_impl.models.family import ModelFamily
from reference_impl.models.raw_rules import FamilyTable, Rule, copy, merge_vision_qkv, prefixed
from reference_impl.models.vllm_names import FamilyNames, PrefixRename, under

if TYPE_CHECKING:
    from reference_impl.models.registry import ModelSpec


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

# Parameters of vLLM's `Qwen3_VisionTransformer` below `visual.` (`vllm/model_executor/models/qwen3_vl.py`;
# the attention block is `Qwen2_5_VisionAttention` of `qwen2_5_vl.py`). `attn.qkv` is one
# QKVParallelLinear that takes the checkpoint's already fused qkv tensor whole (shard None); the
# vision rotary embedding's inv_freq is computed, never loaded.
QWEN3_VL_VISION = (
    r"patch_embed\.proj\.(weight|bias)",
    r"pos_embed\.weight",
    r"blocks\.\d+\.norm[12]\.(weight|bias)",
    r"blocks\.\d+\.attn\.(qkv|proj)\.(weight|bias)",
    r"blocks\.\d+\.mlp\.linear_fc[12]\.(weight|bias)",
    r"merger\.(norm|linear_fc1|linear_fc2)\.(weight|bias)",
    r"deepstack_merger_list\.\d+\.(norm|linear_fc1|linear_fc2)\.(weight|bias)",
)

# Qwen3VLForConditionalGeneration.hf_to_vllm_mapper (vllm/model_executor/models/qwen3_vl.py); the MoE
# model subclasses it and keeps the mapper (qwen3_vl_moe.py).
QWEN3_VL_RENAMES = (
    PrefixRename("model.visual.", "visual."),
    PrefixRename("lm_head.", "language_model.lm_head."),
    PrefixRename("model.language_model.", "language_model.model."),
)

NAMES = FamilyNames(
    model_type="qwen3_vl",
    # Qwen3VLForConditionalGeneration.hf_to_vllm_mapper (vllm/model_executor/models/qwen3_vl.py).
    renames=QWEN3_VL_RENAMES,
    # The language model is Qwen3LLMForCausalLM (a Qwen3ForCausalLM) at `language_model.`.
    stacked=qwen3.stacked_rules("language_model.model."),
    experts=(),
    tied_aliases={"lm_head.weight": "model.language_model.embed_tokens.weight"},
    vllm_params=(
        *under("language_model.model.", qwen3.QWEN3_DECODER),
        r"language_model\.lm_head\.weight",
        *under("visual.", QWEN3_VL_VISION),
    ),
    source="vllm/model_executor/models/qwen3_vl.py, qwen3.py, qwen2.py, qwen2_5_vl.py",
)


def check_scale_down(spec: ModelSpec, real: ModelSpec) -> list[str]:
    """Qwen3-VL facts `spec` (scaled) lost against `real`: patch/temporal/merge sizes, the position grid,
    vision depth >= 2 holding every deepstack index, mRoPE sections in the real proportion summing to
    head_dim/2, special token ids inside the vocabulary. Empty when all are kept."""
    problems: list[str] = []
    f, r = spec.model_config(), real.model_config()
    v, rv = spec.config["vision_config"], spec.source_config["vision_config"]
    for k in ("patch_size", "temporal_patch_size", "spatial_merge_size", "num_position_embeddings"):
        if v[k] != rv[k]:
            problems.append(f"vision {k} {v[k]} differs from real {rv[k]}")
    if f.vision_depth < 2:
        problems.append("vision depth must be >= 2")
    if len(f.deepstack_indexes) != len(r.deepstack_indexes) or max(f.deepstack_indexes) >= f.vision_depth:
        problems.append("deepstack indexes must keep their count and lie inside the vision depth")
    sec = spec.text_config()["rope_scaling"]["mrope_section"]
    rsec = spec.source_config["text_config"]["rope_scaling"]["mrope_section"]
    if sum(sec) * 2 != f.head_dim:
        problems.append(f"mrope_section {sec} must sum to head_dim/2 = {f.head_dim // 2}")
    if [round(s / sum(sec), 1) for s in sec] != [round(s / sum(rsec), 1) for s in rsec]:
        problems.append(f"mrope_section {sec} is not in the real proportion {rsec}")
    # Qwen3-VL-2B's config copy lacks the vision start/end ids (not confirmed, SOURCES.md): check those present.
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    ids = [spec.config[k] for k in keys if k in spec.config]
    if max(ids) >= f.vocab_size:
        problems.append(f"special token ids {ids} must lie inside vocab_size {f.vocab_size}")
    return problems


# Megatron-Bridge 0.6.2's Qwen3-VL patch mergers (the final one and the deepstack ones,
# `megatron/bridge/models/qwen_vl/modelling_qwen3_vl/`) use tanh-approximate GELU where transformers'
# `Qwen3VLVisionPatchMerger` (and vLLM's) use exact GELU: the trainer's image-prompt log-probs differ in
# fp32 on the scaled-down checkpoints by up to 7.9e-4 max (Qwen3-VL-MoE, the image prompt at T 0.7;
# 1.2e-4 to 1.5e-4 on the earlier prompts without a chat template), and by 6e-7 with exact GELU in the
# mergers. tests/test_megatron_forward.py pins the gap: the image prompt alone moves, by less than 1e-3.
MERGER_GELU_GAP = 1e-3

FAMILY = ModelFamily(
    "qwen3_vl",
    FamilyTable(RULES),
    NAMES,
    is_vl=True,
    scale_down_checks=(check_scale_down,),
    trainer_logprob_gap=MERGER_GELU_GAP,
)

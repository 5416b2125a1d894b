"""Hugging Face checkpoint name -> the vLLM parameter (and shard) it loads into, per model family.

The embedded engine holds a transformers model, but it speaks about its parameters the way vLLM does:
an engine *shard* is one HF tensor placed into one vLLM parameter, at a shard id when vLLM fuses several
HF tensors into one parameter. The rules are data (one `FamilyNames` table per family, in
`models/families/<model_type>.py`); `hf_to_vllm` is the one small engine that applies them, in vLLM's
order:

1. Prefix renames (`PrefixRename`), at most one applies: vLLM's `WeightsMapper(orig_to_new_prefix=...)`
   (`vllm/model_executor/models/utils.py`), used by Qwen3-VL's `hf_to_vllm_mapper`
   (`vllm/model_executor/models/qwen3_vl.py`; Qwen3-VL-MoE's class in `qwen3_vl_moe.py` inherits it).
2. Routed experts (`ExpertRule`), at most one applies, before the stacked rules (a per-expert
   `experts.{e}.gate_proj` must not become the dense `gate_up_proj`): vLLM 0.33.0 hands expert tensors to
   `MoERunner.load_weights` -> `RoutedExperts.load_weights`
   (`vllm/model_executor/layers/fused_moe/runner/moe_runner.py`, `fused_moe/routed_experts.py`), whose
   mapping comes from `RoutedExperts.build_expert_params_mapping(..., include_fused=True)`: per-expert
   (`experts.w13_`, `experts.{e}.gate_proj.`, e, "w1"), (`experts.w13_`, `experts.{e}.up_proj.`, e, "w3"),
   (`experts.w2_`, `experts.{e}.down_proj.`, e, "w2"), and fused (`experts.w13_weight`,
   `experts.gate_up_proj`, chunk 0/1, "w1"/"w3"), (`experts.w2_weight`, `experts.down_proj`, 0, "w2").
   The expert parameters are `w13_weight` [E, 2I, H] (gate first) and `w2_weight` [E, H, I]
   (`fused_moe/unquantized_fused_moe_method.py`). Our shard ids: `f"{e}:w1"`, `f"{e}:w3"`, `f"{e}:w2"`
   for one expert's tensor, `"all"` for a fused tensor that fills every expert. Qwen3-VL-MoE's decoder
   layers pass `is_fused_checkpoint_transposed=True` (`qwen3_vl_moe.py`), so its fused tensors are the
   released [E, H, 2I] / [E, I, H] (the loader checks shapes; see `checkpoint_views`). The router is a
   `GateLinear` at prefix `mlp.gate` (`qwen3_moe.py`): `mlp.gate.weight`, unchanged.
   vLLM 0.33.0 registers `w13_weight`/`w2_weight` on `mlp.experts.routed_experts` (`FusedMoEFactory` in
   `fused_moe/layer.py` builds a `MoERunner` whose `routed_experts` is the `RoutedExperts`;
   `MoERunner.load_weights` yields `routed_experts.{name}`); older releases held them on `mlp.experts`.
   `EXPERTS_MODULE` below is the one place that names this module.
3. Stacked (fused) parameters (`StackedRule`), at most one applies, and only to names under the rule's
   scope (the module whose `load_weights` holds the mapping): `stacked_params_mapping` in
   `Qwen2Model.load_weights` (`vllm/model_executor/models/qwen2.py`; `Qwen3Model` subclasses it in
   `qwen3.py`): q_proj/k_proj/v_proj -> qkv_proj shards "q"/"k"/"v", gate_proj/up_proj -> gate_up_proj
   shards 0/1. Newer vLLM spells the same rules as `WeightsMapper(orig_to_new_stacked=...)` on
   `Qwen2Model.hf_to_vllm_mapper`.

Tied embeddings: with `tie_word_embeddings`, vLLM's `lm_head` shares `embed_tokens`' Parameter
(`ParallelLMHead.tie_weights`, `qwen3.py` / `qwen2.py`), so `lm_head.weight` is not a parameter of its
own and vLLM skips the name silently (`AutoWeightsLoader(skip_prefixes=["lm_head."])`). `FamilyNames.tied_aliases`
lists those names so the strict loader can reject them instead (README "Verdicts": a name an engine
would silently ignore is a NAME_ERROR). Untied (`tie_word_embeddings: false`, e.g. Qwen3-30B-A3B or the
`qwen3-untied` entry), `lm_head` is a `ParallelLMHead` of its own and `lm_head.weight`
(`language_model.lm_head.weight` for the VL families) is an ordinary shard.

`FamilyNames.vllm_params` holds, per family, patterns of every parameter name vLLM's model has
(`named_parameters()` of `Qwen3ForCausalLM` / `Qwen3VLForConditionalGeneration` / `Qwen3MoeForCausalLM` /
`Qwen3VLMoeForConditionalGeneration`), so the loader can
check that each shard it builds targets a parameter vLLM really has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

ShardId = str | int | None


class VllmTarget(NamedTuple):
    """Where one HF tensor loads in vLLM: parameter `name` and `shard` (None: the whole parameter)."""

    name: str
    shard: ShardId

    @property
    def key(self) -> str:
        """The engine shard's key in records and `/finish_weight_update` counts: `name[shard]` or `name`."""
        return self.name if self.shard is None else f"{self.name}[{self.shard}]"


@dataclass(frozen=True)
class PrefixRename:
    """HF names starting with `hf` start with `vllm` instead (vLLM `WeightsMapper.orig_to_new_prefix`)."""

    hf: str
    vllm: str


@dataclass(frozen=True)
class StackedRule:
    """Within `scope` (a vLLM name prefix), `.{hf_part}.` becomes `.{vllm_part}.` at shard `shard`.

    One row of vLLM's `stacked_params_mapping = [(param_name, shard_name, shard_id), ...]`.
    """

    scope: str
    hf_part: str
    vllm_part: str
    shard: str | int


@dataclass(frozen=True)
class ExpertRule:
    """Within `scope`, a routed-expert checkpoint tensor `.mlp.experts.{e}.{hf_part}` (per expert) or
    `.mlp.experts.{hf_part}` (fused, `expert_shard=None`) loads into `.mlp.{EXPERTS_MODULE}{vllm_param}`.

    One row of vLLM's `build_expert_params_mapping` (`fused_moe/routed_experts.py`); the shard is
    `f"{e}:{expert_shard}"` for a per-expert tensor and "all" for a fused one.
    """

    scope: str
    hf_part: str  # "gate_proj.weight" | "up_proj.weight" | "down_proj.weight" | "gate_up_proj" | "down_proj"
    vllm_param: str  # "w13_weight" | "w2_weight"
    expert_shard: str | None  # "w1" | "w3" | "w2"; None: a fused tensor of all experts

    def pattern(self) -> str:
        """Regex (full match) of the names this rule applies to, with groups `pre` and `e`."""
        expert = r"\.(?P<e>\d+)" if self.expert_shard is not None else ""
        return rf"(?P<pre>{re.escape(self.scope)}.*\.mlp)\.experts{expert}\.{re.escape(self.hf_part)}"


@dataclass(frozen=True)
class FamilyNames:
    """All name rules of one model family; see the module docstring for the vLLM sources."""

    model_type: str
    renames: tuple[PrefixRename, ...]
    stacked: tuple[StackedRule, ...]
    experts: tuple[ExpertRule, ...]
    tied_aliases: dict[str, str]  # HF alias -> HF owner, when tie_word_embeddings
    vllm_params: tuple[str, ...]  # regexes (full match) of every vLLM parameter name
    source: str  # vLLM files these facts come from


# Module of vLLM's routed-expert parameters below `mlp.` (see the module docstring, step 2).
EXPERTS_MODULE = "experts.routed_experts."


def expert_rules(scope: str) -> tuple[ExpertRule, ...]:
    """`RoutedExperts.build_expert_params_mapping(include_fused=True)` rows, per expert and fused."""
    return (
        ExpertRule(scope, "gate_proj.weight", "w13_weight", "w1"),
        ExpertRule(scope, "up_proj.weight", "w13_weight", "w3"),
        ExpertRule(scope, "down_proj.weight", "w2_weight", "w2"),
        ExpertRule(scope, "gate_up_proj", "w13_weight", None),
        ExpertRule(scope, "down_proj", "w2_weight", None),
    )


def under(prefix: str, patterns: tuple[str, ...]) -> tuple[str, ...]:
    """`patterns` (regexes of vLLM parameter names) below the module prefix `prefix`."""
    return tuple(re.escape(prefix) + p for p in patterns)


def hf_to_vllm(table: FamilyNames, hf_name: str) -> VllmTarget:
    """The vLLM parameter and shard that HF tensor `hf_name` loads into, by the family's rules `table`.

    Purely syntactic: it does not say whether the target exists (see `is_vllm_param` and the loader;
    an expert id >= the number of experts maps to a shard no engine has).
    Examples (tables of `models/families/`): (qwen3_vl, "model.language_model.layers.3.self_attn.k_proj.weight")
    -> VllmTarget("language_model.model.layers.3.self_attn.qkv_proj.weight", "k");
    (qwen3_moe, "model.layers.1.mlp.experts.5.up_proj.weight") ->
    VllmTarget("model.layers.1.mlp.experts.routed_experts.w13_weight", "5:w3");
    (qwen3_vl_moe, "model.language_model.layers.0.mlp.experts.gate_up_proj") ->
    VllmTarget("language_model.model.layers.0.mlp.experts.routed_experts.w13_weight", "all").
    """
    name = hf_name
    for rule in table.renames:
        if name.startswith(rule.hf):
            name = rule.vllm + name[len(rule.hf) :]
            break
    for ex in table.experts:
        m = re.fullmatch(ex.pattern(), name)
        if m is not None:
            shard = "all" if ex.expert_shard is None else f"{int(m['e'])}:{ex.expert_shard}"
            return VllmTarget(f"{m['pre']}.{EXPERTS_MODULE}{ex.vllm_param}", shard)
    for st in table.stacked:
        part = f".{st.hf_part}."
        if name.startswith(st.scope) and part in name:
            return VllmTarget(name.replace(part, f".{st.vllm_part}.", 1), st.shard)
    return VllmTarget(name, None)


def is_vllm_param(table: FamilyNames, vllm_name: str) -> bool:
    """Whether `vllm_name` is a parameter name vLLM's model of the family has (`table.vllm_params`)."""
    return any(re.fullmatch(p, vllm_name) for p in table.vllm_params)

"""`ModelFamily`: everything the harness knows about one HF `model_type`, in one object.

One family file per `model_type` (`models/families/<model_type>.py`) defines one `ModelFamily`;
`models.families.FAMILIES` registers them. What each field is used for:
- `raw`: the raw Megatron -> HF converter (`raw_rules.FamilyTable`), run by `export.stream.export_raw`;
- `names`: where each HF checkpoint tensor loads in vLLM (`vllm_names.FamilyNames`), the embedded
  engine's shards;
- `views`: which checkpoint tensors a transformers parameter is saved as (`checkpoint_views.ViewRule`),
  used by the engine's loader and by the trainer-side transformers forward;
- `is_vl`: a vision-language model (its config has `text_config` / `vision_config`);
- `released_fused_experts`: the checkpoint maker rewrites fused expert tensors into the released
  checkpoints' layout (`checkpoint.to_released_expert_layout`);
- `local_gpt_layer_spec`: the trainer builds the language model with megatron-core's
  `get_gpt_layer_local_spec` (the VL providers of Megatron-Bridge bring their own spec);
- `scale_down_checks`: the family's own facts a scaled-down entry must keep, beyond the generic ones
  of `registry.check_scale_down_keeps_facts`;
- `trainer_logprob_gap`: a known, sourced difference (max |log-prob diff|, fp32) between the trainer's
  Megatron forward and the HF / vLLM forward of the same weights, added to the trainer-vs-engine
  log-prob budget (0 where both compute the same function).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reference_impl.models.checkpoint_views import ViewRule
from reference_impl.models.raw_rules import FamilyTable
from reference_impl.models.vllm_names import FamilyNames

if TYPE_CHECKING:
    from reference_impl.models.registry import ModelSpec

ScaleDownCheck = Callable[["ModelSpec", "ModelSpec"], list[str]]
"""(scaled entry, the same entry at its real size) -> the facts the scaled one lost, one sentence each."""


@dataclass(frozen=True)
class ModelFamily:
    """One model family; see the module docstring for what each field drives.

    Family files pass `model_type`, `raw` and `names` by position and the rest by keyword; a field left
    out keeps its default (no checkpoint views, not VL, the maker's plain layout, the provider's own
    layer spec, no family scale-down checks).
    """

    model_type: str  # transformers `config.model_type`, also the `model_type:` of a model entry
    raw: FamilyTable
    names: FamilyNames
    views: tuple[ViewRule, ...] = ()  # none: every transformers parameter is saved as itself
    is_vl: bool = False
    released_fused_experts: bool = False
    local_gpt_layer_spec: bool = False
    scale_down_checks: tuple[ScaleDownCheck, ...] = ()
    trainer_logprob_gap: float = 0.0

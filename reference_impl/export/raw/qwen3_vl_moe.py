"""Raw converter for Qwen3-VL-MoE (Megatron-Bridge `Qwen3VLModel` with MoE language model -> HF
`Qwen3VLMoeForConditionalGeneration` checkpoint names).

Vision tower and dense language parts as Qwen3-VL; experts as Qwen3-MoE per expert, then fused per
layer by the post-pass into the checkpoint's stacked tensors. The fused layout, derived from the
checkpoints (checked against the file transformers writes in tests/test_moe_layouts.py):
- released (Qwen/Qwen3-VL-30B-A3B-Instruct; vLLM `qwen3_vl_moe.py` transposes it on load):
  `mlp.experts.gate_up_proj` [E, hidden, 2*moe_inter] = stack_e(cat(gate_e, up_e).T),
  `mlp.experts.down_proj` [E, moe_inter, hidden] = stack_e(down_e.T);
- transformers 5.12.1 `save_pretrained` (its in-memory layout): [E, 2*moe_inter, hidden] =
  stack_e(cat(gate_e, up_e)) and [E, hidden, moe_inter] = stack_e(down_e).
Gate comes before up along the 2*moe_inter axis in both. `LayoutFacts.fused_experts_layout` picks one.
"""

from __future__ import annotations

import re

import torch

from reference_impl.export.raw import qwen3_moe, qwen3_vl
from reference_impl.export.raw.rules import FamilyTable, LayoutFacts, Rule, prefixed

RULES: list[Rule] = qwen3_vl.VISION_RULES + prefixed(qwen3_moe.RULES, "language_model.", qwen3_vl.language_hf)

_PER_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(owned: list[tuple[str, torch.Tensor]], facts: LayoutFacts) -> list[tuple[str, torch.Tensor]]:
    """Replace each layer's per-expert gate/up/down tensors by the two fused tensors (module doc).

    Raises:
        ValueError: a layer's experts are not exactly 0..E-1 (an expert id is missing or repeated).
    """
    layers: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in owned:
        m = _PER_EXPERT.match(name)
        if m is None:
            out.append((name, t))
            continue
        layers.setdefault(m.group("layer"), {}).setdefault(m.group("proj"), {})[int(m.group("e"))] = t
    released = facts.fused_experts_layout == "released"
    for layer, projs in layers.items():
        for proj, experts in projs.items():
            if sorted(experts) != list(range(facts.num_experts)):
                raise ValueError(f"{layer}.{proj}: experts {sorted(experts)} are not 0..{facts.num_experts - 1}")
        gate_up = [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], 0) for e in range(facts.num_experts)]
        down = [projs["down_proj"][e] for e in range(facts.num_experts)]
        if released:
            gate_up, down = [t.T for t in gate_up], [t.T for t in down]
        out.append((f"{layer}.gate_up_proj", torch.stack(gate_up).contiguous()))
        out.append((f"{layer}.down_proj", torch.stack(down).contiguous()))
    return out


TABLE = FamilyTable(RULES, fuse_experts)

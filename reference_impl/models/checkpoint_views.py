"""Which checkpoint tensors each transformers parameter is saved as, as writable views of it, per family
(the view rules of a family live in `models/families/<model_type>.py`).

The engine's unit of loading is *one checkpoint tensor* (what the trainer sends, in HF checkpoint
names and layout). transformers does not always hold a checkpoint tensor as a parameter of its own:
transformers 5.12.1 keeps MoE experts fused in memory, `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows
first) and `mlp.experts.down_proj` [E, H, I] (`transformers/models/qwen3_moe/modeling_qwen3_moe.py`,
`qwen3_vl_moe/modeling_qwen3_vl_moe.py`), while checkpoints hold them otherwise:

- Qwen3-MoE checkpoints (released, and as `save_pretrained` writes them through the conversion mapping
  `transformers/conversion_mapping.py` "qwen2_moe": `MergeModulelist(dim=0)`, `Concatenate(dim=1)`) name
  experts one by one: `...mlp.experts.{e}.gate_proj.weight` = p[e, :I], `...{e}.up_proj.weight` = p[e, I:]
  ([I, H] each) and `...mlp.experts.{e}.down_proj.weight` = p[e] ([H, I]).
- Qwen3-VL-MoE checkpoints as released (Qwen3-VL-30B-A3B; what vLLM's `qwen3_vl_moe.py` expects: it
  builds its experts with `is_fused_checkpoint_transposed=True` and transposes every fused tensor) keep
  the fused names but transposed: `...mlp.experts.gate_up_proj` [E, H, 2I] (gate first along the last
  dim) and `...mlp.experts.down_proj` [E, I, H]. Our checkpoint maker writes this layout
  (`reference_impl.models.checkpoint.to_released_expert_layout`).

A `ViewRule` maps a transformers parameter name pattern to the checkpoint tensors it is saved as, each
a `SavedAs`: a checkpoint name template and a view function. Every parameter no rule matches is saved
as itself (identity). Views are *writable views* of the parameter (`copy_` into one updates the
parameter), and checksums are taken over `.contiguous()` of a view, so the engine's checksums are in
checkpoint names and layout and equal the safetensors tensors' bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations here: a process that reads the rules (an engine actor) needs no torch
    import torch

View = Callable[["torch.Tensor", int | None], "torch.Tensor"]


def identity(p: torch.Tensor, e: int | None) -> torch.Tensor:
    """The parameter itself."""
    return p


def expert_gate_rows(p: torch.Tensor, e: int | None) -> torch.Tensor:
    """Expert `e`'s gate projection of a fused [E, 2I, H] gate_up_proj: rows [0, I) -> [I, H]."""
    return p[e, : p.shape[1] // 2]


def expert_up_rows(p: torch.Tensor, e: int | None) -> torch.Tensor:
    """Expert `e`'s up projection of a fused [E, 2I, H] gate_up_proj: rows [I, 2I) -> [I, H]."""
    return p[e, p.shape[1] // 2 :]


def expert_slice(p: torch.Tensor, e: int | None) -> torch.Tensor:
    """Expert `e` of a fused [E, ...] parameter (down_proj [E, H, I] -> [H, I])."""
    return p[e]


def transpose_last_two(p: torch.Tensor, e: int | None) -> torch.Tensor:
    """A fused [E, a, b] parameter as [E, b, a] (the released Qwen3-VL-MoE orientation)."""
    return p.transpose(1, 2)


@dataclass(frozen=True)
class SavedAs:
    """One checkpoint tensor cut out of a parameter.

    Attributes:
        name: checkpoint name template; `{m}` is the rule's matched group `m`, `{e}` the expert id.
        view: (parameter, expert id or None) -> writable view holding exactly this checkpoint tensor.
        layout: what the checkpoint tensor's dims are, for error messages ("" for plain parameters).
    """

    name: str
    view: View
    layout: str = ""


@dataclass(frozen=True)
class ViewRule:
    """Transformers parameters whose names fully match `param` are saved as `saved_as`.

    With `per_expert`, each `SavedAs` is repeated for every expert e = 0..E-1 (E = the parameter's dim 0).
    """

    param: str  # regex with a named group `m`
    saved_as: tuple[SavedAs, ...]
    per_expert: bool = False


IDENTITY = SavedAs("{m}", identity)


@dataclass(frozen=True)
class CheckpointTensor:
    """Checkpoint tensor `name`: `part` of transformers parameter `param` (for expert `expert`)."""

    name: str
    param: str
    expert: int | None
    part: SavedAs

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """The writable view of parameter `p` (must be `param`) holding this checkpoint tensor."""
        return self.part.view(p.detach(), self.expert)

    @property
    def layout(self) -> str:
        return self.part.layout


def saved_as(views: Sequence[ViewRule], param_name: str, p: torch.Tensor) -> list[CheckpointTensor]:
    """The checkpoint tensors transformers parameter `param_name` (value `p`) is saved as, by a family's
    view rules `views` (`ModelFamily.views`).

    The first rule whose pattern fully matches applies; no match means the parameter is saved as itself.

    Raises:
        RuntimeError: a view is not a view of `p` (so loading into it would not update the parameter), or
            the views of one parameter do not cover it exactly once by element count.
    """
    rule = next((r for r in views if re.fullmatch(r.param, param_name)), None)
    if rule is None:
        return [CheckpointTensor(param_name, param_name, None, IDENTITY)]
    m = re.fullmatch(rule.param, param_name)["m"]
    experts: list[int | None] = list(range(p.shape[0])) if rule.per_expert else [None]
    out = [CheckpointTensor(part.name.format(m=m, e=e), param_name, e, part) for e in experts for part in rule.saved_as]
    base = p.detach().untyped_storage().data_ptr()
    numel = 0
    for ct in out:
        v = ct.view(p)
        if v.untyped_storage().data_ptr() != base:
            raise RuntimeError(f"view rule {rule.param!r}: {ct.name} is not a view of {param_name}")
        numel += v.numel()
    if numel != p.numel():
        raise RuntimeError(
            f"view rule {rule.param!r}: the {len(out)} checkpoint tensors of {param_name} hold {numel} elements, "
            f"the parameter {p.numel()}"
        )
    return out


def checkpoint_tensors(views: Sequence[ViewRule], params: Mapping[str, torch.Tensor]) -> dict[str, CheckpointTensor]:
    """Checkpoint name -> `CheckpointTensor` for every parameter of `params` (in their order), by a family's
    view rules `views`.

    Raises:
        RuntimeError: two parameters are saved under one checkpoint name, or a view rule is broken
            (see `saved_as`).
    """
    out: dict[str, CheckpointTensor] = {}
    for name, p in params.items():
        for ct in saved_as(views, name, p):
            if ct.name in out:
                raise RuntimeError(f"{name} and {out[ct.name].param} are both saved as {ct.name}")
            out[ct.name] = ct
    return out

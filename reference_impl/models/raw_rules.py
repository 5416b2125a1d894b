"""The rule engine shared by the raw converters: one table of rules per model family (the tables
live in `models/families/<model_type>.py`).

A rule maps a Megatron parameter name pattern to one or more HF name templates and names the layout
transform between them. Patterns use `{X}` placeholders (one dotted component each) that carry over
into the templates, e.g. `decoder.layers.{L}.mlp.linear_fc2.weight` -> `model.layers.{L}.mlp.down_proj.weight`.
Names are global Megatron names (PP layer offset applied, TP shards gathered) on input.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations here: reading the tables (an engine actor does) needs no torch
    import torch


class UnmappedName(KeyError):
    """A Megatron parameter that no rule of the family's table matches."""


@dataclass(frozen=True)
class ConvertConfig:
    """Numbers the layout transforms need (from the model's HF config)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    vision_heads: int = 0
    vision_head_dim: int = 0
    num_experts: int = 0
    fused_experts_layout: str = "released"  # "released" | "transformers" (Qwen3-VL-MoE fused experts)


Transform = Callable[["torch.Tensor", ConvertConfig], list["torch.Tensor"]]


def copy(t: torch.Tensor, f: ConvertConfig) -> list[torch.Tensor]:
    """Same tensor, same layout."""
    return [t]


def split_qkv(t: torch.Tensor, f: ConvertConfig) -> list[torch.Tensor]:
    """Megatron `linear_qkv` [G * (Q/G + 2) * D, H] -> HF q [Q*D, H], k [G*D, H], v [G*D, H].

    Megatron groups rows by query group g: (Q/G heads of q, 1 head of k, 1 head of v), each head D =
    head_dim rows (megatron-core `SelfAttention.get_query_key_value_tensors`). HF stores q, k, v
    separately, heads in order. Works for weights and (1-D) biases.
    """
    g, d = f.num_kv_heads, f.head_dim
    qpg = f.num_heads // g
    grouped = t.reshape(g, (qpg + 2) * d, *t.shape[1:])
    q = grouped[:, : qpg * d].reshape(f.num_heads * d, *t.shape[1:])
    k = grouped[:, qpg * d : (qpg + 1) * d].reshape(g * d, *t.shape[1:])
    v = grouped[:, (qpg + 1) * d :].reshape(g * d, *t.shape[1:])
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def split_gate_up(t: torch.Tensor, f: ConvertConfig) -> list[torch.Tensor]:
    """Megatron `mlp.linear_fc1` [2F, H] (full, after the stride-2 TP gather: [gate; up]) -> gate [F, H],
    up [F, H] (HF `gate_proj`, `up_proj`)."""
    gate, up = t.chunk(2, dim=0)
    return [gate.contiguous(), up.contiguous()]


def merge_vision_qkv(t: torch.Tensor, f: ConvertConfig) -> list[torch.Tensor]:
    """Megatron vision `linear_qkv` [N * 3 * D, C] (per head: q_h, k_h, v_h; num_query_groups = heads)
    -> HF `attn.qkv` [3 * N * D, C] ([q all heads; k all heads; v all heads], transformers
    `Qwen3VLVisionAttention` splits it with reshape(seq, 3, heads, -1))."""
    n, d = f.vision_heads, f.vision_head_dim
    per_head = t.reshape(n, 3, d, *t.shape[1:])
    return [per_head.transpose(0, 1).reshape(3 * n * d, *t.shape[1:]).contiguous()]


def trim_vocab(t: torch.Tensor, f: ConvertConfig) -> list[torch.Tensor]:
    """Embedding / output layer [V_padded, H] -> [V, H]: drop Megatron's vocab padding rows."""
    return [t[: f.vocab_size].contiguous()]


def output_layer(t: torch.Tensor, f: ConvertConfig) -> list[torch.Tensor]:
    """`output_layer.weight` -> `lm_head.weight`, or nothing when embeddings are tied: a tied engine
    has no lm_head parameter (vLLM ties it to embed_tokens), so sending one is a name error."""
    return [] if f.tied_embeddings else trim_vocab(t, f)


@dataclass(frozen=True)
class Rule:
    """`megatron` pattern -> `hf` templates (one per output of `transform`)."""

    megatron: str
    hf: Sequence[str]
    transform: Transform = copy
    _regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pattern = re.escape(self.megatron).replace(r"\{", "{").replace(r"\}", "}")
        pattern = re.sub(r"{(\w+)}", r"(?P<\1>[^.]+)", pattern)
        object.__setattr__(self, "_regex", re.compile(f"^{pattern}$"))
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))

    def match(self, name: str) -> dict[str, str] | None:
        """Placeholder values when `name` matches, else None."""
        m = self._regex.match(name)
        return m.groupdict() if m else None


def prefixed(rules: Sequence[Rule], megatron_prefix: str, hf_rename: Callable[[str], str]) -> list[Rule]:
    """The same rules under a Megatron module prefix, with HF templates renamed (e.g. for the language
    model inside a VLM)."""
    return [Rule(megatron_prefix + r.megatron, [hf_rename(h) for h in r.hf], r.transform) for r in rules]


def convert(
    name: str, tensor: torch.Tensor, rules: Sequence[Rule], config: ConvertConfig
) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one full Megatron parameter.

    Raises:
        UnmappedName: no rule matches `name` (the message names it and the table to extend).
        ValueError: the transform produced a different number of tensors than the rule has templates.
    """
    for rule in rules:
        groups = rule.match(name)
        if groups is None:
            continue
        outs = rule.transform(tensor, config)
        if outs and len(outs) != len(rule.hf):
            raise ValueError(f"rule {rule.megatron}: {len(outs)} tensors for {len(rule.hf)} HF names")
        return [(tmpl.format(**groups), t) for tmpl, t in zip(rule.hf, outs, strict=False)]
    raise UnmappedName(f"no raw conversion rule matches Megatron parameter {name!r}; add one to the family table")


PostPass = Callable[[list[tuple[str, "torch.Tensor"]], ConvertConfig], list[tuple[str, "torch.Tensor"]]]


@dataclass(frozen=True)
class FamilyTable:
    """A family's raw converter: per-parameter `rules`, then an optional `post` pass over the named
    (name, tensor) list (e.g. fusing per-expert tensors into one stacked tensor)."""

    rules: Sequence[Rule]
    post: PostPass | None = None

    @property
    def ep_gathers_experts(self) -> bool:
        """Whether the raw export all-gathers routed experts over EP to the expert leader (EP 0): a post
        pass (fusing a layer's experts into one stacked tensor) needs every expert of its stage on one rank.
        Without one, each EP rank converts and owns its own experts, and the sync hands them to the sender
        point to point (`transport.sync.hand_off`), as it hands off other PP stages' tensors."""
        return self.post is not None

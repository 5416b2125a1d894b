"""The two export modes, as an RL framework runs them on every trainer rank.

Both return the HF (name, tensor) pairs this rank *owns* for sending, in a deterministic order, and
the seconds spent per phase:
- raw: every rank walks its parameters (global names), all TP ranks all-gather each sharded one,
  and TP rank 0 of each PP stage converts and owns its stage's tensors.
- bridge: Megatron-Bridge's `export_hf_weights(model, cpu=True)` on every rank (it gathers TP and
  collects across PP stages itself, yielding every name on every rank); global rank 0 owns them all.
  Its gather and convert are one call: the time is recorded as `convert`, `gather` is 0.
"""

from __future__ import annotations

import time

import torch

from reference_impl.export.raw import TABLES
from reference_impl.export.raw.rules import LayoutFacts, Rule, convert
from reference_impl.models.registry import ModelSpec
from reference_impl.trainer.model import TrainerModel
from reference_impl.trainer.parallel import RankLayout
from reference_impl.trainer.params import iter_global_params, tp_gather

MODES = ("raw", "bridge")

Owned = list[tuple[str, torch.Tensor]]


def layout_facts(spec: ModelSpec) -> LayoutFacts:
    """The layout numbers of `spec` the raw transforms need."""
    f = spec.facts()
    return LayoutFacts(
        num_heads=f.num_heads,
        num_kv_heads=f.num_kv_heads,
        head_dim=f.head_dim,
        vocab_size=f.vocab_size,
        tied_embeddings=f.tied_embeddings,
        vision_heads=f.vision_heads,
        vision_head_dim=f.vision_hidden // f.vision_heads if f.vision_heads else 0,
    )


def export_raw(
    model: TrainerModel, layout: RankLayout, facts: LayoutFacts, rules: list[Rule] | None = None
) -> tuple[Owned, dict[str, float]]:
    """This rank's owned HF tensors via the family's raw table (see module doc), and phase seconds."""
    from megatron.core import parallel_state as ps

    rules = rules if rules is not None else TABLES[model.family]
    tp_group = ps.get_tensor_model_parallel_group() if layout.tp > 1 else None
    owned: Owned = []
    t_gather = t_convert = 0.0
    for name, p in iter_global_params(model.chunks):
        t0 = time.perf_counter()
        full = tp_gather(p, tp_group, layout.tp)
        t1 = time.perf_counter()
        if layout.is_stage_leader:
            owned.extend(convert(name, full, rules, facts))
        t_gather += t1 - t0
        t_convert += time.perf_counter() - t1
    return owned, {"gather": t_gather, "convert": t_convert}


def export_bridge(model: TrainerModel, layout: RankLayout) -> tuple[Owned, dict[str, float]]:
    """This rank's owned HF tensors via Megatron-Bridge (all on global rank 0), and phase seconds."""
    t0 = time.perf_counter()
    owned: Owned = []
    for name, tensor in model.bridge.export_hf_weights(model.chunks, cpu=True, show_progress=False):
        if layout.rank == 0:
            owned.append((name, tensor.detach().contiguous()))
    return owned, {"gather": 0.0, "convert": time.perf_counter() - t0}


def export(mode: str, model: TrainerModel, layout: RankLayout, facts: LayoutFacts) -> tuple[Owned, dict[str, float]]:
    """Dispatch on `mode` ("raw" | "bridge").

    Raises:
        ValueError: unknown mode.
    """
    if mode == "raw":
        return export_raw(model, layout, facts)
    if mode == "bridge":
        return export_bridge(model, layout)
    raise ValueError(f"unknown export mode {mode!r}; use one of {MODES}")

"""The two export modes, as an RL framework runs them on every trainer rank.

Both return the HF (name, tensor) pairs this rank *owns* for sending, in a deterministic order, and
the seconds spent per phase:
- raw: every rank walks its parameters (global names), the TP ranks gather each sharded one to TP
  rank 0, and TP rank 0 of each PP stage converts and owns its stage's dense tensors by the family's raw rule
  table (`models/families/<model_type>.py`, applied by `models.raw_rules.convert`); routed experts are
  owned by each EP rank's expert leader, or all-gathered over EP to EP 0 where the family fuses them
  (`iter_raw`).
- bridge: Megatron-Bridge's `export_hf_weights(model, conversion_tasks=...)` on every rank,
  with the conversion tasks of the rank's own PP stage (`export/bridge.py`: the library gathers TP
  shards inside the stage and broadcasts nothing across stages; per-expert HF names are exported by
  each EP rank for its own experts, stacked ones gathered by the library over EP); the stage leader
  (TP 0, DP 0) owns its stage's tensors, each EP rank's expert leader its own experts. Its gather and
  convert are one call: the time is recorded as `convert`, `gather` is 0.
- Tensors owned by a rank other than the sender reach it by the sync's point-to-point hand-off
  (`transport.sync`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from reference_impl.export import MODES
from reference_impl.export.bridge import iter_bridge
from reference_impl.models.families import model_family
from reference_impl.models.raw_rules import ConvertConfig, FamilyTable, convert
from reference_impl.models.registry import ModelSpec
from reference_impl.trainer.model import TrainerModel
from reference_impl.trainer.parallel import RankLayout, gather_groups
from reference_impl.trainer.params import (
    GatherBuffers,
    ep_gather,
    expert_id,
    is_expert_param,
    iter_global_params,
    tp_gather,
    tp_shards,
    with_expert_id,
)

NamedTensors = list[tuple[str, torch.Tensor]]


def convert_config(spec: ModelSpec, checkpoint: Path | None = None) -> ConvertConfig:
    """The layout numbers of `spec` the raw transforms need.

    With `checkpoint`, the fused-expert layout (Qwen3-VL-MoE) is read from the checkpoint's tensor
    shapes: `gate_up_proj` [E, hidden, 2*moe_inter] is the released layout, [E, 2*moe_inter, hidden]
    the one transformers' save_pretrained writes (ambiguous when hidden == 2*moe_inter: released).
    """
    f = spec.model_config()
    return ConvertConfig(
        num_heads=f.num_heads,
        num_kv_heads=f.num_kv_heads,
        head_dim=f.head_dim,
        vocab_size=f.vocab_size,
        tied_embeddings=f.tied_embeddings,
        vision_heads=f.vision_heads,
        vision_head_dim=f.vision_hidden // f.vision_heads if f.vision_heads else 0,
        num_experts=f.num_experts,
        fused_experts_layout=_fused_layout(checkpoint, f.hidden_size) if checkpoint else "released",
    )


def _fused_layout(checkpoint: Path, hidden: int) -> str:
    from safetensors import safe_open

    for f in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118  (safe_open has no __iter__)
                if name.endswith(".mlp.experts.gate_up_proj"):
                    shape = st.get_slice(name).get_shape()
                    return "released" if shape[1] == hidden else "transformers"
    return "released"


def iter_raw(
    model: TrainerModel,
    layout: RankLayout,
    config: ConvertConfig,
    phases: dict[str, float],
    table: FamilyTable | None = None,
    buffers: GatherBuffers | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's named HF tensors via the family's raw table (see module doc), produced as the export
    runs: each parameter's collectives run when the consumer asks for the tensors after it (every rank of a
    group must consume its export to the end). Seconds are added to `phases` ("gather", "convert") as it
    runs.

    `table` defaults to the raw table of the model's family (`ModelFamily.raw`, looked up per call).
    `buffers`: where the gathers write, kept from one export to the next (`trainer.params.GatherBuffers`:
    the tensors produced are valid until this rank's next export with the same buffers); None: new memory.

    Dense parameters: the TP ranks gather each one to their group's first rank (`tp_gather` / `tp_shards`
    with `to_first`: on a host the others only send their shard); the stage leader (TP 0, DP 0) combines the
    shards, converts and owns them. Expert parameters: the expert-TP
    ranks all-gather each local expert; then, for a family without a post pass, each EP rank's expert
    leader (ETP 0, EDP 0) converts and owns its own experts (global names), which the sync hands to the
    sender point to point; for a family with one (`FamilyTable.ep_gathers_experts`), the EP ranks
    all-gather each expert (entry r = global expert r * E/EP + K) and the expert leader (EP 0, ETP 0,
    EDP 0) converts and owns every expert of its stage. A post pass over all of a rank's tensors (e.g.
    fusing experts) produces them only at the end.
    """
    table = table or model_family(model.model_type).raw
    groups = gather_groups(layout)
    local_experts = config.num_experts // layout.ep if config.num_experts else 0
    held: NamedTensors = []  # a post-pass's input
    phases.setdefault("gather", 0.0)
    phases.setdefault("convert", 0.0)
    for name, p in iter_global_params(model.chunks, layout.ep_rank, local_experts):
        t0 = time.perf_counter()
        if is_expert_param(name):
            full = tp_gather(p, groups.etp, layout.etp, buffers, name)
            if not table.ep_gathers_experts:  # this EP rank's own experts, handed off by the sync
                full_tensors, mine = [(name, full)], layout.leads_its_experts
            else:
                per_rank = ep_gather(full, groups.ep, layout.ep, buffers, name)
                k = expert_id(name) - layout.ep_rank * local_experts
                full_tensors = [(with_expert_id(name, r * local_experts + k), t) for r, t in enumerate(per_rank)]
                mine = layout.is_expert_leader
        elif layout.is_stage_leader:
            full_tensors, mine = [(name, tp_gather(p, groups.tp, layout.tp, buffers, name, to_first=True))], True
        else:  # its shard goes to its TP group's first rank; nothing to combine here
            tp_shards(p, groups.tp, layout.tp, buffers)
            full_tensors, mine = [], False
        t1 = time.perf_counter()
        phases["gather"] += t1 - t0
        if mine:
            out = [pair for n, t in full_tensors for pair in convert(n, t, table.rules, config)]
            phases["convert"] += time.perf_counter() - t1
            if table.post is not None:
                held.extend(out)
            else:
                yield from out
    if table.post is not None and held:
        t0 = time.perf_counter()
        held = table.post(held, config)
        phases["convert"] += time.perf_counter() - t0
        yield from held


def export_raw(
    model: TrainerModel, layout: RankLayout, config: ConvertConfig, table: FamilyTable | None = None
) -> tuple[NamedTensors, dict[str, float]]:
    """`iter_raw` run to the end: this rank's named HF tensors and phase seconds."""
    phases: dict[str, float] = {}
    return list(iter_raw(model, layout, config, phases, table)), phases


@dataclass
class Export:
    """One export on one rank: the (HF name, tensor) pairs it owns, phase seconds, and the export mode
    that actually ran. `tensors` may be produced as it is consumed (`iter_raw`, `iter_bridge`): every
    rank consumes it to the end, once; `phases` is complete after that."""

    tensors: Iterable[tuple[str, torch.Tensor]]
    phases: dict[str, float]
    export_mode: str


def export(
    export_mode: str,
    model: TrainerModel,
    layout: RankLayout,
    config: ConvertConfig,
    buffers: GatherBuffers | None = None,
) -> Export:
    """Dispatch on `export_mode` ("raw" | "bridge"); the tensors are produced as they are consumed. `buffers`:
    the raw export's gather buffers, kept between exports (`iter_raw`); the bridge export allocates its own.

    Raises:
        ValueError: an unknown export mode.
    """
    phases: dict[str, float] = {"gather": 0.0, "convert": 0.0}
    if export_mode == "raw":
        return Export(iter_raw(model, layout, config, phases, buffers=buffers), phases, export_mode="raw")
    if export_mode == "bridge":
        return Export(iter_bridge(model, layout, phases), phases, export_mode="bridge")
    raise ValueError(f"unknown export mode {export_mode!r}; use one of {MODES}")

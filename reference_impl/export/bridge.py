"""The bridge export mode: Megatron-Bridge's `export_hf_weights`, run on each PP stage for that stage's
parameters only.

Megatron-Bridge 0.6.2 exports the whole model on every rank: `build_conversion_tasks` lists every
parameter of every PP stage, and each mapping's `megatron_to_hf` first calls
`MegatronParamMapping.broadcast_from_pp_rank`, which all-gathers the tensor's spec over the PP group
(`all_gather_object`, per tensor, cached only on the mapping instance, and the mappings are rebuilt on
every call) and then broadcasts the tensor from its stage to every stage
(`megatron/bridge/models/conversion/param_mapping.py`). Every stage thus receives the whole model,
although only the sender uses it, and every tensor costs two PP collectives.

Here, with the library's own API:
1. `AutoBridge.get_conversion_tasks(model)` once per model (its docstring: pre-built tasks for
   `export_hf_weights(conversion_tasks=...)`);
2. keep the tasks whose parameter lives on this stage (`task.param_weight is not None`), and of a
   parameter held by several stages only the lowest stage's (the rule `broadcast_from_pp_rank` uses to
   pick its source), learned by one `all_gather_object` of owned names over the PP group;
3. hand those tasks' mappings a process-group collection whose PP group is this rank's own single-rank
   group (`MegatronParamMapping.set_process_groups_from_pg_collection`, the library's hook for
   caller-supplied groups), so `broadcast_from_pp_rank` takes its PP-size-1 fast path; the TP group
   stays Megatron's, so the library still gathers TP shards inside the stage;
4. at EP > 1, where the family's HF checkpoint names each expert apart (no task with
   `is_grouped_export`), hand the routed-expert tasks a single-rank EP group too, so
   `gather_from_ep_ranks` takes its EP-size-1 fast path and returns this rank's own experts under
   their global names (the tasks were built with Megatron's EP rank); the library otherwise all-gathers
   every expert weight over EP, one collective per weight, gate and up apart, into every EP rank.
   Stacked experts (`is_grouped_export`: the library stacks all E experts of a layer, counting them
   with Megatron's global EP size) keep the library's EP gather;
5. `export_hf_weights(model, cpu=..., conversion_tasks=tasks, merge_adapter_weights=False)` on every
   rank of the stage (no LoRA adapters here; merging them would all-gather adapter facts over PP on
   every call), once for the stage's shared tasks and once for this rank's own experts. Tensors stay
   where the model lives (`cpu` is true only without CUDA), as the raw mode's do: the hand-off below
   sends them over the default group, NCCL on GPU, which takes device tensors only.

Each stage's leader (TP 0, DP 0) owns what its shared tasks yield, each EP rank's expert leader (ETP 0,
EDP 0) its own experts; the sync loop's point-to-point hand-off (`transport.sync`) carries every other
owner's tensors to the sender, as for the raw mode, which hands off per-expert families' experts the
same way (`FamilyTable.ep_gathers_experts`). Names, layouts and values still come from Megatron-Bridge
alone: this module shares no code with the raw converter (`models.raw_rules`, `trainer.params`), so the
two modes stay independent export paths.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reference_impl.trainer.model import TrainerModel
from reference_impl.trainer.parallel import RankLayout

NamedTensors = list[tuple[str, torch.Tensor]]


def _own_group() -> dist.ProcessGroup:
    """This rank's single-rank process group. Collective: every rank of the world calls it together
    (`new_subgroups` makes one group per rank)."""
    group, _ = dist.new_subgroups(group_size=1)
    return group


def lowest_stage(per_stage: list[list[str]]) -> dict[str, int]:
    """Name -> the lowest PP stage whose list holds it (`per_stage[s]`: the global Megatron names stage
    `s` holds). The source rule of Megatron-Bridge's `broadcast_from_pp_rank` for a parameter several
    stages hold (tied embeddings, MTP)."""
    first: dict[str, int] = {}
    for stage, names in enumerate(per_stage):
        for n in names:
            first.setdefault(n, stage)
    return first


def _first_owner(owned: list[str], pp_group: dist.ProcessGroup, pp: int) -> dict[str, int]:
    """`lowest_stage` of every stage's `owned` names. Collective over `pp_group`."""
    per_stage: list[list[str] | None] = [None] * pp
    dist.all_gather_object(per_stage, owned, group=pp_group)
    return lowest_stage([names or [] for names in per_stage])


@dataclass(frozen=True)
class StageTasks:
    """The conversion tasks this rank runs, in two exports: `shared`, whose tensors the stage leader
    keeps (dense parameters, and routed experts the library gathers over EP), and `own_experts`, this EP
    rank's routed experts under a single-rank EP group, whose tensors this EP rank's expert leader keeps
    (empty unless EP > 1 and the family's HF experts are per-expert tensors)."""

    shared: list[Any]
    own_experts: list[Any]


def stage_tasks(model: TrainerModel, layout: RankLayout) -> StageTasks:
    """This stage's Megatron-Bridge `WeightConversionTask`s (steps 1-4 of the module doc), built on the
    first call for `model` and kept in `model.export_cache` (it lives and dies with the model).

    Collective on first use: every trainer rank must call it together (the PP all-gather inside
    `get_conversion_tasks`, one `all_gather_object` of owned names at PP > 1, one group per rank at PP > 1
    or EP > 1). Tasks hold references to the parameters, which the trainer's step updates in place, so
    later exports read the current values; a trainer that reallocates its parameters (offload and reload)
    must drop `model.export_cache` first. No task keeps PP-collective state between syncs: with a
    single-rank PP group the mappings' spec and object caches (`_tensor_spec_output_cache`,
    `_broadcast_obj_cache`) are never filled.
    """
    cached = model.export_cache.get("bridge_stage_tasks")
    if cached is not None:
        return cached
    from megatron.core.process_groups_config import ProcessGroupCollection

    tasks = [t for t in model.bridge.get_conversion_tasks(model.chunks) if t is not None]
    # Every stage's tasks are listed on every rank, so every rank decides alike.
    stacked = any(getattr(t.mapping, "is_grouped_export", False) for t in tasks)
    own = _own_group() if layout.pp > 1 or layout.ep > 1 else None
    single = ProcessGroupCollection()
    if layout.pp > 1:
        from megatron.core import parallel_state as ps

        local = [t for t in tasks if t.param_weight is not None]
        first = _first_owner([t.global_param_name for t in local], ps.get_pipeline_model_parallel_group(), layout.pp)
        tasks = [t for t in local if first[t.global_param_name] == layout.pp_rank]
        single.pp = own
        for t in tasks:
            t.mapping.set_process_groups_from_pg_collection(single)
    own_experts: list[Any] = []
    if layout.ep > 1 and not stacked:
        own_experts = [t for t in tasks if t.mapping.is_expert]
        tasks = [t for t in tasks if not t.mapping.is_expert]
        single.ep = own
        for t in own_experts:
            t.mapping.set_process_groups_from_pg_collection(single)
    result = StageTasks(shared=tasks, own_experts=own_experts)
    model.export_cache["bridge_stage_tasks"] = result
    return result


def iter_bridge(
    model: TrainerModel, layout: RankLayout, phases: dict[str, float]
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's named HF tensors via Megatron-Bridge, produced as the library's export yields them
    (every rank must consume each export to its end); seconds are added to `phases` as it runs.

    Every rank of a stage runs the library's export of `StageTasks.shared` (it gathers TP shards, and
    stacked experts over EP, over Megatron's groups), whose pairs the stage leader keeps; then, where
    there are any, the export of `StageTasks.own_experts` (TP shards of an expert gathered over the
    expert-TP group only), whose pairs each EP rank's expert leader (ETP 0, EDP 0) keeps. Pairs come in
    the library's order; a rank that keeps neither produces none. Gather and convert are one library
    call: the time spent inside it is recorded as `convert`, `gather` stays 0.
    """
    phases.setdefault("gather", 0.0)
    phases.setdefault("convert", 0.0)
    t0 = time.perf_counter()
    tasks = stage_tasks(model, layout)
    on_host = not torch.cuda.is_available()
    exports = [(tasks.shared, layout.is_stage_leader)]
    if tasks.own_experts:
        exports.append((tasks.own_experts, layout.leads_its_experts))
    for conversion_tasks, keep in exports:
        produced = model.bridge.export_hf_weights(
            model.chunks,
            cpu=on_host,
            show_progress=False,
            conversion_tasks=conversion_tasks,
            merge_adapter_weights=False,
        )
        while True:
            pair = next(produced, None)
            if pair is None:
                break
            name, tensor = pair
            if keep:
                tensor = tensor.detach().contiguous()
            phases["convert"] += time.perf_counter() - t0
            if keep:
                yield name, tensor
            t0 = time.perf_counter()
    phases["convert"] += time.perf_counter() - t0


def export_bridge(model: TrainerModel, layout: RankLayout) -> tuple[NamedTensors, dict[str, float]]:
    """`iter_bridge` run to the end: this rank's named HF tensors and phase seconds."""
    phases: dict[str, float] = {}
    return list(iter_bridge(model, layout, phases)), phases

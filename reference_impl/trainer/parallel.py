"""torch.distributed and Megatron parallel state for one trainer rank.

The default process group (gloo on CPU, NCCL when CUDA is present) is created once per process and
kept across scenarios of the same world size; Megatron's model-parallel state (TP, PP) is created per
scenario and destroyed after it, so trainer processes can be reused.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference_impl.trainer.layout import world_size_for


@dataclass(frozen=True)
class RankLayout:
    """Where this rank sits: global rank, world size and its TP/PP/DP and expert (EP/ETP/EDP) coordinates."""

    rank: int
    world_size: int
    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int = 0
    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    edp_rank: int = 0

    @property
    def is_stage_leader(self) -> bool:
        """TP rank 0 and DP rank 0 of its PP stage: the rank that owns the stage's gathered dense tensors."""
        return self.tp_rank == 0 and self.dp_rank == 0

    @property
    def leads_its_experts(self) -> bool:
        """Expert-TP rank 0 and expert-DP rank 0 of its EP rank: owns that EP rank's own gathered experts
        where the export hands experts off rather than all-gathering them over EP."""
        return self.etp_rank == 0 and self.edp_rank == 0

    @property
    def is_expert_leader(self) -> bool:
        """EP rank 0, expert-TP rank 0 and expert-DP rank 0 of its stage: owns the stage's gathered experts."""
        return self.ep_rank == 0 and self.leads_its_experts


@dataclass(frozen=True)
class GatherGroups:
    """The groups an export all-gathers a rank's parameters over: TP (dense parameters), expert-TP then EP
    (routed experts); None for a group of one rank (nothing to gather there)."""

    tp: dist.ProcessGroup | None
    etp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None


def gather_groups(layout: RankLayout) -> GatherGroups:
    """This rank's `GatherGroups` from Megatron's parallel state (`init_model_parallel` must have run)."""
    from megatron.core import parallel_state as ps

    return GatherGroups(
        tp=ps.get_tensor_model_parallel_group() if layout.tp > 1 else None,
        etp=ps.get_expert_tensor_parallel_group() if layout.etp > 1 else None,
        ep=ps.get_expert_model_parallel_group() if layout.ep > 1 else None,
    )


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 600) -> None:
    """Create the default process group once (gloo on CPU, NCCL with CUDA). Idempotent."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"process already in a world of {dist.get_world_size()} as rank {dist.get_rank()}, "
                f"asked for rank {rank} of {world_size}"
            )
        return
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def init_model_parallel(tp: int, pp: int, ep: int = 1, etp: int = 1) -> RankLayout:
    """(Re)create Megatron's parallel state for TP x PP with EP x ETP experts on the current world.

    Raises:
        ValueError: the world size is not `world_size_for(tp, pp, ep, etp)`.
    """
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world != world_size_for(tp, pp, ep, etp):
        raise ValueError(
            f"TP {tp} x PP {pp} with EP {ep} x ETP {etp} needs {world_size_for(tp, pp, ep, etp)} ranks, "
            f"but the trainer world has {world}"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    return RankLayout(
        rank=dist.get_rank(),
        world_size=world,
        tp=tp,
        pp=pp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep=ep,
        etp=etp,
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
    )


def destroy_model_parallel() -> None:
    """Tear down Megatron's parallel state and destroy every process group it made (the default group
    stays). megatron-core's own `destroy_model_parallel` only forgets its groups; each gloo group keeps
    its connection threads, ~60 threads per rank per scenario, so reused processes would pile them up."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        default = dist.group.WORLD
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not default:
                dist.destroy_process_group(group)

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


@dataclass(frozen=True)
class RankLayout:
    """Where this rank sits: global rank, world size and its TP/PP coordinates."""

    rank: int
    world_size: int
    tp: int
    pp: int
    tp_rank: int
    pp_rank: int

    @property
    def is_stage_leader(self) -> bool:
        """TP rank 0 of its PP stage: the rank that owns the stage's gathered tensors (raw mode)."""
        return self.tp_rank == 0


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


def init_model_parallel(tp: int, pp: int, ep: int = 1) -> RankLayout:
    """(Re)create Megatron's parallel state for TP x PP (x EP) on the current world.

    Raises:
        ValueError: tp * pp does not equal the world size.
    """
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if tp * pp != world:
        raise ValueError(f"TP {tp} x PP {pp} = {tp * pp} ranks, but the trainer world has {world}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    return RankLayout(
        rank=dist.get_rank(),
        world_size=world,
        tp=tp,
        pp=pp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
    )


def destroy_model_parallel() -> None:
    """Tear down Megatron's parallel state (the default group stays)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()

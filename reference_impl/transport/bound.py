"""The same-run bound of a sync: the bare cost of moving its own bytes over its own links.

Measured after a scenario's syncs, in the same processes, on the same groups and with the same sizes
as the last sync, with nothing of the reference path (no conversion, packing, HTTP per chunk, checksum
or load):

- gather (every trainer rank, collectively): per sharded parameter, the bytes the export moves for it
  over the group it gathers it on (TP for dense parameters, to the group's first rank; expert-TP for
  routed experts, then EP where the family's export gathers experts over EP,
  `FamilyTable.ep_gathers_experts`, to every rank of the group: the shards of `export.stream.export_raw`,
  the same for both export modes), sent and received point to point into buffers allocated beforehand
  on a host (one bare `all_gather_single` on a GPU, as the export); then the bytes each non-sender owner
  holds in the plan, sent point to point to the sender in plan order (the hand-off of `transport.sync`).
- wire (the sender): non-colocate, one bare broadcast of each chunk's size over the transfer group the
  channel uses (the engines take them in POST /transfer_probe, `engine/embedded/server.py`); colocate on
  CPU, one copy of each chunk's size into the channel's own shared-memory segment. vLLM and the CUDA
  channels have no probe: no wire bound (None).

`bound_s = gather_s + wire_s` (the same steps one after the other, as the reference path takes them); the
best of `repeats` measurements of each part after an untimed warm-up (`worker.measure_bound`). Seconds from
`time.perf_counter`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference_impl.trainer.model import TrainerModel
from reference_impl.trainer.parallel import RankLayout, gather_groups
from reference_impl.trainer.params import is_expert_param, iter_global_params
from reference_impl.transport.client import EngineClient
from reference_impl.transport.plan import Chunk
from reference_impl.transport.replicas import ReplicaClient, engines_of
from reference_impl.transport.sync import SENDER, Channel

# What the bound measures, as a number a run writes into env.json (`harness.env`): two runs whose bounds
# measured other steps cannot be compared by efficiency or by their bounds (`harness.report`). Raised when
# the steps change: 1, gloo's all-gather of every sharded parameter to every rank of its group; 2, on a
# host the bytes the export moves point to point, a dense parameter only to its TP group's first rank.
BOUND_VERSION = 2


@dataclass(frozen=True)
class GatherStep:
    """One bare gather: this rank's contribution in bytes, over the group of `size` ranks; `to_first`: only
    the group's first rank receives (`trainer.params.tp_gather`'s `to_first`), else every rank does."""

    nbytes: int
    group: dist.ProcessGroup | None
    size: int
    to_first: bool = False


def gather_steps(
    model: TrainerModel, layout: RankLayout, num_experts: int, ep_gathers_experts: bool
) -> list[GatherStep]:
    """The gathers the export runs on this rank, in its order: per TP-sharded dense parameter one over
    the TP group to its first rank (shard bytes); per routed expert parameter one over the expert-TP group
    when it is sharded there, then, if `ep_gathers_experts`, one over the EP group (the expert's full
    bytes; otherwise each EP rank's experts reach the sender by the hand-off), both to every rank of the
    group. Replicated parameters gather nothing. Every rank of a group lists the same steps in the same
    order (the export's collective schedule)."""
    groups = gather_groups(layout)
    local_experts = num_experts // layout.ep if num_experts else 0
    steps: list[GatherStep] = []
    for name, p in iter_global_params(model.chunks, layout.ep_rank, local_experts):
        nbytes = p.numel() * p.element_size()
        sharded = bool(getattr(p, "tensor_model_parallel", False))
        if is_expert_param(name):
            if sharded and layout.etp > 1:
                steps.append(GatherStep(nbytes, groups.etp, layout.etp))
                nbytes *= layout.etp
            if layout.ep > 1 and ep_gathers_experts:
                steps.append(GatherStep(nbytes, groups.ep, layout.ep))
        elif sharded and layout.tp > 1:
            steps.append(GatherStep(nbytes, groups.tp, layout.tp, to_first=True))
    return steps


def _bare_gathers(steps: Sequence[GatherStep], on_gpu: bool) -> None:
    if not steps:
        return
    device = torch.cuda.current_device() if on_gpu else "cpu"
    src = torch.empty(max(s.nbytes for s in steps), dtype=torch.uint8, device=device)
    out = torch.empty(max(s.nbytes * s.size for s in steps), dtype=torch.uint8, device=device)
    for s in steps:  # what the export moves (`trainer.params`), into one buffer
        if on_gpu:
            dist.all_gather_single(out[: s.nbytes * s.size], src[: s.nbytes], group=s.group)
            continue
        me, parts = dist.get_rank(s.group), out[: s.nbytes * s.size].view(s.size, s.nbytes)
        ops = [
            dist.P2POp(op, buf, group=s.group, group_peer=peer)
            for peer in range(s.size)
            if peer != me
            for op, buf, moves in (
                (dist.isend, src[: s.nbytes], not s.to_first or peer == 0),
                (dist.irecv, parts[peer], not s.to_first or me == 0),
            )
            if moves
        ]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()


def _bare_hand_off(plan: Sequence[Chunk], rank: int) -> None:
    metas = [m for chunk in plan for m in chunk.tensors if m.owner != SENDER]
    if not metas or (rank != SENDER and not any(m.owner == rank for m in metas)):
        return
    buffer = torch.empty(max(m.nbytes for m in metas), dtype=torch.uint8)
    for m in metas:
        if rank == SENDER:
            dist.recv(buffer[: m.nbytes], src=m.owner)
        elif m.owner == rank:
            dist.send(buffer[: m.nbytes], dst=SENDER)


def gather_bound(
    model: TrainerModel,
    layout: RankLayout,
    num_experts: int,
    plan: Sequence[Chunk],
    rank: int,
    world_size: int,
    ep_gathers_experts: bool,
) -> float:
    """Collective on every trainer rank: seconds of the bare gather of one sync (module doc), from a barrier
    of every rank to this rank's last step (on the sender: the last hand-off received).
    `ep_gathers_experts`: as for `gather_steps`.

    Raises:
        RuntimeError: from torch.distributed when a rank does not take part.
    """
    steps = gather_steps(model, layout, num_experts, ep_gathers_experts)
    if world_size > 1:
        dist.barrier()
    t0 = time.perf_counter()
    _bare_gathers(steps, on_gpu=dist.get_backend() == "nccl")  # the default group: NCCL where CUDA is
    _bare_hand_off(plan, rank)
    return time.perf_counter() - t0


def _broadcast_bound(group: object, client: EngineClient | ReplicaClient, sizes: Sequence[int]) -> float:
    """Bare broadcasts of `sizes` over `group` (a `wsh_vllm_plugin.group.TransferGroup`) while every engine
    takes them."""
    engines = engines_of(client)
    buffer = torch.empty(max(sizes), dtype=torch.uint8, device=group.device)  # type: ignore[attr-defined]
    with ThreadPoolExecutor(max_workers=len(engines), thread_name_prefix="transfer-probe") as pool:
        answers = [pool.submit(c.transfer_probe, [1, *sizes]) for c in engines]
        group.broadcast(buffer[:1], SENDER)  # type: ignore[attr-defined]  (every engine is in: start the clock)
        t0 = time.perf_counter()
        for n in sizes:
            group.broadcast(buffer[:n], SENDER)  # type: ignore[attr-defined]
        elapsed = time.perf_counter() - t0
        for answer in answers:
            answer.result()
    return elapsed


def _copy_bound(channel: object, sizes: Sequence[int]) -> float:
    """Copies of `sizes` from a buffer of the sender's into the channel's shared-memory segment."""
    segment = channel.buffer  # type: ignore[attr-defined]  (colocate.SharedMemoryChannel's SharedMemoryBuffer)
    segment.grow(max(sizes))
    source = torch.empty(max(sizes), dtype=torch.uint8)
    t0 = time.perf_counter()
    for n in sizes:
        segment.tensor(n).copy_(source[:n])
    return time.perf_counter() - t0


def wire_bound(channel: Channel, client: EngineClient | ReplicaClient, sizes: Sequence[int]) -> float | None:
    """Sender only: seconds of the bare wire of one sync whose chunks are `sizes` bytes (module doc); None
    when the channel has no bare counterpart here (vLLM's packed channels, the CUDA channels) or there is
    nothing to send.

    Raises:
        EngineRejected: an engine refused /transfer_probe.
        RuntimeError: a broadcast timed out (gloo).
    """
    from reference_impl.transport.colocate import SharedMemoryChannel
    from reference_impl.transport.noncolocate import BroadcastChannel

    if not sizes:
        return None
    if type(channel) is BroadcastChannel:
        return _broadcast_bound(channel.group, client, sizes)
    if type(channel) is SharedMemoryChannel:
        return _copy_bound(channel, sizes)
    return None

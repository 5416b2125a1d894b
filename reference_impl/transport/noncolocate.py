"""Non-colocate sync: chunks broadcast from the trainer's sender (global rank 0) to the engine.

One sync, on every trainer rank, after its export produced the tensors it owns:
1. all ranks exchange their tensor metadata (one `all_gather_object`) and compute the same chunk plan;
2. the sender opens one session (`/start_weight_update`);
3. per chunk: owners other than the sender hand their tensors to it point-to-point (each rank sends
   only what it owns in that chunk, in plan order; a rank that owns nothing sends nothing: there is
   no per-chunk collective among trainer ranks, so stages with different chunk counts cannot
   deadlock); the sender packs the chunk, posts `/update_weights` in a thread and broadcasts the
   packed bytes over the transfer group at the same time, then waits for the engine's answer;
4. the sender closes the session (`/finish_weight_update`).
A rejected chunk is recorded and the loop goes on (every rank keeps the same schedule).
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from reference_impl.checksum import tensor_checksum
from reference_impl.transport.client import EngineRejected, UpdateClient
from reference_impl.transport.plan import Chunk, TensorMeta, plan_chunks
from reference_impl.transport.wire import TransferGroup, dtype_from_name, dtype_name, pack

SENDER = 0


@dataclass
class SyncResult:
    """What one rank observed in one sync (the runner merges ranks into a `SyncRecord`)."""

    rank: int
    phases: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    chunks: list[dict[str, Any]] = field(default_factory=list)  # sender only
    names_sent: list[str] = field(default_factory=list)
    names_accepted: list[str] = field(default_factory=list)
    names_rejected: dict[str, str] = field(default_factory=dict)
    sent_checksums: dict[str, str] = field(default_factory=dict)
    engine_update_counts: dict[str, int] = field(default_factory=dict)
    finished: bool = False
    bytes: int = 0


def gather_metadata(owned: list[tuple[str, torch.Tensor]], rank: int, world_size: int) -> list[TensorMeta]:
    """Every rank's owned tensors as `TensorMeta`, ordered by owner rank then export order."""
    mine = [TensorMeta(n, tuple(t.shape), dtype_name(t.dtype), t.numel() * t.element_size(), rank) for n, t in owned]
    if world_size == 1:
        return mine
    everyone: list[list[TensorMeta] | None] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return [m for per_rank in everyone for m in (per_rank or [])]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def send_owned(plan: list[Chunk], owned: dict[str, torch.Tensor], rank: int) -> None:
    """Non-sender ranks: hand this rank's tensors of each chunk to the sender, in plan order."""
    for chunk in plan:
        for meta in chunk.tensors:
            if meta.owner == rank:
                dist.send(_as_bytes(owned[meta.name]), dst=SENDER)


def collect_chunk(chunk: Chunk, owned: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Sender: the chunk's tensors, local ones as they are, others received from their owners."""
    out = []
    for meta in chunk.tensors:
        if meta.owner == SENDER:
            out.append(owned[meta.name])
        else:
            buf = torch.empty(meta.nbytes, dtype=torch.uint8)
            dist.recv(buf, src=meta.owner)
            out.append(buf.view(dtype_from_name(meta.dtype)).reshape(meta.shape))
    return out


def run_sync(
    *,
    owned: list[tuple[str, torch.Tensor]],
    rank: int,
    world_size: int,
    bucket_bytes: int,
    sync_index: int,
    weight_version: int,
    client: UpdateClient | None,
    group: TransferGroup | None,
) -> tuple[SyncResult, list[Chunk]]:
    """One sync's transfer on this rank (see module doc). The sender passes `client` and `group`.

    Returns this rank's observations and the chunk plan. Seconds in `phases`: `gather` here is the
    sender's wait for other ranks' tensors; `transfer` is the chunk loop's wall time less that wait,
    less checksum time and less the engine's reported load time (`load`).
    """
    res = SyncResult(rank=rank)
    metas = gather_metadata(owned, rank, world_size)
    plan = plan_chunks(metas, bucket_bytes)
    by_name = dict(owned)
    if rank != SENDER:
        send_owned(plan, by_name, rank)
        return res, plan
    assert client is not None and group is not None, "the sender needs the engine client and transfer group"
    t_recv = t_sum = t_load = 0.0
    t_loop0 = time.perf_counter()
    # A rejected start is recorded in client.calls; the chunk schedule still runs so every rank stays in step.
    with contextlib.suppress(EngineRejected):
        client.start(sync_index, weight_version)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="update-http")
    try:
        for chunk in plan:
            t0 = time.perf_counter()
            tensors = collect_chunk(chunk, by_name)
            t1 = time.perf_counter()
            payload = pack(tensors)
            info = {
                "names": [m.name for m in chunk.tensors],
                "dtype_names": [m.dtype for m in chunk.tensors],
                "shapes": [list(m.shape) for m in chunk.tensors],
                "packed": True,
                "src": SENDER,
                "chunk_index": chunk.index,
            }
            fut = pool.submit(client.update, info, sync_index, chunk.index)
            group.broadcast_chunk(payload, src=SENDER)
            entry = {"index": chunk.index, "names": info["names"], "bytes": chunk.nbytes, "sent": True}
            try:
                answer = fut.result()
                entry["received"] = True
                t_load += float(answer.get("load_s", 0.0))
                res.names_accepted.extend(info["names"])
            except EngineRejected as e:
                entry["received"] = False
                rejected = e.rejected_names() or {n: f"chunk rejected: {e}" for n in info["names"]}
                res.names_rejected.update(rejected)
            res.chunks.append(entry)
            res.names_sent.extend(info["names"])
            res.bytes += chunk.nbytes
            t2 = time.perf_counter()
            for m, t in zip(chunk.tensors, tensors, strict=True):
                res.sent_checksums[m.name] = tensor_checksum(t)
            t_sum += time.perf_counter() - t2
            t_recv += t1 - t0
        try:
            answer = client.finish(sync_index, weight_version)
            res.finished = True
            res.engine_update_counts = {k: int(v) for k, v in answer.get("update_counts", {}).items()}
        except EngineRejected:
            pass  # recorded in client.calls
    finally:
        pool.shutdown(wait=True)
    loop = time.perf_counter() - t_loop0 - t_sum
    res.phases = {"gather": t_recv, "transfer": max(loop - t_recv - t_load, 0.0), "load": t_load}
    res.total_s = loop
    return res, plan

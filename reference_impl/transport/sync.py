"""One sync's chunk loop, the same for both placements; a channel says how a chunk's bytes travel.

On every trainer rank, after its export produced the tensors it owns:
1. all ranks exchange their tensor metadata (one `all_gather_object`) and compute the same chunk plan;
2. the sender (global rank 0) opens one session (`/start_weight_update`);
3. per chunk: owners other than the sender hand their tensors to it point to point (each rank sends
   only what it owns in that chunk, in plan order; a rank that owns nothing in a chunk sends nothing:
   there is no per-chunk collective among trainer ranks, so stages with different chunk counts cannot
   deadlock); the sender hands the chunk to the channel, which packs it, makes the engine take it
   (`/update_weights`) and returns the engine's answer;
4. the sender closes the session (`/finish_weight_update`).
A rejected chunk is recorded and the loop goes on (every rank keeps the same schedule). While the
engine holds no open session (its start was refused, or it ended the session when a chunk failed, as
vLLM does) the sender still collects each chunk from its owners but does not send it: nobody would
receive it, and a broadcast nobody receives hangs. Such chunks are recorded as not sent, with why.

Channels: `noncolocate.BroadcastChannel` (packed bytes broadcast over the transfer group while the
HTTP call is in flight), `colocate.SharedMemoryChannel` / `colocate.CudaIpcChannel` (packed bytes in a
buffer the engine maps by handle).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
from wsh_vllm_plugin.protocol import SENDER_RANK, UpdateInfo, dtype_from_name, dtype_name

from reference_impl.checksum import tensor_checksum
from reference_impl.transport.client import EngineClient, EngineRejected
from reference_impl.transport.observed import GENERIC_REJECTION, ChunkRecord, SyncReport, TensorLayout
from reference_impl.transport.plan import Chunk, TensorMeta, plan_chunks
from reference_impl.transport.progress import Progress

SENDER = SENDER_RANK


class Channel(Protocol):
    """How one chunk's bytes reach the engine (see module doc)."""

    backend: str  # init_info backend: "gloo" | "shm" | "cuda_ipc"

    def send(self, client: EngineClient, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
        """Pack `tensors`, make the engine take them with POST /update_weights `info` (a channel adds its
        handle with `dataclasses.replace`), return the engine's answer.

        Raises:
            EngineRejected: the engine answered non-200 (the chunk's bytes were still consumed).
        """
        ...

    def close(self) -> None:
        """Release buffers / groups."""
        ...


def gather_metadata(named: list[tuple[str, torch.Tensor]], rank: int, world_size: int) -> list[TensorMeta]:
    """Every rank's named tensors as `TensorMeta`, ordered by owner rank then export order."""
    mine = [TensorMeta(n, tuple(t.shape), dtype_name(t.dtype), t.numel() * t.element_size(), rank) for n, t in named]
    if world_size == 1:
        return mine
    everyone: list[list[TensorMeta] | None] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    return [m for per_rank in everyone for m in (per_rank or [])]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def hand_off(plan: list[Chunk], named: dict[str, torch.Tensor], rank: int) -> None:
    """Non-sender ranks: hand this rank's tensors of each chunk to the sender, in plan order."""
    for chunk in plan:
        for meta in chunk.tensors:
            if meta.owner == rank:
                dist.send(_as_bytes(named[meta.name]), dst=SENDER)


def collect(chunk: Chunk, named: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Sender: the chunk's tensors, local ones as they are, others received from their owners."""
    out = []
    for meta in chunk.tensors:
        if meta.owner == SENDER:
            out.append(named[meta.name])
        else:
            buf = torch.empty(meta.nbytes, dtype=torch.uint8)
            dist.recv(buf, src=meta.owner)
            out.append(buf.view(dtype_from_name(meta.dtype)).reshape(meta.shape))
    return out


def send_chunk(channel: Channel, client: EngineClient, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
    """The sender hands one chunk to its channel and returns the engine's answer to it (a seam:
    `reference_impl.seams`).

    Raises:
        EngineRejected: the engine answered non-200.
    """
    return channel.send(client, tensors, info, sync)


def reset_engine_caches(client: EngineClient, sync: int) -> None:
    """After a finished update, what RL trainers do before the next rollouts: drop the engine's prefix
    cache and its vision-encoder cache (vLLM's /reset_prefix_cache and /reset_encoder_cache; vLLM 0.32's
    finish resets neither, and a stale encoder cache is a public bug: vllm-project/vllm#44910). A seam
    (`reference_impl.seams`).

    Raises:
        EngineRejected: the engine refused a reset.
    """
    client.reset_prefix_cache(sync)
    client.reset_encoder_cache(sync)


def update_info(chunk: Chunk) -> UpdateInfo:
    """The `update_info` of one chunk: names, dtype names and shapes in plan order, packed, from the
    sender, no handle (a colocate channel adds its own)."""
    return UpdateInfo(
        names=[m.name for m in chunk.tensors],
        dtype_names=[m.dtype for m in chunk.tensors],
        shapes=[list(m.shape) for m in chunk.tensors],
        packed=True,
        src=SENDER,
        chunk_index=chunk.index,
    )


def names_rejected(names: list[str], rejected: EngineRejected) -> dict[str, str]:
    """HF name -> the engine's reason, for the names of a chunk (`names`) that the engine's answer refused.

    The tensors the answer's rejections name; when they name none of the chunk's tensors (vLLM's 500 for a
    wrong shape, a refused session), every name of the chunk with the generic reason
    `GENERIC_REJECTION` + the exception's text, which says nothing about which name (if any) was wrong.
    """
    sent = set(names)
    named = {r.name: r.reason for r in rejected.rejections if r.name in sent}
    return named or {n: f"{GENERIC_REJECTION}{rejected}" for n in names}


def run_sync(
    *,
    named: list[tuple[str, torch.Tensor]],
    rank: int,
    world_size: int,
    chunk_bytes: int,
    sync_index: int,
    weight_version: int,
    client: EngineClient | None,
    channel: Channel | None,
    progress: Progress | None = None,
) -> tuple[SyncReport, list[Chunk]]:
    """One sync's transfer on this rank (see module doc). The sender passes `client` and `channel`.
    `progress` is told every phase this rank enters (what a watchdog reports when the rank hangs).

    Returns this rank's observations and the chunk plan. Seconds in
    `phases`: `gather` here is the sender's wait for other ranks' tensors; `transfer` is the chunk loop's
    wall time less that wait, less checksum time and less the engine's reported load time (`load`).
    """
    res = SyncReport(rank=rank)
    progress = progress or Progress(None)
    where = f"sync {sync_index}"
    progress.at(f"{where}: exchanging tensor metadata with every rank (all_gather_object)")
    metas = gather_metadata(named, rank, world_size)
    plan = plan_chunks(metas, chunk_bytes)
    by_name = dict(named)
    if rank != SENDER:
        progress.at(f"{where}: handing its tensors of {len(plan)} chunks to the sender point to point (gather)")
        hand_off(plan, by_name, rank)
        progress.at(f"{where}: handed every tensor it owns to the sender")
        return res, plan
    assert client is not None and channel is not None, "the sender needs the engine client and a channel"
    t_recv = t_sum = t_load = 0.0
    t_loop0 = time.perf_counter()
    # A rejected start is recorded in client.calls; the chunk schedule still runs so every rank stays in step.
    progress.at(f"{where}: /start_weight_update in flight")
    with contextlib.suppress(EngineRejected):
        client.start(sync_index, weight_version)
    for chunk in plan:
        t0 = time.perf_counter()
        progress.at(f"{where}: collecting chunk {chunk.index} of {len(plan)} from its owners (gather)")
        tensors = collect(chunk, by_name)
        t1 = time.perf_counter()
        info = update_info(chunk)
        entry = ChunkRecord(index=chunk.index, names=info.names, bytes=chunk.nbytes, sent=True)
        if not client.session_open:
            why = f"not sent: no open update session ({client.session_closed_by or 'unknown why'})"
            res.chunks.append(entry.model_copy(update={"sent": False, "note": why}))
            continue
        try:
            progress.at(f"{where}: chunk {chunk.index} of {len(plan)} on the wire: /update_weights in flight")
            answer = send_chunk(channel, client, tensors, info, sync_index)
            entry.received = True
            t_load += float(answer.get("load_s", 0.0))
            res.names_accepted.extend(info.names)
        except EngineRejected as e:
            res.names_rejected.update(names_rejected(info.names, e))
        res.chunks.append(entry)
        res.names_sent.extend(info.names)
        for n, shape, dtype in zip(info.names, info.shapes, info.dtype_names, strict=True):
            res.sent_layout[n] = TensorLayout(shape=list(shape), dtype=dtype)  # as declared to the engine
        res.bytes += chunk.nbytes
        t2 = time.perf_counter()
        for m, t in zip(chunk.tensors, tensors, strict=True):
            res.sent_checksums[m.name] = tensor_checksum(t)
        t_sum += time.perf_counter() - t2
        t_recv += t1 - t0
    try:
        if client.session_open:  # else the engine already ended it: nothing to finish (not finished)
            progress.at(f"{where}: /finish_weight_update in flight (load)")
            answer = client.finish(sync_index, weight_version)
            res.finished = True
            res.engine_update_counts = {k: int(v) for k, v in answer.get("update_counts", {}).items()}
            progress.at(f"{where}: resetting the engine's caches")
            reset_engine_caches(client, sync_index)
    except EngineRejected:
        pass  # recorded in client.calls
    loop = time.perf_counter() - t_loop0 - t_sum
    res.phases = {"gather": t_recv, "transfer": max(loop - t_recv - t_load, 0.0), "load": t_load}
    res.total_s = loop
    res.chunks_planned = len(plan)
    progress.at(f"{where}: finished")
    return res, plan

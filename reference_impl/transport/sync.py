"""One sync's chunk loop, the same for both placements; a channel says how a chunk's bytes travel.

On every trainer rank, while its export runs (`export.stream.export` produces tensors as they are consumed):
1. the sender (global rank 0) opens one session (`/start_weight_update`), then consumes its export and hands
   each chunk of its own tensors to its send thread as soon as the tensor after it was produced (the
   plan's greedy rule over the sender's tensors, which come first in the plan): gather and convert of the
   next chunks overlap with the wire of the earlier ones (up to `QUEUE_DEPTH` chunks unanswered: a sender
   holds a few chunks, never its stage); the send thread takes one chunk at a time, in plan order, so a
   channel's buffer is rewritten only after the engine acknowledged the chunk before;
2. all ranks exchange their tensor metadata (one `all_gather_object`) and compute the same chunk plan (the
   sender checks that it begins with the chunks it already queued);
3. per remaining chunk: owners other than the sender hand their tensors to it point to point (each rank
   sends only what it owns in that chunk, in plan order; a rank that owns nothing in a chunk sends nothing:
   there is no per-chunk collective among trainer ranks, so stages with different chunk counts cannot
   deadlock); the sender queues the chunk to its send thread, which hands it to the channel; the channel
   packs it, makes the engine take it (`/update_weights`) and returns the engine's answer;
4. once the last answer is in, the sender closes the session (`/finish_weight_update`).
Where the engine serves requests between chunks (vLLM), the sender pauses its generation before the
session and resumes it after (`generation_paused`).
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
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from wsh_vllm_plugin.protocol import SENDER_RANK, UpdateInfo, dtype_from_name, dtype_name

from reference_impl.checksum import tensor_checksum
from reference_impl.transport.client import EngineClient, EngineRejected, names_rejected
from reference_impl.transport.observed import ChunkRecord, SyncReport, TensorLayout
from reference_impl.transport.plan import Chunk, Greedy, TensorMeta, plan_chunks
from reference_impl.transport.progress import Progress

SENDER = SENDER_RANK
SEND_THREAD = "sync-send"  # the send thread's name prefix (its progress lines begin with it)
QUEUE_DEPTH = 2  # chunks the sender holds unanswered (one on the wire, one ready) before its export waits


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


def tensor_meta(name: str, t: torch.Tensor, rank: int) -> TensorMeta:
    """One exported tensor's entry in the chunk plan: its HF name, shape, vLLM dtype name, bytes
    (numel x element size) and owning trainer rank."""
    return TensorMeta(name, tuple(t.shape), dtype_name(t.dtype), t.numel() * t.element_size(), rank)


def gather_metadata(mine: list[TensorMeta], world_size: int) -> list[TensorMeta]:
    """Every rank's tensor metadata (`mine` is this rank's, in export order), ordered by owner rank then
    export order: one `all_gather_object` over the default group (none when `world_size` is 1)."""
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
    """Sender: the chunk's tensors, local ones as they are (taken out of `named`: the queued chunk then holds
    the only reference the sync keeps, until the engine answered it), others received from their owners."""
    out = []
    for meta in chunk.tensors:
        if meta.owner == SENDER:
            out.append(named.pop(meta.name))
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


def finish_update(client: EngineClient, sync: int, weight_version: int) -> Any:
    """Once every chunk of the sync was answered, the sender closes the update session
    (`/finish_weight_update`, which commits `weight_version`) and returns the engine's answer. A seam
    (`reference_impl.seams`).

    Raises:
        EngineRejected: the engine answered non-200.
    """
    return client.finish(sync, weight_version)


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


@dataclass
class _Sent:
    """One chunk the sender handed to its send thread: the tensors as collected (dropped once the engine
    answered and they were hashed), what went into the record, the engine's load seconds, the checksums
    of what was sent and when (perf_counter seconds) it was queued and hashed."""

    chunk: Chunk
    tensors: list[torch.Tensor]
    entry: ChunkRecord
    info: UpdateInfo
    queued_at: float = 0.0
    answered: bool = False
    rejected: EngineRejected | None = None
    load_s: float = 0.0
    wire_s: float = 0.0
    checksums: dict[str, str] = field(default_factory=dict)
    hashed: tuple[float, float] = (0.0, 0.0)  # (start, end) of the hashing, perf_counter seconds

    def hash_and_drop(self) -> None:
        """Checksum the tensors that went out (HF name -> `tensor_checksum`), then drop them: the sender
        holds a chunk's tensors only until the engine answered it, not until the sync's end."""
        t0 = time.perf_counter()
        self.checksums = {m.name: tensor_checksum(t) for m, t in zip(self.chunk.tensors, self.tensors, strict=True)}
        self.tensors = []
        self.hashed = (t0, time.perf_counter())


def hashing_delay(done: list[_Sent]) -> float:
    """Seconds the send thread's hashing held the sync up: for each chunk, the part of its hashing after
    the next chunk was queued (that chunk waited for it; hashing while the thread had nothing else to send
    delayed nothing), and all of the last chunk's (the finish waited for it). Subtracted from a sync's
    wall time, which thereby counts what the sync would take without the checksums."""
    delay = 0.0
    for sent, after in zip(done, [*done[1:], None], strict=False):  # `after` is None for the last
        start, end = sent.hashed
        if after is not None:
            start = max(start, after.queued_at)
        delay += max(0.0, end - start)
    return delay


class _SendThread:
    """The sender's send thread: chunks go to the channel one at a time, in the order they are queued,
    while the calling thread goes on exporting and collecting the next ones. One chunk is on the wire at
    a time, so a channel's one buffer (the packing buffer, the shared segment) is written again only
    after the engine acknowledged the chunk before (the 200 of its /update_weights)."""

    def __init__(self, channel: Channel, client: EngineClient, sync_index: int, progress: Progress) -> None:
        self.channel, self.client, self.sync_index, self.progress = channel, client, sync_index, progress
        self.planned: int | None = None  # the plan's chunk count, once every rank's metadata made the plan
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.pool = ThreadPoolExecutor(  # a CUDA channel's buffers on the caller's device, not the thread's default
            max_workers=1, thread_name_prefix=SEND_THREAD, initializer=_use_device, initargs=(device,)
        )
        self.queued: list[tuple[_Sent, Future[None]]] = []
        self.stopped: str | None = None  # why the chunks still queued are not sent

    def put(self, chunk: Chunk, tensors: list[torch.Tensor]) -> None:
        """Queue one collected chunk (`update_info` made now, in plan order); waits while `QUEUE_DEPTH` are out."""
        unanswered = [future for _, future in self.queued if not future.done()]
        if len(unanswered) >= QUEUE_DEPTH:
            wait(unanswered[: len(unanswered) - QUEUE_DEPTH + 1])
        info = update_info(chunk)
        sent = _Sent(
            chunk,
            tensors,
            ChunkRecord(
                index=chunk.index,
                names=info.names,
                owners=[m.owner for m in chunk.tensors],
                bytes=chunk.nbytes,
                sent=True,
            ),
            info,
            queued_at=time.perf_counter(),
        )
        self.queued.append((sent, self.pool.submit(self._send, sent)))

    def stop(self, why: str) -> None:
        """Send none of the chunks still queued (each is recorded as not sent, with `why`); the one on the
        wire finishes."""
        self.stopped = self.stopped or why

    def n_planned(self) -> str:
        """The chunk count for progress lines: the plan's, or while the plan is not made yet (the sender is still
        exporting) "at least" the chunks queued plus the one being filled. The caller sets `planned`: a closure
        over its plan that referred back to this object made a reference cycle, and every sync's thread,
        futures and chunk records waited for the cycle collector (about 80 KB a sync on qwen3-moe)."""
        return str(self.planned) if self.planned is not None else f"at least {len(self.queued) + 1}"

    def _send(self, sent: _Sent) -> None:
        where = f"sync {self.sync_index}"
        if self.stopped is not None or not self.client.session_open:
            why = self.stopped or f"no open update session ({self.client.session_closed_by or 'unknown why'})"
            sent.entry = sent.entry.model_copy(update={"sent": False, "note": f"not sent: {why}"})
            sent.tensors = []
            return
        t0 = time.perf_counter()
        try:
            self.progress.at(
                f"{where}: chunk {sent.chunk.index} of {self.n_planned()} on the wire: /update_weights in flight"
            )
            answer = send_chunk(self.channel, self.client, sent.tensors, sent.info, self.sync_index)
            sent.entry.received = sent.answered = True
            sent.load_s = float(answer.get("load_s", 0.0))
        except EngineRejected as e:
            sent.rejected = e.with_traceback(None)  # its traceback's frame holds `sent`: a reference cycle
        except BaseException as e:  # the channel broke (a broadcast timed out, ...): no later chunk can follow
            self.stop(f"the send of chunk {sent.chunk.index} raised {type(e).__name__}")
            sent.tensors = []  # the error's traceback keeps `sent` alive while it is handled: not its bytes
            raise
        sent.wire_s = time.perf_counter() - t0 - sent.load_s
        sent.hash_and_drop()  # what went out, taken or refused

    def drain(self) -> list[_Sent]:
        """Wait for every queued chunk; returns them in order. Re-raises what a send raised (other than the
        engine's refusal, which is in its `_Sent`). Once every send returned, the thread's progress line goes
        (one that raised keeps it: the phase it failed in)."""
        try:
            for _, future in self.queued:
                future.result()
        finally:
            self.pool.shutdown(wait=True)
        self.progress.ended(SEND_THREAD)
        return [sent for sent, _ in self.queued]


def _use_device(device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)


def streamed_by_sender(metas: list[TensorMeta], chunk_bytes: int) -> list[tuple[TensorMeta, ...]]:
    """The chunks the sender queues while it exports (`_stream_own_chunks`), from every rank's metadata: what
    every rank checks the plan's first chunks against."""
    greedy = Greedy(chunk_bytes)
    return [full for m in metas if m.owner == SENDER and (full := greedy.add(m)) is not None]


def _stream_own_chunks(
    named: Iterable[tuple[str, torch.Tensor]],
    chunk_bytes: int,
    rank: int,
    sender: _SendThread | None,
    progress: Progress,
    where: str,
) -> tuple[list[TensorMeta], dict[str, torch.Tensor], list[Chunk]]:
    """Consume this rank's export; on the sender, queue each chunk of its own tensors as soon as the export
    produced the tensor after it (`plan_chunks`' greedy rule on the sender's tensors, which come first in the
    plan: those chunks are the plan's first ones whatever the other ranks own). The sender's last, partial
    chunk waits for the plan (other owners' tensors may join it). Returns this rank's tensor metadata in
    export order, its tensors by HF name and the chunks queued."""
    own: list[TensorMeta] = []
    streamed: list[Chunk] = []
    greedy = Greedy(chunk_bytes)
    by_name: dict[str, torch.Tensor] = {}
    for name, t in named:
        meta = tensor_meta(name, t, rank)
        if sender is not None and (full := greedy.add(meta)) is not None:
            chunk = Chunk(len(streamed), full)
            sender.put(chunk, collect(chunk, by_name))
            queued = f"chunk {chunk.index} of at least {chunk.index + 2} queued"
            progress.at(f"{where}: {queued}; exporting the next (gather and convert)")
            streamed.append(chunk)
        own.append(meta)
        by_name[name] = t
    return own, by_name, streamed


def pause_generation(client: EngineClient, sync: int) -> None:
    """Before the update session opens, the sender pauses the engine's generation (`EngineClient.pause`:
    vLLM's /pause), so no request is scheduled on half-updated weights; `run_sync` resumes it once the
    update ended, however it ended. Only for engines that serve requests between chunks
    (`EngineClient.pauses_generation`): on vLLM 0.32 a completion scheduled mid-session killed the engine
    core, the layers not yet reloaded being on the meta device ("Cannot copy out of meta tensor"). A seam
    (`reference_impl.seams`).

    Raises:
        EngineRejected: the engine refused.
    """
    client.pause(sync)


@contextlib.contextmanager
def generation_paused(client: EngineClient | None, sync: int, progress: Progress) -> Iterator[list[float]]:
    """Around one sync on the sender: `pause_generation` before, `/resume` after, also after an exception;
    nothing for a client that does not pause (or no client: other ranks). Yields a one-item list that holds,
    once the block ended, the seconds the two calls took. A refused pause or resume is recorded in the
    client's calls and does not stop the sync."""
    took = [0.0]
    if client is None or not client.pauses_generation:
        yield took
        return
    t0 = time.perf_counter()
    progress.at(f"sync {sync}: /pause in flight (no request scheduled while the weights change)")
    with contextlib.suppress(EngineRejected):
        pause_generation(client, sync)
    took[0] += time.perf_counter() - t0
    try:
        yield took
    finally:
        t0 = time.perf_counter()
        progress.at(f"sync {sync}: /resume in flight")
        with contextlib.suppress(EngineRejected):
            client.resume(sync)
        took[0] += time.perf_counter() - t0


def run_sync(
    *, rank: int, sync_index: int, client: EngineClient | None, progress: Progress | None = None, **loop: Any
) -> tuple[SyncReport, list[Chunk]]:
    """`sync_loop` (`loop`: its other keyword arguments) inside `generation_paused` on the sender: the engine's
    generation is paused around the update where it serves between chunks, and that time counts in the
    report's `total_s`. Return and errors are `sync_loop`'s."""
    progress = progress or Progress(None)
    with generation_paused(client if rank == SENDER else None, sync_index, progress) as took:
        res, plan = sync_loop(rank=rank, sync_index=sync_index, client=client, progress=progress, **loop)
    res.total_s += took[0]
    return res, plan


def sync_loop(
    *,
    named: Iterable[tuple[str, torch.Tensor]],
    rank: int,
    world_size: int,
    chunk_bytes: int,
    sync_index: int,
    weight_version: int,
    client: EngineClient | None,
    channel: Channel | None,
    progress: Progress | None = None,
) -> tuple[SyncReport, list[Chunk]]:
    """One sync's transfer on this rank (see module doc). `named` is this rank's export, consumed here (an
    export that produces its tensors as it runs, `export.stream.export`, overlaps with the wire). The sender
    passes `client` and `channel`. `progress` is told every phase this rank enters (what a watchdog reports
    when the rank hangs).

    The sender opens the session first, then queues each chunk of its own tensors to its send thread as soon
    as the export produced it (pack, broadcast or handle, the engine's answer: one chunk at a time, in plan
    order), while the export goes on; with the plan of every rank's tensors, it checks that those chunks are
    the plan's first ones, collects and queues the rest, waits for the last answer and finishes.

    Returns this rank's observations and the chunk plan. Seconds in `phases`: `gather` here is the
    sender's wait for other ranks' tensors; `transfer` is the send thread's time per chunk less the
    engine's reported load time (`load`), summed; `total_s` is the wall time (overlapped phases counted once)
    less the time the checksums of what was sent held it up (`hashing_delay`).

    Raises:
        RuntimeError: the plan does not begin with the chunks streamed during the export (a planner that is
            not `plan_chunks`' greedy rule over owner-ordered tensors); raised on every rank, before any
            hand-off.
    """
    res = SyncReport(rank=rank)
    progress = progress or Progress(None)
    where = f"sync {sync_index}"
    t_loop0 = time.perf_counter()
    sender: _SendThread | None = None
    plan: list[Chunk] = []
    if rank == SENDER:
        assert client is not None and channel is not None, "the sender needs the engine client and a channel"
        sender = _SendThread(channel, client, sync_index, progress)
        # A rejected start is recorded in client.calls; the chunk schedule still runs so every rank stays in step.
        progress.at(f"{where}: /start_weight_update in flight")
        with contextlib.suppress(EngineRejected):
            client.start(sync_index, weight_version)
    progress.at(f"{where}: exporting (gather and convert)")
    try:
        own, by_name, streamed = _stream_own_chunks(named, chunk_bytes, rank, sender, progress, where)
        progress.at(f"{where}: exchanging tensor metadata with every rank (all_gather_object)")
        metas = gather_metadata(own, world_size)
        plan = plan_chunks(metas, chunk_bytes)
        if sender is not None:
            sender.planned = len(plan)
        # Every rank checks (the same metadata, the same answer): a rank that went on would wait for ever.
        queued = [c.tensors for c in streamed] if rank == SENDER else streamed_by_sender(metas, chunk_bytes)
        if [c.tensors for c in plan[: len(queued)]] != queued:
            raise RuntimeError(
                f"{where}: the chunk plan does not begin with the {len(queued)} chunks sent while exporting "
                "(the planner must pack owner-ordered tensors greedily, as plan_chunks does)"
            )
        if rank != SENDER:
            progress.at(f"{where}: handing its tensors of {len(plan)} chunks to the sender point to point (gather)")
            hand_off(plan, by_name, rank)
            progress.at(f"{where}: handed every tensor it owns to the sender")
            res.total_s = time.perf_counter() - t_loop0
            return res, plan
        assert sender is not None and client is not None
        t_recv = 0.0
        for chunk in plan[len(streamed) :]:
            t0 = time.perf_counter()
            progress.at(f"{where}: collecting chunk {chunk.index} of {len(plan)} from its owners (gather)")
            tensors = collect(chunk, by_name)
            t_recv += time.perf_counter() - t0
            sender.put(chunk, tensors)
    except BaseException as e:
        if sender is not None:  # the chunks queued from an export that failed are not sent
            sender.stop(f"the sender's export or plan raised {type(e).__name__}")
            with contextlib.suppress(Exception):
                sender.drain()
        raise
    done = sender.drain() if sender is not None else []
    assert client is not None
    t_load = t_wire = 0.0
    for sent in done:
        t_load += sent.load_s
        t_wire += sent.wire_s
        res.chunks.append(sent.entry)
        if not sent.entry.sent:
            continue
        if sent.answered:
            res.names_accepted.extend(sent.info.names)
        elif sent.rejected is not None:
            res.names_rejected.update(names_rejected(sent.info.names, sent.rejected))
        res.names_sent.extend(sent.info.names)
        for n, shape, dtype in zip(sent.info.names, sent.info.shapes, sent.info.dtype_names, strict=True):
            res.sent_layout[n] = TensorLayout(shape=list(shape), dtype=dtype)  # as declared to the engine
        res.bytes += sent.chunk.nbytes
    try:
        if client.session_open:  # else the engine already ended it: nothing to finish (not finished)
            progress.at(f"{where}: /finish_weight_update in flight (load)")
            answer = finish_update(client, sync_index, weight_version)
            res.finished = True
            res.engine_update_counts = {k: int(v) for k, v in answer.get("update_counts", {}).items()}
            progress.at(f"{where}: resetting the engine's caches")
            reset_engine_caches(client, sync_index)
    except EngineRejected:
        pass  # recorded in client.calls
    hashing = hashing_delay(done)
    res.total_s = time.perf_counter() - t_loop0 - hashing
    res.hashing_s = hashing
    for sent in done:  # what was sent, as collected (hashed by the send thread once answered)
        if sent.entry.sent:
            res.sent_checksums.update(sent.checksums)
    progress.at(f"{where}: checksums of what was sent held the sync up {hashing:.2f} s (not counted)")
    res.phases = {"gather": t_recv, "transfer": t_wire, "load": t_load}
    res.chunks_planned = len(plan)
    progress.at(f"{where}: finished")
    return res, plan

"""The sender's sync loop streams: chunks of its own tensors go on the wire while its export still runs,
one chunk at a time and in plan order, and the record is the same as a sync that exported first.

One trainer rank (world size 1, no process group), a recording channel and a client that answers 200:
stand-ins for the engine, so the order of export and sends is observable.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from wsh_vllm_plugin.protocol import UpdateInfo

from reference_impl.checksum import tensor_checksum
from reference_impl.transport.client import EngineRejected
from reference_impl.transport.observed import HttpCall
from reference_impl.transport.plan import plan_chunks
from reference_impl.transport.sync import run_sync


class Client:
    """Answers every route with 200, as an engine with nothing to refuse."""

    session_open = False
    session_closed_by = ""
    pauses_generation = False

    def start(self, sync: int, weight_version: int | None = None) -> Any:
        self.session_open = True
        return {}

    def finish(self, sync: int, weight_version: int) -> Any:
        self.session_open = False
        return {"update_counts": {}}

    def reset_prefix_cache(self, sync: int | None = None) -> Any:
        return {}

    def reset_encoder_cache(self, sync: int | None = None) -> Any:
        return {}


class Channel:
    """Records what it sent and the export's progress at that moment; one send takes `delay_s`."""

    backend = "gloo"

    def __init__(self, produced: list[str], delay_s: float) -> None:
        self.produced, self.delay_s = produced, delay_s
        self.sent: list[tuple[int, list[str], int]] = []  # chunk, names, tensors produced when it was sent
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()

    def send(self, client: Any, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.sent.append((info.chunk_index or 0, list(info.names), len(self.produced)))
        time.sleep(self.delay_s)
        with self.lock:
            self.in_flight -= 1
        return {"load_s": 0.0}

    def close(self) -> None:
        pass


def tensors() -> list[tuple[str, torch.Tensor]]:
    return [(f"model.layers.{i}.mlp.down_proj.weight", torch.full((256,), float(i))) for i in range(12)]


def one_rank_sync(
    named: Iterator[tuple[str, torch.Tensor]],
    channel: Any,
    client: Any = None,
    sync: int = 1,
    chunk_bytes: int = 3 * 1024,
    **kw: Any,
) -> Any:
    """`run_sync` of a single-rank trainer (rank 0 of 1) in chunks of `chunk_bytes`, as sync `sync` with weight
    version `sync`; `client` defaults to a fresh `Client`, `kw` goes to `run_sync` as it is."""
    return run_sync(
        named=named,
        rank=0,
        world_size=1,
        chunk_bytes=chunk_bytes,
        sync_index=sync,
        weight_version=sync,
        client=client if client is not None else Client(),
        channel=channel,
        **kw,
    )


def test_chunks_go_on_the_wire_while_the_export_runs() -> None:
    named = tensors()
    produced: list[str] = []

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            time.sleep(0.05)  # the export's gather and convert of one tensor
            produced.append(name)
            yield name, t

    channel = Channel(produced, delay_s=0.01)
    chunk_bytes = 3 * 1024  # 3 tensors of 1 KiB per chunk
    res, plan = one_rank_sync(export(), channel, sync=0, chunk_bytes=chunk_bytes)
    # the plan of an export run first (hand-derived: 12 tensors of 1 KiB, 3 per chunk)
    assert [[m.name for m in c.tensors] for c in plan] == [[n for n, _ in named[i : i + 3]] for i in (0, 3, 6, 9)]
    assert plan == plan_chunks([m for c in plan for m in c.tensors], chunk_bytes)
    assert [(i, names) for i, names, _ in channel.sent] == [(c.index, [m.name for m in c.tensors]) for c in plan]
    # chunk 0 left while most of the export was still to come (queued once tensor 4 was produced; two more
    # tensors of slack for a loaded host); only the last chunk waited for the end
    assert channel.sent[0][2] <= 6 and all(at < len(named) for _, _, at in channel.sent[:-1])
    assert channel.most_in_flight == 1  # one chunk on the wire at a time: a channel's one buffer is safe
    assert res.finished and res.names_sent == [n for n, _ in named] == res.names_accepted
    assert res.sent_checksums == {n: tensor_checksum(t) for n, t in named}
    assert [c.index for c in res.chunks] == [0, 1, 2, 3] and all(c.sent and c.received for c in res.chunks)
    assert res.bytes == 12 * 1024 and res.chunks_planned == 4


def test_an_export_faster_than_the_wire_waits_for_it_so_the_sender_holds_a_few_chunks() -> None:
    # 30 tensors of 1 KiB, 3 per chunk, exported at once; each send takes 20 ms. Without the wait the export
    # ran to its end before chunk 1 left, and every chunk's tensors were held until it was answered.
    from reference_impl.transport.sync import QUEUE_DEPTH

    named = [(f"model.layers.{i}.mlp.down_proj.weight", torch.full((256,), float(i))) for i in range(30)]
    produced: list[str] = []

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named:
            produced.append(name)
            yield name, t

    channel = Channel(produced, delay_s=0.02)
    res, plan = one_rank_sync(export(), channel, sync=0, chunk_bytes=3 * 1024)
    assert len(plan) == 10 and channel.most_in_flight == 1
    # When chunk k goes on the wire, chunks k and k + 1 are unanswered and the sender waits to queue chunk
    # k + 2, which it filled by tensor 3 (k + 2) + 2 and queued once the tensor after it was produced.
    for k, _, at in channel.sent:
        assert at <= 3 * (k + QUEUE_DEPTH + 1) + 1, (k, at)
    assert res.finished and res.sent_checksums == {n: tensor_checksum(t) for n, t in named}


def test_a_chunk_is_not_sent_once_the_engine_ended_the_session() -> None:
    named = tensors()
    client = Client()

    class Ending(Channel):
        def send(self, client: Any, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
            out = super().send(client, tensors, info, sync)
            if info.chunk_index == 1:  # as vLLM does when a chunk fails
                client.session_open, client.session_closed_by = False, "the engine ended the session"
            return out

    channel = Ending([], delay_s=0.0)
    res, _ = one_rank_sync(iter(named), channel, client=client)
    assert [i for i, _, _ in channel.sent] == [0, 1]
    assert [c.sent for c in res.chunks] == [True, True, False, False]
    assert "the engine ended the session" in res.chunks[2].note and not res.finished
    assert set(res.sent_checksums) == {n for n, _ in named[:6]}


def test_a_send_that_raises_stops_the_chunks_after_it() -> None:
    # A broken channel (a broadcast that timed out) sends nothing more: each later chunk would wait out the
    # same timeout. The error reaches the caller.
    named = tensors()

    class Broken(Channel):
        def send(self, client: Any, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
            if info.chunk_index == 1:
                raise RuntimeError("gloo broadcast timed out")
            return super().send(client, tensors, info, sync)

    channel = Broken([], delay_s=0.0)
    with pytest.raises(RuntimeError, match="timed out"):
        one_rank_sync(iter(named), channel)
    assert [i for i, _, _ in channel.sent] == [0]


def test_chunks_queued_from_an_export_that_fails_are_not_sent() -> None:
    # Chunk 0 is on the wire when the export raises; chunk 1, queued behind it, is not sent.
    named = tensors()

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        yield from named[:7]  # chunk 0 queued at the 4th tensor, chunk 1 at the 7th
        raise KeyError("model.layers.7.mlp.down_proj.weight")

    channel = Channel([], delay_s=0.5)
    with pytest.raises(KeyError):
        one_rank_sync(export(), channel)
    assert [i for i, _, _ in channel.sent] == [0]


class PausingClient(Client):
    """A client of an engine that serves between chunks (vLLM): records the routes in the order called."""

    pauses_generation = True

    def __init__(self) -> None:
        self.routes: list[str] = []

    def pause(self, sync: int | None = None) -> Any:
        self.routes.append("/pause")
        return {}

    def resume(self, sync: int | None = None) -> Any:
        self.routes.append("/resume")
        return {}

    def start(self, sync: int, weight_version: int | None = None) -> Any:
        self.routes.append("/start_weight_update")
        return super().start(sync, weight_version)

    def finish(self, sync: int, weight_version: int) -> Any:
        self.routes.append("/finish_weight_update")
        return super().finish(sync, weight_version)

    def reset_prefix_cache(self, sync: int | None = None) -> Any:
        self.routes.append("/reset_prefix_cache")
        return {}


def test_an_engine_that_serves_between_chunks_is_paused_around_the_whole_update() -> None:
    client = PausingClient()
    channel = Channel([], delay_s=0.0)
    one_rank_sync(iter(tensors()), channel, client=client)
    assert client.routes == [
        "/pause",
        "/start_weight_update",
        "/finish_weight_update",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert [i for i, _, _ in channel.sent] == [0, 1, 2, 3]  # 12 tensors of 1 KiB, 3 to a 3 KiB chunk


def test_an_update_that_raised_still_resumes_the_engine() -> None:
    client = PausingClient()

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        yield from tensors()[:2]
        raise KeyError("model.layers.2.mlp.down_proj.weight")

    with pytest.raises(KeyError):
        one_rank_sync(export(), Channel([], delay_s=0.0), client=client)
    assert client.routes == ["/pause", "/start_weight_update", "/resume"]


def test_a_finished_send_thread_leaves_no_progress_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A watchdog quotes a rank's progress lines when it hangs later (in the checks, in the next step): the
    # send thread's last "chunk k on the wire" must not outlive the sync it belongs to.
    from reference_impl.transport.progress import Progress, read_progress

    progress = Progress(tmp_path / "rank0.txt")
    one_rank_sync(iter(tensors()), Channel([], delay_s=0.0), sync=4, progress=progress)
    assert read_progress(tmp_path) == {"rank0": "sync 4: finished"}
    progress.at("step 5: the trainer's step on every parameter")
    assert read_progress(tmp_path) == {"rank0": "step 5: the trainer's step on every parameter"}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_plan_that_does_not_begin_with_the_streamed_chunks_stops_every_rank(rank: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A planner that is not plan_chunks' greedy rule (here: the sender's tensors in reverse) makes the sender's
    # streamed chunks a wrong prefix. Every rank sees it from the same metadata and raises before any hand-off;
    # a rank that went on would wait for ever on a sender that stopped.
    from reference_impl.transport import sync
    from reference_impl.transport.plan import TensorMeta

    sender = [TensorMeta(f"s{i}", (256,), "float32", 1024, 0) for i in range(7)]  # what rank 0 exported
    mine = [(f"r1.{i}", torch.zeros(256)) for i in range(2)]  # rank 1's own export
    metas = sender + [sync.tensor_meta(n, t, 1) for n, t in mine]
    monkeypatch.setattr(sync, "gather_metadata", lambda own, world_size: metas)
    monkeypatch.setattr(sync, "plan_chunks", lambda tensors, chunk_bytes: plan_chunks(tensors[::-1], chunk_bytes))
    handed: list[Any] = []
    monkeypatch.setattr(sync, "hand_off", lambda *args: handed.append(args))
    named = [(m.name, torch.zeros(256)) for m in sender] if rank == 0 else mine
    channel = Channel([], delay_s=0.0)
    with pytest.raises(RuntimeError, match="does not begin with the 2 chunks sent while exporting"):
        run_sync(
            named=iter(named),
            rank=rank,
            world_size=2,
            chunk_bytes=3 * 1024,
            sync_index=0,
            weight_version=0,
            client=Client() if rank == 0 else None,
            channel=channel if rank == 0 else None,  # type: ignore[arg-type]
        )
    assert handed == []
    assert sync.streamed_by_sender(metas, 3 * 1024) == [tuple(sender[0:3]), tuple(sender[3:6])]  # hand-derived


def test_the_sender_holds_a_chunks_tensors_only_until_the_engine_answered_it() -> None:
    # Each tensor comes fresh from the export (as a gather or a conversion makes it) and the test keeps only
    # weak references: when chunk k goes on the wire, chunk k-1 was answered, hashed and dropped. Before, the
    # sender kept every sent tensor to the sync's end for its checksums (a whole model's bytes on rank 0).
    sums: dict[str, str] = {}
    alive: dict[str, weakref.ref[torch.Tensor]] = {}

    def export() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(12):
            name, t = f"model.layers.{i}.mlp.down_proj.weight", torch.full((256,), float(i))
            sums[name], alive[name] = tensor_checksum(t), weakref.ref(t)
            yield name, t

    held_back: list[list[str]] = []

    class Watching(Channel):
        def send(self, client: Any, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
            gc.collect()
            held_back.append([n for n, ref in alive.items() if ref() is not None and n not in info.names])
            return super().send(client, tensors, info, sync)

    res, _ = one_rank_sync(export(), Watching([], delay_s=0.0))
    names = list(sums)
    # at chunk k's send, only tensors not sent yet are alive (those the export already produced for chunk k+1)
    for k, held in enumerate(held_back):
        assert set(held) <= set(names[3 * (k + 1) :]), f"chunk {k}: earlier tensors still held: {held}"
    assert res.sent_checksums == sums  # hashed as sent, before they were dropped


def test_hashing_delay_counts_only_what_held_the_next_chunk_or_the_finish_up() -> None:
    from reference_impl.transport.plan import Chunk
    from reference_impl.transport.sync import _Sent, hashing_delay

    def sent(queued_at: float, hashed: tuple[float, float]) -> _Sent:
        return _Sent(Chunk(0, ()), [], None, None, queued_at=queued_at, hashed=hashed)  # type: ignore[arg-type]

    # chunk 1 was queued during chunk 0's hashing (1.0 to 3.0) at 2.5: it waited 0.5 s; chunk 2 was queued at
    # 9.0, after chunk 1's hashing (4.0 to 5.0) ended: no wait; chunk 2's hashing (10.0 to 10.25) held up the
    # finish: 0.25 s
    done = [sent(0.0, (1.0, 3.0)), sent(2.5, (4.0, 5.0)), sent(9.0, (10.0, 10.25))]
    assert hashing_delay(done) == pytest.approx(0.75)
    assert hashing_delay([]) == 0.0


def _cyclic_garbage_of_the_sync() -> list[str]:
    """Names of the sync loop's objects the cycle collector would have to free (call with the collector off):
    what is left after every reference count dropped is in a reference cycle."""
    return sorted({type(o).__name__ for o in gc.get_objects() if type(o).__name__ in ("_SendThread", "_Sent")})


def test_a_sync_leaves_nothing_for_the_cycle_collector() -> None:
    # Python's cycle collector frees a process's old objects rarely (a full collection waits until the objects
    # pending reach a quarter of the long-lived ones: millions in a Megatron rank), so a cycle made per sync is
    # memory that grows sync after sync. The send thread's progress callback once closed over the thread
    # itself: qwen3-moe's sender grew about 80 KB a sync, 10 MiB per 100 syncs (the soak's RESOURCE_LEAK).
    refused = {1}

    class Refusing(Channel):
        def send(self, client: Any, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
            if info.chunk_index in refused:
                call = HttpCall(route="/update_weights", status=400, ms=1.0, sync=sync, chunk=info.chunk_index)
                raise EngineRejected(call, "refused")
            return super().send(client, tensors, info, sync)

    gc.collect()
    gc.disable()
    try:
        one_rank_sync(iter(tensors()), Channel([], delay_s=0.0))
        one_rank_sync(iter(tensors()), Refusing([], delay_s=0.0))  # a refused chunk too
        assert _cyclic_garbage_of_the_sync() == []
    finally:
        gc.enable()

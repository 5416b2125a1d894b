"""Channels in vLLM's own protocol and packed format (`wsh_vllm_plugin/packed.py`), for `engine: vllm`.

Each harness chunk is one `/update_weights` call whose `update_info` is vLLM's (`names`, `dtype_names`,
`shapes`; for `ipc` also `tensor_sizes` and `ipc_handles_pickled`); its bytes travel as vLLM's
receiver expects them:

- `PackedBroadcastChannel` (vLLM's `nccl` format): the chunk's tensors cut into packed buffers
  (`packed.buffer_spans`) and broadcast from rank 0 while the HTTP call is in flight (the worker
  receives from inside the call, as with vLLM's own `NCCLTrainerWeightTransferEngine`). Over a gloo
  group on CPU (`connect_packed_gloo`: this package's `gloo` backend for vLLM), over NCCL on GPU
  (`connect_packed_nccl`: vLLM's `nccl` backend unmodified; GPU only, not exercised on CPU hosts).
- `VllmIpcChannel` (vLLM's `ipc` format, colocate, GPU only, not exercised on CPU hosts): the chunk packed
  into one reusable CUDA buffer whose IPC handle travels in the body; vLLM's worker clones the tensors
  out before it answers, so the buffer is reused once the call returned.

`update_info` has no header and the worker sizes every buffer from it, so the sender checks its own
declaration first (`packed.declared_nbytes`: the rules vLLM's typed info and loader apply; a body they
refuse would receive nothing and leave the broadcast waiting) and packs exactly the declared bytes
(`packed.pack_declared`).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from wsh_vllm_plugin.group import host_store, join_transfer_group
from wsh_vllm_plugin.packed import (
    DEFAULT_BUFFER_BYTES,
    VLLM_GLOO,
    VLLM_IPC,
    VLLM_NCCL,
    PackedSender,
    declared_nbytes,
    ipc_init_info,
    ipc_update_info,
    nccl_init_info,
    nccl_update_info,
    pack_declared,
)
from wsh_vllm_plugin.protocol import DEFAULT_TIMEOUT_S, SENDER_RANK, UpdateInfo

from reference_impl.transport import group
from reference_impl.transport.client import EngineClient
from reference_impl.transport.replicas import ReplicaClient

LOOPBACK = "127.0.0.1"


class PackedBroadcastChannel:
    """vLLM's packed broadcast over a communicator's `broadcast(tensor)` (see module doc).

    `timing` accumulates seconds over sends: `pack_s` (packing into the reusable buffer), `wire_s` (the
    broadcasts), `answer_s` (waiting for the engine's answer after the last buffer: its load).
    """

    def __init__(self, backend: str, broadcast: Any, buffer_size_bytes: int, device: torch.device | str) -> None:
        self.backend = backend
        self.timing: dict[str, float] = defaultdict(float)
        self.sender = PackedSender(self._timed(broadcast), buffer_size_bytes, device)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="update-http")
        self.init_infos: list[dict[str, Any]] = []  # vLLM's init_info each engine was sent (for the record)

    def _timed(self, broadcast: Any) -> Any:
        def send(buf: torch.Tensor) -> None:
            t0 = time.perf_counter()
            broadcast(buf)
            self.timing["wire_s"] += time.perf_counter() - t0

        return send

    def send(
        self, client: EngineClient | ReplicaClient, tensors: list[torch.Tensor], info: UpdateInfo, sync: int
    ) -> Any:
        """Post `info` as vLLM's update_info in a thread (to every engine of a `ReplicaClient`) and broadcast
        the chunk's packed buffers; return the engine's answer. A call that ended before its bytes were all
        sent (the engine refused it before receiving) stops the broadcast: nobody would take the rest.

        Raises:
            ProtocolError: `info` breaks a rule of vLLM's update_info (nothing was sent).
            EngineRejected: the engine answered non-200.
        """
        sizes = declared_nbytes(info.names, info.dtype_names, info.shapes)
        body = nccl_update_info(info.names, info.dtype_names, info.shapes)
        fut: Future[Any] = self.pool.submit(client.update, body, sync, info.chunk_index)
        t0 = time.perf_counter()
        wire0 = self.timing["wire_s"]
        self.sender.send(tensors, sizes, keep_going=lambda: not fut.done())
        t1 = time.perf_counter()
        self.timing["pack_s"] += (t1 - t0) - (self.timing["wire_s"] - wire0)
        try:
            return fut.result()
        finally:
            self.timing["answer_s"] += time.perf_counter() - t1

    def close(self) -> None:
        """Stop the HTTP thread (the group is dropped with the channel)."""
        self.pool.shutdown(wait=True)


def connect_packed_gloo(
    client: EngineClient | ReplicaClient,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    engine_ranks: Sequence[int] = (1,),
    master_address: str = LOOPBACK,
    buffer_size_bytes: int = DEFAULT_BUFFER_BYTES,
) -> PackedBroadcastChannel:
    """vLLM's `nccl` protocol over a gloo group (this package's `gloo` backend for vLLM on CPU): host a
    TCPStore at `master_address`, POST vLLM's init_info to every engine at once (`packed.nccl_init_info`
    with the store's address, the engine's `rank_offset` and the group's world size, `transport.group`;
    each of an engine's TP workers joins as rank_offset + its rank) while joining the group as rank 0.
    The engines' workers use the protocol's default gloo timeout.

    Raises:
        ValueError: `engine_ranks` does not have one entry per engine.
        EngineRejected: an engine refused the init call.
        RuntimeError / DistStoreError: the engines did not join within `timeout_s` seconds.
    """
    clients = group.engine_clients(client, engine_ranks)
    store = host_store(master_address, timeout_s=timeout_s)
    size = group.world_size(engine_ranks)
    bodies = [
        nccl_init_info(
            world_size=size,
            master_address=master_address,
            master_port=store.port,
            rank_offset=offset,
            buffer_size_bytes=buffer_size_bytes,
        )
        for offset in group.rank_offsets(engine_ranks)
    ]
    joined = group.init_while_joining(
        clients, bodies, lambda: join_transfer_group(master_address, store.port, SENDER_RANK, size, timeout_s, store)
    )
    channel = PackedBroadcastChannel(
        VLLM_GLOO, lambda buf: joined.broadcast(buf, SENDER_RANK), buffer_size_bytes, "cpu"
    )
    channel.init_infos = bodies
    return channel


def connect_packed_nccl(
    client: EngineClient | ReplicaClient,
    engine_ranks: Sequence[int] = (1,),
    buffer_size_bytes: int = DEFAULT_BUFFER_BYTES,
) -> PackedBroadcastChannel:  # pragma: no cover - GPU only
    """vLLM's `nccl` backend, unmodified (GPU only): the unique-id rendezvous vLLM documents for trainers
    without vLLM (`NCCLWeightTransferInitInfo.nccl_unique_id_b64`). This process mints the id
    (`torch.cuda.nccl.unique_id`), POSTs it to every engine (each with its `rank_offset`, `transport.group`)
    while it enters `ncclCommInitRank` as rank 0 (the workers enter at the same time: there is no store
    barrier), then runs the one-element float32 `all_reduce` warm-up vLLM's `PyNcclCommunicator` runs right
    after its init, before any broadcast.

    Raises:
        ValueError: `engine_ranks` does not have one entry per engine.
        EngineRejected: an engine refused the init call.
        RuntimeError: no CUDA device, or NCCL's.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("vLLM's nccl backend needs a CUDA device; on CPU use connect_packed_gloo")
    import torch.cuda.nccl as nccl

    clients = group.engine_clients(client, engine_ranks)
    device = torch.device("cuda", torch.cuda.current_device())
    uid = nccl.unique_id()
    size = group.world_size(engine_ranks)
    bodies = [
        nccl_init_info(world_size=size, nccl_unique_id=uid, rank_offset=offset, buffer_size_bytes=buffer_size_bytes)
        for offset in group.rank_offsets(engine_ranks)
    ]

    def join() -> Any:
        comm = nccl.init_rank(size, uid, SENDER_RANK)
        warm = torch.zeros(1, dtype=torch.float32, device=device)
        nccl.all_reduce([warm], comms=[comm])
        torch.cuda.synchronize(device)
        return comm

    comm = group.init_while_joining(clients, bodies, join)

    def broadcast(buf: torch.Tensor) -> None:
        nccl.broadcast([buf], root=SENDER_RANK, comms=[comm])  # torch's root indexes the list: the sender's buffer
        torch.cuda.synchronize(device)  # the buffer is repacked for the next one right after

    channel = PackedBroadcastChannel(VLLM_NCCL, broadcast, buffer_size_bytes, device)
    channel.init_infos = bodies
    return channel


class VllmIpcChannel:  # pragma: no cover - GPU only
    """vLLM's `ipc` backend, packed, unmodified (colocate, GPU only; see module doc).

    One CUDA buffer, exported (`reduce_tensor`) once per sync and after it grew: vLLM's worker keeps one
    mapping per export and releases it at finish (`PackedBufferImporter`), so an export per sync keeps
    torch's cross-process refcount paired.
    """

    backend = VLLM_IPC

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("vLLM's ipc backend needs a CUDA device")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.exported: tuple[int, tuple[Any, ...]] | None = None  # (sync, reduce_tensor args)

    def send(self, client: EngineClient, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
        """Pack the chunk at the start of the buffer, POST vLLM's ipc update_info, return the answer.

        Raises:
            ProtocolError: `info` breaks a rule of vLLM's update_info (nothing was sent).
            EngineRejected: the engine answered non-200.
        """
        from torch.multiprocessing.reductions import reduce_tensor

        sizes = declared_nbytes(info.names, info.dtype_names, info.shapes)
        if self.buffer.numel() < sum(sizes):
            self.buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self.exported = None
        pack_declared(tensors, sizes, self.buffer)
        torch.cuda.synchronize(self.device)
        if self.exported is None or self.exported[0] != sync:
            self.exported = (sync, reduce_tensor(self.buffer)[1])
        body = ipc_update_info(info.names, info.dtype_names, info.shapes, sizes, {self.uuid: self.exported[1]})
        return client.update(body, sync, info.chunk_index)

    def close(self) -> None:
        """Drop the buffer and free what the engine released."""
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        torch.cuda.ipc_collect()


def connect_vllm_ipc(client: EngineClient) -> VllmIpcChannel:  # pragma: no cover - GPU only
    """POST vLLM's ipc init_info (`{"packed": true}`: nothing to join) and return the channel."""
    channel = VllmIpcChannel()
    client.init_transfer(ipc_init_info())
    return channel

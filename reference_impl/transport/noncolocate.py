"""Non-colocate channel in the harness's protocol: the packed chunk is broadcast from the trainer's sender
to the engine over the transfer group (gloo on CPU, NCCL on GPU) while the chunk's `/update_weights` call
is in flight. (vLLM is spoken to in its own format: `vllm_packed.py`.)

The HTTP call blocks until the engine has received and loaded the chunk, and the engine joins the
broadcast from inside that call, so the call runs in a thread while this thread broadcasts (vLLM's
NCCL example does the same). The packing buffer is reused across chunks and syncs.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from wsh_vllm_plugin.group import TransferGroup, host_store, join_transfer_group
from wsh_vllm_plugin.protocol import DEFAULT_TIMEOUT_S, GLOO, InitInfo, UpdateInfo, pack

from reference_impl.transport import group
from reference_impl.transport.client import EngineClient
from reference_impl.transport.replicas import ReplicaClient
from reference_impl.transport.sync import SENDER

LOOPBACK = "127.0.0.1"


class BroadcastChannel:
    """Chunks over a `TransferGroup` (sender = rank 0, the engines' workers after it: `transport.group`) of
    backend `backend`."""

    def __init__(self, group: TransferGroup, init_infos: Sequence[InitInfo] = (), backend: str = GLOO) -> None:
        self.group, self.backend = group, backend
        self.init_infos = list(init_infos)  # what each engine was sent to join the group (for the record)
        self.buffer = torch.empty(0, dtype=torch.uint8, device=group.device)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="update-http")

    def send(self, client: EngineClient, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
        """Pack, post /update_weights in a thread, broadcast the bytes, return the engine's answer.

        Raises:
            EngineRejected: the engine answered non-200 (it still received the bytes).
        """
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        payload = pack(tensors, out=self.buffer)
        fut = self.pool.submit(client.update, info, sync, info.chunk_index)
        self.group.send_chunk(payload)
        return fut.result()

    def close(self) -> None:
        """Stop the HTTP thread (the group is dropped with the channel)."""
        self.pool.shutdown(wait=True)


def connect_broadcast(
    client: EngineClient | ReplicaClient,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    engine_ranks: Sequence[int] = (1,),
    master_address: str = LOOPBACK,
    backend: str = GLOO,
) -> BroadcastChannel:
    """Set up the non-colocate channel: host a TCPStore at `master_address` (the sender's node: 127.0.0.1
    when every process runs on one node), POST /init_weight_transfer_engine to every engine at once, each
    with its own `InitInfo` (`transport.group.init_infos`: its rank offset, the group's world size `1 +
    sum(engine_ranks)`, `timeout_s`), each in a thread (an engine answers once it joined) while this
    process joins the group as rank 0. `engine_ranks`: each engine's workers in the group (its TP), one
    entry per engine of `client` (an `EngineClient` for one engine, a `ReplicaClient` for several). Both
    sides use `timeout_s` (seconds) for the join and for every broadcast. `backend`: "gloo", or "nccl" on GPU.

    Raises:
        ValueError: `engine_ranks` does not have one entry per engine.
        EngineRejected: an engine refused the init call.
        RuntimeError / DistStoreError: the engines did not join within `timeout_s` seconds.
    """
    clients = group.engine_clients(client, engine_ranks)
    store = host_store(master_address, timeout_s=timeout_s)
    infos = group.init_infos(master_address, store.port, engine_ranks, timeout_s, backend)
    size = group.world_size(engine_ranks)
    joined = group.init_while_joining(
        clients,
        infos,
        lambda: join_transfer_group(
            master_address, store.port, SENDER, size, timeout_s=timeout_s, store=store, backend=backend
        ),
    )
    return BroadcastChannel(joined, infos, backend)

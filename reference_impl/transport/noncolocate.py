"""Non-colocate channel in the harness's protocol: the packed chunk is broadcast from the trainer's sender
to the engine over the transfer group (gloo on CPU, NCCL on GPU) while the chunk's `/update_weights` call
is in flight. (vLLM is spoken to in its own format: `vllm_packed.py`.)

The HTTP call blocks until the engine has received and loaded the chunk, and the engine joins the
broadcast from inside that call, so the call runs in a thread while this thread broadcasts (vLLM's
NCCL example does the same). The packing buffer is reused across chunks and syncs.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from wsh_vllm_plugin.protocol import (
    DEFAULT_TIMEOUT_S,
    GLOO,
    InitInfo,
    TransferGroup,
    UpdateInfo,
    host_store,
    join_transfer_group,
    pack,
)

from reference_impl.transport.client import EngineClient
from reference_impl.transport.sync import SENDER


class BroadcastChannel:
    """Chunks over a `TransferGroup` (sender = rank 0, engine = rank 1) of backend `backend`."""

    def __init__(self, group: TransferGroup, backend: str = GLOO) -> None:
        self.group, self.backend = group, backend
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
    client: EngineClient, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = GLOO
) -> BroadcastChannel:
    """Set up the non-colocate channel: host a TCPStore on 127.0.0.1, POST /init_weight_transfer_engine
    `InitInfo(backend, master_address, master_port, rank_offset=1, world_size=2, timeout_s)` in a thread
    (the engine answers once it joined) while this process joins the group as rank 0. Both sides use
    `timeout_s` (seconds) for the join and for every broadcast. `backend`: "gloo", or "nccl" on GPU.

    Raises:
        EngineRejected: the engine refused the init call.
        RuntimeError / DistStoreError: the engine did not join within `timeout_s` seconds.
    """
    store = host_store(timeout_s=timeout_s)
    init_info = InitInfo(
        backend=backend,  # type: ignore[arg-type]  (a GROUP_BACKENDS name)
        master_address="127.0.0.1",
        master_port=store.port,
        rank_offset=1,
        world_size=2,
        timeout_s=timeout_s,
    )
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="init-transfer")
    try:
        answer = pool.submit(client.init_transfer, init_info)
        group = join_transfer_group(
            "127.0.0.1", store.port, SENDER, init_info.world_size, timeout_s=timeout_s, store=store, backend=backend
        )
        answer.result()  # re-raises the init call's error here
    finally:
        pool.shutdown(wait=False)  # a failed join does not wait for the HTTP call
    return BroadcastChannel(group, backend)

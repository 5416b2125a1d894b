"""The transfer group: how the trainer's sender and the engines' workers join it and broadcast chunks over it.

Its backends, ranks and timeout (`GLOO`, `NCCL`, `SENDER_RANK`, `DEFAULT_TIMEOUT_S`) and the bodies that
announce it (`InitInfo`, `UpdateInfo`) are the protocol's (`protocol.py`). Torch only, like the protocol.

The transfer group: a `ProcessGroupGloo` (or, backend "nccl", a `ProcessGroupNCCL` on the sender's and
the engine's CUDA devices) built directly on a `TCPStore` (no PrefixStore, not through
`init_process_group`) that the trainer's sender hosts; the sender is rank 0, an engine worker joins as
rank `rank_offset` + its worker index, in a group of `world_size` ranks (2 for one single-worker
engine). Built this way it works beside the trainer's own default group and across two Python
environments, and `broadcast` works on it (vLLM's `stateless_init_torch_distributed_process_group` warns
that its group does not). One chunk = two broadcasts from `protocol.UpdateInfo.src`: a one-element int64
tensor holding the payload's byte count, then the payload. The receiver learns the size from the header,
so a chunk whose bytes do not match its declared dtypes/shapes is still received whole and can be
refused with a clear error instead of a hang or a size-mismatch crash inside the collective.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._distributed_c10d import BroadcastOptions, ProcessGroupGloo
from torch.distributed import TCPStore

from wsh_vllm_plugin.protocol import DEFAULT_TIMEOUT_S, GLOO, GROUP_BACKENDS, NCCL, SENDER_RANK


@dataclass
class TransferGroup:
    """This process's membership of the transfer group (see the module doc). `device` is where its
    broadcasts live: CPU for gloo, this process's CUDA device for NCCL."""

    pg: Any  # ProcessGroupGloo | ProcessGroupNCCL
    rank: int
    world_size: int
    store: TCPStore
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # True: `receive_chunk` returns a view of one receive buffer kept between chunks (grown as needed), so a
    # receive writes into memory already mapped instead of a new allocation per chunk; the caller must copy
    # what it keeps before the next receive (the embedded engine's loader does). The vLLM plugin does not:
    # vLLM's layerwise reload keeps the tensors it was given until their layer is complete
    # (`model_loader/reload/layerwise.py`, `info.loaded_weights`), which may be chunks later.
    reuse_receive_buffer: bool = False
    _received: torch.Tensor | None = field(default=None, repr=False)

    def send_chunk(self, payload: torch.Tensor) -> None:
        """Broadcast one packed chunk from this rank (the sender): int64 byte-count header, then payload.

        `payload`: flat uint8 tensor (moved to the group's device when elsewhere). Blocks until every rank
        took both broadcasts or the group's timeout passes (RuntimeError from gloo / NCCL).
        """
        self.broadcast(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device), self.rank)
        self.broadcast(payload.to(self.device), self.rank)

    def receive_chunk(self, src: int = SENDER_RANK) -> torch.Tensor:
        """Receive one packed chunk broadcast by `src`: the header, then a flat uint8 tensor of that many
        bytes (returned): a new one, or with `reuse_receive_buffer` a view of the group's receive buffer,
        which the next receive overwrites. Raises RuntimeError from gloo when `src` does not send within the
        timeout."""
        header = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(header, src)
        nbytes = int(header.item())
        if not self.reuse_receive_buffer:
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            if self._received is None or self._received.numel() < nbytes:
                self._received = None  # the old buffer is freed before the larger one is made
                self._received = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            payload = self._received[:nbytes]
        self.broadcast(payload, src)
        return payload

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        """Broadcast `t` (on the group's device, same size on every rank) from rank `src`, in place on the
        others; blocks until done (on NCCL: until the device finished it). The shape of vLLM's
        `PyNcclCommunicator.broadcast`, used by vLLM's packed format (`packed.py`). Raises RuntimeError from
        gloo / NCCL when a peer does not join within the timeout."""
        opts = BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([t], opts).wait()
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()


def host_store(host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S) -> TCPStore:
    """The sender's TCPStore on a free port of `host` (read it from `store.port`); does not wait for peers."""
    return TCPStore(
        host, 0, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_transfer_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store: TCPStore | None = None,
    backend: str = GLOO,
    reuse_receive_buffer: bool = False,
) -> TransferGroup:
    """Join the transfer group as `rank`; blocks until all `world_size` ranks arrive.

    The sender (rank 0) passes the store it made with `host_store`; an engine rank connects to
    `master_address:master_port` (the `InitInfo` it was sent). `backend` "gloo" (host memory) or "nccl"
    (GPU only: a `ProcessGroupNCCL` on the same store, broadcasting on this process's current CUDA device;
    not exercised on CPU hosts). `reuse_receive_buffer`: see `TransferGroup`.

    Raises:
        ValueError: another backend.
        RuntimeError / DistStoreError: a peer did not arrive within `timeout_s` seconds, or no CUDA for "nccl".
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend not in GROUP_BACKENDS:
        raise ValueError(f"transfer group backend {backend!r}: use one of {GROUP_BACKENDS}")
    if store is None:
        store = TCPStore(master_address, master_port, None, is_master=False, timeout=timeout)
    if backend == NCCL:  # pragma: no cover - GPU only
        if not torch.cuda.is_available():
            raise RuntimeError("transfer group backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
        from torch.distributed import ProcessGroupNCCL

        device = torch.device("cuda", torch.cuda.current_device())
        pg: Any = ProcessGroupNCCL(store, rank, world_size, timeout)
        return TransferGroup(pg, rank, world_size, store, device, reuse_receive_buffer)
    pg = ProcessGroupGloo(store, rank, world_size, timeout)
    return TransferGroup(pg, rank, world_size, store, reuse_receive_buffer=reuse_receive_buffer)

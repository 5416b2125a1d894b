"""The wire format of one chunk and the trainer<->engine transfer group (non-colocate).

A chunk is sent packed: its tensors' raw bytes concatenated in plan order into one flat uint8 buffer
(no padding). On the group, the sender broadcasts first a one-element int64 tensor with the payload's
byte count, then the payload. The receiver learns the size from the header, so a chunk whose bytes do
not match its declared dtypes/shapes is still received whole and can be rejected with a clear error
instead of a hang or a size-mismatch crash inside the collective.

The group is a `ProcessGroupGloo` on a `TCPStore` hosted by the trainer's sender (rank 0); the engine
joins as rank `rank_offset`. It is built directly (not through `init_process_group`) so that it works
beside the trainer's own default group and across two Python environments, and `broadcast` works on
it (vLLM's `stateless_init_torch_distributed_process_group` warns that its group does not).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._C._distributed_c10d import BroadcastOptions, ProcessGroupGloo
from torch.distributed import TCPStore

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (vLLM's update_info spelling, no 'torch.' prefix)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`.

    Raises:
        ValueError: an unknown dtype name (the message lists the known ones).
    """
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known: {sorted(DTYPE_NAMES)}") from None


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a contiguous tensor of `shape` and `dtype`."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate the raw bytes of `tensors` (in order) into one flat uint8 tensor.

    `out`, when given, is a reusable uint8 buffer of at least the total size; a view of it is returned.
    """
    total = sum(t.numel() * t.element_size() for t in tensors)
    buf = torch.empty(total, dtype=torch.uint8) if out is None else out[:total]
    off = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        buf[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        off += n
    return buf


def unpack(buf: torch.Tensor, dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Split a packed uint8 buffer into tensors (views into `buf`) of the declared dtypes and shapes.

    Raises:
        ValueError: the buffer's size differs from the declared total (message gives both).
    """
    sizes = [nbytes_of(s, d) for s, d in zip(shapes, dtypes, strict=True)]
    if sum(sizes) != buf.numel():
        raise ValueError(f"chunk holds {buf.numel()} bytes but its declared dtypes/shapes need {sum(sizes)}")
    out, off = [], 0
    for n, d, s in zip(sizes, dtypes, shapes, strict=True):
        piece = buf[off : off + n]
        if off % torch.empty((), dtype=d).element_size():
            piece = piece.clone()  # no padding in the format: a misaligned offset cannot be viewed
        out.append(piece.view(d).reshape(tuple(s)))
        off += n
    return out


@dataclass
class TransferGroup:
    """A gloo group between the trainer's sender (rank 0) and the engine (rank `rank_offset`)."""

    pg: ProcessGroupGloo
    rank: int
    world_size: int
    store: TCPStore

    def broadcast_chunk(self, payload: torch.Tensor | None, src: int = 0) -> torch.Tensor:
        """Broadcast one packed chunk from `src`: header (int64 byte count), then payload.

        The sender passes its uint8 payload; receivers pass None and get a new uint8 tensor back.
        """
        header = torch.tensor([payload.numel() if self.rank == src else 0], dtype=torch.int64)
        self._bcast(header, src)
        if self.rank != src:
            payload = torch.empty(int(header.item()), dtype=torch.uint8)
        assert payload is not None
        self._bcast(payload, src)
        return payload

    def _bcast(self, t: torch.Tensor, src: int) -> None:
        opts = BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([t], opts).wait()


def host_store(host: str = "127.0.0.1", timeout_s: float = 120.0) -> TCPStore:
    """The sender's TCPStore on a free port (read it from `store.port`); does not wait for peers."""
    return TCPStore(
        host, 0, None, is_master=True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_transfer_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 120.0,
    store: TCPStore | None = None,
) -> TransferGroup:
    """Join the transfer group as `rank`; blocks until all `world_size` ranks arrive.

    Rank 0 passes the store it made with `host_store`; other ranks connect to
    `master_address:master_port`.

    Raises:
        RuntimeError / DistStoreError: a peer did not arrive within `timeout_s`.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(master_address, master_port, None, is_master=False, timeout=timeout)
    pg = ProcessGroupGloo(store, rank, world_size, timeout)
    return TransferGroup(pg=pg, rank=rank, world_size=world_size, store=store)

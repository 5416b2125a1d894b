"""The harness's weight-update protocol between the trainer and a rollout engine, and its wire format.

This module is the one definition both sides use: the trainer's sender and the embedded engine import
it (real vLLM is spoken to in vLLM's own protocol, `packed.py`; this package's vLLM backend uses only the
transfer group below). It needs only torch (no vLLM, no pydantic, nothing of the harness)
and runs on Python >= 3.11, so it installs into the trainer's environment and into vLLM's alike
(`pip install -e reference_impl/engine/vllm`, distribution `wsh-vllm-plugin`).

Routes and bodies (vLLM's RLHF routes, `vllm/entrypoints/rl/online/api_router.py`):

- POST /init_weight_transfer_engine `{"init_info": InitInfo}`. Backends "gloo" (CPU) / "nccl" (GPU),
  non-colocate: the engine joins the sender's transfer group (below). Backends "shm" / "cuda_ipc"
  (colocate): nothing to join; every chunk carries a handle.
- POST /update_weights `{"update_info": UpdateInfo}`, one call per chunk. The chunk's bytes travel
  packed (`pack`): over the transfer group while the call is in flight (gloo, nccl), or in a buffer the
  producer owns, named by `UpdateInfo.handle` (`ShmHandle`, `CudaIpcHandle`).

The wire format of one chunk: its tensors' raw bytes concatenated in `names` order into one flat uint8
buffer, no header, no padding. Dtype names are torch's without the "torch." prefix (`DTYPE_NAMES`), as
vLLM's `update_info` spells them (`str(tensor.dtype).split(".")[-1]` in
`vllm/distributed/weight_transfer/ipc_engine.py`).

The transfer group: a `ProcessGroupGloo` (or, backend "nccl", a `ProcessGroupNCCL` on the sender's and
the engine's CUDA devices) built directly on a `TCPStore` (no PrefixStore, not through
`init_process_group`) that the trainer's sender hosts; the sender is rank 0, an engine worker joins as
rank `rank_offset` + its worker index, in a group of `world_size` ranks (2 for one single-worker
engine). Built this way it works beside the trainer's own default group and across two Python
environments, and `broadcast` works on it (vLLM's `stateless_init_torch_distributed_process_group`
warns that its group does not). One chunk = two broadcasts from `UpdateInfo.src`: a one-element int64
tensor holding the payload's byte count, then the payload. The receiver learns the size from the
header, so a chunk whose bytes do not match its declared dtypes/shapes is still received whole and can
be refused with a clear error instead of a hang or a size-mismatch crash inside the collective.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch._C._distributed_c10d import BroadcastOptions, ProcessGroupGloo
from torch.distributed import TCPStore

# ---------------------------------------------------------------- backends and handle kinds

GLOO = "gloo"  # non-colocate: packed chunks broadcast over the transfer group (host memory)
NCCL = "nccl"  # non-colocate on GPU: the same broadcasts over an NCCL transfer group (device memory)
SHM = "shm"  # colocate on CPU: packed chunks in a POSIX shared-memory segment
CUDA_IPC = "cuda_ipc"  # colocate on GPU: packed chunks in a CUDA buffer shared by IPC handle
BACKENDS: tuple[str, ...] = (GLOO, NCCL, SHM, CUDA_IPC)
GROUP_BACKENDS: tuple[str, ...] = (GLOO, NCCL)  # the backends that join a transfer group
HANDLE_KINDS: tuple[str, ...] = (SHM, CUDA_IPC)  # a handle backend's name is its handle's kind
Backend = Literal["gloo", "nccl", "shm", "cuda_ipc"]  # BACKENDS as a type (what request validation enforces)

SENDER_RANK = 0  # the trainer's sender in the transfer group
DEFAULT_TIMEOUT_S = 120.0  # gloo timeout of the group's join and of every broadcast, both sides


class ProtocolError(ValueError):
    """A protocol body that breaks a rule its field types do not express.

    `str(e)` is the reason, prefixed with the field's name when the field is missing.

    Attributes:
        field: the offending field of the body (e.g. "master_address").
        reason: one sentence saying what is wrong.
        required: True when the field is missing (None) where the rule needs it.
    """

    def __init__(self, field: str, reason: str, required: bool = False) -> None:
        super().__init__(f"{field}: {reason}" if required else reason)
        self.field = field
        self.reason = reason
        self.required = required


# ---------------------------------------------------------------- bodies


@dataclass(kw_only=True)
class InitInfo:
    """`init_info` of /init_weight_transfer_engine.

    For backend "gloo" it carries the fields of vLLM's `NCCLWeightTransferInitInfo`
    (`vllm/distributed/weight_transfer/nccl_common.py`: master_address, master_port, rank_offset,
    world_size) plus `timeout_s` (seconds; the gloo timeout of the join and of every broadcast, which
    the sender sets to its own); master_address and master_port are then required (`check`). For the
    colocate backends "shm" and "cuda_ipc" only `backend` matters, as vLLM's `IPCWeightTransferInitInfo`
    (`ipc_engine.py`) needs no rendezvous.
    """

    backend: Backend = GLOO
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int = 1
    world_size: int = 2
    timeout_s: float = DEFAULT_TIMEOUT_S

    def check(self) -> None:
        """Check the rules of the group backends "gloo" and "nccl" (nothing for the colocate backends).

        Raises:
            ProtocolError: master_address or master_port missing (`required`), or a rank_offset outside
                1..world_size-1 (rank 0 is the sender).
        """
        if self.backend not in GROUP_BACKENDS:
            return
        for name in ("master_address", "master_port"):
            if getattr(self, name) is None:
                raise ProtocolError(name, f"Field required for backend '{self.backend}'", required=True)
        if not 0 < self.rank_offset < self.world_size:
            raise ProtocolError(
                "rank_offset",
                f"init_info rank_offset {self.rank_offset} must lie in 1..world_size-1 "
                f"(world_size {self.world_size}); the trainer's sender is rank {SENDER_RANK}",
            )


@dataclass(kw_only=True)
class UpdateInfo:
    """`update_info` of one /update_weights chunk.

    names / dtype_names / shapes / packed follow vLLM's `NCCLWeightTransferUpdateInfo`
    (`vllm/distributed/weight_transfer/nccl_engine.py`): HF checkpoint names in chunk order, one dtype
    name (`DTYPE_NAMES`) and one shape per name. `src` is the broadcasting rank (gloo), `chunk_index`
    the chunk's place in the sync's plan (for error messages and records), `handle` the JSON form of a
    `ShmHandle` / `CudaIpcHandle` under the colocate backends (None under gloo). The handle stays a
    plain dict here: an engine checks it itself and refuses a malformed one as a bad chunk.
    """

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    packed: bool = True
    src: int = SENDER_RANK
    chunk_index: int | None = None
    handle: dict[str, Any] | None = None

    def check(self) -> None:
        """Raises ProtocolError ("names"): the three lists differ in length (see `check_lengths`)."""
        check_lengths(self.names, self.dtype_names, self.shapes)


def check_lengths(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
    """Check that a chunk declares one dtype name and one shape per name.

    Raises:
        ProtocolError: field "names"; the message gives the three lengths.
    """
    if not len(names) == len(dtype_names) == len(shapes):
        raise ProtocolError(
            "names",
            f"update_info lists differ in length: {len(names)} names, {len(dtype_names)} dtype_names, "
            f"{len(shapes)} shapes; send one dtype name and one shape per name",
        )


# ---------------------------------------------------------------- handles (colocate)


@dataclass(frozen=True, kw_only=True)
class ShmHandle:
    """Where a packed chunk lies in POSIX shared memory (backend "shm"); JSON: `dataclasses.asdict`.

    `name` is the segment's name as `multiprocessing.shared_memory` spells it (no leading "/"); the
    chunk is the segment's first `nbytes` bytes (the segment may be larger: one reusable buffer serves
    chunks of different sizes).
    """

    kind: Literal["shm"] = SHM
    name: str
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class CudaIpcHandle:
    """Where a packed chunk lies in a CUDA buffer (backend "cuda_ipc"); JSON: `dataclasses.asdict`.

    `ipc` is base64 of the pickled `torch.multiprocessing.reductions.reduce_tensor(buf)` tuple (rebuild
    function, args), as vLLM's `ipc` backend passes handles over HTTP (`ipc_handles_pickled` in
    `vllm/distributed/weight_transfer/ipc_engine.py`); the consumer rebuilds it with the device index,
    args[6], set to its own index of the GPU named by `device_uuid` (`torch.cuda.get_device_properties
    (...).uuid` as a string), whatever its CUDA_VISIBLE_DEVICES. `nbytes` is the buffer's size.
    """

    kind: Literal["cuda_ipc"] = CUDA_IPC
    ipc: str
    nbytes: int
    device_uuid: str


HANDLE_LOCATOR: dict[str, str] = {SHM: "name", CUDA_IPC: "ipc"}  # kind -> the field that says where the bytes are


# ---------------------------------------------------------------- dtypes and packing

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of `dtype`: 'float32' for torch.float32 (torch's name without 'torch.')."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name (inverse of `dtype_name`).

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
    """Concatenate the raw bytes of `tensors` (in order, any dtypes/shapes) into one flat uint8 tensor.

    `out`, when given, is a reusable uint8 buffer of at least the total size (on the tensors' device);
    a view of its first bytes is returned.
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
    """Split a packed uint8 buffer into tensors of the declared dtypes and shapes.

    Pieces are views into `buf`, except at an offset that is not a multiple of the dtype's size (the
    format has no padding), where the piece is copied first.

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
            piece = piece.clone()
        out.append(piece.view(d).reshape(tuple(s)))
        off += n
    return out


# ---------------------------------------------------------------- the transfer group (gloo)


@dataclass
class TransferGroup:
    """This process's membership of the transfer group (see the module doc). `device` is where its
    broadcasts live: CPU for gloo, this process's CUDA device for NCCL."""

    pg: Any  # ProcessGroupGloo | ProcessGroupNCCL
    rank: int
    world_size: int
    store: TCPStore
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def send_chunk(self, payload: torch.Tensor) -> None:
        """Broadcast one packed chunk from this rank (the sender): int64 byte-count header, then payload.

        `payload`: flat uint8 tensor (moved to the group's device when elsewhere). Blocks until every rank
        took both broadcasts or the group's timeout passes (RuntimeError from gloo / NCCL).
        """
        self._bcast(torch.tensor([payload.numel()], dtype=torch.int64, device=self.device), self.rank)
        self._bcast(payload.to(self.device), self.rank)

    def receive_chunk(self, src: int = SENDER_RANK) -> torch.Tensor:
        """Receive one packed chunk broadcast by `src`: the header, then a new flat uint8 tensor of that
        many bytes (returned). Raises RuntimeError from gloo when `src` does not send within the timeout."""
        header = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(header, src)
        payload = torch.empty(int(header.item()), dtype=torch.uint8, device=self.device)
        self._bcast(payload, src)
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

    def _bcast(self, t: torch.Tensor, src: int) -> None:
        self.broadcast(t, src)


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
) -> TransferGroup:
    """Join the transfer group as `rank`; blocks until all `world_size` ranks arrive.

    The sender (rank 0) passes the store it made with `host_store`; an engine rank connects to
    `master_address:master_port` (the `InitInfo` it was sent). `backend` "gloo" (host memory) or "nccl"
    (GPU only: a `ProcessGroupNCCL` on the same store, broadcasting on this process's current CUDA device;
    not exercised on CPU hosts).

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
        return TransferGroup(pg=pg, rank=rank, world_size=world_size, store=store, device=device)
    pg = ProcessGroupGloo(store, rank, world_size, timeout)
    return TransferGroup(pg=pg, rank=rank, world_size=world_size, store=store)

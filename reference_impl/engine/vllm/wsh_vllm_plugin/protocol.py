"""The harness's weight-update protocol between the trainer and a rollout engine, and its wire format.

This module is the one definition both sides use: the trainer's sender and the embedded engine import it
(real vLLM is spoken to in vLLM's own protocol, `packed.py`; this package's vLLM backend uses only the
transfer group, `group.py`). It needs only torch (no vLLM, no pydantic, nothing of the harness) and runs
on Python >= 3.11: it installs into both environments (`pip install -e reference_impl/engine/vllm`).

Routes and bodies (vLLM's RLHF routes, `vllm/entrypoints/rl/online/api_router.py`):

- POST /init_weight_transfer_engine `{"init_info": InitInfo}`. Backends "gloo" (CPU) / "nccl" (GPU),
  non-colocate: the engine joins the sender's transfer group (`group.py`). Backends "shm" / "cuda_ipc"
  (colocate): nothing to join; every chunk carries a handle.
- POST /update_weights `{"update_info": UpdateInfo}`, one call per chunk. The chunk's bytes travel
  packed (`pack`): over the transfer group while the call is in flight (gloo, nccl), or in a buffer the
  producer owns, named by `UpdateInfo.handle` (`ShmHandle`, `CudaIpcHandle`).

The wire format of one chunk: its tensors' raw bytes concatenated in `names` order into one flat uint8
buffer, no header, no padding. Dtype names are torch's without the "torch." prefix (`DTYPE_NAMES`), as
vLLM's `update_info` spells them (`str(tensor.dtype).split(".")[-1]` in
`vllm/distributed/weight_transfer/ipc_engine.py`).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self

import torch

from wsh_vllm_plugin.fields import MAX_INT64, ProtocolError, check_types, from_json

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

# Limits a body must keep (a value outside them is refused before anything is joined, mapped or read).
MAX_PORT = 65535
MAX_WORLD_SIZE = 1 << 16  # ranks of one transfer group
MAX_TIMEOUT_S = 24 * 3600.0  # seconds; also what datetime.timedelta and gloo take without overflowing
MAX_NAME_CHARS = 1024  # characters of one tensor name (HF checkpoint names are far shorter)
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?")  # RFC 1123 host names
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _in_range(name: str, value: float, low: float, high: float, unit: str = "") -> None:
    if not low <= value <= high:
        raise ProtocolError(name, f"{name} {value!r} must lie in {low}..{high}{unit}")


def _check_host(address: str) -> None:
    try:
        ipaddress.ip_address(address)
        return
    except ValueError:
        pass
    if not _HOSTNAME.fullmatch(address):
        raise ProtocolError(
            "master_address", f"master_address {address[:80]!r} is neither an IP address nor a host name"
        )


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

    @classmethod
    def from_json(cls, body: Any) -> Self:
        """The `init_info` of a request, checked (`fields.from_json`, then `check`).

        Raises:
            ProtocolError: an unknown field, a wrong type, or a rule of `check` broken.
        """
        info = from_json(cls, body, "init_info")
        info.check()
        return info

    def check(self) -> None:
        """Check the field types and ranges (every backend) and the rules of the group backends (gloo, nccl).

        Raises:
            ProtocolError: a value of the wrong type; master_port outside 1..MAX_PORT, world_size outside
                2..MAX_WORLD_SIZE, timeout_s outside (0, MAX_TIMEOUT_S], a master_address that is no IP
                address or host name; for a group backend, master_address or master_port missing
                (`required`), or a rank_offset outside 1..world_size-1 (rank 0 is the sender).
        """
        check_types(self)
        if self.master_port is not None:
            _in_range("master_port", self.master_port, 1, MAX_PORT)
        if self.master_address is not None:
            _check_host(self.master_address)
        _in_range("world_size", self.world_size, 2, MAX_WORLD_SIZE)
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise ProtocolError("timeout_s", f"timeout_s {self.timeout_s!r} must lie in (0, {MAX_TIMEOUT_S}] seconds")
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

    REQUIRED: ClassVar[tuple[str, ...]] = ("names", "dtype_names", "shapes")  # in JSON, as vLLM requires them

    @classmethod
    def from_json(cls, body: Any) -> Self:
        """The `update_info` of a request, checked (`fields.from_json` with `REQUIRED`, then `check`).

        Raises:
            ProtocolError: an unknown or missing field, a wrong type, or a rule of `check` broken.
        """
        info = from_json(cls, body, "update_info", cls.REQUIRED)
        info.check()
        return info

    def check(self) -> None:
        """Check the field types and the chunk's declarations (the dtype names are the loader's to judge).

        Raises:
            ProtocolError: a value of the wrong type; the three lists differ in length ("names",
                `check_lengths`) or are empty ("names"); a name that is empty, longer than MAX_NAME_CHARS,
                holds a control character (NUL included) or appears twice ("names.<i>"); a dimension outside
                0..MAX_INT64 ("shapes.<i>.<j>"); src or chunk_index outside 0..MAX_INT64.
        """
        check_types(self)
        check_lengths(self.names, self.dtype_names, self.shapes)
        if not self.names:
            raise ProtocolError("names", "a chunk declares no tensor; send at least one name")
        seen: dict[str, int] = {}
        for i, name in enumerate(self.names):
            where = f"names.{i}"
            if not name or len(name) > MAX_NAME_CHARS:
                raise ProtocolError(where, f"{where}: a tensor name must have 1..{MAX_NAME_CHARS} characters")
            bad = _CONTROL.search(name)
            if bad:
                raise ProtocolError(where, f"{where} {name[:80]!r} holds the control character {bad.group()!r}")
            if name in seen:
                raise ProtocolError(
                    where, f"{where} {name!r} appears twice in this chunk (also names.{seen[name]}); send it once"
                )
            seen[name] = i
        for i, shape in enumerate(self.shapes):
            for j, dim in enumerate(shape):
                _in_range(f"shapes.{i}.{j}", dim, 0, MAX_INT64)
        _in_range("src", self.src, 0, MAX_INT64)
        if self.chunk_index is not None:
            _in_range("chunk_index", self.chunk_index, 0, MAX_INT64)


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


# A segment the engine maps must be named so: one name the producer's `SharedMemoryBuffer`
# (`reference_impl.transport.handles`) makes, then hex digits. Nothing else on the host can be named by a handle.
SHM_NAME_PREFIX = "wsh_chunk_"
_SHM_NAME = re.compile(re.escape(SHM_NAME_PREFIX) + r"[0-9a-f]{1,32}")
SHM_PID_DIGITS = 8  # Linux pids are below 2^22 (/proc/sys/kernel/pid_max): 6 hex digits, 8 leave room


def shm_maker_prefix(pid: int) -> str:
    """The start of the name of every segment process `pid` makes: `SHM_NAME_PREFIX`, then `pid` as
    `SHM_PID_DIGITS` hex digits (random hex digits follow: `transport.handles.SharedMemoryBuffer`). Whoever ends
    a producer that may die before it unlinks its segment finds every one it made by that prefix, also one it
    made a moment before its end (`harness.shm.made_by`).

    Raises:
        ValueError: `pid` is negative or needs more than `SHM_PID_DIGITS` hex digits.
    """
    if not 0 <= pid < 16**SHM_PID_DIGITS:
        raise ValueError(f"pid {pid} does not fit {SHM_PID_DIGITS} hex digits")
    return f"{SHM_NAME_PREFIX}{pid:0{SHM_PID_DIGITS}x}"


def _check_nbytes(nbytes: int, expected: int | None) -> None:
    _in_range("nbytes", nbytes, 0, MAX_INT64)
    if expected is not None and nbytes != expected:
        raise ProtocolError(
            "nbytes", f"handle nbytes {nbytes} but the chunk's declared dtypes/shapes need {expected} bytes"
        )


@dataclass(frozen=True, kw_only=True)
class ShmHandle:
    """Where a packed chunk lies in POSIX shared memory (backend "shm"); JSON: `dataclasses.asdict`.

    `name` is the segment's name as `multiprocessing.shared_memory` spells it (no leading "/"):
    `SHM_NAME_PREFIX` and hex digits; the chunk is the segment's first `nbytes` bytes (the segment may be
    larger: one reusable buffer serves chunks of different sizes).
    """

    kind: Literal["shm"] = SHM
    name: str
    nbytes: int

    def check(self, expected_nbytes: int | None = None) -> None:
        """Check the types, the segment name and the size (against `expected_nbytes` when given).

        Raises:
            ProtocolError: a wrong type; a name that is not `SHM_NAME_PREFIX` + hex digits ("name": another
                program's segment, a path); nbytes outside 0..MAX_INT64 or not `expected_nbytes` ("nbytes").
        """
        check_types(self)
        if not _SHM_NAME.fullmatch(self.name):
            raise ProtocolError(
                "name",
                f"shm handle name {self.name[:80]!r} is not an engine chunk segment: names are "
                f"{SHM_NAME_PREFIX!r} + hex digits (reference_impl.transport.handles.SharedMemoryBuffer)",
            )
        _check_nbytes(self.nbytes, expected_nbytes)


@dataclass(frozen=True, kw_only=True)
class CudaIpcHandle:
    """Where a packed chunk lies in a CUDA buffer (backend "cuda_ipc"); JSON: `dataclasses.asdict`.

    `ipc` is base64 of the pickled `torch.multiprocessing.reductions.reduce_tensor(buf)` tuple (rebuild
    function, args), as vLLM's `ipc` backend passes handles over HTTP (`ipc_handles_pickled` in
    `vllm/distributed/weight_transfer/ipc_engine.py`); the consumer rebuilds it with the device index,
    args[6], set to its own index of the GPU named by `device_uuid` (`torch.cuda.get_device_properties
    (...).uuid` as a string), whatever its CUDA_VISIBLE_DEVICES. `nbytes` is the buffer's size. What the
    pickle may hold is the consumer's to check (`reference_impl.transport.handles.decode_ipc`).
    """

    kind: Literal["cuda_ipc"] = CUDA_IPC
    ipc: str
    nbytes: int
    device_uuid: str

    def check(self, expected_nbytes: int | None = None) -> None:
        """Check the types, that `ipc` is not empty, and the size (against `expected_nbytes` when given).

        Raises:
            ProtocolError: a wrong type, an empty ipc ("ipc"), or nbytes outside 0..MAX_INT64 or not
                `expected_nbytes` ("nbytes").
        """
        check_types(self)
        if not self.ipc:
            raise ProtocolError("ipc", "cuda_ipc handle 'ipc' is empty; send base64(pickle(reduce_tensor(buf)))")
        _check_nbytes(self.nbytes, expected_nbytes)


HANDLE_LOCATOR: dict[str, str] = {SHM: "name", CUDA_IPC: "ipc"}  # kind -> the field that says where the bytes are
HANDLE_TYPES: dict[str, type[ShmHandle] | type[CudaIpcHandle]] = {SHM: ShmHandle, CUDA_IPC: CudaIpcHandle}


def handle_from_json(body: Any, expected_nbytes: int | None = None) -> ShmHandle | CudaIpcHandle:
    """A handle (`update_info.handle`) read by its own kind and checked (`ShmHandle.check` /
    `CudaIpcHandle.check`, with `expected_nbytes` when given).

    Raises:
        ProtocolError: not an object, no or an unknown kind ("kind"), an unknown or missing field, a wrong
            type, or a rule of the kind's `check` broken.
    """
    if not isinstance(body, dict):
        raise ProtocolError("", f"a handle must be a JSON object, got {type(body).__name__}")
    kind = body.get("kind")
    if kind not in HANDLE_TYPES:
        raise ProtocolError("kind", f"handle kind {kind!r} is none of {', '.join(HANDLE_KINDS)}")
    handle = from_json(HANDLE_TYPES[kind], body, f"{kind} handle", ("kind",))
    handle.check(expected_nbytes)
    return handle


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


def chunk_nbytes(dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> int:
    """Bytes of a packed chunk of these declared dtypes and shapes (what its handle's nbytes must be).

    Raises:
        ValueError: an unknown dtype name (`dtype_from_name`), or lists of different lengths.
    """
    return sum(nbytes_of(s, dtype_from_name(d)) for d, s in zip(dtype_names, shapes, strict=True))


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

"""Colocate handles: how a trainer hands one packed chunk to an engine on the same host (or GPU) by name.

The trainer (producer) packs a chunk (`protocol.pack(..., out=...)`) into a buffer it owns and sends
`update_info.handle` with /update_weights; the engine (consumer) opens the handle, unpacks views over
the shared bytes, copies them into its parameters and closes the handle again. The handle layouts are
the protocol's (`wsh_vllm_plugin.protocol.ShmHandle`: kind "shm", name, nbytes; `CudaIpcHandle`: kind
"cuda_ipc", ipc, nbytes, device_uuid), sent as plain JSON (`dataclasses.asdict`); this module makes
and opens them:

- CPU, POSIX shared memory: one reusable segment (`SharedMemoryBuffer`) on the producer, attached
  untracked by the consumer (`open_shm_handle`).
- GPU, CUDA IPC: `cuda_ipc_handle` pickles torch's `reduce_tensor` of the buffer, as vLLM's `ipc`
  weight-transfer backend passes it over HTTP (`ipc_handles_pickled` in
  vllm/distributed/weight_transfer/ipc_engine.py); `open_cuda_ipc_handle` rebuilds it with
  `rebuild_cuda_tensor(*args)` after setting the device index, args[6], to the consumer's own index of
  the GPU that `device_uuid` names, whatever its CUDA_VISIBLE_DEVICES.

What a consumer accepts (`check_handle`, the one validation, before anything is mapped): a handle
of the engine's backend whose nbytes is exactly the chunk's declared size; an shm segment named by the
producer (`protocol.SHM_NAME_PREFIX` + hex digits: no other program's segment, no path); a cuda_ipc
pickle that names only the globals torch's `reduce_tensor` pickles for a CUDA uint8 buffer
(`IPC_GLOBALS`) and holds exactly its `(rebuild_cuda_tensor, args)` tuple (`decode_ipc`). Unpickling
calls nothing but torch.Size; the rebuild function runs only after every argument was checked.

Lifetime contract (both kinds): the producer must keep the buffer alive and unmodified from the moment
it sends the handle until the engine has acknowledged the chunk, i.e. until the 200 of its
/update_weights. Only then may it pack the next chunk into the same buffer, grow it or close it. The
consumer never unlinks or frees the producer's memory.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import inspect
import io
import os
import pickle
import secrets
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, cast

import torch
from wsh_vllm_plugin.protocol import (
    CUDA_IPC,
    MAX_INT64,
    SHM,
    CudaIpcHandle,
    ProtocolError,
    ShmHandle,
    handle_from_json,
    shm_maker_prefix,
)


def _uint8_view(shm: SharedMemory, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the first `nbytes` bytes of `shm` (no copy; it pins the segment's buffer)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)


def _close(shm: SharedMemory, who: str) -> None:
    """`shm.close()`, collecting cycles first if a view is still referenced from one.

    Raises:
        BufferError: a tensor made from the segment is still alive (message says which segment).
    """
    try:
        shm.close()
    except BufferError:
        gc.collect()
        try:
            shm.close()
        except BufferError as e:
            raise BufferError(
                f"{who}: a tensor made from shared-memory segment {shm.name} is still alive; drop every "
                "view of it before closing"
            ) from e


# ---------------------------------------------------------------- CPU: POSIX shared memory (producer)


def _create_segment(size: int) -> SharedMemory:
    """A new segment of `size` bytes named `SHM_NAME_PREFIX`, this process's pid and 16 random hex digits
    (`protocol.shm_maker_prefix`; the only names an engine maps: `protocol.ShmHandle.check`)."""
    while True:
        try:
            return SharedMemory(name=shm_maker_prefix(os.getpid()) + secrets.token_hex(8), create=True, size=size)
        except FileExistsError:  # 2^-64 per try; as SharedMemory's own naming does, try another
            continue


class SharedMemoryBuffer:
    """A producer-named, reusable POSIX shared-memory segment for packed chunks.

    Usage per chunk: `grow(n)`, `protocol.pack(tensors, out=buf.tensor(n))`, POST /update_weights with
    `handle(n)`, wait for its 200, repeat; `close()` at the end (it unlinks the segment).

    The buffer must stay alive and unmodified until the engine has acknowledged the chunk (the 200 of
    its /update_weights). Views returned by `tensor()` pin the segment: drop them before `grow()` or
    `close()` (a BufferError says one is still alive).

    Args:
        capacity: bytes of the segment (at least 1 byte is allocated).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity}")
        self._shm: SharedMemory | None = _create_segment(max(1, int(capacity)))

    @property
    def shm(self) -> SharedMemory:
        if self._shm is None:
            raise ValueError("SharedMemoryBuffer is closed")
        return self._shm

    @property
    def name(self) -> str:
        """The segment's name (what a handle carries)."""
        return self.shm.name

    @property
    def capacity(self) -> int:
        """Bytes the segment holds."""
        return self.shm.size

    def tensor(self, nbytes: int) -> torch.Tensor:
        """A writable uint8 view (no copy) of the segment's first `nbytes` bytes.

        Raises:
            ValueError: `nbytes` exceeds the capacity (call `grow(nbytes)` first).
        """
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(
                f"{nbytes} bytes do not fit shared-memory segment {self.name} of {self.capacity} bytes; "
                "call grow() first"
            )
        return _uint8_view(self.shm, nbytes)

    def grow(self, nbytes: int) -> bool:
        """Make sure the segment holds `nbytes`; returns True when it was replaced by a new, larger one.

        The old segment is unlinked and closed (its name stops working): only call this once every chunk
        sent from it was acknowledged, and after dropping its views.
        """
        if nbytes <= self.capacity:
            return False
        old = self.shm
        new = _create_segment(int(nbytes))
        self._shm = new
        old.unlink()
        _close(old, "SharedMemoryBuffer.grow")
        return True

    def handle(self, nbytes: int) -> dict[str, Any]:
        """The handle of the segment's first `nbytes` bytes: `{"kind": "shm", "name", "nbytes"}`."""
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"handle of {nbytes} bytes for segment {self.name} of {self.capacity} bytes")
        return asdict(ShmHandle(name=self.name, nbytes=int(nbytes)))

    def close(self) -> None:
        """Close and unlink the segment (idempotent). Drop the views from `tensor()` first."""
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        try:
            _close(shm, "SharedMemoryBuffer.close")
        finally:
            shm.unlink()

    def __enter__(self) -> SharedMemoryBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- CPU: POSIX shared memory (consumer)


def check_handle(handle: Any, backend: str, nbytes: int | None = None) -> ShmHandle | CudaIpcHandle:
    """The one validation of a colocate handle (`update_info.handle`), before anything is mapped.

    The handle is read by its own kind (`protocol.handle_from_json`): an shm segment name must be the
    producer's (`protocol.SHM_NAME_PREFIX` + hex digits), a cuda_ipc pickle may hold only what torch's
    `reduce_tensor` pickles for a CUDA uint8 buffer (`decode_ipc`); then its kind must be `backend`, and
    its nbytes `nbytes` (the chunk's declared dtypes x shapes) when given.

    Raises:
        ProtocolError: field "" (not an object), "kind" (unknown, or not `backend`), "name", "ipc",
            "nbytes", "device_uuid" or an unknown field, with the reason.
    """
    parsed = handle_from_json(handle, nbytes)
    if isinstance(parsed, CudaIpcHandle):
        decode_ipc(parsed.ipc, parsed.nbytes)
    if parsed.kind != backend:
        raise ProtocolError("kind", f"handle kind {parsed.kind!r} does not match the transfer backend {backend}")
    return parsed


def _attach(name: str) -> SharedMemory:
    """Attach to an existing segment without letting this process's resource tracker unlink it at exit.

    On Python < 3.13 attaching registers the name with the tracker, which would unlink the producer's
    segment when this process ends (bpo-39959); unregistering right away prevents that. Python 3.13+
    has `track=False`.
    """
    if "track" in inspect.signature(SharedMemory).parameters:
        return SharedMemory(name=name, create=False, track=False)
    shm = SharedMemory(name=name, create=False)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    return shm


def _clear_exception_frames(exc: BaseException | None) -> None:
    """Clear the locals of the finished frames an exception (and its causes) hold: views of the segment
    may sit there and would keep it from closing."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


@contextlib.contextmanager
def open_shm_handle(handle: ShmHandle | dict[str, Any]) -> Iterator[torch.Tensor]:
    """Consumer side of a `{"kind": "shm"}` handle: yields a uint8 view (no copy) of its `nbytes` bytes.

    A handle given as JSON is checked first (`check_handle`). The segment is the producer's: it is
    attached untracked (never unlinked here) and closed on exit. Every tensor made from the view (unpacked
    pieces included) must be dropped before the block ends, also by the code inside the block (`del` its
    names); locals of frames in an exception propagating out of the block are cleared for that purpose.

    Raises:
        ProtocolError: a malformed handle (`check_handle`).
        ValueError: a segment smaller than `nbytes`.
        FileNotFoundError: no segment of that name (the producer closed it, or never made it).
        BufferError: a view outlived the block.
    """
    if not isinstance(handle, ShmHandle):
        handle = cast(ShmHandle, check_handle(handle, SHM))
    name, nbytes = handle.name, handle.nbytes
    shm = _attach(name)
    try:
        if shm.size < nbytes:
            raise ValueError(f"shared-memory segment {name} holds {shm.size} bytes, fewer than the handle's {nbytes}")
        view = _uint8_view(shm, nbytes)
    except BaseException:
        shm.close()
        raise
    try:
        yield view
    except BaseException as e:
        _clear_exception_frames(e)
        raise
    finally:
        del view
        _close(shm, "open_shm_handle")


# ---------------------------------------------------------------- GPU: CUDA IPC


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs CUDA, but torch.cuda.is_available() is False in this process; "
            "on CPU use the shared-memory handle (SharedMemoryBuffer, backend 'shm')"
        )


def cuda_ipc_handle(buf: torch.Tensor) -> dict[str, Any]:
    """Producer side: the CUDA IPC handle of a packed uint8 CUDA buffer (a view of a larger one is fine).

    Returns `{"kind": "cuda_ipc", "ipc": base64(pickle(reduce_tensor(buf))), "nbytes", "device_uuid"}`.
    `buf` must stay alive and unmodified until the engine has acknowledged the chunk (the 200 of its
    /update_weights); then call `torch.cuda.ipc_collect()` now and then to free what consumers released.

    Raises:
        RuntimeError: no CUDA here, or `buf` is not a CUDA tensor.
        ValueError: `buf` is not a contiguous 1-D uint8 tensor.
    """
    _require_cuda("cuda_ipc_handle")
    if not buf.is_cuda:
        raise RuntimeError(f"cuda_ipc_handle needs a CUDA tensor, got one on {buf.device}")
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"cuda_ipc_handle takes a contiguous 1-D uint8 buffer, got {buf.dtype} {list(buf.shape)}")
    from torch.multiprocessing.reductions import reduce_tensor

    reduced = reduce_tensor(buf)  # (rebuild_cuda_tensor, args)
    handle = CudaIpcHandle(
        ipc=base64.b64encode(pickle.dumps(reduced)).decode("ascii"),
        nbytes=int(buf.numel()),
        device_uuid=str(torch.cuda.get_device_properties(buf.device).uuid),
    )
    return asdict(handle)


# What `torch.multiprocessing.reductions.reduce_tensor` pickles for a CUDA tensor (torch 2.13,
# torch/multiprocessing/reductions.py, its `storage._untyped_storage.device.type == "cuda"` branch):
# `(rebuild_cuda_tensor, (type(tensor), tensor.size(), tensor.stride(), tensor_offset, type(storage),
# tensor.dtype, device, handle, storage_size_bytes, storage_offset_bytes, tensor.requires_grad,
# ref_counter_handle, ref_counter_offset, event_handle, event_sync_required))`, the last eight fields
# from `storage._share_cuda_()` (torch/csrc/StorageSharing.cpp: the handles are bytes, or None with the
# sync flag for a storage without data). `storage` is `tensor._typed_storage()`, a TypedStorage. The
# globals such a pickle names, by qualified name: nothing else may be unpickled.
REBUILD_CUDA_TENSOR = "torch.multiprocessing.reductions.rebuild_cuda_tensor"
IPC_TENSOR_CLASSES = ("torch.Tensor", "torch.nn.parameter.Parameter")  # type(tensor)
IPC_STORAGE_CLASS = "torch.storage.TypedStorage"  # type(tensor._typed_storage())
IPC_GLOBALS: tuple[str, ...] = (
    REBUILD_CUDA_TENSOR,
    *IPC_TENSOR_CLASSES,
    IPC_STORAGE_CLASS,
    "torch.Size",  # tensor.size()
    "torch.uint8",  # tensor.dtype of a packed chunk
)


@dataclass(frozen=True, slots=True)
class _Named:
    """A callable global of the allow-list, by name: unpickling never calls it (a REDUCE on it raises);
    `open_cuda_ipc_handle` calls the real one after the whole tuple was checked."""

    qualname: str

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise pickle.UnpicklingError(f"a cuda_ipc handle may not call {self.qualname} while it is unpickled")


class _IpcUnpickler(pickle.Unpickler):
    """Unpickles only `IPC_GLOBALS`: torch.Size (its own REDUCE rebuilds it) and torch.uint8 as themselves,
    the rebuild function and the classes as `_Named` markers (never called here)."""

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{module}.{name}"
        if qualname not in IPC_GLOBALS:
            raise pickle.UnpicklingError(
                f"a cuda_ipc handle may reference only what torch's reduce_tensor pickles for a CUDA tensor "
                f"({', '.join(IPC_GLOBALS)}), not {qualname}"
            )
        if qualname == "torch.Size":
            return torch.Size
        if qualname == "torch.uint8":
            return torch.uint8
        return _Named(qualname)


def _is_int(v: Any, low: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= MAX_INT64


# Each argument of rebuild_cuda_tensor (reduce_tensor's order): its name and what it must be.
_IPC_ARGS: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("tensor_cls", " or ".join(IPC_TENSOR_CLASSES), lambda v: v in [_Named(c) for c in IPC_TENSOR_CLASSES]),
    ("tensor_size", "a 1-D torch.Size", lambda v: type(v) is torch.Size and len(v) == 1),
    ("tensor_stride", "(1,)", lambda v: v == (1,) and type(v) is tuple and type(v[0]) is int),
    ("tensor_offset", "an int >= 0", _is_int),
    ("storage_cls", IPC_STORAGE_CLASS, lambda v: v == _Named(IPC_STORAGE_CLASS)),
    ("dtype", "torch.uint8", lambda v: v is torch.uint8),
    ("storage_device", "a device index >= 0", _is_int),
    ("storage_handle", "bytes or None", lambda v: v is None or type(v) is bytes),
    ("storage_size_bytes", "an int >= 0", _is_int),
    ("storage_offset_bytes", "an int >= 0", _is_int),
    ("requires_grad", "a bool", lambda v: type(v) is bool),
    ("ref_counter_handle", "bytes or None", lambda v: v is None or type(v) is bytes),
    ("ref_counter_offset", "an int >= 0", _is_int),
    ("event_handle", "bytes or None", lambda v: v is None or type(v) is bytes),
    ("event_sync_required", "a bool or None", lambda v: v is None or type(v) is bool),
)


def decode_ipc(ipc: str, nbytes: int) -> list[Any]:
    """The checked arguments of `rebuild_cuda_tensor` in a handle's `ipc` string; calls nothing.

    The pickle may name only `IPC_GLOBALS` and must be `(rebuild_cuda_tensor, args)` with each of the 15
    args what `reduce_tensor` makes of a contiguous 1-D uint8 CUDA buffer of `nbytes` bytes (`_IPC_ARGS`),
    lying inside its storage. The tensor and storage classes come back as markers; `open_cuda_ipc_handle`
    puts the real ones in.

    Raises:
        ProtocolError: field "ipc": not base64, not such a pickle (naming the global it may not
            reference, or the argument that is not what reduce_tensor makes, and why).
    """
    try:
        raw = base64.b64decode(ipc, validate=True)
    except ValueError as e:
        raise ProtocolError("ipc", f"cuda_ipc handle 'ipc' is not base64: {e}") from None
    try:
        loaded = _IpcUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # a hostile pickle can raise anything; nothing of it ran
        why = f"{type(e).__name__}: {e}"
        raise ProtocolError("ipc", f"cuda_ipc handle 'ipc' is not a reduce_tensor pickle: {why}") from None
    if not (type(loaded) is tuple and len(loaded) == 2 and loaded[0] == _Named(REBUILD_CUDA_TENSOR)):
        raise ProtocolError("ipc", f"cuda_ipc handle 'ipc' does not hold ({REBUILD_CUDA_TENSOR}, args)")
    args = loaded[1]
    if type(args) is not tuple or len(args) != len(_IPC_ARGS):
        raise ProtocolError("ipc", f"cuda_ipc handle 'ipc' holds no tuple of {len(_IPC_ARGS)} rebuild arguments")
    for i, ((name, want, ok), value) in enumerate(zip(_IPC_ARGS, args, strict=True)):
        if not ok(value):
            raise ProtocolError("ipc", f"cuda_ipc rebuild argument {i} ({name}) must be {want}, got {value!r:.80}")
    if args[1][0] != nbytes or args[3] + nbytes > args[8]:
        raise ProtocolError(
            "ipc",
            f"cuda_ipc buffer of {args[1][0]} bytes at offset {args[3]} in a storage of {args[8]} bytes; the handle "
            f"says {nbytes} bytes",
        )
    return list(args)


def _local_device_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid` (the current device when no uuid is given)."""
    if not uuid:
        return torch.cuda.current_device()
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(f"cuda_ipc handle is for GPU {uuid}, which this process does not see; colocate the engine on it")


def open_cuda_ipc_handle(handle: CudaIpcHandle | dict[str, Any]) -> torch.Tensor:
    """Consumer side of a `{"kind": "cuda_ipc"}` handle: the producer's uint8 buffer, rebuilt (no copy).

    A handle given as JSON is checked first (`check_handle`); the rebuild arguments are `decode_ipc`'s,
    with the real tensor and storage classes and the device index, args[6], set to this process's index
    of the GPU `device_uuid` names (as vLLM's ipc engine does). Drop the returned tensor (and views of
    it) once the chunk is loaded.

    Raises:
        RuntimeError: no CUDA here, or the handle's GPU is not visible.
        ProtocolError: a malformed handle (`check_handle`, `decode_ipc`).
    """
    _require_cuda("open_cuda_ipc_handle")
    if not isinstance(handle, CudaIpcHandle):
        handle = cast(CudaIpcHandle, check_handle(handle, CUDA_IPC))
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = decode_ipc(handle.ipc, handle.nbytes)
    args[0] = torch.nn.parameter.Parameter if args[0] == _Named(IPC_TENSOR_CLASSES[1]) else torch.Tensor
    args[4] = torch.storage.TypedStorage
    args[6] = _local_device_index(handle.device_uuid)
    return rebuild_cuda_tensor(*args)

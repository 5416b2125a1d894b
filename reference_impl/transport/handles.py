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
import pickle
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch
from wsh_vllm_plugin.protocol import CUDA_IPC, SHM, CudaIpcHandle, ShmHandle


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
        self._shm: SharedMemory | None = SharedMemory(create=True, size=max(1, int(capacity)))

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
        new = SharedMemory(create=True, size=int(nbytes))
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


def _check_handle(handle: Any, kind: str) -> int:
    """The handle's nbytes after checking its common fields (ValueError on a malformed handle)."""
    if not isinstance(handle, dict):
        raise ValueError(f"a handle must be an object, got {type(handle).__name__}")
    if handle.get("kind") != kind:
        raise ValueError(f"handle kind {handle.get('kind')!r} where {kind!r} was expected")
    nbytes = handle.get("nbytes")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"handle nbytes must be an integer >= 0, got {nbytes!r}")
    return nbytes


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
def open_shm_handle(handle: dict[str, Any]) -> Iterator[torch.Tensor]:
    """Consumer side of a `{"kind": "shm"}` handle: yields a uint8 view (no copy) of its `nbytes` bytes.

    The segment is the producer's: it is attached untracked (never unlinked here) and closed on exit.
    Every tensor made from the view (unpacked pieces included) must be dropped before the block ends,
    also by the code inside the block (`del` its names); locals of frames in an exception propagating
    out of the block are cleared for that purpose.

    Raises:
        ValueError: a malformed handle, or a segment smaller than `nbytes`.
        FileNotFoundError: no segment of that name (the producer closed it, or never made it).
        BufferError: a view outlived the block.
    """
    nbytes = _check_handle(handle, SHM)
    name = handle.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"shm handle name must be a non-empty string, got {name!r}")
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


class _TorchOnlyUnpickler(pickle.Unpickler):
    """Unpickles only torch globals (a reduce_tensor tuple needs nothing else)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or module.startswith("torch."):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a cuda_ipc handle may reference only torch objects, not {module}.{name}")


def decode_ipc(ipc: str) -> tuple[Any, list[Any]]:
    """The (rebuild function, args) of a handle's `ipc` string (torch globals only).

    Raises:
        ValueError: not base64 of a pickled (callable, args) pair of torch objects.
    """
    try:
        rebuild, args = _TorchOnlyUnpickler(io.BytesIO(base64.b64decode(ipc, validate=True))).load()
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError) as e:
        raise ValueError(f"cuda_ipc handle 'ipc' is not a base64 pickled reduce_tensor tuple: {e}") from e
    if not callable(rebuild) or not isinstance(args, tuple | list):
        raise ValueError("cuda_ipc handle 'ipc' does not hold a (rebuild function, args) pair")
    return rebuild, list(args)


def _local_device_index(uuid: str | None) -> int:
    """This process's index of the GPU with `uuid` (the current device when no uuid is given)."""
    if not uuid:
        return torch.cuda.current_device()
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(f"cuda_ipc handle is for GPU {uuid}, which this process does not see; colocate the engine on it")


def open_cuda_ipc_handle(handle: dict[str, Any]) -> torch.Tensor:
    """Consumer side of a `{"kind": "cuda_ipc"}` handle: the producer's uint8 buffer, rebuilt (no copy).

    Drop the returned tensor (and views of it) once the chunk is loaded.

    Raises:
        RuntimeError: no CUDA here, or the handle's GPU is not visible.
        ValueError: a malformed handle, or a buffer whose size is not the handle's `nbytes`.
    """
    _require_cuda("open_cuda_ipc_handle")
    nbytes = _check_handle(handle, CUDA_IPC)
    ipc = handle.get("ipc")
    if not isinstance(ipc, str) or not ipc:
        raise ValueError("cuda_ipc handle needs 'ipc': base64 of pickle(reduce_tensor(buf))")
    rebuild, args = decode_ipc(ipc)
    if len(args) > 6:
        args[6] = _local_device_index(handle.get("device_uuid"))  # as vLLM's ipc engine does
    buf = rebuild(*args)
    if buf.dtype != torch.uint8 or buf.numel() != nbytes:
        raise ValueError(f"cuda_ipc buffer is {buf.dtype} of {buf.numel()} elements; the handle says {nbytes} bytes")
    return buf

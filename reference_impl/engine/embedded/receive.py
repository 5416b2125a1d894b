"""How the embedded engine gets one chunk's bytes and loads them: transfer backends and handles.

Backends (`init_info.backend` of /init_weight_transfer_engine):

- "gloo" (non-colocate): the engine joins the trainer's transfer group; each /update_weights receives
  the packed chunk by broadcast (`wsh_vllm_plugin.group.TransferGroup.receive_chunk`).
- "shm" (colocate on CPU) and "cuda_ipc" (colocate on GPU): nothing to join; each /update_weights
  carries `update_info.handle` (`protocol.ShmHandle` / `protocol.CudaIpcHandle`, opened by
  `reference_impl.transport.handles`) and the engine reads the packed chunk from the producer's
  memory. Nothing is copied before the load: the unpacked tensors are views
  over the shared buffer, the loader copies them into the parameters, and every view is dropped before
  the handle is closed. The producer keeps the buffer until the 200 of /update_weights.

Either way the same `ChunkApplier.apply` validates, unpacks and loads the chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from wsh_vllm_plugin import protocol

from reference_impl.engine.embedded.loader import EngineLoader, LoadRejected
from reference_impl.transport import handles


class ChunkRejected(Exception):
    """A chunk refused with a 400: `error` sentence, `rejected` {hf_name: reason}, `kinds` {hf_name: kind}."""

    def __init__(self, error: str, rejected: dict[str, str] | None = None, kinds: dict[str, str] | None = None):
        super().__init__(error)
        self.error = error
        self.rejected = dict(rejected or {})
        self.kinds = dict(kinds or {})


def _bytes_rejected(chunk: str, names: Sequence[str], reason: str, fix: str) -> ChunkRejected:
    return ChunkRejected(
        f"{chunk}: {reason}; {fix}",
        dict.fromkeys(names, f"{chunk}: {reason}"),
        dict.fromkeys(names, "bytes"),
    )


def check_handle(
    handle: Any, backend: str, chunk: str, names: Sequence[str], nbytes: int
) -> protocol.ShmHandle | protocol.CudaIpcHandle:
    """The chunk's handle, checked by `handles.check_handle` (the one validation) against the engine's
    handle backend and the chunk's declared size `nbytes`; nothing is mapped.

    Raises:
        ChunkRejected: kind "bytes" for every name: no handle, or one `handles.check_handle` refuses (the
            reason names the field: a foreign segment name, a size that is not `nbytes`, a pickled global
            that reduce_tensor does not make, ...).
    """
    fix = f'send update_info.handle {{"kind": "{backend}", ...}} made by reference_impl.transport.handles'
    if handle is None:
        raise _bytes_rejected(chunk, names, f"no handle in update_info, but the transfer backend is {backend}", fix)
    try:
        return handles.check_handle(handle, backend, nbytes)
    except protocol.ProtocolError as e:
        where = f"update_info.handle.{e.field}" if e.field else "update_info.handle"
        raise _bytes_rejected(chunk, names, f"{where} refused: {e}", fix) from None


@contextlib.contextmanager
def _open_cuda_ipc(handle: protocol.CudaIpcHandle) -> Iterator[torch.Tensor]:
    buf = handles.open_cuda_ipc_handle(handle)
    try:
        yield buf
    finally:
        del buf


def open_handle(
    stack: contextlib.ExitStack,
    handle: protocol.ShmHandle | protocol.CudaIpcHandle,
    chunk: str,
    names: Sequence[str],
) -> torch.Tensor:
    """Open a handle `check_handle` returned inside `stack` (closed when it exits); the chunk's uint8
    bytes, no copy.

    The caller must drop the returned tensor (and every view of it) before `stack` exits.

    Raises:
        ChunkRejected: kind "bytes": the handle cannot be opened (no such segment, too small, no GPU).
    """
    try:
        if isinstance(handle, protocol.ShmHandle):
            return stack.enter_context(handles.open_shm_handle(handle))
        return stack.enter_context(_open_cuda_ipc(handle))
    except (OSError, ValueError, RuntimeError) as e:
        raise _bytes_rejected(
            chunk,
            names,
            f"its {handle.kind} handle cannot be opened ({type(e).__name__}: {e})",
            "keep the buffer alive and unmodified until the engine answered this /update_weights",
        ) from None


class ChunkApplier:
    """Validates, unpacks and loads chunks into `loader`."""

    def __init__(self, loader: EngineLoader) -> None:
        self.loader = loader

    def check(
        self, chunk: str, names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> int:
        """Check a chunk's declared metadata against the engine's shards; reads no bytes.

        Returns:
            the chunk's packed size in bytes (what its handle or broadcast must carry).

        Raises:
            ChunkRejected: a name, shape or dtype the loader refuses (kinds per name), or lists of
                different lengths.
        """
        try:
            rejected, kinds = self.loader.validate(names, dtype_names, shapes)
        except ValueError as e:
            raise ChunkRejected(f"{chunk}: {e}") from None
        if rejected:
            raise ChunkRejected(str(LoadRejected(rejected, kinds)), rejected, kinds)
        return protocol.chunk_nbytes(dtype_names, shapes)

    def apply(
        self,
        chunk: str,
        names: Sequence[str],
        dtype_names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        payload: torch.Tensor,
    ) -> None:
        """Validate the chunk's metadata, unpack `payload` (views over it) and load it (copies).

        When it returns, no tensor made from `payload` is left; when it raises, such tensors sit only in
        the finished frames of the exception's traceback (`handles.open_shm_handle` clears those).

        Raises:
            ChunkRejected: metadata the loader refuses (name/shape/dtype), or bytes that do not match
                the declared dtypes/shapes ("bytes"); nothing of the chunk was loaded.
        """
        self.check(chunk, names, dtype_names, shapes)
        dtypes = [protocol.dtype_from_name(d) for d in dtype_names]
        received = int(payload.numel())
        try:
            tensors = protocol.unpack(payload, dtypes, shapes)
        except ValueError as e:
            reason = f"{chunk} holds {received} bytes, which does not match its declared dtypes/shapes"
            raise ChunkRejected(
                f"{e} ({chunk}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}); "
                "make the packed bytes match dtype_names and shapes",
                dict.fromkeys(names, reason),
                dict.fromkeys(names, "bytes"),
            ) from None
        try:
            self.loader.load(names, dtype_names, shapes, tensors)
        except LoadRejected as e:
            raise ChunkRejected(str(e), e.rejected, e.kinds) from None
        finally:
            del tensors

"""Colocate channels: trainer and engine share the devices; a chunk travels by handle, not by collective.

- CPU: `SharedMemoryChannel` packs each chunk into one reusable POSIX shared-memory segment and passes
  `{"kind": "shm", "name", "nbytes"}` in the chunk's `update_info["handle"]`; the engine maps the
  segment and copies the tensors into its parameters.
- GPU: `CudaIpcChannel` packs into a CUDA buffer and passes a CUDA IPC handle (torch `reduce_tensor`),
  as vLLM's `ipc` weight-transfer backend expects.
The producer keeps the buffer alive and unmodified until the engine has acknowledged the chunk (the
200 of its /update_weights): `send` returns only then, and only the next `send` writes the buffer again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from wsh_vllm_plugin.protocol import CUDA_IPC, SHM, UpdateInfo, pack

from reference_impl.transport.client import EngineClient
from reference_impl.transport.handles import SharedMemoryBuffer, cuda_ipc_handle


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class SharedMemoryChannel:
    """Chunks through one reusable shared-memory segment (grown when a chunk needs more)."""

    backend = SHM

    def __init__(self, capacity: int = 1 << 20) -> None:
        self.buffer = SharedMemoryBuffer(capacity)

    def send(self, client: EngineClient, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
        """Pack into the segment, post /update_weights with its handle, return the engine's answer.

        Raises:
            EngineRejected: the engine answered non-200.
        """
        nbytes = _nbytes(tensors)
        self.buffer.grow(nbytes)
        pack(tensors, out=self.buffer.tensor(nbytes))
        return client.update(replace(info, handle=self.buffer.handle(nbytes)), sync, info.chunk_index)

    def close(self) -> None:
        """Close and unlink the segment."""
        self.buffer.close()


class CudaIpcChannel:
    """Chunks through one reusable CUDA buffer shared by IPC handle (GPU hosts only)."""

    backend = CUDA_IPC

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaIpcChannel needs a CUDA device; on CPU use SharedMemoryChannel")
        self.buffer = torch.empty(0, dtype=torch.uint8, device="cuda")

    def send(self, client: EngineClient, tensors: list[torch.Tensor], info: UpdateInfo, sync: int) -> Any:
        """Pack into the CUDA buffer, post /update_weights with its IPC handle, return the engine's answer."""
        nbytes = _nbytes(tensors)
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        payload = pack([t.cuda() for t in tensors], out=self.buffer)
        torch.cuda.synchronize()
        return client.update(replace(info, handle=cuda_ipc_handle(payload)), sync, info.chunk_index)

    def close(self) -> None:
        """Drop the buffer."""
        self.buffer = torch.empty(0, dtype=torch.uint8, device="cuda")

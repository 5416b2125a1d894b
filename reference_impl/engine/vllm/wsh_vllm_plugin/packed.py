"""vLLM's packed weight-transfer format (its `nccl` and `ipc` backends, vLLM 0.32), written from vLLM's
documented format with torch only, so that a trainer without vLLM can speak it.

vLLM ships the sender of this format (`NCCLTrainerWeightTransferEngine`, `packed_nccl_broadcast_producer`,
`packed_ipc_producer`) inside the `vllm` package, whose import pulls vLLM's whole dependency tree, and
its producer needs CUDA streams; the trainer's environment has no vLLM. So this module writes the
format's rules; `tests/test_vllm_packed.py` checks them byte for byte against vLLM's own `pack_tensors` /
`unpack_tensor` / typed infos in vLLM's environment.

The facts (vllm/distributed/weight_transfer/: nccl_common.py, nccl_engine.py, ipc_engine.py,
packed_tensor.py):

- `init_info` of backend `nccl` (`NCCLWeightTransferInitInfo`, keyword-only): `master_address`,
  `master_port` (a TCPStore rendezvous) or `nccl_unique_id_b64` (standard base64 of the 128-byte
  `ncclUniqueId`; every rank then enters `ncclCommInitRank` at once and runs a one-element float32
  `all_reduce` warm-up before any other collective), `rank_offset`, `world_size`, `packed`,
  `packed_buffer_size_bytes` (default 1 GiB), `packed_num_buffers` (default 2; streams only, no effect
  on the bytes). The worker joins as rank `rank_offset` + its global worker index.
- `update_info` of backend `nccl` (`NCCLWeightTransferUpdateInfo`): exactly `names`, `dtype_names`,
  `shapes` (the typed info is built by keyword: any other key is refused). Dtype names are torch's
  without "torch." (`getattr(torch, name)` on the worker).
- Packed broadcast: the tensors of one `update_info`, in order, are cut into buffers; a buffer takes
  tensors until its byte count EXCEEDS `packed_buffer_size_bytes` (the tensor that crosses the bound is
  in it), the last buffer takes what is left. A buffer is its tensors' raw bytes concatenated (uint8, no
  header, no padding), broadcast from rank 0, buffers in order. The receiver sizes every buffer from
  `update_info` (prod(shape) * itemsize of the declared dtype): nothing on the wire says how long a
  buffer is, so sender and receiver must agree on the declaration.
- `init_info` of backend `ipc` (`IPCWeightTransferInitInfo`): `{"packed": true}`. `update_info`
  (`IPCWeightTransferUpdateInfo`): `names`, `dtype_names`, `shapes`, `tensor_sizes` (bytes of each
  tensor in the buffer), and `ipc_handles_pickled`: standard base64 of the pickled `{gpu_uuid: args}`,
  `args` being the second item of `torch.multiprocessing.reductions.reduce_tensor(buffer)` (the worker
  sets args[6] to its own device index; the server needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1`). The
  worker clones every tensor out of the buffer before it answers, so the producer may reuse its buffer
  for the next chunk once the call returned.
"""

from __future__ import annotations

import base64
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

from wsh_vllm_plugin.protocol import ProtocolError

VLLM_NCCL = "nccl"  # vLLM's NCCL backend (GPU), non-colocate
VLLM_IPC = "ipc"  # vLLM's CUDA IPC backend (GPU), colocate
VLLM_GLOO = "gloo"  # this package's backend for vLLM on CPU: the `nccl` format over a gloo group
DEFAULT_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
DEFAULT_NUM_BUFFERS = 2  # vLLM's DEFAULT_PACKED_NUM_BUFFERS
NCCL_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
UPDATE_INFO_KEYS: tuple[str, ...] = ("names", "dtype_names", "shapes")  # NCCLWeightTransferUpdateInfo's fields


def torch_dtype(dtype_name: str, tensor: str = "") -> torch.dtype:
    """The torch dtype a worker reads from a dtype name (`getattr(torch, name)`, as vLLM's engines do).

    Raises:
        ProtocolError: field "dtype_names": not the name of a torch dtype (`tensor` names the tensor).
    """
    dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ProtocolError("dtype_names", f"{tensor or 'update_info'}: {dtype_name!r} is not a torch dtype name")
    return dtype


def declared_nbytes(names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[int]:
    """Bytes of each declared tensor: prod(shape) * itemsize of the declared dtype (what the receiver
    sizes its buffers from).

    Raises:
        ProtocolError: the lists differ in length (field "names"), an unknown dtype name or a negative
            dimension (field "dtype_names" / "shapes").
    """
    if not len(names) == len(dtype_names) == len(shapes):
        raise ProtocolError(
            "names",
            f"update_info lists differ in length: {len(names)} names, {len(dtype_names)} dtype_names, "
            f"{len(shapes)} shapes; send one dtype name and one shape per name",
        )
    out = []
    for name, dname, shape in zip(names, dtype_names, shapes, strict=True):
        itemsize = torch.empty((), dtype=torch_dtype(dname, name)).element_size()
        if any(int(d) < 0 for d in shape):
            raise ProtocolError("shapes", f"{name}: negative dimension in shape {list(shape)}")
        out.append(math.prod(int(d) for d in shape) * itemsize)
    return out


def buffer_spans(sizes: Sequence[int], buffer_size_bytes: int) -> list[range]:
    """The packed buffers of one `update_info`: index ranges into its tensors, in order (see module doc:
    a buffer takes tensors until its size exceeds `buffer_size_bytes`). No tensors, no buffers.

    Raises:
        ValueError: `buffer_size_bytes` < 1.
    """
    if buffer_size_bytes < 1:
        raise ValueError(f"packed_buffer_size_bytes must be >= 1, got {buffer_size_bytes}")
    spans, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total > buffer_size_bytes:
            spans.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        spans.append(range(start, len(sizes)))
    return spans


def pack_declared(tensors: Sequence[torch.Tensor], sizes: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """One packed buffer: each tensor's raw bytes in its declared slot of `sizes` bytes, in order.

    The wire carries exactly what `update_info` declared, because that is all the receiver knows: a
    tensor whose byte count differs from its declaration (a sender whose update_info lies about its
    tensors) fills its slot with its first bytes, zero-padded, so the receiver stays in step with the
    stream and judges the declaration (e.g. refuses its dtype) instead of the collective failing or
    hanging. `out`: a flat uint8 buffer of at least sum(sizes) bytes on the tensors' device; the returned
    view is its first sum(sizes) bytes.

    Raises:
        ValueError: `out` is smaller than the buffer, or the two lists differ in length.
    """
    total = sum(sizes)
    if out.numel() < total:
        raise ValueError(f"packing buffer holds {out.numel()} bytes, the packed buffer needs {total}")
    buf, off = out[:total], 0
    for t, n in zip(tensors, sizes, strict=True):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        k = min(n, raw.numel())
        buf[off : off + k].copy_(raw[:k])
        if k < n:
            buf[off + k : off + n].zero_()
        off += n
    return buf


class PackedSender:
    """The sender of vLLM's packed broadcast for one transfer group: cuts a chunk's tensors into packed
    buffers (`buffer_spans` over their declared sizes), packs each (`pack_declared`) into one reusable
    buffer and hands it to `broadcast` (which broadcasts it from rank 0 and returns when the group took
    it), buffer after buffer.
    """

    def __init__(
        self,
        broadcast: Callable[[torch.Tensor], None],
        buffer_size_bytes: int = DEFAULT_BUFFER_BYTES,
        device: torch.device | str = "cpu",
    ) -> None:
        self.broadcast, self.buffer_size_bytes, self.device = broadcast, buffer_size_bytes, torch.device(device)
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)

    def send(
        self,
        tensors: Sequence[torch.Tensor],
        sizes: Sequence[int],
        keep_going: Callable[[], bool] = lambda: True,
    ) -> list[int]:
        """Broadcast `tensors` (declared sizes `sizes`, from `declared_nbytes`) as packed buffers; returns
        the byte count of each buffer sent. Before each buffer `keep_going()` is asked (e.g. "the engine
        has not answered yet"): when False, the rest is not sent (nobody would receive it).

        Raises:
            ValueError: the two lists differ in length.
            RuntimeError: from the group (a peer left, the group's timeout passed).
        """
        if len(tensors) != len(sizes):
            raise ValueError(f"{len(tensors)} tensors but {len(sizes)} declared sizes")
        sent = []
        for span in buffer_spans(sizes, self.buffer_size_bytes):
            if not keep_going():
                break
            need = sum(sizes[i] for i in span)
            if self.buffer.numel() < need:
                self.buffer = torch.empty(need, dtype=torch.uint8, device=self.device)
            buf = pack_declared([tensors[i] for i in span], [sizes[i] for i in span], self.buffer)
            self.broadcast(buf)
            sent.append(need)
        return sent


# ---------------------------------------------------------------- bodies


def nccl_init_info(
    *,
    world_size: int,
    master_address: str | None = None,
    master_port: int | None = None,
    nccl_unique_id: bytes | None = None,
    rank_offset: int = 1,
    buffer_size_bytes: int = DEFAULT_BUFFER_BYTES,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
) -> dict[str, Any]:
    """`init_info` of backend `nccl` (and of this package's `gloo` backend, which takes the same body), packed.

    Give `master_address` and `master_port` (TCPStore rendezvous) or `nccl_unique_id` (128 bytes).

    Raises:
        ProtocolError: both or neither rendezvous given, a unique id of another length, or a rank_offset
            outside 1..world_size-1 (rank 0 is the sender).
    """
    has_store = master_address is not None or master_port is not None
    if has_store == (nccl_unique_id is not None):
        raise ProtocolError("master_address", "give master_address and master_port, or nccl_unique_id (not both)")
    if not 0 < rank_offset < world_size:
        raise ProtocolError("rank_offset", f"rank_offset {rank_offset} must lie in 1..world_size-1 ({world_size})")
    body: dict[str, Any] = {
        "rank_offset": rank_offset,
        "world_size": world_size,
        "packed": True,
        "packed_buffer_size_bytes": buffer_size_bytes,
        "packed_num_buffers": num_buffers,
    }
    if nccl_unique_id is not None:
        if len(nccl_unique_id) != NCCL_UNIQUE_ID_BYTES:
            raise ProtocolError(
                "nccl_unique_id_b64", f"an ncclUniqueId has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(nccl_unique_id)}"
            )
        return {"nccl_unique_id_b64": base64.b64encode(nccl_unique_id).decode("ascii"), **body}
    if master_address is None or master_port is None:
        raise ProtocolError("master_port", "master_address and master_port go together")
    return {"master_address": master_address, "master_port": master_port, **body}


def nccl_update_info(
    names: Sequence[str], dtype_names: Sequence[str], shapes: Sequence[Sequence[int]]
) -> dict[str, Any]:
    """`update_info` of backend `nccl` / `gloo`: exactly `UPDATE_INFO_KEYS` (lists, JSON-ready)."""
    return {"names": list(names), "dtype_names": list(dtype_names), "shapes": [list(s) for s in shapes]}


def ipc_init_info() -> dict[str, Any]:
    """`init_info` of backend `ipc`, packed."""
    return {"packed": True}


def pickle_ipc_handles(handles: dict[str, tuple[Any, ...]]) -> str:
    """`ipc_handles_pickled`: standard base64 of the pickled {gpu_uuid: reduce_tensor args}."""
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


def ipc_update_info(
    names: Sequence[str],
    dtype_names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    tensor_sizes: Sequence[int],
    handles: dict[str, tuple[Any, ...]],
) -> dict[str, Any]:
    """`update_info` of backend `ipc`, packed: the chunk's tensors lie at the start of the buffer the
    handles name, `tensor_sizes` bytes each, in order."""
    return {
        **nccl_update_info(names, dtype_names, shapes),
        "tensor_sizes": [int(n) for n in tensor_sizes],
        "ipc_handles_pickled": pickle_ipc_handles(handles),
    }

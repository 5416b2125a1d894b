"""Colocate handles as an attacker would send them: the one validation (`handles.check_handle`) refuses
every pickled global that torch's `reduce_tensor` does not make, every segment the producer did not name,
and every size the chunk does not declare, before anything is mapped or called.

Pickles here are built by hand (a CUDA `reduce_tensor` needs a GPU): the allowed tuple is the one
`torch/multiprocessing/reductions.py` builds for a CUDA tensor, compared with `rebuild_cuda_tensor`'s own
signature; the hostile ones call `torch.save`, `builtins.eval` and `os.system` with side effects this
test looks for afterwards.
"""

from __future__ import annotations

import base64
import builtins
import inspect
import io
import os
import pickle
from dataclasses import asdict
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile.bodies import PickledCall
from torch.multiprocessing.reductions import rebuild_cuda_tensor
from wsh_vllm_plugin import protocol
from wsh_vllm_plugin.protocol import SHM_NAME_PREFIX, CudaIpcHandle, ProtocolError

from reference_impl.transport import handles
from reference_impl.transport.handles import SharedMemoryBuffer, check_handle, decode_ipc, open_shm_handle

NBYTES = 256


def _args(**edits: Any) -> tuple[Any, ...]:
    """The arguments reduce_tensor gives rebuild_cuda_tensor for a contiguous uint8 CUDA buffer of NBYTES
    bytes at offset 0 of its storage (`storage._share_cuda_()`'s fields: device, handle bytes, size,
    offset, ref-counter handle and offset, event handle, sync flag), with `edits` by parameter name."""
    t = torch.zeros(NBYTES, dtype=torch.uint8)
    values = {
        "tensor_cls": torch.Tensor,
        "tensor_size": t.size(),
        "tensor_stride": t.stride(),
        "tensor_offset": 0,
        "storage_cls": type(t._typed_storage()),
        "dtype": t.dtype,
        "storage_device": 0,
        "storage_handle": b"\x01" * 64,
        "storage_size_bytes": NBYTES,
        "storage_offset_bytes": 0,
        "requires_grad": False,
        "ref_counter_handle": b"/torch_ref_counter",
        "ref_counter_offset": 0,
        "event_handle": b"\x02" * 64,
        "event_sync_required": True,
    }
    values.update(edits)
    return tuple(values[p] for p in inspect.signature(rebuild_cuda_tensor).parameters)


def _ipc(obj: object) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode("ascii")


def _handle(ipc: str, nbytes: int = NBYTES) -> dict[str, Any]:
    return asdict(CudaIpcHandle(ipc=ipc, nbytes=nbytes, device_uuid="GPU-0"))


class _Recorder(pickle.Unpickler):
    """Unpickles our own pickle, recording every global it names."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.named: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.named.add(f"{module}.{name}")
        return super().find_class(module, name)


def test_the_allow_list_is_what_reduce_tensor_pickles_for_a_cuda_tensor() -> None:
    """The globals the pickled tuple names are exactly IPC_GLOBALS but the Parameter class (a plain
    tensor), and the checked arguments are rebuild_cuda_tensor's parameters, in order."""
    names = [name for name, _, _ in handles._IPC_ARGS]
    assert names == list(inspect.signature(rebuild_cuda_tensor).parameters)
    for tensor_cls, other in ((torch.Tensor, "torch.nn.parameter.Parameter"), (torch.nn.Parameter, "torch.Tensor")):
        recorder = _Recorder(pickle.dumps((rebuild_cuda_tensor, _args(tensor_cls=tensor_cls))))
        recorder.load()
        assert recorder.named == set(handles.IPC_GLOBALS) - {other}
    assert f"{rebuild_cuda_tensor.__module__}.{rebuild_cuda_tensor.__name__}" == handles.REBUILD_CUDA_TENSOR


def test_a_reduce_tensor_tuple_decodes_without_calling_anything() -> None:
    args = decode_ipc(_ipc((rebuild_cuda_tensor, _args())), NBYTES)
    assert len(args) == 15 and args[1] == torch.Size([NBYTES]) and args[5] is torch.uint8
    assert args[0] == handles._Named("torch.Tensor") and args[4] == handles._Named("torch.storage.TypedStorage")
    param = decode_ipc(_ipc((rebuild_cuda_tensor, _args(tensor_cls=torch.nn.Parameter))), NBYTES)
    assert param[0] == handles._Named("torch.nn.parameter.Parameter")
    # A storage without data (storage._share_cuda_ of an empty storage): None handles, no sync flag.
    empty = _args(tensor_size=torch.Size([0]), storage_handle=None, storage_size_bytes=0, event_sync_required=None)
    assert decode_ipc(_ipc((rebuild_cuda_tensor, empty)), 0)[7] is None
    assert check_handle(_handle(_ipc((rebuild_cuda_tensor, _args()))), "cuda_ipc", NBYTES).nbytes == NBYTES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real CUDA IPC handle needs a GPU")
def test_a_real_cuda_handle_passes() -> None:
    buf = torch.arange(NBYTES, dtype=torch.uint8, device="cuda")
    handle = handles.cuda_ipc_handle(buf)
    assert check_handle(handle, "cuda_ipc", NBYTES).nbytes == NBYTES
    assert decode_ipc(handle["ipc"], NBYTES)[1] == torch.Size([NBYTES])


def test_hostile_calls_are_refused_and_never_run(tmp_path: Path) -> None:
    """torch.save (a file write anywhere), builtins.eval and os.system, as the pickle's own call or as the
    rebuild function: each is refused by name and nothing of it ran."""
    target = tmp_path / "written.pt"
    marker = tmp_path / "ran"
    cases = {
        torch.save: [PickledCall(torch.save, {"x": 1}, str(target)), (torch.save, ({"x": 1}, str(target)))],
        builtins.eval: [PickledCall(builtins.eval, f"open({str(marker)!r}, 'w')"), (builtins.eval, ("1",))],
        os.system: [PickledCall(os.system, f"touch {marker}"), (os.system, (f"touch {marker}",))],
    }
    for fn, payloads in cases.items():
        qualname = f"{fn.__module__}.{fn.__qualname__}"  # as pickle names it: torch.serialization.save
        for payload in payloads:
            with pytest.raises(ProtocolError) as e:
                check_handle(_handle(_ipc(payload)), "cuda_ipc", NBYTES)
            assert e.value.field == "ipc" and qualname in str(e.value), str(e.value)
            assert "not" in str(e.value) and "reduce_tensor" in str(e.value)
    assert not target.exists() and not marker.exists()
    # Sent to an shm engine, the same handle is refused for what it holds, not only for its kind.
    with pytest.raises(ProtocolError, match=r"torch\.serialization\.save"):
        check_handle(_handle(_ipc(PickledCall(torch.save, {"x": 1}, str(target)))), "shm", NBYTES)
    assert not target.exists()


def test_allowed_globals_are_never_called_while_unpickling() -> None:
    """The rebuild function and the classes are allowed as names only: a pickle that calls them refuses."""
    call = PickledCall(rebuild_cuda_tensor, *_args())
    with pytest.raises(ProtocolError, match=r"may not call torch\.multiprocessing\.reductions\.rebuild_cuda_tensor"):
        decode_ipc(_ipc((call, ())), NBYTES)
    with pytest.raises(ProtocolError, match=r"may not call torch\.Tensor"):
        decode_ipc(_ipc((rebuild_cuda_tensor, (PickledCall(torch.Tensor, 10**6),))), NBYTES)


@pytest.mark.parametrize(
    ("edits", "words"),
    [
        ({"dtype": torch.float32}, "torch.float32"),  # not a global reduce_tensor makes of a packed chunk
        ({"tensor_cls": torch.nn.Module}, "torch.nn.modules.module.Module"),
        ({"tensor_size": torch.Size([NBYTES - 1])}, f"{NBYTES - 1} bytes"),
        ({"tensor_size": torch.Size([16, 16])}, "tensor_size"),
        ({"tensor_stride": (2,)}, "tensor_stride"),
        ({"tensor_offset": -1}, "tensor_offset"),
        ({"tensor_offset": 1}, "offset 1 in a storage of 256 bytes"),
        ({"storage_device": True}, "storage_device"),
        ({"storage_handle": "text"}, "storage_handle"),
        ({"event_sync_required": 1}, "event_sync_required"),
    ],
)
def test_a_tuple_that_is_not_reduce_tensors_is_refused(edits: dict[str, Any], words: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_ipc(_ipc((rebuild_cuda_tensor, _args(**edits))), NBYTES)
    assert words in str(e.value), str(e.value)


def test_malformed_ipc_strings() -> None:
    for ipc, words in (
        ("not base64!", "not base64"),
        (base64.b64encode(b"\x80\x05garbage").decode(), "not a reduce_tensor pickle"),
        (_ipc((rebuild_cuda_tensor,)), "does not hold"),
        (_ipc((rebuild_cuda_tensor, _args()[:-1])), "tuple of 15"),
        (_ipc([rebuild_cuda_tensor, list(_args())]), "does not hold"),
    ):
        with pytest.raises(ProtocolError, match=words):
            decode_ipc(ipc, NBYTES)
    with pytest.raises(ProtocolError, match="empty"):
        check_handle(_handle(""), "cuda_ipc")


# ---------------------------------------------------------------- shared memory


def test_producer_segments_carry_the_prefix_and_the_makers_pid_and_pass() -> None:
    # the maker's pid as 8 hex digits, so whoever ends a killed producer finds every segment it made
    maker = f"{SHM_NAME_PREFIX}{os.getpid():08x}"
    with SharedMemoryBuffer(NBYTES) as buf:
        assert buf.name.startswith(maker) and len(buf.name) == len(maker) + 16
        assert check_handle(buf.handle(NBYTES), "shm", NBYTES).name == buf.name
        old = buf.name
        buf.grow(4 * NBYTES)
        assert buf.name != old and buf.name.startswith(maker)


@pytest.mark.parametrize(
    "name",
    [
        "psm_1a2b",
        "../x",
        "wsh_chunk_../x",
        f"{SHM_NAME_PREFIX}",
        f"{SHM_NAME_PREFIX}ABC",
        f"{SHM_NAME_PREFIX}00\x00",
        "/dev/shm/x",
    ],
)
def test_foreign_segment_names_are_refused(name: str) -> None:
    with pytest.raises(ProtocolError) as e:
        check_handle({"kind": "shm", "name": name, "nbytes": NBYTES}, "shm", NBYTES)
    assert e.value.field == "name" and SHM_NAME_PREFIX in str(e.value)


def test_a_foreign_segment_is_never_attached() -> None:
    """A segment another program made (another prefix) holds bytes; the consumer refuses its name before
    attaching, so opening it fails the same way whether it exists or not."""
    other = SharedMemory(create=True, size=NBYTES)
    try:
        with (
            pytest.raises(ProtocolError, match="not an engine chunk segment"),
            open_shm_handle({"kind": "shm", "name": other.name, "nbytes": NBYTES}),
        ):
            pass
    finally:
        other.close()
        other.unlink()


def test_sizes_other_than_the_declared_one_are_refused() -> None:
    with SharedMemoryBuffer(4 * NBYTES) as buf:
        for nbytes in (NBYTES - 1, NBYTES + 1, 0, 4 * NBYTES):
            with pytest.raises(ProtocolError) as e:
                check_handle(buf.handle(nbytes), "shm", NBYTES)
            assert e.value.field == "nbytes" and f"{nbytes}" in str(e.value) and f"{NBYTES} bytes" in str(e.value)
        with pytest.raises(ProtocolError, match="nbytes -1 must lie in 0"):
            check_handle({"kind": "shm", "name": buf.name, "nbytes": -1}, "shm")


@pytest.mark.parametrize(
    ("handle", "field"),
    [
        ("wsh_chunk_00", ""),
        ({"name": "wsh_chunk_00", "nbytes": 1}, "kind"),
        ({"kind": "nccl", "name": "wsh_chunk_00", "nbytes": 1}, "kind"),
        ({"kind": "shm", "name": "wsh_chunk_00"}, "nbytes"),
        ({"kind": "shm", "name": "wsh_chunk_00", "nbytes": 1, "path": "/etc"}, "path"),
        ({"kind": "shm", "name": "wsh_chunk_00", "nbytes": "1"}, "nbytes"),
        ({"kind": "shm", "name": "wsh_chunk_00", "nbytes": True}, "nbytes"),
        ({"kind": "shm", "name": ["wsh_chunk_00"], "nbytes": 1}, "name"),
        ({"kind": "cuda_ipc", "ipc": "x", "nbytes": 1}, "device_uuid"),
    ],
)
def test_malformed_handles_name_their_field(handle: Any, field: str) -> None:
    with pytest.raises(ProtocolError) as e:
        check_handle(handle, "shm")
    assert e.value.field == field, str(e.value)


def test_kind_must_be_the_backends() -> None:
    with SharedMemoryBuffer(NBYTES) as buf, pytest.raises(ProtocolError, match="does not match the transfer backend"):
        check_handle(buf.handle(NBYTES), protocol.CUDA_IPC, NBYTES)

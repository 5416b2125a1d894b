"""The protocol module: torch-only, its bodies' rules, handle layouts, and one chunk over the transfer group."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch
from wsh_vllm_plugin import protocol
from wsh_vllm_plugin.protocol import CudaIpcHandle, InitInfo, ProtocolError, ShmHandle, UpdateInfo

from reference_impl.transport.handles import SharedMemoryBuffer


def test_protocol_imports_only_torch() -> None:
    """Both environments import it: nothing of vLLM, pydantic or the harness may come with it."""
    code = (
        "import sys, json, wsh_vllm_plugin.protocol\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    top = set(json.loads(out.stdout))
    assert "torch" in top
    assert not top & {"vllm", "pydantic", "fastapi", "reference_impl", "harness", "transformers"}


def test_init_info_body_round_trip_and_gloo_rules() -> None:
    info = InitInfo(master_address="127.0.0.1", master_port=29500, timeout_s=7.5)
    body = json.loads(json.dumps(asdict(info)))
    assert body == {
        "backend": "gloo",
        "master_address": "127.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 2,
        "timeout_s": 7.5,
    }
    assert InitInfo(**body) == info
    info.check()
    with pytest.raises(ProtocolError) as e:
        InitInfo(master_port=1).check()
    assert (e.value.field, e.value.required) == ("master_address", True)
    assert e.value.reason == "Field required for backend 'gloo'"
    assert str(e.value).startswith("master_address: ")
    with pytest.raises(ProtocolError, match=r"rank_offset 2 must lie in 1\.\.world_size-1") as e:
        InitInfo(master_address="h", master_port=1, rank_offset=2, world_size=2).check()
    assert (e.value.field, e.value.required) == ("rank_offset", False)
    InitInfo(backend="shm").check()  # colocate: nothing to join, nothing required


def test_update_info_lengths() -> None:
    UpdateInfo(names=["a", "b"], dtype_names=["float32", "int64"], shapes=[[2], [3, 1]]).check()
    with pytest.raises(ProtocolError, match="2 names, 1 dtype_names, 2 shapes"):
        UpdateInfo(names=["a", "b"], dtype_names=["float32"], shapes=[[2], [3]]).check()
    assert asdict(UpdateInfo())["handle"] is None


def test_handle_layouts() -> None:
    assert list(asdict(ShmHandle(name="seg", nbytes=3))) == ["kind", "name", "nbytes"]
    assert asdict(CudaIpcHandle(ipc="x", nbytes=4, device_uuid="GPU-1")) == {
        "kind": "cuda_ipc",
        "ipc": "x",
        "nbytes": 4,
        "device_uuid": "GPU-1",
    }
    with SharedMemoryBuffer(16) as buf:
        assert buf.handle(10) == {"kind": "shm", "name": buf.name, "nbytes": 10}
    assert protocol.HANDLE_KINDS == ("shm", "cuda_ipc")
    assert {k: protocol.HANDLE_LOCATOR[k] for k in protocol.HANDLE_KINDS} == {"shm": "name", "cuda_ipc": "ipc"}


def test_dtype_names() -> None:
    for name, dtype in protocol.DTYPE_NAMES.items():
        assert protocol.dtype_name(dtype) == name == str(dtype).split(".")[-1]
        assert protocol.dtype_from_name(name) is dtype
    assert protocol.nbytes_of([3, 5], torch.bfloat16) == 30
    with pytest.raises(ValueError, match="unknown dtype name 'float8'"):
        protocol.dtype_from_name("float8")


def test_one_chunk_over_the_transfer_group() -> None:
    """Sender and engine rank in two threads: the receiver learns the size from the header, also for a
    payload whose size no declared shape predicts."""
    store = protocol.host_store(timeout_s=30)
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([7], dtype=torch.int64)]
    payload = protocol.pack(tensors)
    assert payload.numel() == 6 * 4 + 8

    def engine() -> torch.Tensor:
        group = protocol.join_transfer_group("127.0.0.1", store.port, rank=1, world_size=2, timeout_s=30)
        return group.receive_chunk(protocol.SENDER_RANK)

    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(engine)
        sender = protocol.join_transfer_group("127.0.0.1", store.port, 0, 2, timeout_s=30, store=store)
        sender.send_chunk(payload)
        received = got.result(timeout=60)
    assert received.dtype == torch.uint8 and torch.equal(received, payload)
    a, b = protocol.unpack(received, [torch.float32, torch.int64], [[2, 3], [1]])
    assert torch.equal(a, tensors[0]) and torch.equal(b, tensors[1])

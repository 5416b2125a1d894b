"""The protocol module: torch-only, its bodies' rules, handle layouts; one chunk over the transfer group (group.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import pytest
import torch
from wsh_vllm_plugin import protocol
from wsh_vllm_plugin.group import host_store, join_transfer_group
from wsh_vllm_plugin.protocol import CudaIpcHandle, InitInfo, ProtocolError, ShmHandle, UpdateInfo

from reference_impl.transport.handles import SharedMemoryBuffer


def test_protocol_imports_only_torch() -> None:
    """Both environments import it and the transfer group (`group.py`): nothing of vLLM, pydantic or the
    harness may come with them."""
    code = (
        "import sys, json, wsh_vllm_plugin.protocol, wsh_vllm_plugin.group\n"
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
    store = host_store(timeout_s=30)
    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([7], dtype=torch.int64)]
    payload = protocol.pack(tensors)
    assert payload.numel() == 6 * 4 + 8

    def engine() -> torch.Tensor:
        group = join_transfer_group("127.0.0.1", store.port, rank=1, world_size=2, timeout_s=30)
        return group.receive_chunk(protocol.SENDER_RANK)

    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(engine)
        sender = join_transfer_group("127.0.0.1", store.port, 0, 2, timeout_s=30, store=store)
        sender.send_chunk(payload)
        received = got.result(timeout=60)
    assert received.dtype == torch.uint8 and torch.equal(received, payload)
    a, b = protocol.unpack(received, [torch.float32, torch.int64], [[2, 3], [1]])
    assert torch.equal(a, tensors[0]) and torch.equal(b, tensors[1])


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"backend": "gloo", "master_address": "h", "master_port": 1, "nccl_id": 3}, "nccl_id", "unknown field"),
        ({"backend": "gloo", "master_address": "h", "master_port": "29500"}, "master_port", "int | null, got str"),
        ({"backend": "gloo", "master_address": "h", "master_port": True}, "master_port", "got bool"),
        ({"backend": "gloo", "master_address": "h", "master_port": 0}, "master_port", "1..65535"),
        ({"backend": "gloo", "master_address": "h", "master_port": 65536}, "master_port", "1..65535"),
        ({"backend": "gloo", "master_address": "h b", "master_port": 1}, "master_address", "host name"),
        ({"backend": "gloo", "master_address": "", "master_port": 1}, "master_address", "host name"),
        (
            {"backend": "gloo", "master_address": "h", "master_port": 1, "world_size": 1, "rank_offset": 0},
            "world_size",
            "2..65536",
        ),
        ({"backend": "gloo", "master_address": "h", "master_port": 1, "world_size": 2.0}, "world_size", "got float"),
        ({"backend": "shm", "timeout_s": 0}, "timeout_s", "(0, 86400.0]"),
        ({"backend": "shm", "timeout_s": 1e300}, "timeout_s", "(0, 86400.0]"),
        ({"backend": "shm", "timeout_s": 10**400}, "timeout_s", "finite number"),
        ({"backend": "gloo"}, "master_address", "Field required"),
        ({"backend": "nccl"}, "master_address", "Field required for backend 'nccl'"),
        ({"backend": "ipc"}, "backend", "one of 'gloo' | 'nccl' | 'shm' | 'cuda_ipc'"),
        ([], "", "JSON object"),
    ],
)
def test_init_info_from_json_refuses_by_field(body: object, field: str, words: str) -> None:
    with pytest.raises(ProtocolError) as e:
        InitInfo.from_json(body)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_init_info_from_json_takes_what_the_sender_sends() -> None:
    info = InitInfo(master_address="127.0.0.1", master_port=29500, timeout_s=7.5)
    assert InitInfo.from_json(json.loads(json.dumps(asdict(info)))) == info
    assert (
        InitInfo.from_json({"backend": "gloo", "master_address": "::1", "master_port": 1, "timeout_s": 3}).timeout_s
        == 3
    )
    assert InitInfo.from_json({"backend": "shm"}) == InitInfo(backend="shm")


CHUNK = {"names": ["a", "b"], "dtype_names": ["float32", "int64"], "shapes": [[2], [3, 1]]}


@pytest.mark.parametrize(
    ("edits", "field", "words"),
    [
        ({"names": ["a", "a"]}, "names.1", "appears twice"),
        ({"names": [], "dtype_names": [], "shapes": []}, "names", "no tensor"),
        ({"names": ["a", "b\x00c"]}, "names.1", "control character '\\x00'"),
        ({"names": ["", "b"]}, "names.0", "1..1024 characters"),
        ({"names": ["a", "b" * 1025]}, "names.1", "1..1024 characters"),
        ({"names": ["a", 7]}, "names.1", "must be str"),
        ({"names": "ab"}, "names", "must be list[str]"),
        ({"shapes": [[2], [-3, 1]]}, "shapes.1.0", "must lie in 0.."),
        ({"shapes": [[2], [2**63, 1]]}, "shapes.1.0", "must lie in 0.."),
        ({"shapes": [[2], [3.0, 1]]}, "shapes.1.0", "must be int"),
        ({"shapes": [[2]]}, "names", "2 names, 2 dtype_names, 1 shapes"),
        ({"packed": "true"}, "packed", "must be bool"),
        ({"src": -1}, "src", "must lie in 0.."),
        ({"chunk_index": -1}, "chunk_index", "must lie in 0.."),
        ({"handle": "wsh_chunk_00"}, "handle", "must be dict"),
        ({"bucket": 3}, "bucket", "unknown field 'bucket' in update_info"),
        ({"names": None}, "names", "must be list[str], got NoneType"),
    ],
)
def test_update_info_from_json_refuses_by_field(edits: dict, field: str, words: str) -> None:
    with pytest.raises(ProtocolError) as e:
        UpdateInfo.from_json({**CHUNK, **edits})
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_update_info_from_json_requires_the_lists_and_takes_the_senders_body() -> None:
    for key in ("names", "dtype_names", "shapes"):
        with pytest.raises(ProtocolError) as e:
            UpdateInfo.from_json({k: v for k, v in CHUNK.items() if k != key})
        assert (e.value.field, e.value.required) == (key, True)
    info = UpdateInfo(**CHUNK, chunk_index=3)
    assert UpdateInfo.from_json(json.loads(json.dumps(asdict(info)))) == info
    assert protocol.chunk_nbytes(CHUNK["dtype_names"], CHUNK["shapes"]) == 2 * 4 + 3 * 8

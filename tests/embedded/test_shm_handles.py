"""Colocate: the engine loads from shared-memory handles, refuses bad ones and never unlinks the trainer's
segment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from wsh_vllm_plugin import protocol

from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.handles import SharedMemoryBuffer, cuda_ipc_handle, open_cuda_ipc_handle

from .engines import (
    CKPT_SEED,
    CLEAN,
    Engine,
    engine_checksums,
    post,
    safetensors_checksums,
    segment_exists,
    shm_chunk,
    shm_sync,
    valid_update,
)


def test_shm_full_sync_matches_checkpoint(
    shm_engines: dict[str, EngineProcess], shm_buffer: SharedMemoryBuffer
) -> None:
    url = shm_engines[CLEAN].url
    ckpt = make_checkpoint(load_model("qwen3"), seed=CKPT_SEED)
    truth = safetensors_checksums(ckpt)
    before = engine_checksums(url)
    assert all(before[n] != truth[n] for n in truth), "engine must start from different (dummy) weights"
    tensors = read_checkpoint(ckpt)
    names = list(tensors)
    fin = shm_sync(url, shm_buffer, tensors, [names[i::3] for i in range(3)])
    assert fin["update_counts"] and all(c == 1 for c in fin["update_counts"].values()), fin["update_counts"]
    assert engine_checksums(url) == truth
    # The engine attached untracked and closed without unlinking: the producer's segment is intact.
    if Path("/dev/shm").is_dir():
        assert segment_exists(shm_buffer.name)
    last = [tensors[n] for n in names[2::3]]
    n = sum(t.numel() * t.element_size() for t in last)
    assert torch.equal(shm_buffer.tensor(n).clone(), protocol.pack(last))  # and unmodified


NO_SUCH_SEGMENT = protocol.SHM_NAME_PREFIX + "0123456789abcdef"  # a producer's name, but nobody made it
SHM_BAD = {
    # case: (handle edits, words the error must contain)
    "missing_handle": ({"drop": True}, ["chunk 5", "no handle"]),
    "nbytes_too_small": ({"nbytes": 60}, ["chunk 5", "bytes", "256"]),
    "no_such_segment": ({"name": NO_SUCH_SEGMENT}, ["chunk 5", "cannot be opened", NO_SUCH_SEGMENT]),
    "kind_mismatch": ({"kind": "cuda_ipc"}, ["chunk 5", "cuda_ipc", "shm"]),
}


@pytest.mark.parametrize("case", list(SHM_BAD))
def test_shm_bad_handle_is_400_bytes(
    shm_engines: dict[str, EngineProcess], shm_buffer: SharedMemoryBuffer, case: str
) -> None:
    url = shm_engines[CLEAN].url
    edits, words = SHM_BAD[case]
    before = engine_checksums(url)
    assert post(url, "/start_weight_update").status_code == 200
    norm = {"model.norm.weight": torch.full((64,), 2.5)}
    r = shm_chunk(url, shm_buffer, norm, 5, edits)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert all(w in detail["error"] for w in words), detail["error"]
    assert detail["kinds"] == {"model.norm.weight": "bytes"}
    assert engine_checksums(url) == before
    # The server keeps serving: a valid chunk through the same buffer loads.
    assert shm_chunk(url, shm_buffer, norm, 6).status_code == 200
    fin = post(url, "/finish_weight_update").json()
    assert fin["update_counts"]["model.norm.weight"] == 1
    assert sum(fin["update_counts"].values()) == 1


def test_shm_init_and_backend_mismatch(shm_engines: dict[str, EngineProcess], engines: dict[str, Engine]) -> None:
    url = shm_engines[CLEAN].url
    nccl = {"backend": "nccl", "master_address": "127.0.0.1", "master_port": 1}  # every rule but CUDA holds
    r = post(url, "/init_weight_transfer_engine", {"init_info": nccl})
    assert r.status_code == 400
    assert r.json()["detail"]["kinds"] == {"body.init_info.backend": "request"}
    if not torch.cuda.is_available():
        r = post(url, "/init_weight_transfer_engine", {"init_info": {"backend": "cuda_ipc"}})
        assert r.status_code == 400
        assert "shm" in r.json()["detail"]["error"]
    # A handle sent to a gloo engine is refused without waiting for a broadcast.
    eng = engines["qwen3"]
    assert eng.post("/start_weight_update").status_code == 200
    info = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]], "chunk_index": 0}
    r = eng.post("/update_weights", {"update_info": {**info, "handle": {"kind": "shm", "name": "x", "nbytes": 256}}})
    assert r.status_code == 400, r.text
    assert r.json()["detail"]["kinds"] == {"model.norm.weight": "bytes"}
    assert "gloo" in r.json()["detail"]["error"]
    valid_update(eng)
    assert eng.post("/finish_weight_update").status_code == 200


def test_shm_consumer_does_not_unlink_at_exit(shm_buffer: SharedMemoryBuffer) -> None:
    """A consumer process that opened a handle leaves the segment to its producer when it exits (its
    resource tracker would otherwise unlink it), and reads the bytes without copying them first."""
    shm_buffer.grow(16)
    shm_buffer.tensor(16).copy_(torch.arange(16, dtype=torch.uint8))
    code = (
        "import sys, torch\n"
        "from reference_impl.transport.handles import open_shm_handle\n"
        f"with open_shm_handle({shm_buffer.handle(16)!r}) as p:\n"
        "    try:\n"
        "        print(int(p.view(torch.int32).sum()))\n"
        "    finally:\n"
        "        del p\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == int(torch.arange(16, dtype=torch.uint8).view(torch.int32).sum())
    assert "leaked" not in out.stderr
    if Path("/dev/shm").is_dir():
        assert segment_exists(shm_buffer.name)
    name = shm_buffer.name
    shm_buffer.close()
    if Path("/dev/shm").is_dir():
        assert not segment_exists(name)


def test_shm_buffer_capacity() -> None:
    with SharedMemoryBuffer(8) as buf:
        with pytest.raises(ValueError, match="grow"):
            buf.tensor(9)
        assert buf.grow(8) is False
        name = buf.name
        assert buf.grow(100) is True and buf.capacity >= 100 and buf.name != name
        assert buf.handle(100) == {"kind": "shm", "name": buf.name, "nbytes": 100}
        assert buf.tensor(0).numel() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_ipc_without_cuda_raises() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_ipc_handle(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="CUDA"):
        open_cuda_ipc_handle({"kind": "cuda_ipc", "ipc": "", "nbytes": 4})

"""The engine's mutation-test faults (each caught with the checkpoint as truth) and the bare-broadcast
transfer probe."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from reference_impl.engine.embedded.launcher import EngineProcess, EngineStartError
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.handles import SharedMemoryBuffer

from .engines import (
    CKPT_SEED,
    CLEAN,
    ENGINE_SEED,
    FINALIZE_PER_CHUNK,
    OK_WITHOUT_TRANSFER,
    Engine,
    engine_checksums,
    post,
    safetensors_checksums,
    shm_sync,
    valid_update,
)


def _two_chunk_sync(url: str, buf: SharedMemoryBuffer) -> tuple[dict, dict[str, str], dict[str, str], list[str]]:
    """Full 2-chunk sync of the qwen3 checkpoint: (finish body, checksums before, after, first chunk's names)."""
    ckpt = make_checkpoint(load_model("qwen3"), seed=CKPT_SEED)
    tensors = read_checkpoint(ckpt)
    names = list(tensors)
    chunks = [names[: len(names) // 2], names[len(names) // 2 :]]
    before = engine_checksums(url)
    fin = shm_sync(url, buf, tensors, chunks)
    return fin, before, engine_checksums(url), chunks[0]


def test_fault_finalize_per_chunk(shm_engines: dict[str, EngineProcess], shm_buffer: SharedMemoryBuffer) -> None:
    truth = safetensors_checksums(make_checkpoint(load_model("qwen3"), seed=CKPT_SEED))
    fin, before, after, first = _two_chunk_sync(shm_engines[FINALIZE_PER_CHUNK].url, shm_buffer)
    assert all(c == 1 for c in fin["update_counts"].values())  # the counts do not show it
    assert {n for n in truth if after[n] != truth[n]} == set(first)
    assert all(after[n] == before[n] for n in first)  # still the dummy values


def test_fault_ok_without_transfer(shm_engines: dict[str, EngineProcess], shm_buffer: SharedMemoryBuffer) -> None:
    fin, before, after, _ = _two_chunk_sync(shm_engines[OK_WITHOUT_TRANSFER].url, shm_buffer)
    assert fin["update_counts"] and all(c == 1 for c in fin["update_counts"].values())
    assert after == before  # every 200 moved nothing


def test_fault_is_logged_and_unknown_fault_exits(shm_engines: dict[str, EngineProcess], tmp_path: Path) -> None:
    assert f"FAULT ACTIVE: {FINALIZE_PER_CHUNK}" in shm_engines[FINALIZE_PER_CHUNK].log_path.read_text()
    assert f"FAULT ACTIVE: {OK_WITHOUT_TRANSFER}" in shm_engines[OK_WITHOUT_TRANSFER].log_path.read_text()
    assert "FAULT ACTIVE" not in shm_engines[CLEAN].log_path.read_text()
    ckpt = str(make_checkpoint(load_model("qwen3"), seed=CKPT_SEED))
    proc = EngineProcess(ckpt, ENGINE_SEED, log_path=str(tmp_path / "bogus.log"), fault="bogus")
    try:
        with pytest.raises(EngineStartError) as err:
            proc.start(timeout_s=60)
    finally:
        proc.stop()
    assert proc.proc is not None and proc.proc.returncode not in (0, None)
    assert "bogus" in str(err.value) and "MODULE:FUNCTION" in str(err.value)
    proc = EngineProcess(ckpt, ENGINE_SEED, log_path=str(tmp_path / "nohook.log"), fault="harness.faults.engine:bogus")
    try:
        with pytest.raises(EngineStartError) as err:
            proc.start(timeout_s=60)
    finally:
        proc.stop()
    assert "harness.faults.engine has no function 'bogus'" in str(err.value)


def test_transfer_probe_takes_bare_broadcasts_and_refuses_inside_a_session(
    engines: dict[str, Engine], shm_engines: dict[str, EngineProcess]
) -> None:
    """POST /transfer_probe takes one bare broadcast per size (no header: a header would leave the group out
    of step and the valid chunk after it would not load), and loads nothing; it is refused, before anything
    is received, inside an update session and under a handle backend."""
    eng = engines["qwen3"]
    before = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
    sizes = [1, 4096, 3 << 20]
    assert eng.group is not None
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(eng.post, "/transfer_probe", {"sizes": sizes})
        for n in sizes:
            eng.group.broadcast(torch.full((n,), 7, dtype=torch.uint8), 0)
        r = fut.result(timeout=60)
    assert r.status_code == 200, r.text
    assert r.json() == {"ok": True, "received_bytes": 1 + 4096 + (3 << 20)}
    assert eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"] == before  # nothing loaded
    assert eng.post("/start_weight_update", {}).status_code == 200
    r = eng.post("/transfer_probe", {"sizes": [8]})  # nothing broadcast: a refusal must not wait for one
    assert r.status_code == 400 and r.json()["detail"]["kinds"] == {"/transfer_probe": "session"}
    valid_update(eng, 4.5)  # the group is still in step
    assert eng.post("/finish_weight_update", {}).status_code == 200
    shm_url = shm_engines[CLEAN].url
    assert post(shm_url, "/init_weight_transfer_engine", {"init_info": {"backend": "shm"}}).status_code == 200
    r = post(shm_url, "/transfer_probe", {"sizes": [8]})
    assert r.status_code == 400 and "transfer group" in r.json()["detail"]["error"]
    assert eng.post("/transfer_probe", {"sizes": [0]}).status_code == 400  # sizes are >= 1 byte

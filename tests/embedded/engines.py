"""What the embedded engine's tests share: the engine servers they drive, and the checkpoint read straight
from its files (the independent truth).

The servers run as subprocesses (one per model entry, started once per session and stopped by pid); the
test process is the trainer's sender: it hosts the TCPStore, joins the transfer group as rank 0 and
broadcasts packed chunks while a worker thread makes the /update_weights call (both block). Colocate: three
more qwen3 servers (no fault and each fault) started through `EngineProcess` with backend shm; the test
process owns a `SharedMemoryBuffer` and posts handles to it. Expected checksums are computed independently
from the safetensors files' raw bytes.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import xxhash
from wsh_vllm_plugin import protocol
from wsh_vllm_plugin.group import TransferGroup, host_store, join_transfer_group

from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.handles import SharedMemoryBuffer

CKPT_SEED = 1234
ENGINE_SEED = 4321
MODELS = ("qwen3", "qwen3-vl", "qwen3-moe", "qwen3-vl-moe", "qwen3-untied")  # one engine each
CLEAN = "no-fault"
FINALIZE_PER_CHUNK = "harness.faults.engine:finalize_per_chunk"
OK_WITHOUT_TRANSFER = "harness.faults.engine:ok_without_transfer"


def safetensors_shapes(folder: Path) -> dict[str, list[int]]:
    """HF name -> shape, read from the safetensors headers."""
    out: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return out


def safetensors_checksums(folder: Path) -> dict[str, str]:
    """HF name -> XXH3-128 of the tensor's bytes, read straight from the safetensors files."""
    out: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, meta in header.items():
            a, b = meta["data_offsets"]
            out[name] = xxhash.xxh3_128_hexdigest(raw[8 + n + a : 8 + n + b])
    return out


@dataclass
class Engine:
    """A running server subprocess linked to this process by a transfer group."""

    model_type: str
    checkpoint: Path
    proc: subprocess.Popen
    url: str
    group: TransferGroup | None = None

    def post(self, route: str, body: dict | None = None) -> httpx.Response:
        return httpx.post(f"{self.url}{route}", json=body if body is not None else {}, timeout=60)

    def send_chunk(
        self,
        names: list[str],
        dtype_names: list[str],
        shapes: list[list[int]],
        payload: torch.Tensor,
        chunk_index: int = 0,
    ) -> httpx.Response:
        """POST /update_weights in a thread while broadcasting `payload` here (rank 0)."""
        assert self.group is not None
        info = {
            "names": names,
            "dtype_names": dtype_names,
            "shapes": shapes,
            "packed": True,
            "src": 0,
            "chunk_index": chunk_index,
        }
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(self.post, "/update_weights", {"update_info": info})
            self.group.send_chunk(payload)
            return fut.result(timeout=60)

    def send_tensors(self, tensors: dict[str, torch.Tensor], chunk_index: int = 0) -> httpx.Response:
        names = list(tensors)
        return self.send_chunk(
            names,
            [protocol.dtype_name(t.dtype) for t in tensors.values()],
            [list(t.shape) for t in tensors.values()],
            protocol.pack(list(tensors.values())),
            chunk_index,
        )


def start_engine(family_model: str, tmp: Path) -> tuple[subprocess.Popen, Path, Path]:
    """Start the embedded server of model entry `family_model` (engine seed ENGINE_SEED) on a free port;
    returns (process, checkpoint folder, the port file it writes once bound)."""
    ckpt = make_checkpoint(load_model(family_model), seed=CKPT_SEED)
    port_file = tmp / f"{family_model}.port"
    log = (tmp / f"{family_model}.log").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reference_impl.engine.embedded",
            "--checkpoint",
            str(ckpt),
            "--seed",
            str(ENGINE_SEED),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(port_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    return proc, ckpt, port_file


def wait_port(proc: subprocess.Popen, port_file: Path, log: Path, deadline_s: float = 90) -> int:
    """The port `proc` wrote to `port_file`; fails the test with the log's tail if it exits or takes longer
    than `deadline_s` seconds."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if port_file.exists():
            return int(port_file.read_text())
        if proc.poll() is not None:
            pytest.fail(f"engine exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    pytest.fail(f"engine did not write its port within {deadline_s} s:\n{log.read_text()[-4000:]}")


def link(engine: Engine) -> None:
    """Join the transfer group: rank 0 here, the engine as rank 1 via /init_weight_transfer_engine."""
    store = host_store(timeout_s=60)
    init = {
        "init_info": {
            "backend": "gloo",
            "master_address": "127.0.0.1",
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": 2,
        }
    }
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(engine.post, "/init_weight_transfer_engine", init)
        engine.group = join_transfer_group("127.0.0.1", store.port, rank=0, world_size=2, timeout_s=60, store=store)
        r = fut.result(timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["ok"] is True


def norm_name(engine: Engine) -> str:
    """HF name of the final norm (shape [hidden]) in `engine`'s family."""
    return "model.norm.weight" if engine.model_type == "qwen3" else "model.language_model.norm.weight"


def valid_update(engine: Engine, value: float = 1.5) -> None:
    """A one-tensor valid chunk must load (the server is still usable and the group in step)."""
    t = torch.full((64,) if engine.model_type == "qwen3" else (128,), value)
    r = engine.send_tensors({norm_name(engine): t})
    assert r.status_code == 200, r.text
    assert r.json()["received_bytes"] == t.numel() * 4


def post(url: str, route: str, body: dict | None = None) -> httpx.Response:
    """POST `body` (default {}) as JSON to `url` + `route`, 60 s timeout."""
    return httpx.post(f"{url}{route}", json=body if body is not None else {}, timeout=60)


def shm_chunk(
    url: str,
    buf: SharedMemoryBuffer,
    tensors: dict[str, torch.Tensor],
    chunk_index: int,
    handle_edits: dict[str, object] | None = None,
) -> httpx.Response:
    """Pack `tensors` into `buf` (grown as needed) and POST /update_weights with its handle (edited by
    `handle_edits`; {"drop": True} sends none)."""
    n = sum(t.numel() * t.element_size() for t in tensors.values())
    buf.grow(n)
    protocol.pack(list(tensors.values()), out=buf.tensor(n))  # views of the segment die here
    info = {
        "names": list(tensors),
        "dtype_names": [protocol.dtype_name(t.dtype) for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "packed": True,
        "chunk_index": chunk_index,
    }
    edits = handle_edits or {}
    if not edits.get("drop"):
        info["handle"] = {**buf.handle(n), **edits}
    return post(url, "/update_weights", {"update_info": info})


def shm_sync(url: str, buf: SharedMemoryBuffer, tensors: dict[str, torch.Tensor], chunks: list[list[str]]) -> dict:
    """One update session over handles; every chunk must answer 200. Returns the finish body."""
    assert post(url, "/start_weight_update").status_code == 200
    for i, chunk in enumerate(chunks):
        r = shm_chunk(url, buf, {n: tensors[n] for n in chunk}, i)
        assert r.status_code == 200, r.text
        assert r.json()["received_bytes"] == sum(tensors[n].numel() * tensors[n].element_size() for n in chunk)
        assert r.json()["loaded"] == len(chunk)
    r = post(url, "/finish_weight_update", {"weight_version": 1})
    assert r.status_code == 200, r.text
    return r.json()


def engine_checksums(url: str) -> dict[str, str]:
    """HF name -> checksum of what the engine at `url` holds (`/weight_checker` checksum)."""
    return post(url, "/weight_checker", {"action": "checksum"}).json()["checksums"]


def segment_exists(name: str) -> bool:
    """Whether shared-memory segment `name` is still in /dev/shm."""
    return Path("/dev/shm", name).exists()

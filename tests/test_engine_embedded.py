"""The embedded engine: vLLM name tables, strict loader, and the real server over a real gloo group.

The servers run as subprocesses (one per model family, started once per session and stopped by pid);
the test process is the trainer's sender: it hosts the TCPStore, joins the transfer group as rank 0
and broadcasts packed chunks while a worker thread makes the /update_weights call (both block).
Expected checksums are computed independently from the safetensors files' raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from reference_impl.checksum import tensor_checksum
from reference_impl.engine.embedded.vllm_names import FAMILY_NAMES, VllmTarget, hf_to_vllm, is_vllm_param
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport import wire

CKPT_SEED = 1234
ENGINE_SEED = 4321


# ---------------------------------------------------------------- helpers


def safetensors_checksums(folder: Path) -> dict[str, str]:
    """HF name -> blake2b-16 of the tensor's bytes, read straight from the safetensors files."""
    out: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, meta in header.items():
            a, b = meta["data_offsets"]
            out[name] = hashlib.blake2b(raw[8 + n + a : 8 + n + b], digest_size=16).hexdigest()
    return out


@dataclass
class Engine:
    """A running server subprocess linked to this process by a transfer group."""

    family: str
    checkpoint: Path
    proc: subprocess.Popen
    url: str
    group: wire.TransferGroup | None = None

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
            self.group.broadcast_chunk(payload, src=0)
            return fut.result(timeout=60)

    def send_tensors(self, tensors: dict[str, torch.Tensor], chunk_index: int = 0) -> httpx.Response:
        names = list(tensors)
        return self.send_chunk(
            names,
            [wire.dtype_name(t.dtype) for t in tensors.values()],
            [list(t.shape) for t in tensors.values()],
            wire.pack(list(tensors.values())),
            chunk_index,
        )


def _start(family_model: str, tmp: Path) -> tuple[subprocess.Popen, Path, Path]:
    ckpt = make_checkpoint(load_model(family_model), seed=CKPT_SEED)
    port_file = tmp / f"{family_model}.port"
    log = (tmp / f"{family_model}.log").open("w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reference_impl.engine.embedded.server",
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


def _wait_port(proc: subprocess.Popen, port_file: Path, log: Path, deadline_s: float = 90) -> int:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if port_file.exists():
            return int(port_file.read_text())
        if proc.poll() is not None:
            pytest.fail(f"engine exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    pytest.fail(f"engine did not write its port within {deadline_s} s:\n{log.read_text()[-4000:]}")


def _link(engine: Engine) -> None:
    """Join the transfer group: rank 0 here, the engine as rank 1 via /init_weight_transfer_engine."""
    store = wire.host_store(timeout_s=60)
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
        engine.group = wire.join_transfer_group(
            "127.0.0.1", store.port, rank=0, world_size=2, timeout_s=60, store=store
        )
        r = fut.result(timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["ok"] is True


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """Both families' engines, started in parallel, linked, and stopped by pid at the end."""
    tmp = tmp_path_factory.mktemp("engines")
    started = {fam: _start(model, tmp) for fam, model in (("qwen3", "qwen3"), ("qwen3_vl", "qwen3-vl"))}
    out: dict[str, Engine] = {}
    try:
        for fam, (proc, ckpt, port_file) in started.items():
            model = "qwen3" if fam == "qwen3" else "qwen3-vl"
            port = _wait_port(proc, port_file, tmp / f"{model}.log")
            out[fam] = Engine(fam, ckpt, proc, f"http://127.0.0.1:{port}")
        for eng in out.values():
            _link(eng)
        yield out
    finally:
        for proc, _, _ in started.values():
            if proc.poll() is None:
                os.kill(proc.pid, 15)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, 9)
                    proc.wait()


def _norm(engine: Engine) -> str:
    return "model.norm.weight" if engine.family == "qwen3" else "model.language_model.norm.weight"


def _valid_update(engine: Engine, value: float = 1.5) -> None:
    """A one-tensor valid chunk must load (the server is still usable and the group in step)."""
    t = torch.full((64,) if engine.family == "qwen3" else (128,), value)
    r = engine.send_tensors({_norm(engine): t})
    assert r.status_code == 200, r.text
    assert r.json()["received_bytes"] == t.numel() * 4


# ---------------------------------------------------------------- (a) name tables


@pytest.mark.parametrize(
    ("family", "hf", "expected"),
    [
        (
            "qwen3",
            "model.layers.0.self_attn.q_proj.weight",
            ("model.layers.0.self_attn.qkv_proj.weight", "q"),
        ),
        (
            "qwen3",
            "model.layers.2.self_attn.v_proj.weight",
            ("model.layers.2.self_attn.qkv_proj.weight", "v"),
        ),
        ("qwen3", "model.layers.1.mlp.gate_proj.weight", ("model.layers.1.mlp.gate_up_proj.weight", 0)),
        ("qwen3", "model.layers.1.mlp.up_proj.weight", ("model.layers.1.mlp.gate_up_proj.weight", 1)),
        ("qwen3", "model.layers.1.mlp.down_proj.weight", ("model.layers.1.mlp.down_proj.weight", None)),
        ("qwen3", "model.layers.0.self_attn.k_norm.weight", ("model.layers.0.self_attn.k_norm.weight", None)),
        ("qwen3", "lm_head.weight", ("lm_head.weight", None)),
        (
            "qwen3_vl",
            "model.language_model.layers.3.self_attn.k_proj.weight",
            ("language_model.model.layers.3.self_attn.qkv_proj.weight", "k"),
        ),
        (
            "qwen3_vl",
            "model.language_model.layers.0.mlp.up_proj.weight",
            ("language_model.model.layers.0.mlp.gate_up_proj.weight", 1),
        ),
        (
            "qwen3_vl",
            "model.language_model.embed_tokens.weight",
            ("language_model.model.embed_tokens.weight", None),
        ),
        ("qwen3_vl", "lm_head.weight", ("language_model.lm_head.weight", None)),
        ("qwen3_vl", "model.visual.blocks.2.attn.qkv.weight", ("visual.blocks.2.attn.qkv.weight", None)),
        ("qwen3_vl", "model.visual.blocks.0.attn.proj.bias", ("visual.blocks.0.attn.proj.bias", None)),
        (
            "qwen3_vl",
            "model.visual.blocks.1.mlp.linear_fc2.weight",
            ("visual.blocks.1.mlp.linear_fc2.weight", None),
        ),
        (
            "qwen3_vl",
            "model.visual.deepstack_merger_list.2.norm.weight",
            ("visual.deepstack_merger_list.2.norm.weight", None),
        ),
        ("qwen3_vl", "model.visual.merger.linear_fc1.bias", ("visual.merger.linear_fc1.bias", None)),
        ("qwen3_vl", "model.visual.patch_embed.proj.weight", ("visual.patch_embed.proj.weight", None)),
        ("qwen3_vl", "model.visual.pos_embed.weight", ("visual.pos_embed.weight", None)),
    ],
)
def test_name_table(family: str, hf: str, expected: tuple[str, str | int | None]) -> None:
    target = hf_to_vllm(family, hf)
    assert target == VllmTarget(*expected)
    assert is_vllm_param(family, target.name)


def test_slot_strings_and_unknown_names() -> None:
    assert VllmTarget("model.layers.0.mlp.gate_up_proj.weight", 0).slot == "model.layers.0.mlp.gate_up_proj.weight[0]"
    assert VllmTarget("model.norm.weight", None).slot == "model.norm.weight"
    # A stacked rule only applies inside its scope (the vision tower has no q_proj in vLLM).
    assert hf_to_vllm("qwen3_vl", "model.visual.blocks.0.attn.q_proj.weight").shard is None
    assert not is_vllm_param("qwen3_vl", "visual.blocks.0.attn.q_proj.weight")
    assert not is_vllm_param("qwen3", "model.layers.0.self_attn.q_proj.weight")  # vLLM fuses it
    assert not is_vllm_param("qwen3", "model.rotary_emb.inv_freq")
    # At most one prefix rename applies, and no two overlap.
    for table in FAMILY_NAMES.values():
        for a in table.renames:
            assert not any(b is not a and b.hf.startswith(a.hf) for b in table.renames)


@pytest.mark.parametrize("model", ["qwen3", "qwen3-vl"])
def test_every_checkpoint_name_maps_to_one_vllm_slot(model: str) -> None:
    spec = load_model(model)
    names = safetensors_checksums(make_checkpoint(spec, seed=CKPT_SEED))
    targets = [hf_to_vllm(spec.family, n) for n in names]
    assert all(is_vllm_param(spec.family, t.name) for t in targets), [
        t for t in targets if not is_vllm_param(spec.family, t.name)
    ]
    assert len(set(targets)) == len(targets)


def test_checksum_is_raw_bytes() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_checksum(t) == hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest()
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())
    assert tensor_checksum(t.to(torch.bfloat16)) != tensor_checksum(t)


# ---------------------------------------------------------------- (b) full sync over the real server


@pytest.mark.parametrize("family", ["qwen3", "qwen3_vl"])
def test_full_sync_matches_checkpoint(engines: dict[str, Engine], family: str) -> None:
    eng = engines[family]
    truth = safetensors_checksums(eng.checkpoint)
    before = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert set(before) == set(truth)
    assert all(before[n] != truth[n] for n in truth), "engine must start from different (dummy) weights"
    slots = eng.post("/weight_checker", {"action": "slots"}).json()["slots"]
    assert len(slots) == len(truth)

    tensors = read_checkpoint(eng.checkpoint)
    names = list(tensors)
    chunks = [names[i::3] for i in range(3)]
    assert eng.post("/start_weight_update", {}).status_code == 200
    for i, chunk in enumerate(chunks):
        r = eng.send_tensors({n: tensors[n] for n in chunk}, chunk_index=i)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["chunk_index"] == i
        assert body["received_bytes"] == sum(tensors[n].numel() * tensors[n].element_size() for n in chunk)
    r = eng.post("/finish_weight_update", {"weight_version": 1})
    assert r.status_code == 200, r.text
    fin = r.json()
    assert fin["weight_version"] == 1
    assert set(fin["update_counts"]) == set(slots)
    assert all(c == 1 for c in fin["update_counts"].values()), fin["update_counts"]
    assert fin["load_s"] >= 0

    r = eng.post("/weight_checker", {"action": "checksum"})
    assert r.json()["checksums"] == truth
    assert r.json()["weight_version"] == 1
    cmp = eng.post("/weight_checker", {"action": "compare", "baseline": truth}).json()
    assert cmp == {"match": True, "mismatches": [], "weight_version": 1}


# ---------------------------------------------------------------- (c) rejections


def _f32(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(n))


BAD_CHUNKS = {
    # case: (names, dtype_names, shapes, payload, kind, words the error must contain)
    "unknown_name": (
        ["model.layers.99.mlp.up_proj.weight"],
        ["float32"],
        [[192, 64]],
        _f32(192 * 64),
        "name",
        ["model.layers.99.mlp.up_proj.weight"],
    ),
    "wrong_shape": (
        ["model.norm.weight"],
        ["float32"],
        [[32]],
        _f32(32),
        "shape",
        ["model.norm.weight", "[64]"],
    ),
    "declared_bf16_sent_f32": (
        ["model.norm.weight"],
        ["bfloat16"],
        [[64]],
        _f32(64),
        "dtype",
        ["model.norm.weight", "float32"],
    ),
    "declared_f32_sent_bf16": (
        ["model.norm.weight"],
        ["float32"],
        [[64]],
        _f32(64).to(torch.bfloat16),
        "bytes",
        ["model.norm.weight", "bytes"],
    ),
    "tied_lm_head": (
        ["lm_head.weight"],
        ["float32"],
        [[512, 64]],
        _f32(512 * 64),
        "name",
        ["lm_head.weight", "tied"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_CHUNKS))
def test_rejected_chunk_is_400_and_server_keeps_serving(engines: dict[str, Engine], case: str) -> None:
    eng = engines["qwen3"]
    names, dtypes, shapes, payload, kind, words = BAD_CHUNKS[case]
    assert eng.post("/start_weight_update", {}).status_code == 200
    r = eng.send_chunk(names, dtypes, shapes, wire.pack([payload]), chunk_index=7)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert all(w in detail["error"] for w in words), detail["error"]
    assert detail["kinds"] == {names[0]: kind}
    assert names[0] in detail["rejected"]
    assert httpx.get(f"{eng.url}/health").status_code == 200
    _valid_update(eng)
    fin = eng.post("/finish_weight_update", {"weight_version": 2}).json()
    assert fin["update_counts"]["model.norm.weight"] == 1
    assert sum(fin["update_counts"].values()) == 1


def test_rejection_is_atomic(engines: dict[str, Engine]) -> None:
    eng = engines["qwen3"]
    before = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
    good, bad = torch.full((64,), 3.0), torch.zeros(7)
    assert eng.post("/start_weight_update", {}).status_code == 200
    r = eng.send_chunk(
        ["model.norm.weight", "model.nope.weight"],
        ["float32", "float32"],
        [[64], [7]],
        wire.pack([good, bad]),
    )
    assert r.status_code == 400
    assert r.json()["detail"]["kinds"] == {"model.nope.weight": "name"}
    fin = eng.post("/finish_weight_update", {}).json()
    assert all(c == 0 for c in fin["update_counts"].values())
    after = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert after == before


def test_session_errors(engines: dict[str, Engine]) -> None:
    eng = engines["qwen3"]
    # update without start: the chunk is still received (no hang), then refused.
    r = eng.send_tensors({"model.norm.weight": torch.ones(64)}, chunk_index=0)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert "start_weight_update" in detail["error"]
    assert detail["kinds"] == {"model.norm.weight": "session"}
    assert httpx.get(f"{eng.url}/health").status_code == 200
    # finish without start, start twice
    assert eng.post("/finish_weight_update", {}).status_code == 400
    assert eng.post("/start_weight_update", {}).status_code == 200
    r = eng.post("/start_weight_update", {})
    assert r.status_code == 400
    assert "finish_weight_update" in r.json()["detail"]["error"]
    _valid_update(eng)
    assert eng.post("/finish_weight_update", {"weight_version": 3}).status_code == 200
    # malformed body: 400 naming the field
    r = eng.post("/init_weight_transfer_engine", {"init_info": {"backend": "gloo"}})
    assert r.status_code == 400
    assert "master_address" in r.json()["detail"]["error"]


def test_misc_routes(engines: dict[str, Engine]) -> None:
    eng = engines["qwen3"]
    assert httpx.get(f"{eng.url}/get_world_size").json() == {"world_size": 1}
    assert eng.post("/pause").json() == {"status": "paused"}
    assert httpx.get(f"{eng.url}/is_paused").json() == {"is_paused": True}
    assert eng.post("/resume").json() == {"status": "resumed"}
    assert eng.post("/weight_checker", {"action": "compare"}).status_code == 400
    assert eng.post("/weight_checker", {"action": "bogus"}).status_code == 400


def test_internal_error_is_500_with_traceback(engines: dict[str, Engine]) -> None:
    eng = engines["qwen3"]
    init = {
        "init_info": {
            "backend": "gloo",
            "master_address": "127.0.0.1",
            "master_port": 1,  # nothing listens there: the join fails inside the engine
            "rank_offset": 1,
            "world_size": 2,
            "timeout_s": 1.0,
        }
    }
    r = eng.post("/init_weight_transfer_engine", init)
    assert r.status_code == 500, r.text
    assert "Traceback" in r.json()["detail"]["traceback"]
    assert httpx.get(f"{eng.url}/health").status_code == 200
    # The old group is kept: a valid update still goes through.
    assert eng.post("/start_weight_update", {}).status_code == 200
    _valid_update(eng)
    assert eng.post("/finish_weight_update", {}).status_code == 200


def test_engine_refuses_the_checkpoints_seed() -> None:
    from reference_impl.engine.embedded.loader import build_engine_model

    with pytest.raises(ValueError, match="seed"):
        build_engine_model(make_checkpoint(load_model("qwen3"), seed=CKPT_SEED), CKPT_SEED)

"""The embedded engine: vLLM name tables, checkpoint views, strict loader, and the real server over gloo
and over colocate shared-memory handles, with its mutation-test faults.

The servers run as subprocesses (one per model entry, started once per session and stopped by pid);
the test process is the trainer's sender: it hosts the TCPStore, joins the transfer group as rank 0
and broadcasts packed chunks while a worker thread makes the /update_weights call (both block).
Colocate: three more qwen3 servers (no fault and each fault) started through `EngineProcess` with
backend shm; the test process owns a `SharedMemoryBuffer` and posts handles to it.
Expected checksums are computed independently from the safetensors files' raw bytes.
"""

from __future__ import annotations

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
import xxhash
from wsh_vllm_plugin import protocol
from wsh_vllm_plugin.group import TransferGroup, host_store, join_transfer_group

from reference_impl.checksum import tensor_checksum
from reference_impl.engine.embedded.launcher import EngineProcess, EngineStartError
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.checkpoint_views import saved_as
from reference_impl.models.families import FAMILIES
from reference_impl.models.registry import load_model
from reference_impl.models.vllm_names import VllmTarget, hf_to_vllm, is_vllm_param
from reference_impl.transport.handles import SharedMemoryBuffer, cuda_ipc_handle, open_cuda_ipc_handle

CKPT_SEED = 1234
ENGINE_SEED = 4321
MODELS = ("qwen3", "qwen3-vl", "qwen3-moe", "qwen3-vl-moe", "qwen3-untied")  # one engine each


# ---------------------------------------------------------------- helpers


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


def _start(family_model: str, tmp: Path) -> tuple[subprocess.Popen, Path, Path]:
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


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """One engine per model entry of MODELS (keyed by entry name), started in parallel, linked, and
    stopped by pid at the end."""
    tmp = tmp_path_factory.mktemp("engines")
    started = {model: _start(model, tmp) for model in MODELS}
    out: dict[str, Engine] = {}
    try:
        for model, (proc, ckpt, port_file) in started.items():
            port = _wait_port(proc, port_file, tmp / f"{model}.log")
            out[model] = Engine(load_model(model).model_type, ckpt, proc, f"http://127.0.0.1:{port}")
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
    return "model.norm.weight" if engine.model_type == "qwen3" else "model.language_model.norm.weight"


def _valid_update(engine: Engine, value: float = 1.5) -> None:
    """A one-tensor valid chunk must load (the server is still usable and the group in step)."""
    t = torch.full((64,) if engine.model_type == "qwen3" else (128,), value)
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
        # qwen3_moe: per-expert checkpoint names -> w13_weight / w2_weight at f"{e}:w1|w3|w2" (vLLM
        # RoutedExperts.build_expert_params_mapping); router unchanged; attention and dense MLP as qwen3.
        (
            "qwen3_moe",
            "model.layers.2.mlp.experts.7.gate_proj.weight",
            ("model.layers.2.mlp.experts.routed_experts.w13_weight", "7:w1"),
        ),
        (
            "qwen3_moe",
            "model.layers.2.mlp.experts.7.up_proj.weight",
            ("model.layers.2.mlp.experts.routed_experts.w13_weight", "7:w3"),
        ),
        (
            "qwen3_moe",
            "model.layers.0.mlp.experts.15.down_proj.weight",
            ("model.layers.0.mlp.experts.routed_experts.w2_weight", "15:w2"),
        ),
        ("qwen3_moe", "model.layers.1.mlp.gate.weight", ("model.layers.1.mlp.gate.weight", None)),
        (
            "qwen3_moe",
            "model.layers.1.self_attn.k_proj.weight",
            ("model.layers.1.self_attn.qkv_proj.weight", "k"),
        ),
        ("qwen3_moe", "model.layers.1.mlp.gate_proj.weight", ("model.layers.1.mlp.gate_up_proj.weight", 0)),
        ("qwen3_moe", "lm_head.weight", ("lm_head.weight", None)),
        # qwen3_vl_moe: qwen3_vl's prefixes; fused experts -> one shard each, shard "all".
        (
            "qwen3_vl_moe",
            "model.language_model.layers.5.mlp.experts.gate_up_proj",
            ("language_model.model.layers.5.mlp.experts.routed_experts.w13_weight", "all"),
        ),
        (
            "qwen3_vl_moe",
            "model.language_model.layers.5.mlp.experts.down_proj",
            ("language_model.model.layers.5.mlp.experts.routed_experts.w2_weight", "all"),
        ),
        (
            "qwen3_vl_moe",
            "model.language_model.layers.0.mlp.gate.weight",
            ("language_model.model.layers.0.mlp.gate.weight", None),
        ),
        (
            "qwen3_vl_moe",
            "model.language_model.layers.0.self_attn.q_proj.weight",
            ("language_model.model.layers.0.self_attn.qkv_proj.weight", "q"),
        ),
        ("qwen3_vl_moe", "model.visual.blocks.3.attn.qkv.bias", ("visual.blocks.3.attn.qkv.bias", None)),
        ("qwen3_vl_moe", "lm_head.weight", ("language_model.lm_head.weight", None)),
    ],
)
def test_name_table(family: str, hf: str, expected: tuple[str, str | int | None]) -> None:
    target = hf_to_vllm(FAMILIES[family].names, hf)
    assert target == VllmTarget(*expected)
    assert is_vllm_param(FAMILIES[family].names, target.name)


def test_shard_ids_and_unknown_names() -> None:
    assert VllmTarget("model.layers.0.mlp.gate_up_proj.weight", 0).key == "model.layers.0.mlp.gate_up_proj.weight[0]"
    assert VllmTarget("model.norm.weight", None).key == "model.norm.weight"
    # A stacked rule only applies inside its scope (the vision tower has no q_proj in vLLM).
    dense, vl, moe = (FAMILIES[f].names for f in ("qwen3", "qwen3_vl", "qwen3_moe"))
    assert hf_to_vllm(vl, "model.visual.blocks.0.attn.q_proj.weight").shard is None
    assert not is_vllm_param(vl, "visual.blocks.0.attn.q_proj.weight")
    assert not is_vllm_param(dense, "model.layers.0.self_attn.q_proj.weight")  # vLLM fuses it
    assert not is_vllm_param(dense, "model.rotary_emb.inv_freq")
    # A per-expert name is an expert rule, never the dense gate_up_proj stacked rule.
    assert hf_to_vllm(moe, "model.layers.0.mlp.experts.3.gate_proj.weight").name.endswith("w13_weight")
    assert not is_vllm_param(moe, "model.layers.0.mlp.experts.gate_up_proj")  # the HF in-memory name
    assert set(FAMILIES) >= {"qwen3_moe", "qwen3_vl_moe"}
    # Each family is registered under its own model_type, and its name table names the same family.
    assert all(key == fam.model_type == fam.names.model_type for key, fam in FAMILIES.items())
    # At most one prefix rename applies, and no two overlap.
    for table in (fam.names for fam in FAMILIES.values()):
        for a in table.renames:
            assert not any(b is not a and b.hf.startswith(a.hf) for b in table.renames)


@pytest.mark.parametrize("model", MODELS)
def test_every_checkpoint_name_maps_to_one_vllm_shard(model: str) -> None:
    spec = load_model(model)
    names = safetensors_checksums(make_checkpoint(spec, seed=CKPT_SEED))
    table = FAMILIES[spec.model_type].names
    targets = [hf_to_vllm(table, n) for n in names]
    assert all(is_vllm_param(table, t.name) for t in targets), [t for t in targets if not is_vllm_param(table, t.name)]
    assert len(set(targets)) == len(targets)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_vl_moe"])
def test_expert_views_are_writable_views_in_checkpoint_layout(family: str) -> None:
    ne, mi, hd = 3, 4, 5  # experts, moe_intermediate, hidden
    gate_up = torch.arange(ne * 2 * mi * hd, dtype=torch.float32).reshape(ne, 2 * mi, hd)  # transformers layout
    down = torch.arange(ne * hd * mi, dtype=torch.float32).reshape(ne, hd, mi)  # transformers [E, H, I]
    views = FAMILIES[family].views
    gu = saved_as(views, "model.layers.0.mlp.experts.gate_up_proj", gate_up)
    dn = saved_as(views, "model.layers.0.mlp.experts.down_proj", down)
    assert saved_as(views, "model.norm.weight", torch.ones(hd))[0].name == "model.norm.weight"
    if family == "qwen3_moe":
        assert [c.name for c in gu[:2]] == [
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            "model.layers.0.mlp.experts.0.up_proj.weight",
        ]
        assert len(gu) == 2 * ne and len(dn) == ne
        by = {c.name: c.view(gate_up) for c in gu} | {c.name: c.view(down) for c in dn}
        assert torch.equal(by["model.layers.0.mlp.experts.2.gate_proj.weight"], gate_up[2, :mi])
        assert torch.equal(by["model.layers.0.mlp.experts.2.up_proj.weight"], gate_up[2, mi:])
        assert torch.equal(by["model.layers.0.mlp.experts.1.down_proj.weight"], down[1])
        by["model.layers.0.mlp.experts.1.up_proj.weight"].copy_(torch.full((mi, hd), -1.0))
        assert (gate_up[1, mi:] == -1).all() and (gate_up[1, :mi] >= 0).all()
    else:
        assert [c.name for c in gu] == ["model.layers.0.mlp.experts.gate_up_proj"]
        assert gu[0].view(gate_up).shape == (ne, hd, 2 * mi) and dn[0].view(down).shape == (ne, mi, hd)
        assert "released layout [E, hidden, 2*moe_inter]" in gu[0].layout
        released = torch.randn(ne, hd, 2 * mi)
        gu[0].view(gate_up).copy_(released)
        assert torch.equal(gate_up, released.transpose(1, 2))  # gate = the first I of the released last dim
        assert tensor_checksum(gu[0].view(gate_up)) == tensor_checksum(released)


@pytest.mark.parametrize("model", MODELS)
def test_views_of_the_checkpoint_model_are_the_checkpoint(model: str) -> None:
    """The view table agrees with what the checkpoint maker writes, independently of any sync: a loader
    over the very model the checkpoint was saved from reports the checkpoint's names and checksums."""
    from reference_impl.engine.embedded.loader import EngineLoader
    from reference_impl.models.checkpoint import build_hf_model

    spec = load_model(model)
    truth = safetensors_checksums(make_checkpoint(spec, seed=CKPT_SEED))
    assert EngineLoader(build_hf_model(spec, "float32", CKPT_SEED), spec.model_type).checksums() == truth


def test_checksum_is_raw_bytes() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_checksum(t) == xxhash.xxh3_128_hexdigest(t.numpy().tobytes())
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())
    assert tensor_checksum(t.to(torch.bfloat16)) != tensor_checksum(t)


# ---------------------------------------------------------------- (b) full sync over the real server


@pytest.mark.parametrize("model", MODELS)
def test_full_sync_matches_checkpoint(engines: dict[str, Engine], model: str) -> None:
    eng = engines[model]
    truth = safetensors_checksums(eng.checkpoint)
    before = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert set(before) == set(truth)
    assert all(before[n] != truth[n] for n in truth), "engine must start from different (dummy) weights"
    shards = eng.post("/weight_checker", {"action": "shards"}).json()["shards"]
    assert len(shards) == len(truth)

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
    assert set(fin["update_counts"]) == set(shards)
    assert all(c == 1 for c in fin["update_counts"].values()), fin["update_counts"]
    assert fin["load_s"] >= 0

    r = eng.post("/weight_checker", {"action": "checksum"})
    assert r.json()["checksums"] == truth
    assert r.json()["weight_version"] == 1
    cmp = eng.post("/weight_checker", {"action": "compare", "baseline": truth}).json()
    assert cmp == {"match": True, "mismatches": [], "weight_version": 1}


def test_moe_and_untied_shards(engines: dict[str, Engine]) -> None:
    """Shards are checkpoint tensors: per-expert for Qwen3-MoE, fused released layout for Qwen3-VL-MoE."""
    spec = load_model("qwen3-moe").model_config()
    ne = spec.num_experts
    assert spec.hidden_size not in (spec.moe_ffn_hidden_size, 2 * spec.moe_ffn_hidden_size)  # orientation shows
    shards = set(engines["qwen3-moe"].post("/weight_checker", {"action": "shards"}).json()["shards"])
    assert {
        f"model.layers.3.mlp.experts.routed_experts.w13_weight[{e}:{w}]" for e in range(ne) for w in ("w1", "w3")
    } <= shards
    assert f"model.layers.3.mlp.experts.routed_experts.w2_weight[{ne - 1}:w2]" in shards
    assert "model.layers.3.mlp.gate.weight" in shards and "lm_head.weight" in shards
    assert len([s for s in shards if ".experts." in s]) == spec.num_layers * 3 * ne

    vl = load_model("qwen3-vl-moe").model_config()
    eng = engines["qwen3-vl-moe"]
    # The checkpoint maker writes the released layout, which the engine (like vLLM) expects.
    shapes = safetensors_shapes(eng.checkpoint)
    pre = "model.language_model.layers.0.mlp.experts."
    assert shapes[pre + "gate_up_proj"] == [vl.num_experts, vl.hidden_size, 2 * vl.moe_ffn_hidden_size]
    assert shapes[pre + "down_proj"] == [vl.num_experts, vl.moe_ffn_hidden_size, vl.hidden_size]
    shards = set(eng.post("/weight_checker", {"action": "shards"}).json()["shards"])
    assert "language_model.model.layers.0.mlp.experts.routed_experts.w13_weight[all]" in shards
    assert "language_model.model.layers.0.mlp.experts.routed_experts.w2_weight[all]" in shards
    assert "language_model.lm_head.weight" in shards
    assert len([s for s in shards if ".experts." in s]) == vl.num_layers * 2

    untied = set(engines["qwen3-untied"].post("/weight_checker", {"action": "shards"}).json()["shards"])
    assert "lm_head.weight" in untied
    assert "lm_head.weight" not in set(engines["qwen3"].post("/weight_checker", {"action": "shards"}).json()["shards"])


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
    r = eng.send_chunk(names, dtypes, shapes, protocol.pack([payload]), chunk_index=7)
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


MOE_CHUNKS = {
    # case: (engine, name, shape, kind, words the error must contain)
    "expert_id_out_of_range": (
        "qwen3-moe",
        "model.layers.0.mlp.experts.16.gate_proj.weight",
        [48, 128],
        "name",
        ["experts.16.gate_proj.weight", "w13_weight[16:w1]", "experts.15.up_proj.weight"],
    ),
    "fused_name_to_per_expert_engine": (
        "qwen3-moe",
        "model.layers.0.mlp.experts.gate_up_proj",
        [16, 96, 128],
        "name",
        ["experts.gate_up_proj", "experts.0.gate_proj.weight"],
    ),
    "per_expert_down_wrong_shape": (
        "qwen3-moe",
        "model.layers.1.mlp.experts.2.down_proj.weight",
        [48, 128],
        "shape",
        ["[128, 48]", "per-expert [hidden, moe_inter]"],
    ),
    "vl_moe_gate_up_transformers_orientation": (
        "qwen3-vl-moe",
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        [16, 96, 128],
        "shape",
        ["[16, 128, 96]", "released layout [E, hidden, 2*moe_inter]", "swapped"],
    ),
    "vl_moe_down_transformers_orientation": (
        "qwen3-vl-moe",
        "model.language_model.layers.2.mlp.experts.down_proj",
        [16, 128, 48],
        "shape",
        ["[16, 48, 128]", "released layout [E, moe_inter, hidden]"],
    ),
    "vl_moe_per_expert_name": (
        "qwen3-vl-moe",
        "model.language_model.layers.0.mlp.experts.3.gate_proj.weight",
        [48, 128],
        "name",
        ["experts.gate_up_proj [all]"],
    ),
    "vl_tied_lm_head": (
        "qwen3-vl",
        "lm_head.weight",
        [1024, 128],
        "name",
        ["lm_head.weight", "tied"],
    ),
}


@pytest.mark.parametrize("case", list(MOE_CHUNKS))
def test_moe_and_tied_rejections(engines: dict[str, Engine], case: str) -> None:
    model, name, shape, kind, words = MOE_CHUNKS[case]
    eng = engines[model]
    before = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert eng.post("/start_weight_update", {}).status_code == 200
    payload = torch.zeros(shape)
    r = eng.send_chunk([name], ["float32"], [shape], protocol.pack([payload]))
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert detail["kinds"] == {name: kind}
    assert all(w in detail["error"] for w in words), detail["error"]
    fin = eng.post("/finish_weight_update", {}).json()
    assert not any(fin["update_counts"].values())
    assert eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"] == before


def test_untied_lm_head_is_accepted(engines: dict[str, Engine]) -> None:
    eng = engines["qwen3-untied"]
    lm_head = torch.randn(512, 64, generator=torch.Generator().manual_seed(5))
    assert eng.post("/start_weight_update", {}).status_code == 200
    r = eng.send_tensors({"lm_head.weight": lm_head})
    assert r.status_code == 200, r.text
    fin = eng.post("/finish_weight_update", {}).json()
    assert fin["update_counts"]["lm_head.weight"] == 1
    assert sum(fin["update_counts"].values()) == 1
    sums = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert sums["lm_head.weight"] == tensor_checksum(lm_head)


def test_rejection_is_atomic(engines: dict[str, Engine]) -> None:
    eng = engines["qwen3"]
    before = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
    good, bad = torch.full((64,), 3.0), torch.zeros(7)
    assert eng.post("/start_weight_update", {}).status_code == 200
    r = eng.send_chunk(
        ["model.norm.weight", "model.nope.weight"],
        ["float32", "float32"],
        [[64], [7]],
        protocol.pack([good, bad]),
    )
    assert r.status_code == 400
    assert r.json()["detail"]["kinds"] == {"model.nope.weight": "name"}
    fin = eng.post("/finish_weight_update", {}).json()
    assert all(c == 0 for c in fin["update_counts"].values())
    after = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert after == before


def test_session_errors(engines: dict[str, Engine]) -> None:
    eng = engines["qwen3"]
    # update without start: refused before anything is received (as vLLM's worker), so nothing is broadcast.
    info = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]], "packed": True, "src": 0}
    r = eng.post("/update_weights", {"update_info": info})
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert "start_weight_update" in detail["error"]
    assert detail["kinds"] == {"model.norm.weight": "session"}
    assert httpx.get(f"{eng.url}/health").status_code == 200
    # finish without start, start twice: session refusals, as vLLM's answers parse
    r = eng.post("/finish_weight_update", {})
    assert r.status_code == 400 and r.json()["detail"]["kinds"] == {"/finish_weight_update": "session"}
    assert eng.post("/start_weight_update", {}).status_code == 200
    r = eng.post("/start_weight_update", {})
    assert r.status_code == 400
    assert "finish_weight_update" in r.json()["detail"]["error"]
    assert r.json()["detail"]["kinds"] == {"/start_weight_update": "session"}
    _valid_update(eng)
    assert eng.post("/finish_weight_update", {"weight_version": 3}).status_code == 200
    # malformed body: 400 naming the field
    r = eng.post("/init_weight_transfer_engine", {"init_info": {"backend": "gloo"}})
    assert r.status_code == 400
    assert "master_address" in r.json()["detail"]["error"]


def test_refused_update_info_is_received_first_under_gloo(engines: dict[str, Engine]) -> None:
    """Inside a session, an update_info the protocol refuses (a name twice) is still received (and dropped)
    before the 400, as the sender broadcasts while the call is in flight: the next chunk then arrives in
    step and loads exactly."""
    eng = engines["qwen3"]
    assert eng.post("/start_weight_update", {}).status_code == 200
    twice = torch.full((64,), 7.0)
    r = eng.send_chunk(["model.norm.weight"] * 2, ["float32"] * 2, [[64], [64]], protocol.pack([twice, twice]))
    assert r.status_code == 400, r.text
    assert r.json()["detail"]["kinds"] == {"body.update_info.names.1": "request"}
    assert "appears twice" in r.json()["detail"]["error"]
    _valid_update(eng, 2.5)
    fin = eng.post("/finish_weight_update", {}).json()
    assert fin["update_counts"]["model.norm.weight"] == 1 and sum(fin["update_counts"].values()) == 1
    norm = eng.post("/weight_checker", {"action": "checksum"}).json()["checksums"]["model.norm.weight"]
    assert norm == tensor_checksum(torch.full((64,), 2.5))


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
    from reference_impl.models.hf_model import build_engine_model

    with pytest.raises(ValueError, match="seed"):
        build_engine_model(make_checkpoint(load_model("qwen3"), seed=CKPT_SEED), CKPT_SEED)


# ---------------------------------------------------------------- (d) colocate: shared-memory handles


CLEAN = "no-fault"
FINALIZE_PER_CHUNK = "harness.faults.engine:finalize_per_chunk"
OK_WITHOUT_TRANSFER = "harness.faults.engine:ok_without_transfer"


@pytest.fixture(scope="module")
def shm_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    """Three qwen3 engines started through EngineProcess (no fault, and each fault), in parallel, all
    initialised with backend shm; stopped by pid at the end."""
    tmp = tmp_path_factory.mktemp("shm-engines")
    ckpt = str(make_checkpoint(load_model("qwen3"), seed=CKPT_SEED))
    procs = {
        name: EngineProcess(ckpt, ENGINE_SEED, log_path=str(tmp / f"{name}.log"), fault=fault)
        for name, fault in ((CLEAN, None), (FINALIZE_PER_CHUNK, FINALIZE_PER_CHUNK), (OK_WITHOUT_TRANSFER,) * 2)
    }
    try:
        with ThreadPoolExecutor(len(procs)) as ex:
            list(ex.map(lambda p: p.start(timeout_s=120), procs.values()))
        for proc in procs.values():
            r = _post(proc.url, "/init_weight_transfer_engine", {"init_info": {"backend": "shm"}})
            assert r.status_code == 200, r.text
            assert r.json() == {"ok": True, "backend": "shm"}
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _post(url: str, route: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body if body is not None else {}, timeout=60)


def _shm_chunk(
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
    return _post(url, "/update_weights", {"update_info": info})


def _shm_sync(url: str, buf: SharedMemoryBuffer, tensors: dict[str, torch.Tensor], chunks: list[list[str]]) -> dict:
    """One update session over handles; every chunk must answer 200. Returns the finish body."""
    assert _post(url, "/start_weight_update").status_code == 200
    for i, chunk in enumerate(chunks):
        r = _shm_chunk(url, buf, {n: tensors[n] for n in chunk}, i)
        assert r.status_code == 200, r.text
        assert r.json()["received_bytes"] == sum(tensors[n].numel() * tensors[n].element_size() for n in chunk)
        assert r.json()["loaded"] == len(chunk)
    r = _post(url, "/finish_weight_update", {"weight_version": 1})
    assert r.status_code == 200, r.text
    return r.json()


def _checksums(url: str) -> dict[str, str]:
    return _post(url, "/weight_checker", {"action": "checksum"}).json()["checksums"]


def _segment_exists(name: str) -> bool:
    return Path("/dev/shm", name).exists()


@pytest.fixture
def shm_buffer() -> Iterator[SharedMemoryBuffer]:
    with SharedMemoryBuffer(1) as buf:
        yield buf


def test_shm_full_sync_matches_checkpoint(
    shm_engines: dict[str, EngineProcess], shm_buffer: SharedMemoryBuffer
) -> None:
    url = shm_engines[CLEAN].url
    ckpt = make_checkpoint(load_model("qwen3"), seed=CKPT_SEED)
    truth = safetensors_checksums(ckpt)
    before = _checksums(url)
    assert all(before[n] != truth[n] for n in truth), "engine must start from different (dummy) weights"
    tensors = read_checkpoint(ckpt)
    names = list(tensors)
    fin = _shm_sync(url, shm_buffer, tensors, [names[i::3] for i in range(3)])
    assert fin["update_counts"] and all(c == 1 for c in fin["update_counts"].values()), fin["update_counts"]
    assert _checksums(url) == truth
    # The engine attached untracked and closed without unlinking: the producer's segment is intact.
    if Path("/dev/shm").is_dir():
        assert _segment_exists(shm_buffer.name)
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
    before = _checksums(url)
    assert _post(url, "/start_weight_update").status_code == 200
    norm = {"model.norm.weight": torch.full((64,), 2.5)}
    r = _shm_chunk(url, shm_buffer, norm, 5, edits)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert all(w in detail["error"] for w in words), detail["error"]
    assert detail["kinds"] == {"model.norm.weight": "bytes"}
    assert _checksums(url) == before
    # The server keeps serving: a valid chunk through the same buffer loads.
    assert _shm_chunk(url, shm_buffer, norm, 6).status_code == 200
    fin = _post(url, "/finish_weight_update").json()
    assert fin["update_counts"]["model.norm.weight"] == 1
    assert sum(fin["update_counts"].values()) == 1


def test_shm_init_and_backend_mismatch(shm_engines: dict[str, EngineProcess], engines: dict[str, Engine]) -> None:
    url = shm_engines[CLEAN].url
    nccl = {"backend": "nccl", "master_address": "127.0.0.1", "master_port": 1}  # every rule but CUDA holds
    r = _post(url, "/init_weight_transfer_engine", {"init_info": nccl})
    assert r.status_code == 400
    assert r.json()["detail"]["kinds"] == {"body.init_info.backend": "request"}
    if not torch.cuda.is_available():
        r = _post(url, "/init_weight_transfer_engine", {"init_info": {"backend": "cuda_ipc"}})
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
    _valid_update(eng)
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
        assert _segment_exists(shm_buffer.name)
    name = shm_buffer.name
    shm_buffer.close()
    if Path("/dev/shm").is_dir():
        assert not _segment_exists(name)


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


# ---------------------------------------------------------------- (e) engine faults (mutation tests)


def _two_chunk_sync(url: str, buf: SharedMemoryBuffer) -> tuple[dict, dict[str, str], dict[str, str], list[str]]:
    """Full 2-chunk sync of the qwen3 checkpoint: (finish body, checksums before, after, first chunk's names)."""
    ckpt = make_checkpoint(load_model("qwen3"), seed=CKPT_SEED)
    tensors = read_checkpoint(ckpt)
    names = list(tensors)
    chunks = [names[: len(names) // 2], names[len(names) // 2 :]]
    before = _checksums(url)
    fin = _shm_sync(url, buf, tensors, chunks)
    return fin, before, _checksums(url), chunks[0]


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
    _valid_update(eng, 4.5)  # the group is still in step
    assert eng.post("/finish_weight_update", {}).status_code == 200
    shm_url = shm_engines[CLEAN].url
    assert _post(shm_url, "/init_weight_transfer_engine", {"init_info": {"backend": "shm"}}).status_code == 200
    r = _post(shm_url, "/transfer_probe", {"sizes": [8]})
    assert r.status_code == 400 and "transfer group" in r.json()["detail"]["error"]
    assert eng.post("/transfer_probe", {"sizes": [0]}).status_code == 400  # sizes are >= 1 byte

"""Chunks the engine must refuse (400, atomic, naming what to change) and routes called out of order; the
engine keeps serving after each."""

from __future__ import annotations

import httpx
import pytest
import torch
from wsh_vllm_plugin import protocol

from reference_impl.checksum import tensor_checksum
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model

from .engines import CKPT_SEED, Engine, valid_update


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
    valid_update(eng)
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
    valid_update(eng)
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
    valid_update(eng, 2.5)
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
    valid_update(eng)
    assert eng.post("/finish_weight_update", {}).status_code == 200


def test_engine_refuses_the_checkpoints_seed() -> None:
    from reference_impl.models.hf_model import build_engine_model

    with pytest.raises(ValueError, match="seed"):
        build_engine_model(make_checkpoint(load_model("qwen3"), seed=CKPT_SEED), CKPT_SEED)

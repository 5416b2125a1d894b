"""A full sync over the real server and gloo: the engine ends holding the checkpoint's bytes, shard by
shard."""

from __future__ import annotations

import pytest

from reference_impl.models.checkpoint import read_checkpoint
from reference_impl.models.registry import load_model

from .engines import MODELS, Engine, safetensors_checksums, safetensors_shapes


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

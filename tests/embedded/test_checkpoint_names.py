"""vLLM's name tables for every family, the checkpoint views the engine loads into, and the checksum's
bytes."""

from __future__ import annotations

import pytest
import torch
import xxhash

from reference_impl.checksum import tensor_checksum
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.checkpoint_views import saved_as
from reference_impl.models.families import FAMILIES
from reference_impl.models.registry import load_model
from reference_impl.models.vllm_names import VllmTarget, hf_to_vllm, is_vllm_param

from .engines import CKPT_SEED, MODELS, safetensors_checksums


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

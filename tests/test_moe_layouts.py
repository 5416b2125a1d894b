"""Expert-parallel ids, the fused Qwen3-VL-MoE layout against the files transformers writes, and the
rank that owns nothing in a chunk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reference_impl.models.checkpoint import build_hf_model, make_checkpoint, read_checkpoint
from reference_impl.models.families.qwen3_vl_moe import fuse_experts
from reference_impl.models.raw_rules import ConvertConfig
from reference_impl.models.registry import load_model
from reference_impl.trainer.params import global_expert_name, is_expert_param
from reference_impl.transport import sync
from reference_impl.transport.plan import TensorMeta, plan_chunks

# E = 16 experts over EP = 2 ranks: 8 local experts each; global = ep_rank * 8 + local (hand-derived).
EP2_TABLE = [(0, 0, 0), (0, 7, 7), (1, 0, 8), (1, 3, 11), (1, 7, 15)]


@pytest.mark.parametrize(("ep_rank", "local", "expected"), EP2_TABLE)
def test_global_expert_ids_at_ep2(ep_rank: int, local: int, expected: int) -> None:
    name = f"decoder.layers.1.mlp.experts.local_experts.{local}.linear_fc1.weight"
    assert (
        global_expert_name(name, ep_rank, 8)
        == f"decoder.layers.1.mlp.experts.local_experts.{expected}.linear_fc1.weight"
    )
    assert is_expert_param(name)
    assert global_expert_name("decoder.layers.1.mlp.router.weight", 1, 8) == "decoder.layers.1.mlp.router.weight"


@pytest.fixture(scope="module")
def vl_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """A seeded Qwen3-VL-MoE saved by transformers' own save_pretrained (no layout rewrite)."""
    spec = load_model("qwen3-vl-moe")
    model = build_hf_model(spec, "float32", seed=7)
    out = tmp_path_factory.mktemp("vlmoe-transformers")
    model.save_pretrained(out)
    return model, out


def per_expert_from_model(model: torch.nn.Module, layer: int) -> list[tuple[str, torch.Tensor]]:
    """Per-expert gate/up/down [I, H], [I, H], [H, I] as Megatron's SequentialMLP holds them, read from
    the transformers module (its in-memory gate_up_proj is [E, 2I, H], gate rows first)."""
    experts = model.model.language_model.layers[layer].mlp.experts
    inter = experts.down_proj.shape[-1]
    prefix = f"model.language_model.layers.{layer}.mlp.experts"
    out = []
    for e in range(experts.gate_up_proj.shape[0]):
        out.append((f"{prefix}.{e}.gate_proj.weight", experts.gate_up_proj[e, :inter].detach().clone()))
        out.append((f"{prefix}.{e}.up_proj.weight", experts.gate_up_proj[e, inter:].detach().clone()))
        out.append((f"{prefix}.{e}.down_proj.weight", experts.down_proj[e].detach().clone()))
    return out


def facts(layout: str) -> ConvertConfig:
    f = load_model("qwen3-vl-moe").model_config()
    return ConvertConfig(
        f.num_heads,
        f.num_kv_heads,
        f.head_dim,
        f.vocab_size,
        f.tied_embeddings,
        num_experts=f.num_experts,
        fused_experts_layout=layout,
    )


def test_fused_layout_equals_the_file_transformers_writes(vl_moe: tuple[torch.nn.Module, Path]) -> None:
    model, folder = vl_moe
    on_disk = read_checkpoint(folder)
    fused = dict(fuse_experts(per_expert_from_model(model, 2), facts("transformers")))
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.language_model.layers.2.mlp.experts.{name}"
        assert fused[key].shape == on_disk[key].shape
        assert torch.equal(fused[key], on_disk[key])
    assert on_disk["model.language_model.layers.2.mlp.experts.gate_up_proj"].shape == (16, 96, 128)  # [E, 2I, H]


def test_released_layout_is_the_transpose_and_what_the_maker_writes(vl_moe: tuple[torch.nn.Module, Path]) -> None:
    model, folder = vl_moe
    written = read_checkpoint(folder)
    fused = dict(fuse_experts(per_expert_from_model(model, 0), facts("released")))
    gate_up = fused["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    down = fused["model.language_model.layers.0.mlp.experts.down_proj"]
    assert gate_up.shape == (16, 128, 96) and down.shape == (16, 48, 128)  # [E, H, 2I], [E, I, H]
    assert torch.equal(gate_up, written["model.language_model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2))
    # The checkpoint maker's file (released layout) for the same seed holds exactly these tensors.
    released = read_checkpoint(make_checkpoint(load_model("qwen3-vl-moe"), seed=7))
    assert torch.equal(released["model.language_model.layers.0.mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(released["model.language_model.layers.0.mlp.experts.down_proj"], down)


def test_fuse_refuses_a_missing_expert(vl_moe: tuple[torch.nn.Module, Path]) -> None:
    model, _ = vl_moe
    pairs = [p for p in per_expert_from_model(model, 0) if ".experts.5." not in p[0]]
    with pytest.raises(ValueError, match=r"experts .* are not 0\.\.15"):
        fuse_experts(pairs, facts("released"))


def test_a_rank_that_owns_nothing_in_a_chunk_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(sync.dist, "send", lambda t, dst: sent.append((t.numel(), dst)))
    metas = [
        TensorMeta("a", (4,), "float32", 16, 0),
        TensorMeta("b", (2,), "float32", 8, 2),
        TensorMeta("c", (1,), "float32", 4, 0),
    ]
    plan = plan_chunks(metas, chunk_bytes=1)  # one tensor per chunk: rank 2 owns only chunk 1
    sync.hand_off(plan, {"b": torch.zeros(2)}, rank=2)
    assert sent == [(8, 0)]  # bytes of "b" to the sender, nothing for chunks 0 and 2
    sent.clear()
    sync.hand_off(plan, {}, rank=3)  # a rank that owns nothing at all
    assert sent == []

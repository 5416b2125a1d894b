"""Raw converter layouts against hand-derived examples (no Megatron model needed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from reference_impl.models.families import FAMILIES
from reference_impl.models.raw_rules import (
    ConvertConfig,
    UnmappedName,
    convert,
    merge_vision_qkv,
    split_gate_up,
    split_qkv,
)
from reference_impl.trainer import params
from reference_impl.trainer.params import combine_shards, global_name

FACTS = ConvertConfig(
    num_heads=4, num_kv_heads=2, head_dim=2, vocab_size=6, tied_embeddings=True, vision_heads=2, vision_head_dim=2
)


def rows(*labels: float) -> torch.Tensor:
    """A [len, 1] tensor whose row i holds labels[i] (to read layouts by eye)."""
    return torch.tensor(labels, dtype=torch.float32).reshape(-1, 1)


def test_split_qkv_by_query_group_with_head_dim() -> None:
    # 4 q heads, 2 kv groups, head_dim 2: Megatron rows per group g = [q(2 heads x 2), k_g(2), v_g(2)].
    # Label = 100*kind + 10*head + row-in-head, kind q=1 k=2 v=3.
    megatron = rows(
        110,
        111,
        120,
        121,
        210,
        211,
        310,
        311,  # group 0: q heads 1,2 (labelled 1x,2x), k0, v0
        130,
        131,
        140,
        141,
        220,
        221,
        320,
        321,  # group 1: q heads 3,4, k1, v1
    )
    q, k, v = split_qkv(megatron, FACTS)
    assert q.flatten().tolist() == [110, 111, 120, 121, 130, 131, 140, 141]
    assert k.flatten().tolist() == [210, 211, 220, 221]
    assert v.flatten().tolist() == [310, 311, 320, 321]


def test_gate_up_split_after_stride_two_gather() -> None:
    # TP=2: rank r holds [gate_r; up_r]. Gathered with stride 2 -> [gate_0; gate_1; up_0; up_1].
    shard0 = rows(1, 2, 10, 20)  # gate rows 1,2 ; up rows 10,20
    shard1 = rows(3, 4, 30, 40)
    full = combine_shards([shard0, shard1], dim=0, stride=2)
    assert full.flatten().tolist() == [1, 2, 3, 4, 10, 20, 30, 40]
    gate, up = split_gate_up(full, FACTS)
    assert gate.flatten().tolist() == [1, 2, 3, 4]
    assert up.flatten().tolist() == [10, 20, 30, 40]


def test_row_parallel_gather_concatenates_columns() -> None:
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])
    assert combine_shards([a, b], dim=1).tolist() == [[1, 2, 3, 4]]


@pytest.mark.parametrize("kept", [False, True], ids=["new-memory", "kept-buffers"])
@pytest.mark.parametrize(
    ("shape", "dim", "stride", "tp"),
    [
        ((6, 4), 0, 1, 2),
        ((6, 4), 0, 2, 2),
        ((6, 4), 1, 1, 2),
        ((6, 4), 1, 2, 4),
        ((4, 6, 3), 1, 3, 3),
        ((2, 3, 4), 2, 2, 2),
    ],
)
def test_tp_gather_layout_matches_concatenation(
    shape: tuple[int, ...], dim: int, stride: int, tp: int, kept: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tp_gather's one buffer and strided copy give what concatenating the blocks in rank order gives
    # (combine_shards: block j of every rank before block j + 1); the exchange hands rank r's shard. With
    # kept buffers, a second export of other values writes the same memory and is right again.
    n = torch.Size(shape).numel()
    buffers = params.GatherBuffers() if kept else None
    addresses = []
    for step in range(2):
        base = step * 10**5
        shards = [
            torch.arange(base + r * 1000, base + r * 1000 + n, dtype=torch.float32).view(shape) for r in range(tp)
        ]

        def exchange(flat: torch.Tensor, parts: torch.Tensor, group: object, to_first: bool, shards=shards) -> bool:  # type: ignore[no-untyped-def]
            # group rank 0's part of the host's point-to-point exchange: every other rank's row
            assert parts.shape == (tp, n) and torch.equal(flat, shards[0].view(-1))  # the flat form
            for r in range(1, tp):
                parts[r].copy_(shards[r].view(-1))
            return True

        monkeypatch.setattr(params, "_exchange", exchange)
        monkeypatch.setattr(params.dist, "get_rank", lambda group=None: 0)
        param = torch.nn.Parameter(shards[0].clone(), requires_grad=False)
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride  # type: ignore[attr-defined]
        full = params.tp_gather(param, None, tp, buffers, "w")
        assert full.is_contiguous() and torch.equal(full, combine_shards(shards, dim, stride))
        addresses.append(full.data_ptr())
        got = params.tp_shards(param, None, tp, buffers)
        assert [torch.equal(a, b) for a, b in zip(got, shards, strict=True)] == [True] * tp
    assert (addresses[0] == addresses[1]) is kept


def test_gather_buffers_keep_one_buffer_per_key_and_grow_the_scratch() -> None:
    buffers = params.GatherBuffers()
    a = buffers.kept(("w", "tp"), 12, torch.bfloat16)
    assert buffers.kept(("w", "tp"), 12, torch.bfloat16).data_ptr() == a.data_ptr()
    assert buffers.kept(("v", "tp"), 12, torch.bfloat16).data_ptr() != a.data_ptr()
    assert buffers.kept(("w", "tp"), 12, torch.float32).dtype == torch.float32  # another dtype: a new buffer
    s = buffers.scratch(10, torch.float32)
    assert s.numel() == 10 and s.dtype == torch.float32
    assert buffers.scratch(20, torch.bfloat16).data_ptr() == s.data_ptr()  # 40 bytes fit in the scratch
    assert buffers.scratch(11, torch.float32).numel() == 11  # grown
    assert buffers.nbytes == 12 * 4 + 12 * 2 + 44


def test_gather_buffers_are_kept_on_a_host_only() -> None:
    # On a GPU the caching allocator reuses freed blocks; kept buffers would hold a stage in device memory.
    assert isinstance(params.kept_gather_buffers(on_gpu=False), params.GatherBuffers)
    assert params.kept_gather_buffers(on_gpu=True) is None


GLOO_LAYOUTS = [((6, 4), 0, 1), ((6, 4), 0, 2), ((6, 4), 1, 1), ((4, 6, 2), 1, 3)]


def _gather_rank(rank: int, port: int, failures: Any) -> None:
    """One of three ranks of a real gloo group: tp_gather / tp_shards / ep_gather of bf16 shards over the
    world and over the group of ranks 1 and 2 (rank 1 its first), checked against concatenating them
    (`combine_shards`)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    pair = dist.new_group([1, 2])
    try:
        for shape, dim, stride in GLOO_LAYOUTS:
            n = torch.Size(shape).numel()
            shards = [torch.arange(r * 1000, r * 1000 + n, dtype=torch.bfloat16).view(shape) for r in range(3)]
            param = torch.nn.Parameter(shards[rank].clone(), requires_grad=False)
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride  # type: ignore[attr-defined]
            for buffers in (None, params.GatherBuffers()):
                if not torch.equal(params.tp_gather(param, None, 3, buffers, "w"), combine_shards(shards, dim, stride)):
                    failures.put(f"rank {rank}: tp_gather {shape} dim {dim} stride {stride} buffers {buffers}")
            gathered = {
                "tp_shards": (params.tp_shards(param, None, 3), shards if rank == 0 else []),
                "ep_gather": (params.ep_gather(shards[rank], None, 3), shards),
                "ep_gather into kept buffers": (
                    params.ep_gather(shards[rank], None, 3, params.GatherBuffers(), "w"),
                    shards,
                ),
            }
            if rank > 0:  # the group of ranks 1 and 2: rank 1 (its first) gathers what rank 2 sends it
                for buffers in (None, params.GatherBuffers()):
                    if rank == 1:
                        full = params.tp_gather(param, pair, 2, buffers, "w", to_first=True)
                        if not torch.equal(full, combine_shards(shards[1:], dim, stride)):
                            failures.put(f"rank 1: tp_gather to the first of a subgroup {shape} buffers {buffers}")
                    elif params.tp_shards(param, pair, 2, buffers) != []:
                        failures.put("rank 2: tp_shards gave shards on a rank that only sends")
                gathered["tp_shards of a subgroup"] = (
                    params.tp_shards(param, pair, 2),
                    shards[1:] if rank == 1 else [],
                )
            for what, (got, expected) in gathered.items():
                if len(got) != len(expected) or not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
                    failures.put(f"rank {rank}: {what} {shape}")
        if rank == 2:  # only a group's first rank gathers to itself
            try:
                params.tp_gather(param, pair, 2, None, "w", to_first=True)
                failures.put("rank 2: tp_gather(to_first=True) did not refuse a rank that is not its group's first")
            except RuntimeError:
                pass
        elif rank == 1:
            params.tp_shards(param, pair, 2)  # the shard rank 2 sent
    finally:
        dist.destroy_process_group()


def test_gathers_over_a_real_gloo_group() -> None:
    # The point-to-point exchange and the layouts, on three real processes: over the world (every rank gets the
    # full tensor) and over a group of two of them (only its first rank does; the other only sends).
    import torch.multiprocessing as mp

    from reference_impl.engine.process import free_port

    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gather_rank, args=(r, port, failures)) for r in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0, 0]
    assert failures.empty(), failures.get()


def test_vision_qkv_regrouped_from_per_head_to_q_k_v() -> None:
    # Megatron vision: per head [q_h, k_h, v_h] (head_dim 2); HF attn.qkv: [q all; k all; v all].
    megatron = rows(10, 11, 20, 21, 30, 31, 12, 13, 22, 23, 32, 33)
    (hf,) = merge_vision_qkv(megatron, FACTS)
    assert hf.flatten().tolist() == [10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33]
    bias = torch.tensor([10.0, 11, 20, 21, 30, 31, 12, 13, 22, 23, 32, 33])
    (hf_bias,) = merge_vision_qkv(bias, FACTS)
    assert hf_bias.tolist() == [10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33]


@pytest.mark.parametrize(
    ("family", "megatron", "expected"),
    [
        ("qwen3", "decoder.layers.3.pre_mlp_layernorm.weight", ["model.layers.3.post_attention_layernorm.weight"]),
        ("qwen3", "decoder.layers.0.self_attention.q_layernorm.weight", ["model.layers.0.self_attn.q_norm.weight"]),
        ("qwen3", "decoder.final_layernorm.weight", ["model.norm.weight"]),
        (
            "qwen3_vl",
            "vision_model.decoder.layers.1.self_attention.linear_proj.weight",
            ["model.visual.blocks.1.attn.proj.weight"],
        ),
        ("qwen3_vl", "vision_model.decoder.layers.0.input_layernorm.bias", ["model.visual.blocks.0.norm1.bias"]),
        ("qwen3_vl", "vision_model.decoder.layers.2.pre_mlp_layernorm.weight", ["model.visual.blocks.2.norm2.weight"]),
        ("qwen3_vl", "vision_model.merger.patch_norm.weight", ["model.visual.merger.norm.weight"]),
        (
            "qwen3_vl",
            "vision_model.decoder.deepstack_merger_list.2.patch_norm.bias",
            ["model.visual.deepstack_merger_list.2.norm.bias"],
        ),
        (
            "qwen3_vl",
            "vision_model.decoder.deepstack_merger_list.0.linear_fc2.weight",
            ["model.visual.deepstack_merger_list.0.linear_fc2.weight"],
        ),
        ("qwen3_vl", "vision_model.patch_embed.proj.weight", ["model.visual.patch_embed.proj.weight"]),
        ("qwen3_vl", "vision_model.pos_embed.weight", ["model.visual.pos_embed.weight"]),
        (
            "qwen3_vl",
            "language_model.decoder.layers.5.mlp.linear_fc1.weight",
            ["model.language_model.layers.5.mlp.gate_proj.weight", "model.language_model.layers.5.mlp.up_proj.weight"],
        ),
        ("qwen3_vl", "language_model.embedding.word_embeddings.weight", ["model.language_model.embed_tokens.weight"]),
    ],
)
def test_table_names(family: str, megatron: str, expected: list[str]) -> None:
    t = torch.zeros(8, 1)
    assert [n for n, _ in convert(megatron, t, FAMILIES[family].raw.rules, FACTS)] == expected


def test_tied_output_layer_sends_nothing_untied_sends_lm_head() -> None:
    w = torch.arange(8.0).reshape(8, 1)  # padded vocab 8 > real 6
    assert convert("output_layer.weight", w, FAMILIES["qwen3"].raw.rules, FACTS) == []
    untied = ConvertConfig(**{**FACTS.__dict__, "tied_embeddings": False})
    ((name, t),) = convert("language_model.output_layer.weight", w, FAMILIES["qwen3_vl"].raw.rules, untied)
    assert name == "lm_head.weight" and t.flatten().tolist() == [0, 1, 2, 3, 4, 5]


def test_unmapped_name_is_named() -> None:
    with pytest.raises(UnmappedName, match=r"decoder\.layers\.0\.mystery\.weight"):
        convert("decoder.layers.0.mystery.weight", torch.zeros(1), FAMILIES["qwen3"].raw.rules, FACTS)


class _Layer(torch.nn.Module):
    def __init__(self, number: int) -> None:
        super().__init__()
        self.layer_number = number
        self.w = torch.nn.Parameter(torch.zeros(1))


def test_pp_layer_offset_from_layer_number() -> None:
    # Second of two stages of 4 layers: local layers 0,1 are global 2,3 (layer_number is 1-based).
    from reference_impl.trainer.params import iter_global_params

    stage = torch.nn.Module()
    stage.decoder = torch.nn.Module()
    stage.decoder.layers = torch.nn.ModuleList([_Layer(3), _Layer(4)])
    assert [n for n, _ in iter_global_params([stage])] == ["decoder.layers.2.w", "decoder.layers.3.w"]
    assert global_name("embedding.word_embeddings.weight", {}) == "embedding.word_embeddings.weight"

"""The embedded engine's TP ranks (in-process, no server): every rank keeps vLLM's piece of every tensor, the
served model is rebuilt from the ranks' shards, and the harness's own oracle of vLLM's partition agrees.

The oracle (`harness.oracles.tp_shards`) is checked against hand-written rows first; the engine's ranks
(`reference_impl.engine.embedded.tp`) are then checked against the oracle on a real checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from wsh_vllm_plugin.protocol import dtype_name, pack

from harness.oracles.tp_shards import expected_tp_checksums, rank_shards
from reference_impl import seams
from reference_impl.checksum import tensor_checksum
from reference_impl.engine.embedded.loader import EngineLoader
from reference_impl.engine.embedded.receive import ChunkRejected
from reference_impl.engine.embedded.tp import TpChunkApplier, TpRanks
from reference_impl.models import vllm_tp
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model

TINY = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 2, "hidden_size": 3, "vocab_size": 5}


def _rows(n: int, cols: int, base: float) -> torch.Tensor:
    return base + torch.arange(n * cols, dtype=torch.float32).reshape(n, cols)


def test_oracle_rows_by_hand() -> None:
    """Rank 1 of TP 2 holds query heads 2, 3 and KV head 1; at TP 4 rank 3 holds query head 3 and KV head
    1 (replicated over ranks 2 and 3); the vocabulary of 5 is padded to 64 rows, 32 per rank."""
    q, k, v = _rows(8, 3, 0), _rows(4, 3, 100), _rows(4, 3, 200)
    gate, up, o = _rows(4, 3, 300), _rows(4, 3, 400), _rows(3, 8, 500)
    emb = _rows(5, 3, 600)
    pre = "model.layers.0."
    tensors = {
        pre + "self_attn.q_proj.weight": q,
        pre + "self_attn.k_proj.weight": k,
        pre + "self_attn.v_proj.weight": v,
        pre + "self_attn.o_proj.weight": o,
        pre + "mlp.gate_proj.weight": gate,
        pre + "mlp.up_proj.weight": up,
        pre + "input_layernorm.weight": torch.ones(3),
        "model.embed_tokens.weight": emb,
    }
    r1 = rank_shards(tensors, TINY, 2, 1)
    assert torch.equal(r1[pre + "self_attn.qkv_proj.weight"], torch.cat([q[4:8], k[2:4], v[2:4]]))
    assert torch.equal(r1[pre + "mlp.gate_up_proj.weight"], torch.cat([gate[2:4], up[2:4]]))
    assert torch.equal(r1[pre + "self_attn.o_proj.weight"], o[:, 4:8])
    assert torch.equal(r1[pre + "input_layernorm.weight"], torch.ones(3))
    assert r1["model.embed_tokens.weight"].shape == (32, 3) and not r1["model.embed_tokens.weight"].any()
    r0 = rank_shards(tensors, TINY, 2, 0)
    assert torch.equal(r0["model.embed_tokens.weight"][:5], emb) and not r0["model.embed_tokens.weight"][5:].any()
    r3 = rank_shards(tensors, TINY, 4, 3)
    assert torch.equal(r3[pre + "self_attn.qkv_proj.weight"], torch.cat([q[6:8], k[2:4], v[2:4]]))
    assert set(r3) == {
        pre + "self_attn.qkv_proj.weight",
        pre + "self_attn.o_proj.weight",
        pre + "mlp.gate_up_proj.weight",
        pre + "input_layernorm.weight",
        "model.embed_tokens.weight",
    }


@pytest.fixture(scope="module")
def checkpoint() -> tuple[dict[str, torch.Tensor], dict]:
    import json

    ckpt = make_checkpoint(load_model("qwen3"), 1234, "float32")
    return read_checkpoint(ckpt), json.loads((ckpt / "config.json").read_text()) | {"path": str(ckpt)}


def _engine(checkpoint: tuple[dict[str, torch.Tensor], dict], tp: int) -> tuple[EngineLoader, TpRanks]:
    from pathlib import Path

    config = checkpoint[1]
    loader = EngineLoader.from_checkpoint(Path(config["path"]), 4321)
    return loader, TpRanks(loader, tp, config)


def _send(applier: TpChunkApplier, names: list[str], tensors: list[torch.Tensor]) -> None:
    """What the server does with one received chunk: every rank holds the same broadcast bytes."""
    payload = pack(tensors)
    applier.ranks.payloads = [payload.clone() for _ in range(applier.ranks.tp)]
    applier.apply("chunk 0", names, [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors], payload)


@pytest.mark.parametrize("tp", [2, 4])
def test_ranks_hold_vllms_partition_and_serve_the_full_tensors(checkpoint, tp: int) -> None:
    tensors, config = checkpoint
    loader, ranks = _engine(checkpoint, tp)
    assert ranks.checksums() != expected_tp_checksums(tensors, config, tp)  # dummy weights before the sync
    applier = TpChunkApplier(loader, ranks)
    names = list(tensors)
    half = len(names) // 2  # two chunks: a layer's q/k/v may be split across them
    _send(applier, names[:half], [tensors[n] for n in names[:half]])
    _send(applier, names[half:], [tensors[n] for n in names[half:]])
    assert ranks.checksums() == expected_tp_checksums(tensors, config, tp)
    assert loader.checksums() == {n: tensor_checksum(t) for n, t in tensors.items()}
    assert set(loader.counts.values()) == {1}


def test_a_refused_chunk_changes_no_rank(checkpoint) -> None:
    tensors, _ = checkpoint
    loader, ranks = _engine(checkpoint, 2)
    before = ranks.checksums()
    name = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(ChunkRejected, match="dtype"):
        _send(TpChunkApplier(loader, ranks), [name], [tensors[name].double()])
    assert ranks.checksums() == before


def test_row_parallel_split_as_column_is_seen_only_by_the_shards(checkpoint) -> None:
    """The engine fault `engine_tp_row_split_as_column`: every rank keeps a wrong piece of o_proj and
    down_proj, yet the rebuilt model is the checkpoint (the pieces still tile the tensor): only the
    per-rank comparison with the oracle sees it."""
    from harness.faults import engine as engine_faults

    tensors, config = checkpoint
    try:
        engine_faults.tp_row_split_as_column()
        loader, ranks = _engine(checkpoint, 2)
        _send(TpChunkApplier(loader, ranks), list(tensors), list(tensors.values()))
    finally:
        seams.restore_all()
    assert loader.checksums() == {n: tensor_checksum(t) for n, t in tensors.items()}
    got, want = ranks.checksums(), expected_tp_checksums(tensors, config, 2)
    wrong = sorted(n for n in want["0"] if got["0"][n] != want["0"][n])
    assert wrong and all(n.endswith(("o_proj.weight", "down_proj.weight")) for n in wrong), wrong
    assert vllm_tp.pieces is seams.current("engine_tp_pieces")  # restored


def test_the_server_joins_every_tp_rank_and_reports_each_ranks_shards(checkpoint) -> None:
    """The embedded server's routes with `tp=2`, in-process: the init joins two ranks of a group of three
    (this thread is the sender), one broadcast chunk reaches both, and /weight_checker reports the full
    tensors and each rank's shards as vLLM's partition gives them."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import asdict
    from pathlib import Path

    from fastapi.testclient import TestClient
    from wsh_vllm_plugin.group import host_store, join_transfer_group
    from wsh_vllm_plugin.protocol import InitInfo, UpdateInfo

    from reference_impl.engine.embedded.server import create_app

    tensors, config = checkpoint
    app = create_app(EngineLoader.from_checkpoint(Path(config["path"]), 4321), config, tp=2)
    client = TestClient(app)
    assert client.get("/get_world_size").json() == {"world_size": 2}
    store = host_store(timeout_s=60)
    info = InitInfo(master_address="127.0.0.1", master_port=store.port, rank_offset=1, world_size=3, timeout_s=60)
    with ThreadPoolExecutor(max_workers=1) as pool:
        init = pool.submit(client.post, "/init_weight_transfer_engine", json={"init_info": asdict(info)})
        sender = join_transfer_group("127.0.0.1", store.port, 0, 3, 60.0, store=store)
        assert init.result(timeout=120).json()["ok"]
        assert client.post("/start_weight_update", json={}).status_code == 200
        names = list(tensors)
        body = UpdateInfo(
            names=names,
            dtype_names=[dtype_name(tensors[n].dtype) for n in names],
            shapes=[list(tensors[n].shape) for n in names],
            chunk_index=0,
        )
        update = pool.submit(client.post, "/update_weights", json={"update_info": asdict(body)})
        sender.send_chunk(pack([tensors[n] for n in names]))
        assert update.result(timeout=120).status_code == 200
    assert client.post("/finish_weight_update", json={"weight_version": 1}).status_code == 200
    report = client.post("/weight_checker", json={"action": "checksum"}).json()
    assert report["checksums"] == {n: tensor_checksum(t) for n, t in tensors.items()}
    assert report["tp_checksums"] == expected_tp_checksums(tensors, config, 2)
    bad = InitInfo(master_address="127.0.0.1", master_port=store.port, rank_offset=2, world_size=3, timeout_s=5)
    answer = TestClient(app, raise_server_exceptions=False).post(
        "/init_weight_transfer_engine", json={"init_info": asdict(bad)}
    )
    assert answer.status_code == 500 and "do not fit world_size 3" in answer.text

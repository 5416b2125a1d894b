"""The update-time model on paper (`harness/scale/`): parameter bytes by hand formula against hand
derivations, against the bytes of real checkpoints and against transformers' own modules; phase times
against hand-computed numbers."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from harness.scale.check import compare
from harness.scale.params import param_count
from harness.scale.published import ARCHITECTURES, checkpoint_engine_s
from harness.scale.update_time import (
    SENDER_QUEUE_DEPTH,
    Design,
    Links,
    Topology,
    Workload,
    predict,
    sender_held_bytes,
)
from harness.scale_model import main
from reference_impl.models.checkpoint import hf_config, make_checkpoint
from reference_impl.models.registry import MODELS_DIR, load_model


def test_scaled_qwen3_by_hand() -> None:
    # scenarios/models/qwen3.yaml: H 64, 4 heads, 2 KV heads, head_dim 32, I 192, 4 layers, V 512, tied.
    # embed 512*64 = 32768; per layer q 64*128 = 8192, k = v = 64*64 = 4096, o 128*64 = 8192,
    # q/k norm 32 + 32, two RMSNorms 64 + 64, MLP 3*64*192 = 36864 -> 61632; x4 = 246528; final norm 64.
    c = param_count(load_model("qwen3").config)
    assert c.total == 32768 + 4 * 61632 + 64 == 279360
    assert c.bytes("float32") == 1117440  # the CPU matrix's bytes_per_sync for qwen3 in float32
    assert c.tensors == 2 + 4 * 11  # embed + final norm; per layer q,k,v,o,q_norm,k_norm,2 norms,3 MLP


def test_real_qwen3_sizes_by_hand() -> None:
    # Qwen3-0.6B: H 1024, 16/8 heads of 128, I 3072, 28 layers, V 151936, tied.
    # embed 151936*1024 = 155582464; layer: q 1024*2048 = 2097152, k = v = 1048576, o 2097152,
    # norms 128*2 + 1024*2 = 2304, MLP 3*1024*3072 = 9437184 -> 15730944; x28 = 440466432; + 1024.
    small = param_count(json.loads((MODELS_DIR / "qwen3-0.6b.config.json").read_text()))
    assert small.total == 155582464 + 28 * 15730944 + 1024 == 596049920
    # Qwen3-4B: H 2560, 32/8 heads of 128, I 9728, 36 layers, tied: embed 388956160; layer
    # 10485760 + 2*2621440 + 10485760 + 2*128 + 2*2560 + 3*2560*9728 = 100930816.
    big = param_count(json.loads((MODELS_DIR / "qwen3-4b.config.json").read_text()))
    assert big.total == 388956160 + 36 * 100930816 + 2560 == 4022468096
    assert big.bytes("bfloat16") == 2 * 4022468096


def test_published_235b_is_235b() -> None:
    # Model card: 235B total parameters; 128 experts of 3*4096*1536 per layer, 94 layers.
    c = param_count(ARCHITECTURES["qwen3-235b-a22b"])
    assert c.experts == 94 * 128 * 3 * 4096 * 1536
    assert abs(c.total / 235e9 - 1) < 0.001


def _checkpoint_elements(folder: Path) -> tuple[int, int, int]:
    elements = tensors = nbytes = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118  (safe_open has no __iter__)
                t = st.get_tensor(key)
                elements, tensors, nbytes = elements + t.numel(), tensors + 1, nbytes + t.numel() * t.element_size()
    return elements, tensors, nbytes


@pytest.mark.parametrize("name", ["qwen3", "qwen3-untied", "qwen3-moe", "qwen3-vl", "qwen3-vl-moe"])
def test_formula_matches_a_checkpoints_bytes(name: str) -> None:
    spec = load_model(name)
    folder = make_checkpoint(spec, seed=1234, dtype="float32")
    elements, tensors, nbytes = _checkpoint_elements(folder)
    c = param_count(json.loads((folder / "config.json").read_text()))  # the config transformers wrote
    assert (c.total, c.tensors, c.bytes("float32")) == (elements, tensors, nbytes)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-4b", "qwen3-30b-a3b", "qwen3-vl-2b", "qwen3-vl-30b-a3b"])
def test_formula_matches_transformers_at_real_size(name: str) -> None:
    import transformers

    spec = load_model(name)
    with torch.device("meta"):
        model = getattr(transformers, spec.hf_architecture)(hf_config(spec, "bfloat16"))
    assert param_count(spec.config).total == sum(p.numel() for p in model.parameters())


# Hand-picked links: every number round, so the phase times below are derived by hand.
LINKS = Links(
    name="test",
    nvlink=400.0,
    pcie=50.0,
    ib=50.0,
    memcpy=10.0,
    hbm_copy=1000.0,
    tcp=5.0,
    call_s=0.002,
    tensor_s=1e-4,
    collective_s=1e-5,
)
W = Workload(bytes=8_000_000_000, tensors=400, chunk_bytes=1_000_000_000)


def test_phases_of_the_harness_design_by_hand() -> None:
    p = predict(W, Topology(tp=2, pp=2), LINKS)
    # export: TP gather 4e9 * 1/2 / 400e9 = 0.005; convert 4e9 / 1000e9 = 0.004; 200 tensors * (1e-4 + 1e-5).
    assert p.phases["export"] == pytest.approx(0.005 + 0.004 + 0.022)
    # handoff: 4 ranks on one node -> NVLink: 8e9 * 1/2 / 400e9 = 0.01; 200 messages * 1e-5.
    assert p.phases["handoff"] == pytest.approx(0.01 + 0.002)
    # gloo on GPU: pack 8e9 / 50e9 over PCIe, 8e9 / 5e9 over TCP, 8e9 / 50e9 back over PCIe.
    assert p.phases["transfer"] == pytest.approx(0.16 + 1.6 + 0.16)
    assert p.phases["load"] == pytest.approx(0.008)
    assert p.phases["calls"] == pytest.approx((8 + 4) * 0.002)
    assert p.total == pytest.approx(0.031 + 0.012 + 1.92 + 0.008 + 0.024)
    assert p.bottleneck == "transfer"


def test_experts_named_apart_are_handed_off_and_stacked_ones_gathered_by_hand() -> None:
    moe = Workload(bytes=8_000_000_000, tensors=400, chunk_bytes=1_000_000_000, expert_bytes=6_000_000_000)
    topo = Topology(pp=2, ep=4)  # 8 ranks on one node: NVLink everywhere
    apart = predict(moe, topo, LINKS)
    # no gather in the export: convert 4e9 / 1000e9, 200 tensors * 1e-4 (no collective).
    assert apart.phases["export"] == pytest.approx(0.004 + 0.02)
    # the other stage: 4e9 / 400e9 + 200 * 1e-5; the other 3 EP ranks' experts of the sender's stage:
    # 6e9 / 2 * 3/4 / 400e9, and their share of the tensors (400 * 6/8 * 3/8) * 1e-5.
    assert apart.phases["handoff"] == pytest.approx(0.01 + 0.002 + 0.005625 + 0.001125)
    stacked = predict(dataclasses.replace(moe, stacked_experts=True), topo, LINKS)
    # EP all-gather in the export: 3e9 * 3/4 / 400e9, and 200 tensors * (1e-4 + 1e-5); handoff: PP only.
    assert stacked.phases["export"] == pytest.approx(0.005625 + 0.004 + 0.022)
    assert stacked.phases["handoff"] == pytest.approx(0.01 + 0.002)


def test_nccl_fan_out_and_the_fixes_by_hand() -> None:
    topo = Topology(pp=4, replicas=2, engine_tp=4, transfer="nccl", engine_same_node=False)
    # ring broadcast over IB to 8 receivers: 8e9 / 50e9 + 7 chunks of 1e9 / 50e9.
    assert predict(W, topo, LINKS).phases["transfer"] == pytest.approx(0.16 + 0.14)
    # one sender per stage (2e9 each) and each engine TP rank taking its quarter (5e8 < one chunk).
    fixed = predict(W, topo, LINKS, Design(per_stage_senders=True, sharded_engine=True))
    assert fixed.phases["transfer"] == pytest.approx(0.5e9 / 50e9 + 7 * 0.5e9 / 50e9)
    assert fixed.phases["handoff"] == 0.0
    # load: 8e9 / 4 / 1000e9; overlap keeps the slowest of handoff, transfer, load.
    over = predict(W, topo, LINKS, Design(overlap=True))
    stream = max(over.phases["handoff"], over.phases["transfer"], over.phases["load"])
    assert over.total == pytest.approx(over.phases["export"] + stream + over.phases["calls"])


def test_cpu_colocate_by_hand() -> None:
    p = predict(W, Topology(colocate=True, device="cpu"), LINKS)
    # one host copy into the shared buffer, one into the engine's parameters: 8e9 / 10e9 each.
    assert (p.phases["transfer"], p.phases["load"]) == (pytest.approx(0.8), pytest.approx(0.8))
    assert p.phases["export"] == pytest.approx(0.8 + 400 * 1e-4)


def test_sender_holds_the_chunks_its_queue_allows_never_more_than_its_stage() -> None:
    from reference_impl.transport.sync import QUEUE_DEPTH

    assert SENDER_QUEUE_DEPTH == QUEUE_DEPTH  # the model's depth is the sync loop's
    # W: 8 GB in chunks of 1 GB; two unanswered and the one filled meanwhile
    assert sender_held_bytes(W, Topology(pp=2)) == 3 * 1_000_000_000
    assert sender_held_bytes(W, Topology(pp=8)) == 1_000_000_000  # the stage's whole export is less
    assert sender_held_bytes(Workload(bytes=10, tensors=1, chunk_bytes=1 << 30), Topology()) == 10


def test_unknown_transfer_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown transfer backend 'ucx'"):
        predict(W, Topology(transfer="ucx"), LINKS)


def test_checkpoint_engine_stages_by_hand() -> None:
    got = checkpoint_engine_s(W, 8, LINKS)
    # 1e9 per GPU over PCIe; every byte over NVLink; 1e9 per GPU copied plus 400 tensors.
    assert got["h2d"] == pytest.approx(0.02)
    assert got["broadcast"] == pytest.approx(0.02)
    assert got["reload"] == pytest.approx(0.001 + 0.04)
    assert got["total"] == pytest.approx(0.081)


def test_check_against_a_run_table(tmp_path: Path) -> None:
    (tmp_path / "records").mkdir()
    rows = [
        ("qwen3/tp1-pp1/noncolocate/raw", 1, 1, 0.0100, 0.02),
        ("qwen3/tp1-pp2/noncolocate/raw", 1, 2, 0.0060, 0.05),
    ]
    lines = ["scenario,model,tp,ep,pp,colocate,export_mode,bytes_per_sync,steady_s,gather_s,convert_s,verdict"]
    for sid, tp, pp, convert, steady in rows:
        lines.append(f"{sid},qwen3,{tp},1,{pp},False,raw,1117440,{steady},0.0,{convert},PASS")
        start = {"route": "/start_weight_update", "status": 200, "ms": 3.0}
        record = {"scenario": {"chunk_bytes": 1 << 20}, "http": [start]}
        (tmp_path / "records" / (sid.replace("/", "__") + ".json")).write_text(json.dumps(record))
    (tmp_path / "summary.csv").write_text("\n".join(lines) + "\n")
    measured = {"tcp": 1.0, "memcpy": 1.0, "gloo_round_trip_s": 1e-4}
    df = compare(tmp_path, measured).set_index("scenario")
    # tensor_s from the single-rank row: (0.01 - 1117440 / 1e9) / 46 tensors.
    tensor_s = (0.01 - 1117440 / 1e9) / 46
    one = df.loc["qwen3/tp1-pp1/noncolocate/raw"]
    assert one["tensor_s"] == pytest.approx(tensor_s)
    # single rank, gloo on CPU: export = copy + tensors; transfer = pack + wire; load; 2 chunks + 4 calls.
    b = 1117440 / 1e9
    assert one["predicted_s"] == pytest.approx((b + 46 * tensor_s) + (b + b) + b + 6 * 0.003)
    two = df.loc["qwen3/tp1-pp2/noncolocate/raw"]
    # PP 2: half the export; the sender takes the other half over TCP, one message per tensor.
    expected = (b / 2 + 23 * tensor_s) + (b / 2 + 23 * 1e-4) + 2 * b + b + 6 * 0.003
    assert two["predicted_s"] == pytest.approx(expected)
    assert math.isclose(two["ratio"], 0.05 / expected)


def test_cli_bytes_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bytes", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "| qwen3-4b.config.json | 4,022,468,096 | 0 | 398 | 8,044,936,192 |" in out

"""End to end: real Megatron trainer ranks (Ray actors), the embedded engine server, real syncs.

Each scenario's verdict comes from the checks; these tests also re-derive the key facts
independently: sync #0 leaves the engine equal to the checkpoint on disk, and every later sync
leaves it equal to what the trainer sent.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from harness_cli import harness_run

from harness.scenario import Scenario
from reference_impl.checksum import tensor_checksum
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.families import model_family
from reference_impl.models.registry import load_model

pytestmark = pytest.mark.e2e


def checkpoint_checksums(sc: Scenario) -> dict[str, str]:
    ckpt = make_checkpoint(load_model(sc.model), sc.seed, sc.dtype)
    return {n: tensor_checksum(t) for n, t in read_checkpoint(ckpt).items()}


@pytest.mark.parametrize(
    "sc",
    [
        Scenario(model="qwen3-vl", tp=2, pp=2, export_mode="raw", syncs=3, chunk_bytes=1 << 20),
        Scenario(model="qwen3", tp=1, pp=2, export_mode="bridge", syncs=3, chunk_bytes=1 << 16),
        Scenario(
            model="qwen3-vl-moe", tp=1, ep=2, pp=1, export_mode="raw", colocate=True, syncs=2, chunk_bytes=1 << 20
        ),
        Scenario(model="qwen3-untied", tp=2, pp=1, export_mode="bridge", syncs=2, chunk_bytes=1 << 16),
    ],
    ids=lambda s: s.id,
)
def test_scenario_passes_and_engine_matches_independent_truth(runner, sc: Scenario) -> None:
    rec = runner.run_scenario(sc)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    truth = checkpoint_checksums(sc)
    assert rec.syncs[0].engine_checksums == truth  # bit-equal to the checkpoint on disk
    assert len(rec.syncs) == sc.syncs + 1 and not rec.syncs[-1].perturbed  # + the re-sync of unchanged weights
    gap = model_family(load_model(sc.model).model_type).trainer_logprob_gap  # sourced, VL families only
    for s in rec.syncs:  # log-prob parity after every sync, within the fp32 budget
        assert s.logprobs["tokens"] > 0 and s.logprobs["max_abs"] <= 1e-4 + gap  # the trainer's Megatron forward
        assert s.logprobs_expected["tokens"] > 0 and s.logprobs_expected["max_abs"] <= 1e-4  # transformers
    # the expected state (checkpoint + the trainer's elementwise step) is what the engine holds, sync by sync
    assert all(s.engine_checksums == s.expected_checksums for s in rec.syncs)
    assert rec.syncs[-1].engine_logprobs == rec.syncs[-2].engine_logprobs
    # the same-run bound: every layout here gathers (TP, PP hand-off or EP) and every channel has a bare wire
    assert rec.bound is not None and rec.bound.gather_s > 0 and rec.bound.wire_s is not None and rec.bound.wire_s > 0
    assert len(rec.bound.gather_repeats_s) == 3 and min(rec.bound.gather_repeats_s) == rec.bound.gather_s
    assert len(rec.bound.wire_repeats_s) == 3 and min(rec.bound.wire_repeats_s) == rec.bound.wire_s
    probes = [c for c in rec.http if c.route == "/transfer_probe"]
    assert len(probes) == (0 if sc.colocate else 4) and all(c.status == 200 for c in probes)  # warm-up, best of 3
    for s in rec.syncs:
        assert s.export_mode == sc.export_mode and s.finished
        assert all(len(c.owners) == len(c.names) for c in s.chunks)
        assert s.chunks_planned == s.chunks_sent == s.chunks_received == len(s.chunks) > 1
        assert set(s.engine_update_counts.values()) == {1}
        assert set(s.names_sent) == set(truth)  # every checkpoint tensor, once
    for s in rec.syncs[1:]:
        assert s.engine_checksums == s.sent_checksums
        assert s.engine_checksums != truth  # the perturbation moved every sync after #0
    assert rec.syncs[-1].engine_checksums == rec.syncs[-2].engine_checksums  # the re-sync changed nothing
    # the re-sync held after its first chunk and before its finish: the old version, a completion refused (409)
    held = rec.syncs[-1]
    assert held.held and not any(s.held for s in rec.syncs[:-1])
    asks = [(a.point, a.weight_version, a.completion, a.paused) for a in held.mid_session]
    before = str(rec.syncs[-2].weight_version)
    assert asks == [("after_first_chunk", before, 409, None), ("before_finish", before, 409, None)], asks
    assert rec.cross_mode_checksums["raw"] == rec.cross_mode_checksums["bridge"]
    assert {c.route for c in rec.http} >= {
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    }
    assert all(c.status == 200 for c in rec.http)
    on_disk = json.loads((runner.out_dir / "records" / (sc.id.replace("/", "__") + ".json")).read_text())
    assert on_disk["verdict"] == "PASS"


@pytest.mark.parametrize("mode", ["raw", "bridge"])
def test_each_ep_rank_hands_its_own_experts_to_the_sender(runner, mode: str) -> None:
    """qwen3-moe names each expert apart in its HF checkpoint, so no export all-gathers experts over EP:
    at EP 2 global experts E/2..E-1 live on EP rank 1 (Megatron's contiguous split), which exports them
    and hands them to the sender (rank 0); everything else the sender exports itself."""
    sc = Scenario(model="qwen3-moe", tp=1, ep=2, pp=1, export_mode=mode, syncs=1, chunk_bytes=1 << 16)
    rec = runner.run_scenario(sc)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    truth = checkpoint_checksums(sc)
    assert rec.syncs[0].engine_checksums == truth
    per_rank = load_model(sc.model).model_config().num_experts // 2
    for s in rec.syncs:
        owner = {n: o for c in s.chunks for n, o in zip(c.names, c.owners, strict=True)}
        assert set(owner) == set(truth)
        expert = {n: int(m[1]) for n in owner if (m := re.search(r"\.mlp\.experts\.(\d+)\.", n))}
        assert len(expert) == 3 * 2 * per_rank * load_model(sc.model).model_config().num_layers
        assert {n: o for n, o in owner.items() if n in expert} == {n: e // per_rank for n, e in expert.items()}
        assert all(o == 0 for n, o in owner.items() if n not in expert)


def test_impossible_scenario_is_config_error_and_launches_nothing(tmp_path: Path) -> None:
    matrix = tmp_path / "bad.yaml"
    matrix.write_text("- model: qwen3\n  tp: 3\n")
    proc = subprocess.run(
        harness_run(matrix, tmp_path, "--run-id", "bad"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    rec = json.loads((tmp_path / "bad" / "records" / "qwen3__tp3-pp1__noncolocate__raw.json").read_text())
    assert rec["verdict"] == "CONFIG_ERROR"
    assert "TP 3 divides neither qwen3's 4 attention heads nor its 2 KV heads" in rec["config_error"]
    assert rec["syncs"] == [] and rec["http"] == []
    assert "CONFIG_ERROR" in (tmp_path / "bad" / "summary.md").read_text()


def test_chunk_size_invariance_and_empty_contributions(runner) -> None:
    """One tensor per chunk (at PP 2 most chunks have a single owner: the other stage sends nothing)
    and the whole model in one chunk leave bit-identical engine weights after every sync."""
    base = {
        "model": "qwen3",
        "tp": 1,
        "pp": 2,
        "export_mode": "raw",
        "syncs": 2,
        "group": "chunk-size",
        "suffix": "b{chunk_bytes}",
    }
    one = runner.run_scenario(Scenario(**base, chunk_bytes=1))
    whole = runner.run_scenario(Scenario(**base, chunk_bytes=1 << 40))
    one, whole = runner.finish_group([one, whole])
    truth = checkpoint_checksums(Scenario(**base))
    assert one.verdict == whole.verdict == "PASS", [c for c in one.checks + whole.checks if not c["ok"]]
    assert one.group_differences == [] and whole.group_differences == []
    assert all(s.chunks_planned == len(truth) for s in one.syncs)  # one tensor per chunk
    assert all(s.chunks_planned == 1 for s in whole.syncs)
    assert [s.engine_checksums for s in one.syncs] == [s.engine_checksums for s in whole.syncs]

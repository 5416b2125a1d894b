"""Whole scenarios on real vLLM through the runner (`engine: vllm`): a dense one (TP 2 x PP 2 trainer,
bridge export), a Qwen3-VL-MoE one at EP 2, every fault of `fault_runs.VLLM_FAULTS`, which must get
the verdict the embedded engine got (a deadlocked vLLM's stacks and its process group included), and the
faults only vLLM shows (`fault_runs.VLLM_ONLY_FAULTS`)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from fault_runs import VLLM_FAULTS, VLLM_ONLY_FAULTS, fault_scenario, run_once
from process_groups import alive_in_group
from vllm_env import require_vllm as _require_vllm

from harness.runner import Runner
from harness.scenario import Scenario
from harness.validate import validate
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model


def test_vllm_scenario_through_the_runner(runner: Runner) -> None:
    """One whole scenario on real vLLM: TP 2 x PP 2 trainer, bridge export, several chunks, log-probs
    after every sync compared with the trainer's forward over what it sent."""
    _require_vllm()
    sc = Scenario(model="qwen3", tp=2, pp=2, export_mode="bridge", engine="vllm", syncs=3, chunk_bytes=1 << 18)
    assert validate(sc) is None
    rec = runner.run_scenario(sc)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    assert all(s.chunks_planned > 1 and s.logprobs["max_abs"] < 1e-4 for s in rec.syncs)
    assert not any(s.engine_checksums for s in rec.syncs)  # vLLM's checksums are not used as HF ones
    coverage = next(c for c in rec.checks if c["name"] == "coverage")
    assert coverage["ok"] and not coverage["skipped"]
    # generation paused around every sync, and the re-sync held mid-session found it paused, at the old version
    routes = [c.route for c in rec.http if c.rank == 0 and c.route in ("/pause", "/resume")]
    assert routes == ["/pause", "/resume"] * len(rec.syncs), routes
    held = rec.syncs[-1]
    assert held.held and [a.point for a in held.mid_session] == ["after_first_chunk", "before_finish"]
    assert all(a.paused is True and a.completion is None for a in held.mid_session), held.mid_session
    assert {a.weight_version for a in held.mid_session} == {str(rec.syncs[-2].weight_version)}
    for name in ("completions_in_session", "weight_version"):
        result = next(c for c in rec.checks if c["name"] == name)
        assert result["ok"] and not result["skipped"], result


def test_vllm_server_is_restarted_in_place_for_the_next_scenario(runner: Runner) -> None:
    """Two Qwen3 scenarios on vLLM back to back, with checkpoints of other seeds: the second runs on the first's
    server restarted in place (`wsh_vllm_plugin/restart.py`), its output in the second's own log from the
    restart on, and passes on its own evidence: log-probs after every sync against the trainer's forward, the
    probe through the caches."""
    _require_vllm()
    scenarios = [
        Scenario(model="qwen3", engine="vllm", syncs=2, seed=seed, chunk_bytes=1 << 18, suffix=f"restart-{seed}")
        for seed in (11, 12)
    ]
    first, second = (runner.run_scenario(sc) for sc in scenarios)
    assert first.verdict == second.verdict == "PASS", [c for r in (first, second) for c in r.checks if not c["ok"]]
    assert any(n.startswith("engine process reused: restarted in place") for n in second.notes), second.notes
    second_ckpt = str(make_checkpoint(load_model("qwen3"), 12))
    log = runner.engine_log(second.scenario_id, 0).read_text()
    assert f"fresh engine from {second_ckpt} (seed {scenarios[1].engine_seed})" in log
    assert "gloo weight transfer: joined" in log  # the new transfer group, in the new log
    assert second_ckpt not in runner.engine_log(first.scenario_id, 0).read_text()


def test_vllm_moe_scenario_through_the_runner(runner: Runner) -> None:
    """Qwen3-VL-MoE (fused experts in the released layout, vision tower, image prompt on the chat route) at
    EP 2 on real vLLM's CPU MoE kernels: every sync after the first reloads prepacked experts, so the
    log-probs of syncs 1 and 2 (changed weights) show that the experts reach vLLM's kernel."""
    _require_vllm()
    sc = Scenario(model="qwen3-vl-moe", ep=2, engine="vllm", syncs=2, chunk_bytes=1 << 20, logprob_temperature=1.0)
    assert validate(sc) is None
    rec = runner.run_scenario(sc)
    assert rec.verdict == "PASS", [c for c in rec.checks if not c["ok"]]
    # against a transformers forward over the expected state: fp32's budget; against the trainer's own
    # Megatron forward: that budget plus the VL families' known gap (tanh-approximate GELU in the mergers)
    assert len(rec.syncs) == 3 and all(s.logprobs_expected["max_abs"] < 1e-4 for s in rec.syncs)
    assert all(s.logprobs["max_abs"] <= rec.trainer_logprob_budget["max_abs"] for s in rec.syncs)
    assert all(len(s.engine_logprobs) == 3 for s in rec.syncs)  # two text prompts and the image prompt


@pytest.mark.parametrize("name", VLLM_FAULTS)
def test_fault_on_vllm_gets_the_embedded_engines_verdict(runner: Runner, fault_records: Path, name: str) -> None:
    from harness.faults import FAULTS

    _require_vllm()
    sc = fault_scenario(name, "vllm")
    assert validate(sc) is None
    rec = runner.run_scenario(sc)
    embedded = run_once(runner, fault_scenario(name), fault_records)  # the record test_faults.py made, if it ran
    assert rec.verdict == embedded.verdict == FAULTS[name].expect, (
        [c for c in rec.checks if not c["ok"]],
        [c for c in embedded.checks if not c["ok"]],
    )
    if FAULTS[name].expect == "DEADLOCK":  # where the embedded engine's hung; its stacks include vLLM's processes
        assert rec.deadlock_at == embedded.deadlock_at, (rec.deadlock_at, embedded.deadlock_at)
        engine_stacks = next(Path(p).read_text() for p in rec.stacks if Path(p).stem == "engine")
        assert "vllm" in engine_stacks and engine_stacks.count("Process ") >= 2, engine_stacks[:2000]
        server = int(re.search(r"pid (\d+)", engine_stacks).group(1))
        time.sleep(2)  # the server's whole process group is gone (it runs in a session of its own)
        left = alive_in_group(server)
        assert not left, left


# What `completions_in_session` says of each fault only vLLM shows (a sync's index: the first one it names).
VLLM_ONLY_SAYS = {
    # no pause at all: the sender's calls on the wire show it at sync 0 (and the held re-sync finds it unpaused)
    "generation_not_paused": "sync 0: /start_weight_update was sent with no /pause answered 200 before it",
    # paused while the first chunk loads, resumed before the finish: the calls' order at sync 0
    "generation_resumed_mid_update": "sync 0: /resume was sent ",
}


@pytest.mark.parametrize("name", VLLM_ONLY_FAULTS)
def test_a_fault_only_vllm_shows_gets_its_verdict(runner: Runner, name: str) -> None:
    """The sender lets vLLM schedule requests while its update session is open (on vLLM 0.32 one killed the
    engine core): only `completions_in_session` fails, and the harness asks vLLM no completion then, so the
    engine lives on."""
    from harness.faults import FAULTS

    _require_vllm()
    sc = fault_scenario(name, "vllm")
    assert validate(sc) is None
    rec = runner.run_scenario(sc)
    assert rec.verdict == FAULTS[name].expect, [c for c in rec.checks if not c["ok"]]
    failing = [c["name"] for c in rec.checks if not c["ok"] and not c["skipped"]]
    assert failing == ["completions_in_session"], failing
    deciding = next(c for c in rec.checks if c["name"] == "completions_in_session")
    assert deciding["message"].startswith(VLLM_ONLY_SAYS[name]), deciding["message"]
    held = rec.syncs[-1]  # after the first chunk, paused only where the fault resumes after the second one
    assert held.held and held.mid_session[0].paused is (name == "generation_resumed_mid_update")
    assert held.mid_session[1].paused is False  # before the finish: no longer paused under either fault

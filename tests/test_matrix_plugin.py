"""Scenarios as pytest tests (the repository's conftest.py, scenarios/test_matrix.py): collection, ids,
selection, and the message a failing scenario test gives. Running scenarios is end-to-end
(`pytest scenarios ...` itself); these tests only collect."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from checks.records import make_record

from harness.checks import judged
from harness.matrix_run import failure_message
from harness.placement import order_for_reuse
from harness.scenario import load_matrix

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "scenarios/test_matrix.py::test_scenario["


def collect(*args: str) -> subprocess.CompletedProcess[str]:
    """`pytest --collect-only -q ARGS` in the repository root, in a fresh interpreter."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def collected_ids(out: str) -> list[str]:
    return [line[len(PREFIX) : -1] for line in out.splitlines() if line.startswith(PREFIX)]


def test_each_scenario_is_one_test_whose_id_is_the_scenario_id() -> None:
    proc = collect("scenarios", "--matrix", "cpu", "-k", "qwen3-vl and tp2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = collected_ids(proc.stdout)
    matrix = load_matrix("cpu")
    chosen = [sc for sc in matrix if "qwen3-vl" in sc.id and "tp2" in sc.id]
    assert sorted(ids) == sorted(sc.id for sc in chosen) and len(ids) == 12
    assert ids == [sc.id for sc in order_for_reuse(chosen)]  # grouped by trainer world size, as `harness run`
    assert f"{len(ids)}/{len(matrix)} tests collected" in proc.stdout

    tagged = collect("scenarios", "--matrix", "cpu_vllm", "--scenario-filter", "tag:full-size", "-k", "not raw")
    assert tagged.returncode == 0, tagged.stdout + tagged.stderr
    expected = {sc.id for sc in load_matrix("cpu_vllm") if "full-size" in sc.tags and "raw" not in sc.id}
    assert set(collected_ids(tagged.stdout)) == expected and len(expected) == 2


def test_an_unknown_matrix_is_a_collection_error_and_tests_collect_no_scenarios() -> None:
    proc = collect("scenarios", "--matrix", "no-such-matrix")
    assert proc.returncode == 2 and "Failed: --matrix: no matrix 'no-such-matrix'" in proc.stdout
    suite = collect("tests/test_env.py")
    assert suite.returncode == 0 and "test_scenario[" not in suite.stdout and "tests/test_env.py::" in suite.stdout


def test_failure_message_is_the_first_failing_check() -> None:
    record = judged(make_record())
    assert failure_message(record) is None
    stale = make_record()
    stale.syncs[1].engine_checksums["lm_head.weight"] = "stale"
    stale = judged(stale)
    message = failure_message(stale)
    assert message is not None and message.startswith(f"{stale.verdict} (expected PASS): ")
    assert "sync 1" in message and "lm_head.weight" in message

    expects_crash = make_record()
    expects_crash.scenario.expect = "CRASH"
    assert failure_message(judged(expects_crash)) == "PASS, expected CRASH"


def test_failure_message_names_group_members_the_comparison_failed() -> None:
    first, last = make_record(), make_record()
    first.scenario_id, last.scenario_id = "qwen3/a/chunk-1", "qwen3/a/chunk-2"
    for rec in (first, last):
        rec.scenario.group = "chunk-size-invariance"
        rec.group_members = ["other"]
    first.group_differences = ["sync 1: 'lm_head.weight' differs between qwen3/a/chunk-1 and qwen3/a/chunk-2"]
    first, last = judged(first), judged(last)
    message = failure_message(last, [first, last])
    assert message is not None and "qwen3/a/chunk-1: " in message and "differs between" in message
    assert failure_message(last, [last]) is None


def test_a_run_id_whose_folder_holds_an_earlier_run_is_a_collection_error(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "summary.csv").write_text("scenario,verdict\n")
    proc = collect("scenarios", "--matrix", "cpu", "--results-dir", str(tmp_path), "--run-id", "r")
    assert proc.returncode == 2 and "holds an earlier run (summary.csv): pick another" in proc.stdout, proc.stdout


def test_a_baseline_that_is_no_run_is_a_collection_error(tmp_path: Path) -> None:
    # read at collection, not at the session's end, after every scenario ran
    proc = collect("scenarios", "--matrix", "cpu", "--results-dir", str(tmp_path), "--baseline", str(tmp_path / "no"))
    assert proc.returncode == 2 and "no does not exist: pass a results/<run-id>/ folder" in proc.stdout, proc.stdout

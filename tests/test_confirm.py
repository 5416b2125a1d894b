"""A time regression must hold in a re-run (`harness.confirm`): the report judges each re-run scenario by its
faster attempt; `harness run --baseline` re-runs what its report flags slower."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from harness_cli import harness_run

from harness.report import write_report
from harness.scenario import load_matrix

ROOT = Path(__file__).resolve().parents[1]
IDS = [f"qwen3/tp{tp}-pp1/{placement}/{mode}" for placement in ("noncolocate", "colocate") for tp in (1, 2, 4, 8)
       for mode in ("raw", "bridge")]  # fmt: skip
ENV = {"bound_version": 2, "calibration": {"memcpy_gbps": 4.0, "gloo_broadcast_gbps": 2.0}}


def folder(path: Path, slower: dict[str, float] | None = None, verdicts: dict[str, str] | None = None) -> Path:
    """A run folder of 16 PASS rows, each with efficiency 0.5 and steady time 0.01 x (i + 1) s; `slower` makes a
    row's syncs that many times longer (its bound as it was), `verdicts` gives a row another verdict."""
    rows = []
    for i, sid in enumerate(IDS):
        factor = (slower or {}).get(sid, 1.0)
        steady = 0.01 * (i + 1) * factor
        row: dict[str, Any] = {"scenario": sid, "colocate": "/colocate/" in sid, "verdict": "PASS", "expected": "PASS"}
        row |= {"steady_s": steady, "steady_min_s": steady, "steady_max_s": steady}
        row |= {"bound_s": 0.005 * (i + 1), "bound_max_s": 0.005 * (i + 1), "efficiency": 0.5 / factor}
        row["verdict"] = (verdicts or {}).get(sid, "PASS")
        rows.append(row)
    path.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(path / "summary.csv", index=False)
    (path / "env.json").write_text(json.dumps(ENV))
    return path


@pytest.mark.parametrize(
    ("rerun", "verdict", "status", "kept", "now", "ratio"),
    [
        (1.0, "PASS", 0, "rerun", "unchanged", 1.0),  # slow by the first attempt's luck: cleared
        (1.8, "PASS", 1, "rerun", "regression", 1.8),  # slow in both attempts: flagged by the faster one (1.8x)
        (3.0, "PASS", 1, "first", "regression", 2.0),  # the first attempt was the faster one
        (0.1, "PASS", 0, "rerun", "unchanged", 0.1),  # 2x slower, then 10x faster: no improvement, they disagree
        (1.0, "CRASH", 1, "rerun", "regression", None),  # a re-run that failed its verdict is a verdict regression
    ],
)
def test_a_re_run_scenario_is_judged_by_its_faster_attempt(
    tmp_path: Path, rerun: float, verdict: str, status: int, kept: str, now: str, ratio: float | None
) -> None:
    sid, unflagged = IDS[3], IDS[5]
    base = folder(tmp_path / "base")
    run = folder(tmp_path / "run", slower={sid: 2.0})
    assert write_report(run, base)[0] == 1  # 2x slower by efficiency, against a band of 1.25x
    rerun_dir = folder(run / "confirm", slower={sid: rerun, unflagged: 5.0}, verdicts={sid: verdict})
    table = pd.read_csv(rerun_dir / "summary.csv")
    table[table["scenario"].isin([sid, unflagged])].to_csv(rerun_dir / "summary.csv", index=False)
    got, md = write_report(run, base)
    rows = pd.read_csv(run / "report.csv").set_index("scenario")
    assert got == status and rows.at[sid, "change"] == now
    if ratio is None:
        assert rows.at[sid, "verdict_change"] == "regressed" and rows.at[sid, "run_verdict"] == "CRASH"
    else:
        assert rows.at[sid, "ratio"] == pytest.approx(ratio)
    if rerun < 1:
        assert "attempts disagree" in rows.at[sid, "note"]
    # a row in confirm/ the first report did not flag is not judged again: it stays as it first ran
    assert rows.at[unflagged, "change"] == "unchanged" and rows.at[unflagged, "ratio"] == pytest.approx(1.0)
    text = md.read_text()
    section = text.split("## Re-run to confirm", 1)[-1].split("\n## ", 1)[0]
    line = next(x for x in section.splitlines() if x.startswith(f"| `{sid}`"))
    assert [c.strip() for c in line.split("|")][5:8] == [verdict, kept, now]
    assert f"`{unflagged}`" not in section and "1 scenario flagged slower at first ran again" in section
    assert pd.read_csv(run / "summary.csv").set_index("scenario").at[sid, "steady_s"] == pytest.approx(0.08)


def test_harness_run_re_runs_what_its_report_flags_slower_and_keeps_a_slowdown_both_attempts_show(
    tmp_path: Path,
) -> None:
    """A real run of one scenario against a baseline whose time for it is 10 us: slower in the run and in the
    re-run, so it stays a regression, and the re-run's tables are in the run's confirm/ folder. With
    --no-confirm nothing is re-run."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text("- {model: qwen3, syncs: 3}\n")
    (sc,) = load_matrix(matrix)
    base = tmp_path / "base"
    base.mkdir()
    row = {"scenario": sc.id, "colocate": False, "verdict": "PASS", "expected": "PASS"}
    pd.DataFrame([row | {"steady_s": 1e-5, "steady_min_s": 1e-5, "steady_max_s": 1e-5}]).to_csv(base / "summary.csv")
    (base / "env.json").write_text(json.dumps({"bound_version": 2, "calibration": {"gloo_broadcast_gbps": 1.0}}))
    argv = harness_run(matrix, tmp_path / "out", "--run-id", "r", "--baseline", str(base))
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"re-running 1 scenario(s) the report flagged slower, to confirm: {sc.id}" in proc.stdout
    out = tmp_path / "out" / "r"
    rerun = pd.read_csv(out / "confirm" / "summary.csv")
    assert rerun["scenario"].tolist() == [sc.id] and (rerun["verdict"] == "PASS").all()
    report = pd.read_csv(out / "report.csv").set_index("scenario")
    assert report.at[sc.id, "change"] == "regression" and report.at[sc.id, "measure"] == "calibration (gloo broadcast)"
    assert "## Re-run to confirm" in (out / "report.md").read_text()

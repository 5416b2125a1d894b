"""Unit tests of the regression report (`harness.report`) on synthetic baseline and run folders."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.cli import main
from harness.report import (
    compare,
    env_differences,
    exit_status,
    fence,
    load_baseline,
    load_run,
    verdict_change,
    write_report,
)
from harness.report_measure import MEASURE_BOUNDS, MEASURE_EFFICIENCY, MEASURE_RAW, MIN_JUDGED_EFFICIENCY
from harness.scenario import Scenario

SCENARIOS = [
    Scenario(model=model, tp=tp, colocate=colocate, export_mode="raw")
    for model in ("qwen3", "qwen3-vl")
    for tp in (1, 2)
    for colocate in (False, True)
]
IDS = [sc.id for sc in SCENARIOS]
BASE_TIMES = [0.010, 0.012, 0.030, 0.025, 0.040, 0.035, 0.080, 0.070]
CALIBRATION = {"memcpy_gbps": 4.0, "gloo_broadcast_gbps": 2.0, "bytes": 1 << 26, "repeats": 5}


def make_table(times: list[float], spread: float | None = 1.1, ids: list[str] = IDS) -> pd.DataFrame:
    """A summary table: one PASS row per scenario with steady time `times[i]`; the fastest and slowest
    steady syncs at time / sqrt(spread) and time * sqrt(spread) (left out when `spread` is None)."""
    by_id = {sc.id: sc for sc in SCENARIOS}
    rows = []
    for sid, t in zip(ids, times, strict=True):
        sc = by_id.get(sid) or Scenario(model="qwen3-moe", ep=2)
        row: dict[str, Any] = {
            "scenario": sid,
            "model": sc.model,
            "tp": sc.tp,
            "ep": sc.ep,
            "pp": sc.pp,
            "colocate": sc.colocate,
            "export_mode": sc.export_mode,
            "engine": sc.engine,
            "tags": "",
            "steady_s": t,
            "verdict": "PASS",
            "expected": "PASS",
            "expect_met": True,
            "message": "",
        }
        if spread is not None:
            row |= {"steady_min_s": t / math.sqrt(spread), "steady_max_s": t * math.sqrt(spread)}
        rows.append(row)
    return pd.DataFrame(rows)


def make_env(calibration: dict[str, Any] | None = CALIBRATION, **extra: Any) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": "3.12.1",
        "hostname": "vm",
        "packages": {"torch": "2.13.0", "ray": "2.60.0"},
        "git": {"commit": "a" * 40, "dirty": False},
        "started_at": "2025-01-01T02:00:00+00:00",
        "ended_at": "2025-01-01T02:10:00+00:00",
    }
    if calibration is not None:
        env["calibration"] = dict(calibration)
    return env | extra


def write_folder(path: Path, table: pd.DataFrame, env: dict[str, Any] | None) -> Path:
    path.mkdir(parents=True)
    table.to_csv(path / "summary.csv", index=False)
    if env is not None:
        (path / "env.json").write_text(json.dumps(env))
    return path


def regress(table: pd.DataFrame, sid: str, verdict: str, message: str) -> None:
    idx = table.index[table["scenario"] == sid][0]
    table["message"] = table["message"].astype(object)
    table.loc[idx, ["verdict", "expect_met", "message"]] = [verdict, False, message]


def rows_by_id(report: Any) -> dict[str, dict[str, Any]]:
    return {r["scenario"]: r for r in report.rows.to_dict(orient="records")}


def test_verdict_regression_and_2x_slowdown_are_flagged(tmp_path: Path) -> None:
    base = write_folder(tmp_path / "base", make_table(BASE_TIMES), make_env())
    run_times = list(BASE_TIMES)
    run_times[2] *= 2.0
    table = make_table(run_times)
    regress(table, IDS[5], "PARITY_FAIL", "sync 2: 'model.norm.weight' engine holds stale values")
    run = write_folder(tmp_path / "run", table, make_env())

    report = compare(load_run(run), load_run(base))
    rows = rows_by_id(report)
    slow, broken = rows[IDS[2]], rows[IDS[5]]
    assert slow["change"] == "regression" and slow["time_change"] == "slower"
    assert slow["ratio"] == pytest.approx(2.0)  # same calibration in both: the raw ratio
    assert slow["measure"] == "calibration (gloo broadcast)"  # non-colocate row
    assert slow["band"] == pytest.approx(1.25)  # max(1.25, spreads 1.1, fence 1: the others did not move)
    assert broken["change"] == "regression" and broken["verdict_change"] == "regressed"
    assert "stale values" in broken["note"] and broken["time_change"] == "not timed"
    others = [rows[sid] for sid in IDS if sid not in (IDS[2], IDS[5])]
    assert {r["change"] for r in others} == {"unchanged"}
    assert all(r["ratio"] == pytest.approx(1.0) for r in others)
    assert rows[IDS[1]]["measure"] == "calibration (memcpy)"  # colocate row
    assert exit_status(report) == 1

    assert main(["report", "--run", str(run), "--baseline", str(base)]) == 1
    md = (run / "report.md").read_text()
    regressions = md.split("## Regressions", 1)[1].split("## Improvements", 1)[0]
    assert f"`{IDS[2]}`" in regressions and "2.00x slower" in regressions
    assert f"`{IDS[5]}`" in regressions and "PASS → PARITY_FAIL" in regressions and "stale values" in regressions
    assert md.index("## Regressions") < md.index("## Improvements") < md.index("## Unchanged")
    assert "6 scenarios: same verdict, 6 with their time within noise" in md
    saved = pd.read_csv(run / "report.csv")
    assert sorted(saved.loc[saved["change"] == "regression", "scenario"]) == sorted([IDS[2], IDS[5]])
    assert (run / "plots" / "regression.png").stat().st_size > 0


def test_a_change_within_the_per_sync_spread_is_noise(tmp_path: Path) -> None:
    run_times = list(BASE_TIMES)
    run_times[3] *= 1.4  # > 1.25, but both runs' syncs spread by 1.6x
    base = write_folder(tmp_path / "base", make_table(BASE_TIMES, spread=1.6), make_env())
    run = write_folder(tmp_path / "run", make_table(run_times, spread=1.6), make_env())
    report = compare(load_run(run), load_run(base))
    row = rows_by_id(report)[IDS[3]]
    assert row["ratio"] == pytest.approx(1.4) and row["band"] == pytest.approx(1.6)
    assert row["time_change"] == "within noise" and exit_status(report) == 0
    assert set(report.rows["change"]) == {"unchanged"}

    # The same change where neither table knows its spread: outside the 1.25 threshold.
    base2 = write_folder(tmp_path / "base2", make_table(BASE_TIMES, spread=None), make_env())
    run2 = write_folder(tmp_path / "run2", make_table(run_times, spread=None), make_env())
    report2 = compare(load_run(run2), load_run(base2))
    assert rows_by_id(report2)[IDS[3]]["time_change"] == "slower" and exit_status(report2) == 1


def test_a_uniformly_slower_host_is_absorbed_by_the_calibration(tmp_path: Path) -> None:
    slower = {k: v / 2.1 if k.endswith("gbps") else v for k, v in CALIBRATION.items()}
    base = write_folder(tmp_path / "base", make_table(BASE_TIMES), make_env())
    run = write_folder(tmp_path / "run", make_table([t * 2.1 for t in BASE_TIMES]), make_env(slower))
    assert main(["report", "--run", str(run), "--baseline", str(base)]) == 0
    report = compare(load_run(run), load_run(base))
    assert all(r == pytest.approx(1.0) for r in report.rows["ratio"])
    assert set(report.rows["change"]) == {"unchanged"}
    md = (run / "report.md").read_text()
    assert "**0 regressions**" in md
    calibration = md.split("## Host calibration", 1)[1].split("##", 1)[0]
    cells = [
        [c.strip() for c in line.strip("|").split("|")] for line in calibration.splitlines() if line.startswith("|")
    ]
    assert ["memcpy (GB/s)", "4.00", "1.90", "0.48"] in cells and [
        "gloo broadcast (GB/s)",
        "2.00",
        "0.95",
        "0.48",
    ] in cells

    # Without the calibration the raw seconds are 2.1x slower everywhere: nothing is flagged either,
    # the report says it centred on the median ratio.
    raw = write_folder(tmp_path / "raw", make_table([t * 2.1 for t in BASE_TIMES]), make_env(None))
    report = compare(load_run(raw), load_run(base))
    assert set(report.rows["measure"]) == {MEASURE_RAW}
    assert report.median_raw_ratio == pytest.approx(2.1) and exit_status(report) == 0


def test_raw_seconds_flag_a_row_far_from_the_median_ratio(tmp_path: Path) -> None:
    run_times = [t * 2.1 for t in BASE_TIMES]
    run_times[6] *= 2.0
    base = write_folder(tmp_path / "base", make_table(BASE_TIMES), make_env(None))
    run = write_folder(tmp_path / "run", make_table(run_times), make_env(None))
    report = compare(load_run(run), load_run(base))
    row = rows_by_id(report)[IDS[6]]
    assert report.median_raw_ratio == pytest.approx(2.1)  # median of seven 2.1s and one 4.2
    assert row["ratio"] == pytest.approx(2.0) and row["change"] == "regression" and row["measure"] == MEASURE_RAW
    assert "divided by the median run/baseline ratio of those rows (2.10x)" in _markdown(report)


def _markdown(report: Any) -> str:
    from harness.report_md import report_markdown

    return report_markdown(report)


def test_fence_widens_the_band_by_the_rows_scatter() -> None:
    assert fence([0.0, 0.1, 0.2]) == 1.0  # fewer than 6 rows: no widening
    logs = [math.log(r) for r in (0.6, 0.8, 1.0, 1.3, 1.7, 2.2, 3.0, 3.8)]
    mid = statistics.median(logs)
    mad = statistics.median([abs(x - mid) for x in logs])
    # their median, 1.49x, sits off 1 by more than the threshold: the fence widens by 1.25x of it
    assert mid == pytest.approx(math.log(1.49), abs=0.01)
    assert fence(logs) == pytest.approx(math.exp(3 * 1.4826 * mad) * 1.25)
    assert fence(logs) > 3.8  # a host that scatters 0.6-3.8x flags nothing within that
    assert fence([0.0] * 7 + [math.log(2.0)]) == 1.0  # one row off, the rest identical: no widening
    # rows centred off 1 by less than the threshold: the fence is their scatter about that centre
    off = [math.log(1.13 * r) for r in (0.8, 0.9, 1.0, 1.0, 1.1, 1.25)]
    mid = statistics.median(off)
    mad = statistics.median([abs(x - mid) for x in off])
    assert fence(off) == pytest.approx(math.exp(3 * 1.4826 * mad) * 1.13)
    # a group that all got 1.5x slower, scattering 1.0-1.1x about that: its fence does not take the 1.5x in
    slowed = [math.log(1.5 * r) for r in (0.95, 1.0, 1.0, 1.0, 1.05, 1.1)]
    assert fence(slowed) < 1.5


def test_new_and_missing_scenarios_are_listed(tmp_path: Path) -> None:
    base = write_folder(tmp_path / "base", make_table(BASE_TIMES), make_env())
    new_id = "qwen3-moe/tp1-pp1-ep2/noncolocate/raw"
    run_ids = [*IDS[1:], new_id]
    table = make_table([*BASE_TIMES[1:], 0.05], ids=run_ids)
    run = write_folder(tmp_path / "run", table, make_env())
    status, md_path = write_report(run, base)
    rows = rows_by_id(compare(load_run(run), load_run(base)))
    assert rows[new_id]["change"] == "new" and rows[IDS[0]]["change"] == "missing"
    assert status == 0  # a scenario that is new or gone is listed, not a regression
    md = md_path.read_text()
    new = md.split("## New scenarios", 1)[1].split("## Missing scenarios", 1)[0]
    missing = md.split("## Missing scenarios", 1)[1].split("## Environment differences", 1)[0]
    assert f"`{new_id}`: PASS" in new and IDS[0] not in new
    assert f"`{IDS[0]}`" in missing and new_id not in missing


def test_environment_differences_are_listed(tmp_path: Path) -> None:
    base_env = make_env()
    run_env = make_env(
        hostname="vm2", packages={"torch": "2.13.1", "ray": "2.60.0"}, git={"commit": "b" * 40, "dirty": True}
    )
    run_env["started_at"] = "2025-02-01T02:00:00+00:00"
    diffs = env_differences(base_env, run_env)
    assert diffs == [
        ("git.commit", "a" * 40, "b" * 40),
        ("git.dirty", "False", "True"),
        ("hostname", "vm", "vm2"),
        ("packages.torch", "2.13.0", "2.13.1"),
    ]
    assert env_differences(base_env, {k: v for k, v in base_env.items() if k != "git"})[0] == (
        "git.commit",
        "a" * 40,
        "—",
    )
    base = write_folder(tmp_path / "base", make_table(BASE_TIMES), base_env)
    run = write_folder(tmp_path / "run", make_table(BASE_TIMES), run_env)
    _, md_path = write_report(run, base)
    section = md_path.read_text().split("## Environment differences", 1)[1].split("##", 1)[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("|")]
    assert ["packages.torch", "2.13.0", "2.13.1"] in cells and ["hostname", "vm", "vm2"] in cells
    assert "started_at" not in section


def test_efficiency_is_compared_when_both_tables_have_it(tmp_path: Path) -> None:
    """A same-run bound makes host speed cancel: efficiency is compared, not time."""
    base_table, run_table = make_table(BASE_TIMES), make_table(BASE_TIMES)
    base_table["efficiency"] = 0.5
    run_table["efficiency"] = 0.5
    run_table.loc[0, "efficiency"] = 0.25  # half as efficient: 2x slower against its bound
    run_table.loc[1, "steady_s"] *= 3.0  # 3x slower in seconds, but its bound moved with it
    base = write_folder(tmp_path / "base", base_table, make_env())
    run = write_folder(tmp_path / "run", run_table, make_env())
    report = compare(load_run(run), load_run(base))
    rows = rows_by_id(report)
    assert set(report.rows["measure"]) == {MEASURE_EFFICIENCY}
    assert rows[IDS[0]]["ratio"] == pytest.approx(2.0) and rows[IDS[0]]["change"] == "regression"
    assert rows[IDS[1]]["ratio"] == pytest.approx(1.0) and rows[IDS[1]]["change"] == "unchanged"
    assert f"- {MEASURE_EFFICIENCY}: 8" in _markdown(report)


def _bound_tables(spread: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Baseline and run tables with efficiency: every row's bound is its steady time / 100, its slowest
    repeat `spread` times that."""
    tables = make_table(BASE_TIMES), make_table(BASE_TIMES)
    for table in tables:
        table["bound_s"] = [t / 100 for t in BASE_TIMES]
        table["bound_max_s"] = table["bound_s"] * spread
        table["efficiency"] = table["bound_s"] / table["steady_s"]
    return tables


def test_an_efficiency_row_carries_its_bound_noise(tmp_path: Path) -> None:
    """Efficiency = bound / steady moves with the bound: its band widens by the bound's spread."""
    base_table, run_table = _bound_tables(spread=1.2)
    run_table.loc[1, ["bound_s", "bound_max_s"]] /= 1.3  # the run's bound 1.3x lower, the same steady time
    run_table.loc[1, "efficiency"] /= 1.3
    base = write_folder(tmp_path / "base", base_table, make_env())
    run = write_folder(tmp_path / "run", run_table, make_env())
    row = rows_by_id(compare(load_run(run), load_run(base)))[IDS[1]]
    assert row["measure"] == MEASURE_EFFICIENCY and row["ratio"] == pytest.approx(1.3)
    assert row["run_bound_spread"] == pytest.approx(1.2) and row["baseline_bound_spread"] == pytest.approx(1.2)
    assert row["band"] == pytest.approx(1.1 * 1.2)  # per-sync spread times the bound's, above the 1.25 threshold
    assert row["time_change"] == "within noise"

    # The same tables without the bound's slowest repeat (older tables): outside the 1.25 threshold.
    base_old = write_folder(tmp_path / "base_old", base_table.drop(columns="bound_max_s"), make_env())
    run_old = write_folder(tmp_path / "run_old", run_table.drop(columns="bound_max_s"), make_env())
    old = rows_by_id(compare(load_run(run_old), load_run(base_old)))[IDS[1]]
    assert old["band"] == pytest.approx(1.25) and old["time_change"] == "slower"

    # A row compared by calibration does not carry a bound's noise, even where its tables have one.
    base_cal = write_folder(tmp_path / "base_cal", base_table.drop(columns="efficiency"), make_env())
    run_cal = write_folder(tmp_path / "run_cal", run_table.drop(columns="efficiency"), make_env())
    cal = rows_by_id(compare(load_run(run_cal), load_run(base_cal)))[IDS[1]]
    assert cal["measure"] == "calibration (memcpy)" and cal["band"] == pytest.approx(1.25)


@pytest.mark.parametrize(
    ("base_ok", "run_ok", "base_v", "run_v", "expected"),
    [
        (True, False, "PASS", "CRASH", "regressed"),
        (False, True, "CRASH", "PASS", "fixed"),
        (False, False, "CRASH", "DEADLOCK", "changed"),
        (True, True, "PASS", "PASS", "same"),
    ],
)
def test_verdict_change(base_ok: bool, run_ok: bool, base_v: str, run_v: str, expected: str) -> None:
    assert verdict_change(base_ok, run_ok, base_v, run_v) == expected


def test_the_committed_baseline_reads_and_matches_itself(tmp_path: Path) -> None:
    """The committed baseline (a folder of runs, read as their medians) compares with itself: every row unchanged
    at ratio 1, measured as efficiency where a row carries one, else by the host speed the other rows' same-run
    bounds give; every row's median is over all of its runs."""
    folder = Path(__file__).resolve().parents[1] / "results" / "baselines" / "cpu"
    baseline = load_baseline(folder)
    assert baseline.env["runs"] >= 5 and (baseline.table["runs"] == baseline.env["runs"]).all()
    assert "export_mode" in baseline.table and baseline.table["expect_met"].all()
    report = compare(baseline, baseline)
    assert exit_status(report) == 0 and set(report.rows["change"]) == {"unchanged"}
    timed = report.rows.dropna(subset=["ratio"])
    assert len(timed) == len(baseline.table) and timed["ratio"].tolist() == pytest.approx([1.0] * len(timed))
    # every passing row has a bound; the expected failure (a padded vocabulary in bridge mode) has none, and
    # rows whose bound is under 10 % of their sync are not judged by it: both by the host speed the other rows'
    # bounds give (1.0 here: the same tables)
    table = baseline.table
    passing = table["verdict"] == "PASS"
    small = passing & (table["efficiency"] < MIN_JUDGED_EFFICIENCY)
    by_measure = report.rows.groupby("measure")["scenario"].apply(set).to_dict()
    assert by_measure.pop(MEASURE_EFFICIENCY) == set(table.loc[passing & ~small, "scenario"])
    padded = {"qwen3-padded-vocab/tp2-pp1/noncolocate/bridge"}
    expected = {
        f"{MEASURE_BOUNDS} (non-colocate)": padded
        | set(table.loc[small & ~table["colocate"].astype(bool), "scenario"]),
        f"{MEASURE_BOUNDS} (colocate)": set(table.loc[small & table["colocate"].astype(bool), "scenario"]),
    }
    assert by_measure == {k: v for k, v in expected.items() if v} and report.host_ratios[False] == 1.0


def test_a_run_that_compared_nothing_exits_1_and_says_so(tmp_path: Path) -> None:
    # A run interrupted before its first scenario (a table with no row) exited 0 against every baseline: "0
    # regressions ... 79 missing" read as a pass in CI.
    base = write_folder(tmp_path / "base", make_table(BASE_TIMES), make_env())
    empty = write_folder(tmp_path / "empty", make_table(BASE_TIMES).iloc[0:0], make_env())
    other = write_folder(tmp_path / "other", make_table([0.05], ids=["qwen3-moe/tp1-pp1-ep2/noncolocate/raw"]), None)
    for run in (empty, other):
        status, md = write_report(run, base)
        assert status == 1 and f"**Nothing compared**: the run has none of the baseline's {len(IDS)}" in md.read_text()
    subset = write_folder(tmp_path / "subset", make_table(BASE_TIMES[:1], ids=IDS[:1]), make_env())
    status, md = write_report(subset, base)  # a filtered run: what it ran is compared, the rest is missing
    assert status == 0 and "Nothing compared" not in md.read_text()


def test_a_folder_that_is_no_run_is_refused_naming_its_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "summary.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"bad/summary.csv is no run's summary table \(no scenario or verdict column"):
        load_run(bad)
    (bad / "summary.csv").write_text("")
    with pytest.raises(ValueError, match=r"bad/summary.csv is empty"):
        load_run(bad)
    with pytest.raises(FileNotFoundError, match=r"summary.csv is a file: pass a results/<run-id>/ folder"):
        load_run(bad / "summary.csv")
    with pytest.raises(FileNotFoundError, match=r"bad/typo does not exist: pass a results/<run-id>/ folder"):
        load_run(bad / "typo")
    with pytest.raises(FileNotFoundError, match=r"bad has no summary.csv"):
        (bad / "summary.csv").unlink()
        load_run(bad)
    run = write_folder(tmp_path / "run", make_table(BASE_TIMES), make_env())
    assert main(["report", "--run", str(run), "--baseline", str(bad)]) == 2  # the error line, not a traceback
    assert main(["report", "--run", str(run), "--baseline", str(run), "--threshold", "1"]) == 2
    assert main(["report", "--run", str(run), "--baseline", str(run), "--threshold", "inf"]) == 2
    (bad / "summary.csv").write_text("scenario,verdict\n")  # a run interrupted before its first scenario
    with pytest.raises(ValueError, match="holds no scenario: pass a run that ran some"):
        write_report(run, bad)
    (bad / "env.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"bad/env.json is no JSON"):
        load_run(bad)
    assert not (run / "report.md").exists()


def test_a_run_compared_with_its_own_folder_is_refused_and_its_report_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `report --run results/baselines/cpu --baseline results/baselines/cpu` overwrote the committed report.md
    # (that baseline against the one it replaced) with one that compared the folder with itself.
    run = write_folder(tmp_path / "run", make_table(BASE_TIMES), make_env())
    (run / "report.md").write_text("the report this folder keeps\n")
    assert main(["report", "--run", str(run), "--baseline", str(tmp_path / "." / "run")]) == 2
    assert "--run and --baseline are one folder" in capsys.readouterr().err
    assert (run / "report.md").read_text() == "the report this folder keeps\n" and not (run / "report.csv").exists()


def test_a_row_without_a_bound_is_judged_by_the_host_speed_the_other_rows_bounds_measured(tmp_path: Path) -> None:
    """A start-of-run calibration that missed the host's state (here: it read the same gloo speed while every
    bound and sync took 1.5x as long) no longer moves the rows without efficiency (vLLM rows): they are divided
    by the median run / baseline bound of the rows beside them."""
    ids = [f"m{i}/tp1-pp1/noncolocate/raw" for i in range(8)]  # 6 with a bound, 2 without (as vLLM rows)
    times = [0.01 * (i + 1) for i in range(8)]
    base_table, run_table = make_table(times, ids=ids), make_table([1.5 * t for t in times], ids=ids)
    for table, host in ((base_table, 1.0), (run_table, 1.5)):
        table["bound_s"] = [host * t / 2 if i < 6 else math.nan for i, t in enumerate(times)]
        table["efficiency"] = table["bound_s"] / table["steady_s"]
    run_table.loc[7, "steady_s"] *= 2.0  # one row that did get 2x slower beyond the host
    base = write_folder(tmp_path / "base", base_table, make_env())
    run = write_folder(tmp_path / "run", run_table, make_env())  # the same calibration in both
    report = compare(load_run(run), load_run(base))
    rows = rows_by_id(report)
    assert report.host_ratios == {False: pytest.approx(1.5)}
    assert rows[ids[6]]["measure"] == f"{MEASURE_BOUNDS} (non-colocate)" and rows[ids[6]]["change"] == "unchanged"
    assert rows[ids[6]]["ratio"] == pytest.approx(1.0)
    assert rows[ids[7]]["ratio"] == pytest.approx(2.0) and rows[ids[7]]["change"] == "regression"
    assert "Host speed from the same-run bounds (non-colocate): the run's bounds took 1.50x" in _markdown(report)
    # Fewer than 6 bounded rows of a placement: the calibration, as before (1.5x slower: flagged)
    few = write_folder(tmp_path / "few", run_table.drop(index=[0, 1, 2]), make_env())
    rows = rows_by_id(compare(load_run(few), load_run(base)))
    assert rows[ids[6]]["measure"] == "calibration (gloo broadcast)" and rows[ids[6]]["change"] == "regression"


def test_a_row_whose_own_bound_departed_from_its_hosts_is_judged_by_the_other_rows_bounds(tmp_path: Path) -> None:
    """A row's bound fell 2.5x while the other rows' bounds and every steady time stayed (its reference path
    stopped moving some bytes, or its bound of a few ms scattered): by efficiency it read 2.5x slower. Its
    steady time over the host ratio the other rows' bounds give says it did not move; a row whose bound moved
    within its noise is still judged by efficiency, and one that got slower beyond the host still shows."""
    ids = [f"m{i}/tp1-pp1/noncolocate/raw" for i in range(8)]
    times = [0.01 * (i + 1) for i in range(8)]
    base_table, run_table = make_table(times, ids=ids), make_table(times, ids=ids)
    for table in (base_table, run_table):
        table["bound_s"] = [t / 2 for t in times]
        table["bound_max_s"] = table["bound_s"] * 1.1
    run_table.loc[0, ["bound_s", "bound_max_s"]] = [times[0] / 5, times[0] / 5 * 1.1]  # 0.4x, spreads 1.1 each
    run_table.loc[1, ["bound_s", "bound_max_s"]] = [times[1] / 2 * 0.9, times[1] / 2 * 0.99]  # 0.9x: noise
    run_table.loc[2, ["bound_s", "bound_max_s"]] = [times[2] / 5, times[2] / 5 * 1.1]
    run_table.loc[2, "steady_s"] *= 2.0  # its bound departed, and it did get 2x slower
    for table in (base_table, run_table):
        table["efficiency"] = table["bound_s"] / table["steady_s"]
    base = write_folder(tmp_path / "base", base_table, make_env())
    run = write_folder(tmp_path / "run", run_table, make_env())
    report = compare(load_run(run), load_run(base))
    rows = rows_by_id(report)
    assert report.host_ratios == {False: pytest.approx(1.0)}
    departed = rows[ids[0]]
    assert departed["measure"] == f"{MEASURE_BOUNDS} (non-colocate)" and departed["change"] == "unchanged"
    assert departed["ratio"] == pytest.approx(1.0)
    assert departed["note"].startswith("its own bound moved 0.40x against the non-colocate rows' 1.00x")
    within = rows[ids[1]]
    assert within["measure"] == MEASURE_EFFICIENCY and within["ratio"] == pytest.approx(1 / 0.9)
    slower = rows[ids[2]]
    assert slower["measure"] == f"{MEASURE_BOUNDS} (non-colocate)" and slower["change"] == "regression"
    assert slower["ratio"] == pytest.approx(2.0)

    # A bound of 1 % of its sync: its bound fell 6x within its own scatter (spreads 2.5 each), its steady time
    # stayed. By efficiency, 6x slower; by the other rows' bounds, unchanged.
    for table, bound in ((base_table, times[3] / 100), (run_table, times[3] / 600)):
        table.loc[3, ["bound_s", "bound_max_s"]] = [bound, bound * 2.5]
        table["efficiency"] = table["bound_s"] / table["steady_s"]
    base = write_folder(tmp_path / "base_tiny", base_table, make_env())
    run = write_folder(tmp_path / "run_tiny", run_table, make_env())
    tiny = rows_by_id(compare(load_run(run), load_run(base)))[ids[3]]
    assert tiny["measure"] == f"{MEASURE_BOUNDS} (non-colocate)" and tiny["change"] == "unchanged"
    assert tiny["note"].startswith("its bound is 0.2 % of its sync in one run (under 10 %)")


def test_runs_whose_bounds_measured_other_steps_are_compared_by_raw_seconds(tmp_path: Path) -> None:
    """A baseline made before the bound changed what it measures (env.json without ``bound_version``, or another
    one): the run's bounds of TP rows fell 4x with the steps they time, so by efficiency every TP row read 4x
    slower, and by the other rows' bounds the host read 4x faster. Neither is used: raw seconds over the rows'
    median ratio, which absorbs the slower host and still flags the row that did get slower."""
    base_table, run_table = make_table(BASE_TIMES), make_table([1.2 * t for t in BASE_TIMES])
    for table, bound in ((base_table, 1.0), (run_table, 0.25)):
        table["bound_s"] = [bound * t / 2 for t in BASE_TIMES]
        table["efficiency"] = table["bound_s"] / table["steady_s"]
    run_table.loc[3, "steady_s"] *= 2.0
    base = write_folder(tmp_path / "base", base_table, make_env())  # no bound_version: 1
    run = write_folder(tmp_path / "run", run_table, make_env(bound_version=2))
    report = compare(load_run(run), load_run(base))
    rows = rows_by_id(report)
    assert set(report.rows["measure"]) == {MEASURE_RAW} and report.host_ratios == {}
    assert report.median_raw_ratio == pytest.approx(1.2)
    assert [rows[sid]["change"] for sid in IDS].count("regression") == 1 and rows[IDS[3]]["change"] == "regression"
    md = _markdown(report)
    assert "measured other steps in the run (bound version 2) than in the baseline (1)" in md
    assert "| bound_version" in md  # listed with the environment differences
    # the same version in both: efficiency again (every row 4x "slower" against the smaller bound)
    same = write_folder(tmp_path / "same", base_table, make_env(bound_version=2))
    assert set(compare(load_run(run), load_run(same)).rows["measure"]) == {MEASURE_EFFICIENCY}


def test_a_measure_too_few_rows_share_takes_the_fence_of_all_timed_rows(tmp_path: Path) -> None:
    """Two rows without a bound (as vLLM rows) are judged by the host speed the 8 bounded rows give: too few for a
    fence of their own. Where the other rows scatter 0.7-1.4x on unchanged code, one of the two moving 1.5x is
    within the scatter of all 10 rows; where the others did not move, the same 1.5x is a regression."""
    ids = [f"m{i}/tp1-pp1/noncolocate/raw" for i in range(10)]
    times = [0.01 * (i + 1) for i in range(10)]
    moved = [0.7, 0.8, 0.9, 1.0, 1.0, 1.1, 1.25, 1.4, 1.5, 1.0]

    def folder(name: str, factors: list[float]) -> Path:
        table = make_table([t * f for t, f in zip(times, factors, strict=True)], ids=ids)
        table["bound_s"] = [t / 2 if i < 8 else math.nan for i, t in enumerate(times)]
        table["efficiency"] = table["bound_s"] / table["steady_s"]
        return write_folder(tmp_path / name, table, make_env())

    base = folder("base", [1.0] * 10)
    rows = rows_by_id(compare(load_run(folder("scattered", moved)), load_run(base)))
    # the eight bounded rows' bound is half their sync: half of it is what their efficiency does not explain,
    # so their log ratios count double in the scatter, and their own band is the fence to the power 0.5
    share = [0.5] * 8 + [1.0] * 2
    logs = [math.log(f) / w for f, w in zip(moved, share, strict=True)]
    mid = statistics.median(logs)
    all_rows = math.exp(3 * 1.4826 * statistics.median(abs(x - mid) for x in logs))
    assert mid == 0.0 and all_rows > 1.5  # hand-computed from the ten ratios: 0.7-1.5x scatter
    vllm_like = rows[ids[8]]
    assert vllm_like["measure"] == f"{MEASURE_BOUNDS} (non-colocate)" and vllm_like["ratio"] == pytest.approx(1.5)
    assert vllm_like["band"] == pytest.approx(all_rows) and vllm_like["change"] == "unchanged"
    eight = logs[:8]
    mid8 = statistics.median(eight)
    own = math.exp(3 * 1.4826 * statistics.median(abs(x - mid8) for x in eight)) ** 0.5
    assert rows[ids[0]]["measure"] == MEASURE_EFFICIENCY and rows[ids[0]]["band"] == pytest.approx(own)

    still = [1.0] * 8 + [1.5, 1.0]
    rows = rows_by_id(compare(load_run(folder("still", still)), load_run(base)))
    assert rows[ids[8]]["band"] == pytest.approx(1.25) and rows[ids[8]]["change"] == "regression"


def test_rows_centred_off_1_by_the_host_are_judged_about_their_centre_and_a_whole_slower_group_still_shows(
    tmp_path: Path,
) -> None:
    """Eight rows by efficiency whose median moved 1.15x on unchanged code (the bounds sped up more than the
    syncs) and scatter about it: the one at 1.64x lies within that scatter about 1.15, not about 1. Eight rows
    that all got 1.5x slower, scattering 0.95-1.1x about that, are all flagged."""
    ids = [f"m{i}/tp1-pp1/noncolocate/raw" for i in range(8)]
    times = [0.01 * (i + 1) for i in range(8)]

    def folder(name: str, factors: list[float]) -> Path:
        table = make_table([t * f for t, f in zip(times, factors, strict=True)], ids=ids)
        table["bound_s"] = [t / 2 for t in times]
        table["efficiency"] = table["bound_s"] / table["steady_s"]
        return write_folder(tmp_path / name, table, make_env())

    base = folder("base", [1.0] * 8)
    moved = [1.13 * f for f in (0.85, 0.9, 1.0, 1.0, 1.05, 1.1, 1.2, 1.45)]
    rows = rows_by_id(compare(load_run(folder("offset", moved)), load_run(base)))
    # every bound is half its sync: the log ratios count double (`unexplained_share` 0.5), the fence is taken
    # of those and raised to 0.5 for each row; their median, 1.34x, is past the 1.25x cap
    logs = [2 * math.log(f) for f in moved]
    mid = statistics.median(logs)
    scatter = math.exp(3 * 1.4826 * statistics.median(abs(x - mid) for x in logs))
    assert math.exp(mid) > 1.25
    assert scatter**0.5 < moved[7] < (scatter * 1.25) ** 0.5  # 1.56 < 1.64 < 1.75
    assert rows[ids[7]]["ratio"] == pytest.approx(moved[7]) and rows[ids[7]]["change"] == "unchanged"
    assert rows[ids[7]]["band"] == pytest.approx((scatter * 1.25) ** 0.5)

    slowed = [1.5 * f for f in (0.95, 1.0, 1.0, 1.0, 1.05, 1.1, 1.0, 1.0)]
    rows = rows_by_id(compare(load_run(folder("slowed", slowed)), load_run(base)))
    assert {rows[sid]["change"] for sid in ids} == {"regression"}
    # scatter 1.0 (MAD 0) x the 1.25 cap, to the power 0.5: under the 1.25 threshold, which is the band
    assert all(rows[sid]["band"] == pytest.approx(1.25) for sid in ids)


def test_a_row_whose_bound_explains_most_of_its_sync_gets_a_narrower_fence(tmp_path: Path) -> None:
    """Seven rows whose bound is 25 % of their sync scatter 0.6-1.6x on unchanged code, as small rows do
    between hosts; an eighth whose bound is 80 % of its sync got 1.6x slower. Its log ratio is divided by
    0.2 (1 - efficiency) in the scatter and its band is the fence to the power 0.2: flagged. One of the
    small rows at 1.6x is not."""
    ids = [f"m{i}/tp1-pp1/noncolocate/raw" for i in range(8)]
    times = [0.01 * (i + 1) for i in range(8)]
    shares = [0.25] * 7 + [0.8]  # bound / sync in the baseline

    def folder(name: str, factors: list[float]) -> Path:
        table = make_table([t * f for t, f in zip(times, factors, strict=True)], ids=ids, spread=None)
        table["bound_s"] = [t * s for t, s in zip(times, shares, strict=True)]
        table["efficiency"] = table["bound_s"] / table["steady_s"]
        return write_folder(tmp_path / name, table, make_env())

    moved = [0.6, 0.8, 0.9, 1.0, 1.1, 1.25, 1.6, 1.6]
    rows = rows_by_id(compare(load_run(folder("run", moved)), load_run(folder("base", [1.0] * 8))))
    logs = [math.log(f) / (1 - s) for f, s in zip(moved, shares, strict=True)]
    mid = statistics.median(logs)
    scatter = math.exp(3 * 1.4826 * statistics.median(abs(x - mid) for x in logs)) * min(math.exp(abs(mid)), 1.25)
    big, small = rows[ids[7]], rows[ids[6]]
    assert big["measure"] == small["measure"] == MEASURE_EFFICIENCY
    assert big["band"] == pytest.approx(max(1.25, scatter**0.2)) and big["change"] == "regression"
    assert small["band"] == pytest.approx(scatter**0.75) and small["band"] > 1.6 and small["change"] == "unchanged"

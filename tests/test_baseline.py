"""A baseline of several runs (`harness.baseline`): how their tables combine, how the report reads them, and the
`baseline` command that adds runs to one. Expected values are derived by hand from the synthetic tables."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.baseline import RUNS_SPREAD_EFFICIENCY, RUNS_SPREAD_S, combine_envs, combine_tables, host_scales
from harness.cli import main
from harness.report import compare, load_baseline, load_run, normalise_table, write_report
from harness.report_measure import MEASURE_EFFICIENCY

# 8 rows per placement: enough for the host speed the bounds give (at least 6 rows share it).
IDS = [f"qwen3/tp{tp}-pp1/{placement}/{mode}" for placement in ("noncolocate", "colocate") for tp in (1, 2, 4, 8)
       for mode in ("raw", "bridge")]  # fmt: skip
STEADY = [0.010 * (i + 1) for i in range(len(IDS))]


def table(host: float = 1.0, efficiency: float = 0.5, spread: float = 1.0, **rows: dict[str, Any]) -> pd.DataFrame:
    """One run's summary table: every row PASS, steady time STEADY x `host` (the host's slowness), the bound
    `efficiency` of it, per-sync and bound spreads `spread`; `rows` overrides cells of one scenario by id
    (underscores for slashes are not needed: pass a dict under the key ``r<index>``)."""
    out = []
    for i, sid in enumerate(IDS):
        steady = STEADY[i] * host
        row: dict[str, Any] = {
            "scenario": sid,
            "model": "qwen3",
            "colocate": "/colocate/" in sid,
            "verdict": "PASS",
            "expected": "PASS",
            "steady_s": steady,
            "steady_min_s": steady / math.sqrt(spread),
            "steady_max_s": steady * math.sqrt(spread),
            "bound_s": steady * efficiency,
            "bound_max_s": steady * efficiency * spread,
            "efficiency": efficiency,
        }
        row.update(rows.get(f"r{i}", {}))
        out.append(row)
    return normalise_table(pd.DataFrame(out))


def env(commit: str, **extra: Any) -> dict[str, Any]:
    return {
        "git": {"commit": commit, "dirty": False},
        "packages": {"torch": "2.13.0"},
        "bound_version": 2,
        "started_at": f"2026-01-0{commit[0]}T00:00:00+00:00",
        "calibration": {"memcpy_gbps": float(commit[0]), "gloo_broadcast_gbps": 2.0},
    } | extra


def write_run(folder: Path, tab: pd.DataFrame, run_env: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    tab.to_csv(folder / "summary.csv", index=False)
    (folder / "env.json").write_text(json.dumps(run_env))
    return folder


def test_runs_on_hosts_of_different_speed_combine_in_the_median_hosts_units() -> None:
    """A run on a host 2x slower (every bound and steady time doubled) and one 4x slower combine with one at 1x:
    host scales 1/2, 1 and 2 against the median host, and after scaling every run reads STEADY x 2, so the
    medians are STEADY x 2 with no spread between runs; efficiency, a ratio of one run's times, is as it was."""
    tables = [table(host=1.0), table(host=2.0), table(host=4.0)]
    scales = host_scales(tables)
    assert [s[False] for s in scales] == pytest.approx([0.5, 1.0, 2.0])
    assert [s[True] for s in scales] == pytest.approx([0.5, 1.0, 2.0])
    combined = combine_tables(tables)
    assert combined["steady_s"].tolist() == pytest.approx([2 * t for t in STEADY])
    assert combined["bound_s"].tolist() == pytest.approx([t for t in STEADY])  # 2 x STEADY x 0.5
    assert combined["efficiency"].tolist() == pytest.approx([0.5] * len(IDS))
    assert combined[RUNS_SPREAD_S].tolist() == pytest.approx([1.0] * len(IDS))
    assert (combined["runs"] == 3).all() and combined["expect_met"].all()


def test_a_scenario_takes_the_median_of_the_runs_that_met_their_expectation() -> None:
    """Row 0's efficiency in five runs: 0.5, 0.4, 0.7, 0.1 (its verdict not as expected: not timed) and 0.6.
    The median over the four timed runs is (0.5 + 0.6) / 2; their spread 0.7 / 0.4; the verdict the one most
    runs gave; a row no run met is not timed at all."""
    effs = [0.5, 0.4, 0.7, 0.1, 0.6]
    tables = []
    for i, eff in enumerate(effs):
        r0 = bounded(eff)
        if i == 3:
            r0 |= {"verdict": "PARITY_FAIL"}
        tables.append(table(r0=r0, r1={"verdict": "CRASH"}))
    combined = combine_tables(tables)
    row = combined.loc[IDS[0]]
    assert row["efficiency"] == pytest.approx(0.55) and row["runs"] == 4
    assert row[RUNS_SPREAD_EFFICIENCY] == pytest.approx(0.7 / 0.4)
    assert row["verdict"] == "PASS" and row["expect_met"]
    crashed = combined.loc[IDS[1]]
    assert crashed["verdict"] == "CRASH" and not crashed["expect_met"] and crashed["runs"] == 0
    assert math.isnan(crashed["steady_s"]) and math.isnan(crashed[RUNS_SPREAD_S])


def test_envs_combine_key_by_key_and_runs_of_other_bound_versions_are_refused() -> None:
    envs = [env("1abc"), env("3def"), env("2abc"), {"git": {"commit": "4fff"}, "bound_version": 2}]
    out = combine_envs(envs)
    assert out["git"] == {"commit": ["1abc", "3def", "2abc", "4fff"], "dirty": False}
    assert out["packages"] == {"torch": "2.13.0"}  # the run that did not record packages says nothing of them
    assert out["started_at"] == "2026-01-01T00:00:00+00:00" and out["runs"] == 4
    assert out["calibration"] == {"memcpy_gbps": 2.0, "gloo_broadcast_gbps": 2.0}  # medians
    with pytest.raises(ValueError, match=r"bound_version \[2, 1\]"):
        combine_envs([env("1abc"), env("2abc", bound_version=1)])


def bounded(efficiency: float) -> dict[str, Any]:
    """Row 0's cells at `efficiency`, its bound as it was (STEADY[0] x 0.5): its syncs took longer or shorter."""
    steady = STEADY[0] * 0.5 / efficiency
    return {"efficiency": efficiency, "steady_s": steady, "steady_min_s": steady, "steady_max_s": steady}


def test_the_report_reads_a_folder_of_runs_as_their_medians_with_their_spread_as_the_baselines_noise(
    tmp_path: Path,
) -> None:
    """Row 0's efficiency in the baseline's three runs: 0.5, 0.4 and 0.6 (median 0.5, spread 1.5), the others 0.5.
    A run at 0.35 reads (1 / 0.35) / (1 / 0.5) = 1.43x: slower against a one-run baseline (band 1.25), within
    the three runs' spread. A run at 0.3 (1.67x) is slower than what the three runs differed by."""
    base = tmp_path / "cpu"
    for i, eff in enumerate((0.5, 0.4, 0.6)):
        write_run(base / "runs" / f"r{i}", table(r0=bounded(eff)), env(f"{i + 1}a"))
    baseline = load_baseline(base)
    assert baseline.env["runs"] == 3 and baseline.table.at[IDS[0], "efficiency"] == pytest.approx(0.5)
    one_run = load_run(base / "runs" / "r0")
    for eff, ratio, against_three, against_one in ((0.35, 0.5 / 0.35, "unchanged", "regression"),
                                                   (0.30, 0.5 / 0.30, "regression", "regression")):  # fmt: skip
        run = write_run(tmp_path / f"run{eff}", table(r0=bounded(eff)), env("9z"))
        three = compare(load_run(run), baseline).rows.set_index("scenario").loc[IDS[0]]
        assert three["measure"] == MEASURE_EFFICIENCY and three["ratio"] == pytest.approx(ratio)
        assert three["baseline_spread"] == pytest.approx(1.5) and three["band"] == pytest.approx(1.5)
        assert three["change"] == against_three
        one = compare(load_run(run), one_run).rows.set_index("scenario").loc[IDS[0]]
        assert one["band"] == pytest.approx(1.25) and one["change"] == against_one


def test_a_folder_of_runs_that_also_holds_a_summary_or_holds_no_run_is_refused(tmp_path: Path) -> None:
    both = tmp_path / "both"
    write_run(both / "runs" / "r0", table(), env("1a"))
    table().to_csv(both / "summary.csv", index=False)
    with pytest.raises(ValueError, match=r"both a summary\.csv and a runs/ folder"):
        load_baseline(both)
    (tmp_path / "empty" / "runs").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds no run folder"):
        load_baseline(tmp_path / "empty")


def test_the_baseline_command_adds_runs_and_refuses_what_it_cannot_combine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [write_run(tmp_path / f"2026-01-0{i}", table(host=1 + i / 10), env(f"{i}a")) for i in (1, 2)]
    target = tmp_path / "baselines" / "cpu"
    assert main(["baseline", "--add", *map(str, runs), "--to", str(target)]) == 0
    assert "2 runs, 16 scenarios" in capsys.readouterr().out
    assert sorted(p.name for p in (target / "runs").iterdir()) == ["2026-01-01", "2026-01-02"]
    assert sorted(p.name for p in (target / "runs" / "2026-01-01").iterdir()) == ["env.json", "summary.csv"]
    # the same run again, a folder without a table, a run of another bound version beside a good one: refused,
    # nothing copied
    fine = write_run(tmp_path / "2026-01-03", table(), env("3a"))
    assert main(["baseline", "--add", str(runs[0]), "--to", str(target)]) == 2
    assert main(["baseline", "--add", str(fine), str(tmp_path / "nothing"), "--to", str(target)]) == 2
    other = write_run(tmp_path / "v1", table(), env("5a", bound_version=1))
    assert main(["baseline", "--add", str(fine), str(other), "--to", str(target)]) == 2
    err = capsys.readouterr().err
    assert "keeps each run once" in err and "does not exist" in err and "bound_version [2, 2, 2, 1]" in err
    assert len(list((target / "runs").iterdir())) == 2
    # a one-run baseline folder is not turned into a folder of runs behind the user's back
    single = write_run(tmp_path / "single", table(), env("4a"))
    assert main(["baseline", "--add", str(runs[0]), "--to", str(single)]) == 2
    assert "move its files into" in capsys.readouterr().err


def test_adding_a_run_by_dot_a_copy_of_a_kept_run_or_into_a_file_is_handled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--add .` names the run's own folder (it used to copy into runs/ itself and leave the baseline unreadable);
    the same run under another name and a `--to` that is a file are refused with a line, not a traceback; a
    report whose run is one of the baseline's says so."""
    run = write_run(tmp_path / "2026-01-01", table(), env("1a"))
    target = tmp_path / "base"
    (target / "runs").mkdir(parents=True)  # an empty runs/ is a baseline to add to
    monkeypatch.chdir(run)
    assert main(["baseline", "--add", ".", "--to", str(target)]) == 0
    assert [p.name for p in (target / "runs").iterdir()] == ["2026-01-01"]
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    assert main(["baseline", "--add", str(copy), "--to", str(target)]) == 2
    (tmp_path / "file").write_text("")
    assert main(["baseline", "--add", str(copy), "--to", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err
    assert "holds already (same commit and start time)" in err and "is a file" in err
    write_run(target / "runs" / "2026-01-02", table(host=1.1), env("2a"))
    assert write_report(run, target)[0] == 0
    md = (run / "report.md").read_text()
    assert "**The run is one of the baseline's runs**" in md and "run_identities" not in md

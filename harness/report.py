"""Regression report: one run's tables against a baseline's (two `results/<run-id>/` folders).

    python -m harness report --run results/<id> --baseline results/baselines/cpu

Scenarios are matched by id. Per scenario:

- **Verdict**: a scenario whose verdict was the expected one in the baseline and is not in the run is a
  regression (with the run's deciding message); the other way round an improvement; two different
  verdicts that are both (not) as expected are listed apart and are not a regression.
- **Steady time** (``steady_s``, the median over syncs >= 1), when both runs met the expectation and
  timed it. What is compared is the time a host cannot explain, in this order of preference:
  ``efficiency`` (both tables carry it: steady time relative to a bound measured in the same run, so
  host speed cancels), unless the row's own bound departed from the other rows' (`bound_departure`: it
  then timed other work, or scattered); else the time divided by how much slower the run's host moved bytes, from the
  other rows of its placement that both tables bound (median of run / baseline ``bound_s`` over at least 6:
  `bound_host_ratios`; a vLLM row has no bound of its own, the embedded rows beside it do); else the time
  multiplied by the host calibration both runs measured at their
  start (env.json ``calibration``, `harness.calibrate`: GB/s of a gloo broadcast for non-colocated
  rows, of a memcpy for colocated ones: the way each placement moves its bytes); else raw seconds,
  divided by the median run/baseline ratio over all such rows (a uniformly slower host moves the
  median, not the rows), which the report says. Each row says which it used. Where the two runs' bounds
  measured other steps (env.json ``bound_version``, `bounds_comparable`), every row is compared by raw
  seconds: neither efficiency nor the bounds' host speed then says anything about the code under test.
- **Noise**: run/baseline ratio r is flagged only outside a band b: slower when r > b, faster when
  r < 1/b, with b = max(threshold (1.25), each run's per-sync spread (slowest over fastest steady sync,
  ``steady_max_s / steady_min_s``; a table without those columns contributes nothing), the fence). A row
  compared by efficiency also carries the noise of its bound: each run's spread is then the per-sync
  spread times the bound's (``bound_max_s / bound_s``, slowest over fastest repeat of the bare
  collectives), since steady / bound moves with either: a small sync's bound is tens of microseconds and
  its repeats scatter 1.1-8x on a 2-core host (README, "Noise"). A baseline of several runs
  (`harness.baseline`) gives its medians, and its side of the band is how far its runs differed: the
  highest over the lowest of their values of the row's measure (efficiency, or host-scaled seconds). The
  fence is exp(3 x 1.4826 x MAD) of the log ratios of the rows measured the same way (when at least 6
  are; else of all timed rows), times how far their median sits off 1 (at most the threshold; `fence`),
  each log ratio divided by the share of its sync the measure does not explain and the fence raised to
  that share for the row (`unexplained_share`: 1 - efficiency for a row compared by efficiency, else 1):
  on hosts where the same commit scatters (0.6-3.8x per scenario on one fresh machine), a row is flagged
  only when it is far from the others, not because the host was noisy.
  Why a band and not a rank test: a baseline table keeps medians and the spread, not every sync, and 4-5
  syncs per side give a rank test too little power to say more than the spread does.

Also listed: new and missing scenarios, scenarios that Ctrl-C or a signal stopped in the run or in the
baseline (``interrupted`` in summary.csv; compared neither by verdict nor by time, and never a regression),
environment differences (versions, host, commit), and both hosts' calibration. Output: `report.md`
(regressions first, then improvements, then counts), `report.csv` (one row per scenario, `COLUMNS`) and
`plots/regression.png` in the run's folder. The exit status is 1 when anything regressed, else 0.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from harness.baseline import (
    RUNS_SPREAD_EFFICIENCY,
    RUNS_SPREAD_S,
    combine_envs,
    combine_tables,
    is_multi_run,
    run_folders,
)
from harness.confirm import calm_disagreements, confirm_folder, faster_attempts, time_regressions
from harness.markdown import flag
from harness.report_measure import (
    FENCE_MADS,
    FENCE_MIN_ROWS,
    MEASURE_EFFICIENCY,
    MEASURE_RAW,
    THRESHOLD,
    band_spreads,
    bound_host_ratios,
    bound_scatter,
    bound_spread,
    bounds_comparable,
    finite,
    mad_fence,
    measure,
    sync_spread,
    unexplained_share,
)

# env.json keys never listed as differences: they differ on every run (report.md shows them per run) or
# are shown elsewhere (calibration; a baseline of several runs' run_identities, in the first line).
ENV_SKIPPED = ("started_at", "ended_at", "wall_s", "command", "python_executable", "calibration", "run_identities")

COLUMNS: tuple[str, ...] = (
    "scenario",
    "change",  # regression | improvement | changed | unchanged | new | missing | interrupted
    "verdict_change",  # regressed | fixed | changed | same | ""
    "time_change",  # slower | faster | within noise | not timed | ""
    "baseline_verdict",
    "run_verdict",
    "baseline_steady_s",
    "run_steady_s",
    "measure",
    "baseline_value",
    "run_value",
    "ratio",  # run / baseline of the measure (> 1: slower); raw seconds: over the median ratio
    "band",
    "baseline_spread",  # per-sync spread; of a baseline of several runs: its runs' spread of the row's measure
    "run_spread",
    "baseline_bound_spread",  # bound_max_s / bound_s: efficiency rows' band also carries it
    "run_bound_spread",
    "note",
)
NUMERIC_COLUMNS: tuple[str, ...] = (
    "baseline_steady_s",
    "run_steady_s",
    "baseline_value",
    "run_value",
    "ratio",
    "band",
    "baseline_spread",
    "run_spread",
    "baseline_bound_spread",
    "run_bound_spread",
)


@dataclass
class RunTables:
    """One results folder as the report reads it: `summary.csv` indexed by scenario id, and env.json."""

    name: str
    path: Path
    table: pd.DataFrame
    env: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    """The comparison: one row per scenario of either run (`COLUMNS`), env differences, and notes."""

    run: RunTables
    baseline: RunTables
    rows: pd.DataFrame
    env_diffs: list[tuple[str, str, str]]
    median_raw_ratio: float
    threshold: float
    host_ratios: dict[bool, float] = field(default_factory=dict)  # `bound_host_ratios`, by colocate
    attempts: pd.DataFrame | None = None  # scenarios re-run to confirm a time regression (`harness.confirm`)


def normalise_table(df: pd.DataFrame) -> pd.DataFrame:
    """A summary table as the report reads it: indexed by scenario id, ``export_mode`` (older tables
    call it ``mode``), ``expect_met`` as bool (from ``expected`` or PASS when absent), ``interrupted`` as
    bool (False when absent)."""
    out = df.rename(columns={"mode": "export_mode"}) if "export_mode" not in df else df.copy()
    if "expect_met" in out:
        met = out["expect_met"].map(flag)
    elif "expected" in out:
        met = out["verdict"] == out["expected"]
    else:
        met = out["verdict"] == "PASS"
    out["expect_met"] = met.astype(bool)
    out["interrupted"] = out["interrupted"].map(flag).astype(bool) if "interrupted" in out else False
    for col in ("steady_s", "steady_min_s", "steady_max_s", "efficiency"):
        if col in out:
            out[col] = pd.to_numeric(out[col], errors="coerce")
    return out.set_index("scenario", drop=False)


def load_run(path: Path | str) -> RunTables:
    """Read `path`/summary.csv and `path`/env.json (``{}`` when absent).

    Raises:
        FileNotFoundError: `path` is no folder with a summary.csv.
        ValueError: its summary.csv is no run's table (empty, or without the `scenario` and `verdict` columns
            every run writes); the message names the file.
    """
    folder = Path(path)
    csv = folder / "summary.csv"
    if not csv.is_file():
        what = "is a file" if folder.is_file() else "has no summary.csv" if folder.is_dir() else "does not exist"
        raise FileNotFoundError(f"{folder} {what}: pass a results/<run-id>/ folder")
    try:
        df = pd.read_csv(csv)
    except pd.errors.EmptyDataError:
        raise ValueError(f"{csv} is empty: pass the folder of a run that wrote its tables") from None
    missing = [c for c in ("scenario", "verdict") if c not in df]
    if missing:
        raise ValueError(f"{csv} is no run's summary table (no {' or '.join(missing)} column): pass a run's folder")
    env_path = folder / "env.json"
    try:
        env = json.loads(env_path.read_text()) if env_path.exists() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{env_path} is no JSON ({e}): pass a run's folder, or remove that file") from None
    return RunTables(name=folder.name, path=folder, table=normalise_table(df), env=env)


def load_baseline(path: Path | str) -> RunTables:
    """`load_run` for a baseline: one run's folder, or a folder of several runs (`path`/runs/<run-id>/, read as
    one table of per-scenario medians: `harness.baseline.combine_tables`). One that holds no scenario (a run
    interrupted before its first) would compare nothing and pass every run.

    Raises:
        FileNotFoundError, ValueError: as `load_run`; ValueError also where its table has no row, where a
            folder of runs also holds a summary.csv or holds no run, or where its runs measured their bounds
            differently (`harness.baseline.combine_envs`).
    """
    folder = Path(path)
    if is_multi_run(folder):
        runs = [load_run(p) for p in run_folders(folder)]
        table = combine_tables([r.table for r in runs])
        baseline = RunTables(name=folder.name, path=folder, table=table, env=combine_envs([r.env for r in runs]))
    else:
        baseline = load_run(folder)
    if not len(baseline.table):
        raise ValueError(f"baseline {baseline.path} holds no scenario: pass a run that ran some")
    return baseline


def verdict_change(base_ok: bool, run_ok: bool, base_verdict: str, run_verdict: str) -> str:
    """regressed (was as expected, is not) | fixed | changed (both (not) as expected, verdicts differ) | same."""
    if base_ok and not run_ok:
        return "regressed"
    if run_ok and not base_ok:
        return "fixed"
    return "changed" if base_verdict != run_verdict else "same"


def fence(
    log_ratios: list[float], mads: float = FENCE_MADS, min_rows: int = FENCE_MIN_ROWS, most_off: float = THRESHOLD
) -> float:
    """How far from 1 a row's ratio strays on unchanged code, from the rows' log ratios `log_ratios`:
    exp(mads x 1.4826 x MAD) (their scatter about their median), times how far their median sits off 1, at
    most `most_off`; 1.0 (no widening) for fewer than `min_rows` values.

    The median sits off 1 where the host measure does not scale as the syncs do: in one fresh-clone matrix on
    unchanged code the bounds moved bytes 1.8x faster than in the baseline while the syncs ran about 1.6x
    faster, so the efficiency rows' median was 1.14 and the colocated rows judged by the bounds' host speed
    1.13; two of those, 1.69x and 1.72x, lay within their rows' scatter of 1.65x about that median, not
    about 1. An offset beyond `most_off` (the smallest ratio ever flagged) is not the host's: a whole group
    of rows that got 1.5x slower is still flagged when they scatter less than 1.5 / 1.25."""
    if len(log_ratios) < min_rows:
        return 1.0
    off = min(math.exp(abs(statistics.median(log_ratios))), most_off)
    return mad_fence(log_ratios, mads, min_rows) * off


def judge_times(rows: pd.DataFrame, threshold: float = THRESHOLD) -> tuple[pd.DataFrame, float]:
    """Fill ``ratio``, ``band`` and ``time_change`` of rows with both values; raw-seconds rows are divided
    by their median ratio (returned; NaN when there is none). The fence of a measure shared by fewer than
    `FENCE_MIN_ROWS` rows is that of all timed rows (`fence`): five rows judged by the bounds' host speed had
    none, and on unchanged code one of them read 1.54x slower against a band of 1.25x.

    Each row's log ratio is divided by its share of time the host measure does not explain
    (`unexplained_share`) before the fence is taken, and the fence is raised to that share for the row: a
    row whose bound is 82 % of its sync strays a fifth as far as one whose bound is 10 %. Without that, the
    efficiency rows' one fence (3.16x, set by the rows of 10-30 % efficiency) hid a loader that widened every
    bf16 tensor to float32: the two full-size raw rows (82 % and 59 %) read 2.75x and 2.77x."""
    out = rows.copy()
    timed = out["baseline_value"].notna() & out["run_value"].notna()
    out.loc[timed, "ratio"] = out.loc[timed, "run_value"] / out.loc[timed, "baseline_value"]
    raw = timed & (out["measure"] == MEASURE_RAW)
    median_raw = float(out.loc[raw, "ratio"].median()) if raw.any() else math.nan
    if raw.any():
        out.loc[raw, "ratio"] = out.loc[raw, "ratio"] / median_raw
    records = out.to_dict(orient="index")  # one row's cells as a dict: .loc per row costs most of a report's time
    weight = {idx: unexplained_share(records[idx]) for idx in out.index[timed]}
    scaled = {idx: math.log(out.at[idx, "ratio"]) / weight[idx] for idx in weight}
    # A measure too few rows share for a fence of their own borrows the scatter of every timed row: each ratio
    # is already what the host cannot explain, so the report's rows together say how far one row of this pair of
    # runs strays on unchanged code.
    pooled = fence(list(scaled.values()), most_off=threshold)
    for name in out.loc[timed, "measure"].unique():
        group = timed & (out["measure"] == name)
        own = [scaled[idx] for idx in out.index[group]]
        wide = fence(own, most_off=threshold) if len(own) >= FENCE_MIN_ROWS else pooled
        for idx in out.index[group]:
            band = max([threshold, wide ** weight[idx], *band_spreads(records[idx])])
            ratio = records[idx]["ratio"]
            out.at[idx, "band"] = band
            out.at[idx, "time_change"] = "slower" if ratio > band else "faster" if ratio < 1 / band else "within noise"
    return out, median_raw


def _untimed_note(base: Mapping[str, Any], run: Mapping[str, Any]) -> str:
    for side, row in (("baseline", base), ("run", run)):
        if not row["expect_met"]:
            return f"not timed: verdict not as expected in the {side}"
    for side, row in (("baseline", base), ("run", run)):
        if finite(row.get("steady_s")) is None:
            return f"not timed: no steady time in the {side}"
    return "not timed"


def _flatten(env: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in env.items():
        name = f"{prefix}{key}"
        if not prefix and key in ENV_SKIPPED:
            continue
        if isinstance(value, Mapping):
            flat |= _flatten(value, name + ".")
        else:
            flat[name] = ", ".join(map(str, value)) if isinstance(value, list) else value
    return flat


def env_differences(base_env: Mapping[str, Any], run_env: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(key, baseline, run) for every env.json value that differs (nested keys dotted, e.g.
    ``packages.torch``, ``git.commit``; absent shown as "—"), timestamps and calibration left out."""
    base, run = _flatten(base_env), _flatten(run_env)
    show = lambda v: "—" if v is None or v == "" else str(v)  # noqa: E731
    return [
        (k, show(base.get(k)), show(run.get(k))) for k in sorted(base.keys() | run.keys()) if base.get(k) != run.get(k)
    ]


def compare(run: RunTables, baseline: RunTables, threshold: float = THRESHOLD) -> Report:
    """The report's rows (`COLUMNS`): every scenario of either table, in the run's order then the
    baseline's missing ones."""
    rows: list[dict[str, Any]] = []
    b_tab, r_tab = baseline.table, run.table
    comparable = bounds_comparable(baseline.env, run.env)
    host_ratios = bound_host_ratios(b_tab, r_tab) if comparable else {}
    bound_fences = bound_scatter(b_tab, r_tab) if comparable else {}
    r_rows, b_rows = r_tab.to_dict(orient="index"), b_tab.to_dict(orient="index")
    for sid in r_tab.index:
        r = r_rows[sid]
        row = _blank(sid)
        row.update(run_verdict=r["verdict"], run_steady_s=r.get("steady_s"), run_spread=sync_spread(r))
        row["run_bound_spread"] = bound_spread(r)
        if sid not in b_tab.index:
            row.update(change="new", note=str(r.get("message") or "") if not r["expect_met"] else "")
            rows.append(row)
            continue
        b = b_rows[sid]
        row.update(baseline_verdict=b["verdict"], baseline_steady_s=b.get("steady_s"), baseline_spread=sync_spread(b))
        row["baseline_bound_spread"] = bound_spread(b)
        if r["interrupted"] or b["interrupted"]:  # stopped by hand or a signal: says nothing of the code under test
            in_baseline = f"interrupted in the baseline: {b.get('message')}"
            note = str(r.get("message") or "") if r["interrupted"] else in_baseline
            row.update(change="interrupted", time_change="not timed", note=note)
            rows.append(row)
            continue
        row["verdict_change"] = verdict_change(bool(b["expect_met"]), bool(r["expect_met"]), b["verdict"], r["verdict"])
        if row["verdict_change"] in ("regressed", "changed") and not r["expect_met"]:
            row["note"] = str(r.get("message") or "")
        name, vb, vr, departed = measure(b, r, baseline.env, run.env, host_ratios, bound_fences)
        if (finite(b.get("runs")) or 0) >= 2:  # a baseline of several runs: its noise is how far they differed
            col = RUNS_SPREAD_EFFICIENCY if name == MEASURE_EFFICIENCY else RUNS_SPREAD_S
            row.update(baseline_spread=finite(b.get(col)) or math.nan, baseline_bound_spread=math.nan)
        if b["expect_met"] and r["expect_met"] and vb and vr:
            row.update(measure=name, baseline_value=vb, run_value=vr)
            row["note"] = row["note"] or departed
        else:
            row["time_change"] = "not timed"
            row["note"] = row["note"] or _untimed_note(b, r)
        rows.append(row)
    for sid in b_tab.index.difference(r_tab.index, sort=False):
        b = b_rows[sid]
        row = _blank(sid)
        row.update(change="missing", baseline_verdict=b["verdict"], baseline_steady_s=b.get("steady_s"))
        row["baseline_spread"] = sync_spread(b)
        rows.append(row)
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    for col in NUMERIC_COLUMNS:
        table[col] = pd.to_numeric(table[col], errors="coerce").astype(float)
    table, median_raw = judge_times(table, threshold)
    table["change"] = [_overall(r) for r in table.to_dict(orient="records")]
    diffs = env_differences(baseline.env, run.env)
    return Report(
        run=run,
        baseline=baseline,
        rows=table,
        env_diffs=diffs,
        median_raw_ratio=median_raw,
        threshold=threshold,
        host_ratios=host_ratios,
    )


def _blank(scenario: str) -> dict[str, Any]:
    """A report row with nothing known yet: "" in text columns, NaN in `NUMERIC_COLUMNS`."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS, "")
    row.update(dict.fromkeys(NUMERIC_COLUMNS, math.nan), scenario=scenario)
    return row


def _overall(row: Mapping[str, Any]) -> str:
    if row["change"] in ("new", "missing", "interrupted"):
        return str(row["change"])
    if row["verdict_change"] == "regressed" or row["time_change"] == "slower":
        return "regression"
    if row["verdict_change"] == "fixed" or row["time_change"] == "faster":
        return "improvement"
    return "changed" if row["verdict_change"] == "changed" else "unchanged"


COMPARED = ("regression", "improvement", "changed", "unchanged", "interrupted")  # changes of scenarios in both


def compared_nothing(report: Report) -> bool:
    """Whether the run shares no scenario with a baseline that has some: an empty or interrupted run, or one of
    another matrix. Its report has no regression to find, and must not read as a pass."""
    rows = report.rows
    return bool(len(report.baseline.table)) and not rows["change"].isin(COMPARED).any()


SENSITIVITY_FACTORS = (1.5, 2.0, 3.0)


def sensitivity(rows: pd.DataFrame, factors: tuple[float, ...] = SENSITIVITY_FACTORS) -> dict[float, int]:
    """For each factor f, how many timed rows (both runs timed them) would have been flagged slower had that row
    alone run f times slower than it did: those whose ``band`` / ``ratio`` is under f. The others' ratios
    and the fences they set are taken as they are, and so is the row's measure, though a row made slower
    can fall under the efficiency cut-off (`report_measure.MIN_JUDGED_EFFICIENCY`) and be judged by the
    host speed instead, with a band of its own. Slowing each of 90 rows 2x in turn in five real runs,
    `compare` flagged 1, 2, 16, 5 and 7 more rows than this says (`tests/test_report_noise.py`)."""
    timed = rows[rows["ratio"].notna() & rows["band"].notna()]
    headroom = timed["band"] / timed["ratio"]
    return {f: int((headroom < f).sum()) for f in factors}


def exit_status(report: Report) -> int:
    """1 when any scenario regressed (verdict or time), or when the run compared nothing (`compared_nothing`: a run
    interrupted before its first scenario exited 0 against every baseline); else 0."""
    return int(bool((report.rows["change"] == "regression").any()) or compared_nothing(report))


def write_report(run_dir: Path | str, baseline_dir: Path | str, threshold: float = THRESHOLD) -> tuple[int, Path]:
    """Compare `run_dir` with `baseline_dir`; write report.md, report.csv and plots/regression.png into
    `run_dir`. Where `run_dir`/confirm/ holds a re-run of some of its scenarios (`harness.confirm`), each of
    those is judged by its faster attempt. Returns (exit status, report.md's path).

    Raises:
        FileNotFoundError: either folder has no summary.csv.
        ValueError: both are one folder (its own report.md, e.g. a committed baseline's, would be overwritten by
            one that compares nothing), either summary.csv is no run's table (`load_run`), or the baseline holds
            no scenario.
    """
    from harness.plots import plot_regression
    from harness.report_md import report_markdown

    if Path(run_dir).resolve() == Path(baseline_dir).resolve():
        raise ValueError(
            f"--run and --baseline are one folder ({run_dir}): a run compared with itself says nothing, and its "
            "report.md would be overwritten; pass the run to judge and a different baseline"
        )
    run, baseline = load_run(run_dir), load_baseline(baseline_dir)
    report = compare(run, baseline, threshold)
    rerun_dir = confirm_folder(run_dir)
    if rerun_dir is not None:  # each re-run scenario judged by its faster attempt
        rerun = load_run(rerun_dir)
        flagged = set(time_regressions(report.rows))  # only what the first report flagged is judged again
        measures = {
            r["scenario"]: r["measure"] for r in report.rows.to_dict(orient="records") if r["scenario"] in flagged
        }
        table, attempts = faster_attempts(run.table, rerun.table, measures)
        report = compare(replace(run, table=table), baseline, threshold)
        report.rows = calm_disagreements(report.rows, attempts)
        report.attempts = attempts
    out = Path(run_dir)
    report.rows.to_csv(out / "report.csv", index=False)
    plot = plot_regression(
        report.rows, out / "plots" / "regression.png", title=f"{report.run.name} vs {report.baseline.name}"
    )
    md = out / "report.md"
    md.write_text(report_markdown(report, plot.relative_to(out)))
    return exit_status(report), md

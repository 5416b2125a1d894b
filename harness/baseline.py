"""A baseline of several runs: per-scenario medians over runs of one matrix, in one host's units.

A baseline folder is either one run's folder (`summary.csv`, `env.json`) or a folder whose `runs/` holds
several such folders (`python -m harness baseline --add results/<id> --to results/baselines/cpu` copies
one in). `harness.report.load_baseline` reads the second kind through `combine_tables` and `combine_envs`.

Why: one run's row carries that run's luck. In six fresh-clone matrices of unchanged code against the
one-run CPU baseline, `qwen3/tp1-pp1/colocate/bridge` read 1.47-2.28x slower in every one (its baseline
0.029 s against 0.043 s for the raw row beside it), and a real 1.33x slowdown of a full-size row read 1.17x
because the baseline's efficiency for that row was worse than unchanged code's usually is.

How runs on different hosts are combined: each run's seconds (steady, per-sync fastest and slowest, bound,
slowest bound repeat) are divided by how much faster or slower its host moved bytes than the runs' median
host, per placement (`report_measure.bound_host_ratios` against the first run, over the median of those:
the same host speed the report judges rows by); efficiency is a ratio of two times of one run and is taken
as it is. A scenario's value is the median over the runs whose verdict was as expected and which were not
interrupted. Its verdict is the one most of its runs gave.
"""

from __future__ import annotations

import math
import shutil
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from harness.report_measure import bound_host_ratios, bound_version, colocated, finite

RUNS_DIR = "runs"
SCALED = ("steady_s", "steady_min_s", "steady_max_s", "bound_s", "bound_max_s")  # seconds: divided by host scale
UNSCALED = ("efficiency",)  # a ratio of one run's times
RUNS_SPREAD_S = "runs_spread_s"  # slowest over fastest run's steady_s (host-scaled), over the runs timed
RUNS_SPREAD_EFFICIENCY = "runs_spread_efficiency"  # highest over lowest run's efficiency
KEPT_FILES = ("summary.csv", "summary.md", "env.json")  # what `add_runs` copies: what the report and a reader need


def is_multi_run(path: Path | str) -> bool:
    """Whether `path` is a baseline of several runs: a folder with a `runs/` folder."""
    return (Path(path) / RUNS_DIR).is_dir()


def _kept_runs(folder: Path) -> list[Path]:
    """`folder`/runs/*/ that hold a summary.csv, sorted by name; [] where there is no runs/."""
    return sorted(p for p in (folder / RUNS_DIR).glob("*") if (p / "summary.csv").is_file())


def run_folders(path: Path | str) -> list[Path]:
    """The run folders of a multi-run baseline (`path`/runs/*/ with a summary.csv), sorted by name.

    Raises:
        ValueError: `path` holds a summary.csv beside its runs/ (which would the report read?), or runs/ holds
            no run folder; the message says what to move.
    """
    folder = Path(path)
    if (folder / "summary.csv").exists():
        raise ValueError(
            f"{folder} has both a summary.csv and a {RUNS_DIR}/ folder: move its summary.csv and env.json into "
            f"{RUNS_DIR}/<run-id>/ (a baseline is one run's folder or a folder of runs, not both)"
        )
    found = _kept_runs(folder)
    if not found:
        raise ValueError(f"{folder / RUNS_DIR} holds no run folder with a summary.csv: add one with `harness baseline`")
    return found


def host_scales(tables: Sequence[pd.DataFrame]) -> list[dict[bool, float]]:
    """Per run, per placement (colocate: True / False), how much slower its host moved bytes than the runs'
    median host: `bound_host_ratios` of each run against the first, over the median of those ratios. A
    placement whose bounds too few rows share (a table without bounds, a filtered run) gets 1.0 for every run.

    Args:
        tables: the runs' summary tables, indexed by scenario id.
    Returns:
        One dict per table, {colocate: scale}, scale > 0 (> 1: that run's host was slower).
    """
    ratios = [bound_host_ratios(tables[0], t) for t in tables]
    scales: list[dict[bool, float]] = [{} for _ in tables]
    for placement in (False, True):
        values = [r.get(placement) for r in ratios]
        mid = statistics.median(v for v in values if v) if all(values) else None
        for i, value in enumerate(values):
            scales[i][placement] = value / mid if value and mid else 1.0
    return scales


def _spread(values: list[float]) -> float:
    return max(values) / min(values) if len(values) >= 2 else math.nan


def combine_tables(tables: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """One summary table from several runs' (each indexed by scenario id, as `report.normalise_table` gives).

    Per scenario: identity columns (model, layout, placement, mode, engine, expected) from the first run that
    has it; ``verdict`` the most common one (ties: the first run's), ``expect_met`` whether that verdict met
    the expectation, ``interrupted`` whether every run was; the seconds in `SCALED` host-scaled (`host_scales`)
    and ``efficiency``, medians over the runs that met the expectation and were not interrupted; ``runs``, how
    many runs that median is over; `RUNS_SPREAD_S` and `RUNS_SPREAD_EFFICIENCY`, the highest over the lowest of
    those runs' values (NaN under 2 runs).

    Returns:
        A table indexed by scenario id (``scenario`` also a column), scenarios in first-seen order.
    """
    scales = host_scales(tables)
    order: list[str] = []
    for table in tables:
        order += [sid for sid in table.index if sid not in order]
    rows = []
    for sid in order:
        present = [(t.loc[sid], s) for t, s in zip(tables, scales, strict=True) if sid in t.index]
        first = present[0][0]
        row: dict[str, Any] = {c: first[c] for c in first.index if c not in (*SCALED, *UNSCALED)}
        verdicts = Counter(str(r["verdict"]) for r, _ in present if not r["interrupted"])
        row["interrupted"] = not verdicts
        if verdicts:
            top = max(verdicts.values())
            verdict = next(str(r["verdict"]) for r, _ in present if verdicts[str(r["verdict"])] == top)
            row["verdict"] = verdict
            row["expect_met"] = bool(next(r["expect_met"] for r, _ in present if str(r["verdict"]) == verdict))
        timed = [(r, s) for r, s in present if not r["interrupted"] and r["expect_met"]]
        scaled = {
            col: [v / s[colocated(r["colocate"])] for r, s in timed if (v := finite(r.get(col)))] for col in SCALED
        }
        for col, values in scaled.items():
            row[col] = statistics.median(values) if values else math.nan
        effs = [v for r, _ in timed if (v := finite(r.get("efficiency")))]
        row["efficiency"] = statistics.median(effs) if effs else math.nan
        steadies = scaled["steady_s"]
        row["runs"] = len(steadies)
        row[RUNS_SPREAD_S] = _spread(steadies)
        row[RUNS_SPREAD_EFFICIENCY] = _spread(effs)
        rows.append(row)
    return pd.DataFrame(rows).set_index("scenario", drop=False)


def _merge(values: list[Any]) -> Any:
    """The one value all runs that recorded one share (a run without the key says nothing of it); nested
    mappings key by key (``git.commit`` differs, ``git.dirty`` may not); else the distinct values in run order;
    None where no run recorded one."""
    known = [v for v in values if v is not None]
    if known and all(isinstance(v, Mapping) for v in known):
        keys = dict.fromkeys(k for v in known for k in v)
        return {k: _merge([v.get(k) for v in known]) for k in keys}
    distinct = [v for i, v in enumerate(known) if v not in known[:i]]
    return distinct[0] if len(distinct) == 1 else distinct or None


def combine_envs(envs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One env.json for several runs: each key whose value every run shares keeps it (nested ones key by key);
    one that differs holds the distinct values in run order (a list: the report shows them joined), except
    ``started_at`` (the first), ``ended_at`` (the last) and ``wall_s`` (the median); ``calibration`` holds each
    key's median; ``runs`` the number of runs.

    Raises:
        ValueError: the runs' same-run bounds measured different steps (``bound_version``): their efficiencies
            and bounds cannot be combined; the message names each run's version.
    """
    versions = [bound_version(env) for env in envs]
    if len(set(versions)) > 1:
        raise ValueError(
            f"the baseline's runs measured their bounds differently (bound_version {versions}, in run order): "
            "keep only runs of one bound version in its runs/ folder"
        )
    out: dict[str, Any] = {}
    keys = [k for env in envs for k in env if k != "calibration"]
    for key in dict.fromkeys(keys):
        values = [env.get(key) for env in envs]
        if key in ("started_at", "ended_at", "wall_s"):  # the first start, the last end, the median wall time
            known = [v for v in values if v not in (None, "")]
            pick = {"started_at": min, "ended_at": max, "wall_s": statistics.median}[key]
            out[key] = pick(known) if known else None
            continue
        out[key] = _merge(values)
    cal_keys = dict.fromkeys(k for env in envs for k in (env.get("calibration") or {}))
    calibration = {}
    for key in cal_keys:
        values = [v for env in envs if (v := finite((env.get("calibration") or {}).get(key)))]
        if values:
            calibration[key] = statistics.median(values)
    if calibration:
        out["calibration"] = calibration
    out["bound_version"] = versions[0]
    out["runs"] = len(envs)
    out["run_identities"] = [list(run_identity(env)) for env in envs]  # a report names a run that is one of these
    return out


def run_identity(env: Mapping[str, Any]) -> tuple[str, str]:
    """(commit, start time) of a run's env.json: two folders with the same are one run."""
    return str((env.get("git") or {}).get("commit")), str(env.get("started_at"))


def add_runs(run_dirs: Sequence[Path | str], baseline_dir: Path | str) -> list[Path]:
    """Copy each run's `KEPT_FILES` into `baseline_dir`/runs/<run folder name>/ (the folder made a baseline of
    several runs if it is new), once every run has been checked: nothing is copied when one is refused.
    Returns the new run folders.

    Raises:
        FileNotFoundError: a run folder has no summary.csv.
        ValueError: a run's table is no run's (`report.load_run`); `baseline_dir` is one run's folder (has a
            summary.csv: move it into runs/ first) or a file; a run's name is already there or given twice; a run
            is one it holds already (same commit and start time); or the runs' bound versions differ from each
            other or from those already kept (`combine_envs`).
    """
    from harness.report import load_run

    runs = [load_run(Path(r).resolve()) for r in run_dirs]  # resolved: `--add .` names the run's own folder
    base = Path(baseline_dir)
    if base.exists() and not base.is_dir():
        raise ValueError(f"--to {base} is a file: pass a baseline's folder (made where missing)")
    if (base / "summary.csv").exists():
        raise ValueError(
            f"{base} is one run's folder: move its files into {base / RUNS_DIR}/<run-id>/ first, then add runs "
            "beside it"
        )
    names = [run.path.name for run in runs]
    for name in names:
        target = base / RUNS_DIR / name
        if target.exists() or names.count(name) > 1:
            raise ValueError(f"{target}: a baseline keeps each run once, and a run of that name is there")
    kept = [load_run(p).env for p in _kept_runs(base)]
    seen = {run_identity(env) for env in kept}
    for run in runs:
        if run_identity(run.env) in seen:  # the same run under another name: its luck would count twice
            raise ValueError(f"{run.path} is a run the baseline holds already (same commit and start time)")
        seen.add(run_identity(run.env))
    combine_envs([*kept, *(run.env for run in runs)])  # raises on another bound version
    targets = []
    for run in runs:
        target = base / RUNS_DIR / run.path.name
        target.mkdir(parents=True)
        for name in KEPT_FILES:
            if (run.path / name).is_file():
                shutil.copy2(run.path / name, target / name)
        targets.append(target)
    return targets

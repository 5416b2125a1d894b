"""report.md's text from a `harness.report.Report`: regressions first, then improvements, then counts,
new and missing scenarios, environment differences, both hosts' calibration and how rows are judged."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from harness.baseline import run_identity
from harness.report import Report, RunTables, compared_nothing, sensitivity
from harness.report_measure import (
    FENCE_MADS,
    FENCE_MIN_ROWS,
    MEASURE_EFFICIENCY,
    MEASURE_RAW,
    bound_version,
    bounds_comparable,
    placement_name,
)
from harness.results import markdown_table

LONG_LIST = 12  # longer lists of scenarios go into a collapsed block
CHANGE_HEADER = ("scenario", "what", "baseline", "run", "ratio", "noise band", "measured as")


def _num(value: Any, digits: int = 3) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return "—"
    return "—" if math.isnan(number) else f"{number:.{digits}f}"


def _what(row: Mapping[str, Any]) -> str:
    parts = []
    if row["verdict_change"] in ("regressed", "fixed", "changed"):
        parts.append(f"verdict {row['baseline_verdict']} → {row['run_verdict']}")
    if row["time_change"] in ("slower", "faster"):
        ratio = float(row["ratio"])
        parts.append(f"{ratio:.2f}x slower" if ratio > 1 else f"{1 / ratio:.2f}x faster")
    text = "; ".join(parts) or str(row["time_change"] or "same")
    note = " ".join(str(row.get("note") or "").split())
    return f"{text}: {note[:200]}" if note and row["verdict_change"] != "same" else text


def _change_rows(rows: pd.DataFrame) -> list[list[str]]:
    return [
        [
            f"`{r['scenario']}`",
            _what(r),
            f"{r['baseline_verdict']} {_num(r['baseline_steady_s'])} s",
            f"{r['run_verdict']} {_num(r['run_steady_s'])} s",
            _num(r["ratio"], 2),
            f"±{_num(r['band'], 2)}x" if not _isnan(r["band"]) else "—",
            r["measure"] or "—",
        ]
        for r in rows.to_dict(orient="records")
    ]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _isnan(value: Any) -> bool:
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return True


def _scenario_list(ids: Sequence[str], notes: Sequence[str] | None = None) -> list[str]:
    items = [
        f"- `{sid}`" + (f": {note}" if note else "") for sid, note in zip(ids, notes or [""] * len(ids), strict=True)
    ]
    if len(items) <= LONG_LIST:
        return items
    return ["<details><summary>" + f"{len(items)} scenarios</summary>", "", *items, "", "</details>"]


def _calibration_rows(report: Report) -> list[list[str]]:
    cal_b = report.baseline.env.get("calibration") or {}
    cal_r = report.run.env.get("calibration") or {}
    rows = []
    for key, label in (("memcpy_gbps", "memcpy (GB/s)"), ("gloo_broadcast_gbps", "gloo broadcast (GB/s)")):
        b, r = cal_b.get(key), cal_r.get(key)
        ratio = r / b if isinstance(b, int | float) and isinstance(r, int | float) and b else math.nan
        rows.append([label, _num(b, 2), _num(r, 2), _num(ratio, 2)])
    return rows


def _run_rows(report: Report) -> list[list[str]]:
    rows = []
    for key, label in (("started_at", "started (UTC)"), ("wall_s", "wall time (s)"), ("command", "command")):
        values = [env.get(key) for env in (report.baseline.env, report.run.env)]
        rows.append(
            [label, *("—" if v is None or v == "" else f"`{v}`" if key == "command" else str(v) for v in values)]
        )
    return rows


def _method(report: Report) -> list[str]:
    rows = report.rows
    measures = rows.loc[rows["measure"].astype(bool), "measure"].value_counts()
    lines = [
        "Steady time = median of syncs >= 1. A row is compared as the measure it names (run / baseline, > 1 "
        f"slower) and flagged only outside its noise band: max({report.threshold:g}, both runs' per-sync spread "
        "(slowest / fastest steady sync; for efficiency, times the bound's slowest / fastest repeat; for a "
        "baseline of several runs, the highest / lowest of its runs' values of the measure), and, "
        f"exp({FENCE_MADS:g} × 1.4826 × MAD) of the log ratios of the rows that share its measure, or of all "
        f"timed rows where fewer than {FENCE_MIN_ROWS} share it, times how far their median sits off 1, at most "
        f"{report.threshold:g}x; each log ratio divided by the share of its sync the measure does not explain, "
        "1 - efficiency for a row compared by efficiency, else 1, and the fence raised to that share for the "
        "row). Rows measured:",
        "",
    ]
    lines += [f"- {name}: {count}" for name, count in measures.items()]
    for colocate, ratio in sorted(report.host_ratios.items()):
        lines += [
            "",
            f"Host speed from the same-run bounds ({placement_name(colocate)}): the run's bounds took {ratio:.2f}x "
            "the baseline's (median over the rows both tables bound); a row without efficiency of its own has its "
            "run time divided by that, instead of by the calibration measured once at each run's start.",
        ]
    if MEASURE_RAW in measures.index:
        why = "at least one run has no host calibration in env.json"
        if not bounds_comparable(report.baseline.env, report.run.env):
            why = (
                f"the same-run bounds measured other steps in the run (bound version "
                f"{bound_version(report.run.env)}) than in the baseline ({bound_version(report.baseline.env)}), so "
                "neither efficiency nor the bounds' host speed compares them (make a new baseline with this code to "
                "compare them again)"
            )
        lines += [
            "",
            f"Raw seconds: {why}; the times are compared "
            f"as they are, divided by the median run/baseline ratio of those rows ({report.median_raw_ratio:.2f}x): "
            "a uniformly slower host is absorbed, and a row is flagged when it is far from that median.",
        ]
    timed = int(rows["ratio"].notna().sum())
    if timed:
        caught = ", ".join(f"{f:g}x in {n}" for f, n in sensitivity(rows).items())
        lines += [
            "",
            f"What this comparison could catch, of its {timed} timed rows (those whose band over their ratio is "
            f"under the factor): one row alone running slower than it did would have been flagged at {caught}.",
        ]
    no_spread = rows["baseline_spread"].isna() & rows["ratio"].notna()
    if no_spread.any():
        lines += ["", f"{int(no_spread.sum())} compared rows have no per-sync spread in the baseline table: "
                  "their band uses the run's spread alone."]  # fmt: skip
    return lines


def _attempt(value: Any, measure: str) -> str:
    """One attempt's value of its measure, with its unit: steady / bound for efficiency, else seconds."""
    return f"{_num(value)} (steady / bound)" if measure == MEASURE_EFFICIENCY else f"{_num(value)} s"


def _attempt_lines(report: Report) -> list[str]:
    """The "Re-run to confirm" section: each scenario flagged slower at first, both attempts' values of its
    measure (larger = slower; seconds before any host scaling), the re-run's verdict and which attempt the
    report judged; nothing where no scenario was re-run."""
    attempts = report.attempts
    if attempts is None or not len(attempts):
        return []
    change = report.rows.set_index("scenario")["change"]
    rows = [
        [
            f"`{a['scenario']}`",
            a["measure"],
            _attempt(a["first"], a["measure"]),
            _attempt(a["rerun"], a["measure"]),
            a["rerun_verdict"],
            a["kept"],
            change.get(a["scenario"], ""),
        ]
        for a in attempts.to_dict(orient="records")
    ]
    header = ("scenario", "measured as", "first attempt", "re-run", "re-run verdict", "judged by", "now")
    return [
        "## Re-run to confirm",
        "",
        f"{_count(len(rows), 'scenario')} flagged slower at first ran again (`confirm/`). Each is judged by its "
        "faster attempt, so a slowdown is flagged only when both attempts show it; a re-run whose verdict failed is "
        "judged by that verdict; one that read faster than the baseline is listed unchanged (its attempts disagree).",
        "",
        markdown_table(header, rows),
        "",
    ]


def _baseline_runs(base: RunTables, run_env: Mapping[str, Any]) -> str:
    """The header's words on a baseline of several runs (how many, their commits); "" for one run's."""
    runs = base.env.get("runs")
    if not isinstance(runs, int) or runs < 2:
        return ""
    commits = (base.env.get("git") or {}).get("commit") or []
    shown = ", ".join(str(c)[:7] for c in (commits if isinstance(commits, list) else [commits]))
    note = f", the per-scenario medians of its {runs} runs (commits {shown}; each row's baseline spread is theirs)"
    identities = base.env.get("run_identities") or []
    if list(run_identity(run_env)) in identities:
        note += ". **The run is one of the baseline's runs**: it is compared with a median it is part of"
    return note


def report_markdown(report: Report, plot: Path | None = None) -> str:
    """report.md: a one-line verdict, then Regressions, Improvements, Unchanged (counts), other verdict
    changes, New, Missing, Interrupted (when any), Environment differences, Host calibration, How rows are judged."""
    rows = report.rows
    by = {
        name: rows[rows["change"] == name]
        for name in ("regression", "improvement", "changed", "unchanged", "new", "missing", "interrupted")
    }
    counts = {name: len(frame) for name, frame in by.items()}
    run, base = report.run, report.baseline
    lines = [
        "# Regression report",
        "",
        f"Run `{run.name}` (`{run.path}`) against baseline `{base.name}` (`{base.path}`)"
        + _baseline_runs(base, run.env)
        + ".",
        "",
        f"**{_count(counts['regression'], 'regression')}**, {_count(counts['improvement'], 'improvement')}, "
        f"{counts['unchanged']} unchanged, {_count(counts['changed'], 'other verdict change')}, "
        f"{counts['new']} new, {counts['missing']} missing"
        + (f", {counts['interrupted']} interrupted." if counts["interrupted"] else "."),
        "",
    ]
    if compared_nothing(report):
        lines += [
            f"**Nothing compared**: the run has none of the baseline's {len(base.table)} scenarios (an empty or "
            "interrupted run, or another matrix); the report exits 1.",
            "",
        ]
    if plot is not None:
        lines += [f"Plot: `{plot}` (run / baseline per scenario, with each row's noise band).", ""]
    for title, name in (("Regressions", "regression"), ("Improvements", "improvement")):
        lines += [f"## {title}", ""]
        if len(by[name]):
            lines += [markdown_table(CHANGE_HEADER, _change_rows(by[name])), ""]
        else:
            lines += ["None.", ""]
    lines += _attempt_lines(report)
    unchanged = by["unchanged"]
    timed = int((unchanged["time_change"] == "within noise").sum())
    lines += [
        "## Unchanged",
        "",
        f"{len(unchanged)} scenarios: same verdict, {timed} with their time within noise and "
        f"{len(unchanged) - timed} not timed (a verdict other than PASS expected, or no steady time).",
        "",
    ]
    if len(by["changed"]):
        lines += ["## Other verdict changes (not as expected in both runs, or as expected in both)", ""]
        lines += [markdown_table(CHANGE_HEADER, _change_rows(by["changed"])), ""]
    new = by["new"]
    lines += ["## New scenarios (in the run, not in the baseline)", ""]
    notes = [
        f"{r['run_verdict']}" + (f" — {r['note'][:160]}" if r["note"] else "") for r in new.to_dict(orient="records")
    ]
    lines += [*(_scenario_list(list(new["scenario"]), notes) or ["None."]), ""]
    lines += ["## Missing scenarios (in the baseline, not in the run)", ""]
    lines += [*(_scenario_list(list(by["missing"]["scenario"])) or ["None."]), ""]
    stopped = by["interrupted"]
    if len(stopped):  # Ctrl-C or a signal stopped them: their verdicts say nothing of the code under test
        lines += ["## Interrupted scenarios (Ctrl-C or a signal, in the run or the baseline; not compared)", ""]
        notes = [r["note"][:160] for r in stopped.to_dict(orient="records")]
        lines += [*_scenario_list(list(stopped["scenario"]), notes), ""]
    lines += ["## Environment differences", ""]
    if report.env_diffs:
        lines += [markdown_table(("key", "baseline", "run"), [list(d) for d in report.env_diffs]), ""]
    else:
        lines += ["None.", ""]
    lines += ["## Runs", ""]
    lines += [markdown_table(("", "baseline", "run"), _run_rows(report)), ""]
    lines += ["## Host calibration (env.json, measured at the start of each run)", ""]
    lines += [markdown_table(("", "baseline", "run", "run / baseline"), _calibration_rows(report)), ""]
    lines += ["## How rows are judged", "", *_method(report), ""]
    compared = rows[rows["change"].isin(["regression", "improvement", "changed", "unchanged"])]
    if len(compared):
        lines += ["<details><summary>Every compared scenario</summary>", ""]
        lines += [markdown_table(CHANGE_HEADER, _change_rows(compared)), "", "</details>", ""]
    return "\n".join(lines)

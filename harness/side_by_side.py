"""summary.md's side-by-side tables: a scenario that ran on two engines, a layout that ran in both export
modes (`harness.results.summary_markdown` places them)."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pandas as pd

from harness.markdown import fmt_float, markdown_table
from reference_impl.engine import DEFAULT_ENGINE

_NAN = float("nan")


ENGINE_COMPARISON_NOTE = (
    "Same scenario on each engine (first = sync 0, steady = median of later syncs, seconds; ratio = "
    f"steady time over the {DEFAULT_ENGINE} engine's)."
)


def engine_comparison(df: pd.DataFrame) -> pd.DataFrame:
    """Scenarios that ran on more than one engine, one row each: first/steady seconds and verdict per
    engine, and each engine's steady time as a ratio of the default engine's (`DEFAULT_ENGINE`). Empty
    when no scenario ran on two engines."""
    if not len(df) or df["engine"].nunique() < 2:
        return pd.DataFrame()
    key = ["model", "tp", "ep", "etp", "pp", "colocate", "export_mode"]
    key += ["engines", "engine_tp"]
    engines = sorted(df["engine"].unique(), key=lambda e: (e != DEFAULT_ENGINE, e))
    rows = []
    for values, group in df.groupby(key, sort=False):
        if group["engine"].nunique() < 2:
            continue
        by_engine = {r["engine"]: r for r in group.to_dict(orient="records")}
        base = by_engine.get(DEFAULT_ENGINE, {}).get("steady_s", _NAN)
        row: dict[str, Any] = dict(zip(key, values, strict=True))
        row["colocate"] = "yes" if row["colocate"] else "no"
        for engine in engines:
            r = by_engine.get(engine)
            row[f"{engine} first (s)"] = fmt_float(r["first_s"], 3) if r else "—"
            row[f"{engine} steady (s)"] = fmt_float(r["steady_s"], 3) if r else "—"
            if engine != DEFAULT_ENGINE:
                ratio = r["steady_s"] / base if r and base and not math.isnan(base) else _NAN
                row[f"{engine} / {DEFAULT_ENGINE}"] = fmt_float(ratio, 2)
            row[f"{engine} verdict"] = r["verdict"] if r else "—"
        rows.append(row)
    return pd.DataFrame(rows)


BRIDGE_GOAL = 1.3  # bridge / raw steady time the bridge export should stay within, per layout pair
EXPORT_MODES_NOTE = (
    "Each layout in both export modes (steady seconds, median of the syncs after sync 0); bridge / raw is the "
    "bridge mode's steady time over the raw mode's in this run. The line under the table counts the pairs where "
    f"both passed, against a goal of {BRIDGE_GOAL}. One run's ratios move with the host's load: judge a layout "
    "over several runs."
)


def _after_mode(scenario: str, export_mode: str) -> str:
    """What follows the export mode in a scenario id (`.../raw/chunk-1` -> "chunk-1"), or ""."""
    parts = scenario.split("/")
    return "/".join(parts[parts.index(export_mode) + 1 :]) if export_mode in parts else ""


def export_mode_comparison(df: pd.DataFrame) -> pd.DataFrame:
    """Layouts that ran in both export modes, one row each: the raw scenario's id without its mode, steady
    seconds and verdict per mode, and `bridge / raw` (the ratio of steady seconds, NaN
    where either is NaN). Rows pair on model, TP, EP, ETP, PP, placement, engine, replicas, engine TP and what
    follows the mode in the id (chunk sizes). Empty when no layout ran in both modes."""
    if not len(df):
        return pd.DataFrame()
    data = df[df["export_mode"].isin(["raw", "bridge"])].copy()
    data["after_mode"] = [
        _after_mode(str(sid), m) for sid, m in zip(data["scenario"], data["export_mode"], strict=True)
    ]
    key = ["model", "tp", "ep", "etp", "pp", "colocate", "engine", "engines", "engine_tp", "after_mode"]
    rows = []
    for _, group in data.groupby(key, sort=False):
        by_mode = {r["export_mode"]: r for r in group.to_dict(orient="records")}
        if set(by_mode) != {"raw", "bridge"}:
            continue
        raw, bridge = by_mode["raw"], by_mode["bridge"]
        ratio = bridge["steady_s"] / raw["steady_s"] if raw["steady_s"] else _NAN
        rows.append(
            {
                "layout": "/".join(p for p in str(raw["scenario"]).split("/") if p != "raw"),
                "raw steady (s)": raw["steady_s"],
                "bridge steady (s)": bridge["steady_s"],
                "bridge / raw": ratio,
                "raw verdict": raw["verdict"],
                "bridge verdict": bridge["verdict"],
            }
        )
    return pd.DataFrame(rows)


def export_mode_lines(df: pd.DataFrame) -> list[str]:
    """summary.md's "Bridge against raw" section (`export_mode_comparison`), with a line counting the pairs
    where both modes passed: their median bridge / raw and how many exceed `BRIDGE_GOAL`. None when no
    layout ran in both modes."""
    pairs = export_mode_comparison(df)
    if not len(pairs):
        return []
    rows = [
        [
            r["layout"],
            fmt_float(r["raw steady (s)"], 3),
            fmt_float(r["bridge steady (s)"], 3),
            fmt_float(r["bridge / raw"], 2),
            r["raw verdict"],
            r["bridge verdict"],
        ]
        for r in pairs.to_dict(orient="records")
    ]
    both = pairs[(pairs["raw verdict"] == "PASS") & (pairs["bridge verdict"] == "PASS")]
    passed = both["bridge / raw"].dropna()
    if len(passed):
        plural = "pair" if len(passed) == 1 else "pairs"
        count = (
            f"{len(passed)} {plural} where both passed: median bridge / raw {statistics.median(passed):.2f}, "
            f"{int((passed > BRIDGE_GOAL).sum())} above {BRIDGE_GOAL} (range {passed.min():.2f}-{passed.max():.2f})."
        )
    elif len(both):
        plural = "pair" if len(both) == 1 else "pairs"
        count = f"{len(both)} {plural} where both passed, none with a steady time (one sync)."
    else:
        count = "No pair where both modes passed."
    return [
        "## Bridge against raw",
        "",
        EXPORT_MODES_NOTE,
        "",
        markdown_table(list(pairs.columns), rows),
        "",
        count,
        "",
    ]

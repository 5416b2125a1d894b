"""A time regression must hold in a re-run: `harness run --baseline` runs the scenarios its report flags slower
once more, into the run's `confirm/` folder, and the report judges each of them by its faster attempt.

Why: a row can be slow by the run's own luck on a shared host. Against a baseline of six runs, five fresh-clone
matrices of unchanged code flagged nothing, but the sixth's `qwen3-vl/tp1-pp2/noncolocate/bridge` read about 2x
slower against most baselines of fewer runs, slower in that run alone. A real slowdown is slow in both
attempts, so it stays flagged; the re-run costs only the flagged scenarios' time, and nothing on a clean run.

Only time is re-run: a verdict that regressed is a regression whatever its time. The run's own tables stay
as they ran (summary.csv is the first attempt); `report.md` lists both attempts of every re-run scenario.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from harness.report_measure import MEASURE_EFFICIENCY, finite

CONFIRM_DIR = "confirm"  # the re-run's folder inside the run's
ATTEMPT_COLUMNS = ("scenario", "measure", "first", "rerun", "kept", "rerun_verdict")


def time_regressions(rows: pd.DataFrame) -> list[str]:
    """Scenario ids a report (`harness.report.Report.rows`) flags slower by time while their verdict did not
    regress: what a re-run can confirm or clear."""
    slower = (rows["change"] == "regression") & (rows["time_change"] == "slower")
    return rows.loc[slower & (rows["verdict_change"] != "regressed"), "scenario"].tolist()


def _value(row: Mapping[str, object], measure: str) -> float:
    """How slow one attempt was by `measure` (larger = slower): 1 / efficiency for a row judged by it, else
    steady seconds; NaN where the attempt has none."""
    if measure == MEASURE_EFFICIENCY:
        eff = finite(row.get("efficiency"))
        return 1 / eff if eff else math.nan
    return finite(row.get("steady_s")) or math.nan


def faster_attempts(
    run: pd.DataFrame, rerun: pd.DataFrame, measures: Mapping[str, str]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The run's table with each re-run scenario's row replaced by its re-run's where that was faster by the
    scenario's measure (`measures`: scenario id -> the measure the first report judged it by) or did not meet
    its expectation; and one row per re-run scenario (`ATTEMPT_COLUMNS`: both attempts' values, "first" or
    "rerun" kept, the re-run's verdict). Tables indexed by scenario id, as `harness.report.normalise_table`
    gives.

    A re-run that did not meet its expectation is kept (its verdict then regressed: a wrong result in either
    attempt is a regression); one without a value keeps the first attempt."""
    out = run.copy()
    attempts = []
    for sid, measure in measures.items():
        if sid not in run.index:
            continue
        first = _value(run.loc[sid], measure)
        again = rerun.loc[sid] if sid in rerun.index else None
        failed = again is not None and not bool(again["expect_met"])
        second = _value(again, measure) if again is not None and not failed else math.nan
        # NaN compares False: the first attempt stays. A re-run whose verdict failed is kept: a wrong result in
        # either attempt is a regression of the verdict, whatever the times.
        kept = "rerun" if failed or second < first else "first"
        if kept == "rerun":
            out.loc[sid] = again.reindex(out.columns)
        verdict = str(again["verdict"]) if again is not None else "not re-run"
        attempts.append({"scenario": sid, "measure": measure, "first": first, "rerun": second, "kept": kept,
                         "rerun_verdict": verdict})  # fmt: skip
    return out, pd.DataFrame(attempts, columns=list(ATTEMPT_COLUMNS))


def calm_disagreements(rows: pd.DataFrame, attempts: pd.DataFrame) -> pd.DataFrame:
    """Report rows (`harness.report.COLUMNS`) in which a re-run scenario that now reads faster is "unchanged",
    with a note: only slow rows get a second attempt, so judging by the faster one would turn noise that
    disagrees with itself (2.8x slower at first, then 12x faster) into an improvement."""
    out = rows.copy()
    rerun = set(attempts.loc[attempts["kept"] == "rerun", "scenario"])
    faster = out["scenario"].isin(rerun) & (out["time_change"] == "faster") & (out["change"] == "improvement")
    out.loc[faster, "time_change"] = "within noise"
    out.loc[faster, "change"] = "unchanged"
    out.loc[faster, "note"] = "slower in its first attempt, faster in its re-run: the attempts disagree"
    return out


def confirm_folder(run_dir: Path | str) -> Path | None:
    """The run's re-run folder when it holds a table, else None."""
    folder = Path(run_dir) / CONFIRM_DIR
    return folder if (folder / "summary.csv").is_file() else None

"""Run records -> one pandas table -> summary.csv / summary.parquet / summary.md (env.json: `harness.env`).

One row per record (scenario). Times come from the record's syncs, on the harness's own clock
(`SyncRecord.clocked_s`, never the trainer's timer alone): ``first_s`` is sync 0's wall time (engine starts
from dummy weights), ``steady_s`` the median over the finished syncs >= 1 but the one held mid-session
(`harness.mid_session`: its wall time holds the harness's asks); ``steady_min_s`` and
``steady_max_s`` are the fastest and slowest of those syncs (the run's own noise, which a regression report
compares against), ``steady_reported_s`` the median the trainer's own timer gives (a row where it falls well
short is named in summary.md: `harness.timers`), and each phase column (``gather_s`` ...) the median of that
phase, as the trainer times it, over the same syncs. ``steady_gbps`` is ``bytes_per_sync / steady_s / 1e9``.
``bound_s`` is the same-run bound of the last sync (``bound_gather_s + bound_wire_s``: the bare gathers,
hand-offs and chunk transfers of the same bytes over the same groups, `reference_impl.transport.bound`) and
``bound_max_s`` the same sum of the slowest repeats (the bound's own noise; NaN in records without them), and
``efficiency`` is ``bound_s / steady_s`` (1.0: the reference path costs what its bare collectives cost; NaN
where no bound was measured: vLLM, faults, failed syncs). ``phases_sum_s`` is the median over the same syncs
of the sum of their phases: the sender exports while earlier chunks are on the wire
(`reference_impl.transport.sync`), so ``phases_sum_s - steady_s`` is about the time the overlap saved. The
verdict is re-derived from the record by `harness.checks`.

``summary.md`` holds the table a PR author pastes (Model | TP | EP | PP | colocate | mode | first (s)
| steady (s) | GB/s | efficiency | 200s per route | chunks | verdict), then every row that did not PASS with the
message of the check that decided its verdict and the names of the other failing checks, then every
oracle that could not run (never a verdict of the system under test). ``interrupted`` is True for a
scenario Ctrl-C or a signal stopped (`harness.checks.interrupted`): its verdict reads "CRASH
(interrupted)", and it is listed as interrupted, not as unexpected.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from harness.checks import expectation_met, expected_verdict, first_failure, interrupted, judge

# env.json lives in harness.env; these names stay importable from here.
from harness.env import collect_env as collect_env
from harness.env import finish_env as finish_env
from harness.env import write_env as write_env
from harness.markdown import cell as _cell
from harness.markdown import flag
from harness.markdown import fmt_float as _fmt_float
from harness.markdown import fmt_sci as _fmt_sci
from harness.markdown import markdown_table as markdown_table
from harness.record import PHASES, WALL_PARTS, RunRecord, SyncRecord
from harness.side_by_side import ENGINE_COMPARISON_NOTE, engine_comparison, export_mode_lines
from harness.timers import timer_lines
from reference_impl.engine import DEFAULT_ENGINE
from reference_impl.engine.exception_text import excerpt

PHASE_COLUMNS: tuple[str, ...] = tuple(f"{phase}_s" for phase in PHASES)

COLUMNS: tuple[str, ...] = (
    "scenario",
    "model",
    "tp",
    "ep",
    "etp",
    "pp",
    "colocate",
    "export_mode",
    "engine",
    "engines",
    "engine_tp",
    "tags",
    "syncs",
    "bytes_per_sync",
    "chunks",
    "first_s",
    "steady_s",
    "steady_min_s",
    "steady_max_s",
    "steady_reported_s",
    "steady_gbps",
    "bound_gather_s",
    "bound_wire_s",
    "bound_s",
    "bound_max_s",
    "efficiency",
    "phases_sum_s",
    *PHASE_COLUMNS,
    *WALL_PARTS,
    "logprob_max_abs",
    "logprob_mean_exp_abs",
    "logprob_expected_max_abs",
    "http_200",
    "verdict",
    "expected",
    "expect_met",
    "interrupted",
    "message",
    "also_failing",
    "oracle_notes",
)

MARKDOWN_HEADER: tuple[str, ...] = (
    "Model",
    "engine",
    "TP",
    "EP",
    "PP",
    "colocate",
    "export_mode",
    "first (s)",
    "steady (s)",
    "GB/s",
    "efficiency",
    "200s per route",
    "chunks",
    "logprob max abs diff",
    "logprob mean exp diff",
    "verdict",
)

# Short labels for the engine routes, in the order they are shown.
ROUTE_LABELS: dict[str, str] = {
    "/init_weight_transfer_engine": "init",
    "/start_weight_update": "start",
    "/update_weights": "update",
    "/finish_weight_update": "finish",
    "/weight_checker": "checker",
    "/transfer_probe": "probe",
}

_NAN = float("nan")


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else _NAN


def _steady_syncs(record: RunRecord) -> list[SyncRecord]:
    return [s for s in record.syncs if s.index >= 1 and s.finished and not s.held]


def _route_label(route: str) -> str:
    path = "/" + route.strip().split()[-1].lstrip("/") if route.strip() else route
    return ROUTE_LABELS.get(path, path.lstrip("/"))


def http_200_summary(record: RunRecord) -> str:
    """'start 5/5 · update 40/40 · finish 5/5': 200 answers over calls, per route."""
    totals: dict[str, list[int]] = {}
    for call in record.http:
        counts = totals.setdefault(_route_label(call.route), [0, 0])
        counts[0] += call.status == 200
        counts[1] += 1
    order = list(ROUTE_LABELS.values())
    labels = sorted(totals, key=lambda k: (order.index(k) if k in order else len(order), k))
    return " · ".join(f"{label} {totals[label][0]}/{totals[label][1]}" for label in labels)


def bound_columns(record: RunRecord, steady_s: float) -> dict[str, float]:
    """`bound_gather_s`, `bound_wire_s`, `bound_s` (their sum) from the record's same-run bound
    (`RunRecord.bound`), `bound_max_s` (the sum of the slowest repeats) and `efficiency = bound_s /
    steady_s`; NaN for what was not measured."""
    b = record.bound
    gather = b.gather_s if b is not None else _NAN
    wire = b.wire_s if b is not None and b.wire_s is not None else _NAN
    slowest = b.max_total_s if b is not None else None
    total = gather + wire
    finite = not math.isnan(total) and steady_s and not math.isnan(steady_s)
    return {
        "bound_gather_s": gather,
        "bound_wire_s": wire,
        "bound_s": total,
        "bound_max_s": _NAN if slowest is None else slowest,
        "efficiency": total / steady_s if finite else _NAN,
    }


def record_row(record: RunRecord) -> dict[str, Any]:
    """The summary row of one record (see `COLUMNS`)."""
    sc = record.scenario
    verdict, results = judge(record)
    deciding = first_failure(results, verdict)
    if deciding is None:  # PASS: still show the first failing check, if any
        deciding = next((r for r in results if r.failed), None)

    steady = _steady_syncs(record)
    sync0 = next((s for s in record.syncs if s.index == 0), None)
    first_s = sync0.clocked_s if sync0 is not None and sync0.finished else _NAN
    steady_s = _median([s.clocked_s for s in steady])
    sized = steady or [s for s in record.syncs if s.finished] or record.syncs
    bytes_per_sync = int(statistics.median([s.bytes for s in sized])) if sized else 0
    gbps = bytes_per_sync / steady_s / 1e9 if steady_s and not math.isnan(steady_s) else _NAN
    last = record.syncs[-1] if record.syncs else None
    chunks = (last.chunks_planned or len(last.chunks)) if last is not None else 0

    row: dict[str, Any] = {
        "scenario": record.scenario_id or sc.id,
        "model": sc.model,
        "tp": sc.tp,
        "ep": sc.ep,
        "etp": sc.etp,
        "pp": sc.pp,
        "colocate": sc.colocate,
        "export_mode": sc.export_mode,
        "engine": sc.engine,
        "engines": sc.engines,
        "engine_tp": sc.engine_tp,
        "tags": ",".join(sc.tags),
        "syncs": len(record.syncs),
        "bytes_per_sync": bytes_per_sync,
        "chunks": int(chunks),
        "first_s": first_s,
        "steady_s": steady_s,
        "steady_min_s": min((s.clocked_s for s in steady), default=_NAN),
        "steady_max_s": max((s.clocked_s for s in steady), default=_NAN),
        "steady_reported_s": _median([s.total_s for s in steady]),
        "steady_gbps": gbps,
        **bound_columns(record, steady_s),
    }
    for phase, column in zip(PHASES, PHASE_COLUMNS, strict=True):
        row[column] = _median([s.phases[phase] for s in steady if phase in s.phases])
    row["phases_sum_s"] = _median([sum(s.phases.get(p, 0.0) for p in PHASES) for s in steady])
    for part in WALL_PARTS:
        row[part] = record.wall.get(part, _NAN)
    measured = [s.logprobs for s in record.syncs if s.logprobs]
    row["logprob_max_abs"] = max((m["max_abs"] for m in measured), default=_NAN)
    row["logprob_mean_exp_abs"] = max((m["mean_exp_abs"] for m in measured), default=_NAN)
    over_expected = [s.logprobs_expected for s in record.syncs if s.logprobs_expected]
    row["logprob_expected_max_abs"] = max((m["max_abs"] for m in over_expected), default=_NAN)
    expected = expected_verdict(record)
    row.update(
        http_200=http_200_summary(record),
        verdict=verdict,
        expected=expected,
        expect_met=expectation_met(record, verdict),
        interrupted=interrupted(record),
        message=deciding.message if deciding is not None else "",
        also_failing=",".join(r.name for r in results if r.failed and r is not deciding),
        oracle_notes="; ".join(r.reason for r in results if r.skipped and r.reason.startswith("oracle could not run")),
    )
    return row


def summarize(records: Iterable[RunRecord]) -> pd.DataFrame:
    """One row per record, columns `COLUMNS` (an empty frame with those columns for no records)."""
    rows = [record_row(record) for record in records]
    return pd.DataFrame(rows, columns=list(COLUMNS))


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------


def _verdict_cell(row: Mapping[str, Any]) -> str:
    verdict, expected = str(row.get("verdict", "")), str(row.get("expected", "PASS") or "PASS")
    if flag(row.get("interrupted")):
        return f"{verdict} (interrupted)"
    if expected == "PASS":
        return verdict
    return f"{verdict} (expected)" if verdict == expected else f"{verdict} (expected {expected})"


def _mode_cell(row: Mapping[str, Any]) -> str:
    """The export mode, plus what tells apart rows that share it (`chunk-1`, `fault-...`)."""
    scenario = str(row.get("scenario") or "")
    parts = scenario.split("/")
    if row.get("engine") and row["engine"] != DEFAULT_ENGINE and parts and parts[0] == row["engine"]:
        parts = parts[1:]  # `vllm/qwen3/...`: an engine other than the default leads the id
    return f"{row['export_mode']} · {'/'.join(parts[4:])}" if len(parts) > 4 else str(row["export_mode"])


def _placement_cell(row: Mapping[str, Any]) -> str:
    """Colocate yes / no, plus the engine replicas and the engine's TP when either is not 1 ("no · 2 engines ·
    engine TP 2")."""
    cell = "yes" if row["colocate"] else "no"
    engines, engine_tp = int(row.get("engines") or 1), int(row.get("engine_tp") or 1)
    cell += f" · {engines} engines" if engines != 1 else ""
    return cell + (f" · engine TP {engine_tp}" if engine_tp != 1 else "")


def _ep_cell(row: dict[str, Any]) -> str:
    """EP, and the expert TP where it is not 1 ("2 · ETP 2"): rows that differ only in ETP stay apart."""
    etp = int(row.get("etp") or 1)
    return f"{row['ep']} · ETP {etp}" if etp != 1 else str(row["ep"])


def summary_table_rows(df: pd.DataFrame) -> list[list[str]]:
    """The pasteable table's rows, in `MARKDOWN_HEADER` order."""
    rows = []
    for row in df.to_dict(orient="records"):
        rows.append(
            [
                row["model"],
                row["engine"] or DEFAULT_ENGINE,
                row["tp"],
                _ep_cell(row),
                row["pp"],
                _placement_cell(row),
                _mode_cell(row),
                _fmt_float(row["first_s"], 3),
                _fmt_float(row["steady_s"], 3),
                _fmt_float(row["steady_gbps"], 2),
                _fmt_float(row["efficiency"], 2),
                row["http_200"] or "—",
                row["chunks"],
                _fmt_sci(row["logprob_max_abs"]),
                _fmt_float(row["logprob_mean_exp_abs"], 6),
                _verdict_cell(row),
            ]
        )
    return rows


def _env_line(env: Mapping[str, Any] | str | None) -> str:
    if env is None or isinstance(env, str):
        return env or ""
    parts = [f"python {env.get('python', '?')}"]
    parts += [f"{pkg} {ver}" for pkg, ver in (env.get("packages") or {}).items() if ver]
    devices = env.get("cuda_devices") or []
    parts.append(f"{len(devices)}× {devices[0]}" if devices else "CPU only")
    engine_env = env.get("engine_env") or {}
    if engine_env:
        parts.append("vLLM env: " + ", ".join(f"{pkg} {ver}" for pkg, ver in engine_env.items()))
    if env.get("hostname"):
        parts.append(f"host {env['hostname']}")
    git = env.get("git") or {}
    if git.get("commit"):
        parts.append(f"commit {str(git['commit'])[:10]}" + (" (dirty)" if git.get("dirty") else ""))
    return " · ".join(str(p) for p in parts)


WALL_NOTE = (
    "Each scenario's wall time in parts (seconds): setup (checkpoint, processes, engine start, trainer build, "
    "connect), syncs (syncs and trainer steps), checks (the harness's reads of the engine, probes, log-prob "
    "views, oracles, judging), teardown. The run's totals, then its slowest scenarios."
)


def wall_lines(df: pd.DataFrame, slowest: int = 5) -> list[str]:
    """summary.md's "Where the time went" section (`WALL_PARTS` per scenario); none without the columns."""
    if not len(df) or any(p not in df.columns for p in WALL_PARTS):
        return []
    timed = df.dropna(subset=list(WALL_PARTS))
    if not len(timed):
        return []
    header = ["scenario", *(p.removesuffix("_s") + " (s)" for p in WALL_PARTS), "total (s)"]
    total = timed[list(WALL_PARTS)].sum(axis=1)
    rows = [["all scenarios", *(_fmt_float(timed[p].sum(), 1) for p in WALL_PARTS), _fmt_float(total.sum(), 1)]]
    for i in total.sort_values(ascending=False).index[:slowest]:
        row = timed.loc[i]
        rows.append([row["scenario"], *(_fmt_float(row[p], 1) for p in WALL_PARTS), _fmt_float(total[i], 1)])
    return ["## Where the time went", "", WALL_NOTE, "", markdown_table(header, rows), ""]


def summary_markdown(
    df: pd.DataFrame,
    run_id: str | None = None,
    env: Mapping[str, Any] | str | None = None,
    not_run: Sequence[str] = (),
    interrupted_by: str | None = None,
) -> str:
    """summary.md's text: title, run id and env line, the line `interrupted_by` (a signal's name) gives, the
    pasteable table, then non-PASS rows, then the planned scenarios `not_run` (ids without a record: the run
    ended, or has not yet come, before them)."""
    lines = ["# Weight-sync harness results", ""]
    if run_id:
        lines.append(f"Run `{run_id}`")
    env_text = _env_line(env)
    if env_text:
        lines.append(f"Env: {env_text}")
    if run_id or env_text:
        lines.append("")
    if interrupted_by:
        lines += [f"**Interrupted by {interrupted_by}**: the run ended before its planned end.", ""]
    lines += [markdown_table(MARKDOWN_HEADER, summary_table_rows(df)), ""]
    pairs = engine_comparison(df)
    if len(pairs):
        lines += ["## Engines side by side", "", ENGINE_COMPARISON_NOTE, ""]
        lines += [markdown_table(list(pairs.columns), pairs.astype(str).values.tolist()), ""]
    lines += export_mode_lines(df)
    lines += timer_lines(df)
    lines += wall_lines(df)
    lines += ["## Not passing", ""]
    failing = df[df["verdict"] != "PASS"] if len(df) else df
    if not len(df):
        lines.append("No scenario ran.")
    elif not len(failing):
        lines.append("Every scenario that ran passed." if not_run else "Every scenario passed.")
    for row in failing.to_dict(orient="records"):
        if flag(row.get("interrupted")):
            status = "interrupted by Ctrl-C or a signal: not judged against its expectation"
        else:
            status = "as expected" if row["expect_met"] else f"UNEXPECTED, expected {row['expected']}"
        message = _cell(row["message"]) or "(no message)"
        also = f" (also failing: {', '.join(row['also_failing'].split(','))})" if row.get("also_failing") else ""
        lines.append(f"- `{row['scenario']}`: **{row['verdict']}** ({status}) — {message}{also}")
    unexpected_pass = df[(df["verdict"] == "PASS") & ~df["expect_met"].astype(bool)] if len(df) else df
    for row in unexpected_pass.to_dict(orient="records"):
        lines.append(f"- `{row['scenario']}`: **PASS** (UNEXPECTED, expected {row['expected']})")
    noted = df[df["oracle_notes"].astype(bool)] if len(df) else df
    if len(noted):
        lines += ["", "## Oracles that could not run", ""]
        lines += [f"- `{row['scenario']}`: {_cell(row['oracle_notes'])}" for row in noted.to_dict(orient="records")]
    if not_run:
        planned = len(df) + len(not_run)
        lines += ["", "## Not run", ""]
        lines.append(
            f"{len(not_run)} of {planned} planned scenarios have no record: the run ended (or has not yet come) "
            "before them."
        )
        lines += [f"- `{sid}`" for sid in not_run]
    return "\n".join(lines) + "\n"


def write_summary(
    df: pd.DataFrame,
    out_dir: Path | str,
    run_id: str | None = None,
    env: Mapping[str, Any] | str | None = None,
    not_run: Sequence[str] = (),
    interrupted_by: str | None = None,
) -> dict[str, Path]:
    """Write summary.csv, summary.parquet and summary.md into `out_dir`; return their paths. `not_run`: planned
    scenario ids without a record; `interrupted_by`: the signal that ended the run; both said in summary.md
    (`summary_markdown`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": out / "summary.csv",
        "parquet": out / "summary.parquet",
        "md": out / "summary.md",
    }
    df.to_csv(paths["csv"], index=False)
    df.to_parquet(paths["parquet"], index=False)
    paths["md"].write_text(summary_markdown(df, run_id, env, not_run, interrupted_by))
    return paths


def fault_table(records: Iterable[RunRecord]) -> pd.DataFrame:
    """One row per fault scenario: fault, scenario, expected, got, caught, interrupted (Ctrl-C or a signal stopped
    it: never caught, `harness.checks.interrupted`), and the deciding message."""
    rows = []
    for rec in records:
        verdict, results = judge(rec)
        failure = first_failure(results, verdict)
        rows.append(
            {
                "fault": rec.scenario.fault,
                "scenario": rec.scenario_id,
                "expected": expected_verdict(rec),
                "got": verdict,
                "caught": expectation_met(rec, verdict),
                "interrupted": interrupted(rec),
                "message": failure.message if failure else "",
            }
        )
    return pd.DataFrame(rows, columns=["fault", "scenario", "expected", "got", "caught", "interrupted", "message"])


def write_fault_table(
    records: Sequence[RunRecord], out_dir: Path | str, planned: Sequence[str] = ()
) -> dict[str, Path]:
    """Write faults.csv and faults.md (the table of injected faults and what the harness said). `planned`: the
    fault scenario ids the run meant to run; faults.md lists those without a record as not run."""
    out = Path(out_dir)
    df = fault_table(records)
    paths = {"csv": out / "faults.csv", "md": out / "faults.md"}
    df.to_csv(paths["csv"], index=False)
    rows = [
        [
            r["fault"],
            f"`{r['scenario']}`",
            r["expected"],
            r["got"],
            "yes" if r["caught"] else "interrupted" if r["interrupted"] else "**NO**",
            excerpt(str(r["message"] or ""), 160),  # faults.csv keeps the whole message
        ]
        for r in df.to_dict(orient="records")
    ]
    caught = int(df["caught"].sum()) if len(df) else 0
    stopped = int(df["interrupted"].map(flag).sum()) if len(df) else 0
    ran = set(df["scenario"])
    not_run = [sid for sid in planned if sid not in ran]
    judged_of = f"{len(df) - stopped} judged, {stopped} interrupted" if stopped else ""
    text = (
        f"# Fault injections\n\n{caught} of {len(df)} faults caught with their expected verdict"
        + (f" ({judged_of}).\n\n" if judged_of else ".\n\n")
        + markdown_table(["fault", "scenario", "expected", "got", "caught", "message"], rows)
    )
    if not_run:
        text += f"\n\n{len(not_run)} of {len(planned)} planned faults did not run (the run ended before them):\n\n"
        text += "\n".join(f"- `{sid}`" for sid in not_run)
    paths["md"].write_text(text + "\n")
    return paths

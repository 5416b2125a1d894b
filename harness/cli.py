"""`python -m harness ...`: run a scenario matrix and write its results.

    python -m harness run --matrix cpu [--filter EXPR] [--results-dir DIR] [--run-id ID] [--ray-address ADDR]
                          [--baseline DIR [--no-confirm]]
    python -m harness list (--matrix cpu | --faults) [--filter EXPR]
    python -m harness faults [--filter EXPR] [--results-dir DIR] [--run-id ID] [--ray-address ADDR]
    python -m harness report --run results/<run-id> --baseline results/baselines/cpu [--threshold 1.25]
    python -m harness baseline --add results/<run-id>... --to results/baselines/cpu
    python -m harness soak [--scenario ID]... [--syncs N] [--matrix cpu] [--results-dir DIR] [--run-id ID]
                           [--ray-address ADDR]

`run` exits 0 when every scenario's verdict is the one it expects (PASS unless it says `expect:`),
1 otherwise, 2 on bad arguments; with `--baseline DIR` it also writes the regression report at the end
and exits 1 when that finds a regression; the scenarios it flags slower run once more first, and only a
slowdown both attempts show is flagged (`harness.confirm`). `report` (`harness.report`) exits 1 on a
regression. `baseline` copies runs' tables into a baseline of several runs (`harness.baseline`), which a
report reads as their per-scenario medians.
`faults` runs every registered fault injection (`harness/faults/`)
and writes `faults.md` / `faults.csv` (fault, scenario, expected, got, caught); it exits 0 when every
fault was caught with its expected verdict. An interrupted command exits 143 after SIGTERM and ends by
SIGINT (130 in a shell) after Ctrl-C or SIGINT, once every process it started is stopped. `soak` runs
scenarios for many syncs and judges the growth of their processes' resources (`harness.soak`). Every
command samples resources after each sync (`harness.soak.sample_resources`); runs of fewer than 10 syncs
are too short for that check to judge.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from harness import interrupts
from harness.checks import expectation_met
from harness.record import RunRecord
from harness.run_args import ray_address_problem, results_folder
from harness.scenario import Scenario, expand, load_matrix, select
from harness.soak import add_arguments as add_soak_arguments
from harness.soak import cmd_soak, sample_resources
from harness.validate import validate

if TYPE_CHECKING:
    from harness.runner import SyncHook

REPO_ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m harness", description="Weight-sync harness")
    sub = ap.add_subparsers(dest="cmd", required=True)
    helps = {
        "run": "run the selected scenarios of a matrix: records, summary.md, plots (exit 1 on an unexpected verdict)",
        "list": "print the selected scenario ids (of a matrix, or the fault scenarios) and whether each validates",
        "faults": "run every registered fault injection (or those --filter selects): faults.md, faults.csv",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        if name != "faults":  # `faults` takes no matrix; an empty group would make argparse's --help raise
            scenarios_from = p.add_mutually_exclusive_group()  # list's --matrix or --faults: argparse refuses both
            if name == "list":
                scenarios_from.add_argument(
                    "--faults",
                    action="store_true",
                    help="list the fault scenarios (`faults` runs them) instead of a matrix",
                )
            scenarios_from.add_argument(
                "--matrix", default="cpu", help="matrix name under scenarios/ or a YAML path (default: cpu)"
            )
        p.add_argument(
            "--filter",
            action="append",  # given twice, both hold (argparse's default kept the last alone, in silence)
            default=None,
            help="space-separated terms, all must hold: key=value, tag:NAME, !tag:NAME, or an id regex; "
            "given more than once, the terms of all",
        )
    soak = sub.add_parser("soak", help="one scenario for many syncs; resource growth per 100 syncs")
    add_soak_arguments(soak)
    for name in ("run", "faults", "soak"):
        p = sub.choices[name]
        p.add_argument(
            "--results-dir",
            type=Path,
            default=REPO_ROOT / "results",
            help="where the run's folder is made (default: results/ of this repository)",
        )
        p.add_argument("--run-id", default=None, help="folder name under --results-dir (default: a timestamp)")
        p.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")
    sub.choices["run"].add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a run's folder, or a folder of runs (runs/<run-id>/), to compare with at the end (report.md)",
    )
    sub.choices["run"].add_argument(
        "--no-confirm",
        dest="confirm",
        action="store_false",
        help="with --baseline: do not re-run the scenarios the report flags slower (default: re-run them once, "
        "and flag only a slowdown both attempts show)",
    )
    rep = sub.add_parser("report", help="compare a run with a baseline: report.md, report.csv, plots/regression.png")
    rep.add_argument("--run", type=Path, required=True, help="the run's folder, results/<run-id>")
    rep.add_argument("--baseline", type=Path, required=True, help="the baseline's folder, e.g. results/baselines/cpu")
    rep.add_argument("--threshold", type=float, default=1.25, help="the smallest time ratio ever flagged (1.25)")
    base = sub.add_parser("baseline", help="add runs to a baseline of several runs (results/baselines/<name>/runs/)")
    base.add_argument("--add", type=Path, nargs="+", required=True, help="run folders, results/<run-id>")
    base.add_argument("--to", type=Path, required=True, help="the baseline's folder, e.g. results/baselines/cpu")
    return ap


def cmd_list(args: argparse.Namespace) -> int:
    """Print the selected scenario ids (of `--matrix`, or with `--faults` the fault scenarios) and whether each
    validates; exit 1 when the filter selects none."""
    scenarios = select(_fault_scenarios() if args.faults else load_matrix(args.matrix), args.filter)
    if not scenarios:
        what = "fault scenario" if args.faults else f"scenario of matrix {args.matrix!r}"
        print(f"no {what} matches filter {args.filter!r}", file=sys.stderr)
        return 1
    for sc in scenarios:
        problem = validate(sc)
        print(f"{sc.id:60s} {'OK' if problem is None else 'CONFIG_ERROR: ' + problem}")
    return 0


def run_scenarios(
    scenarios: list[Scenario],
    results_dir: Path,
    run_id: str | None,
    ray_address: str | None,
    after_each: Callable[[list[RunRecord], Path], None] | None = None,
    after_sync: SyncHook | None = sample_resources,
    fresh_processes: bool = False,
) -> tuple[list[RunRecord], Path]:
    """Run `scenarios` in order into `results_dir/<run_id>/` (`harness.matrix_run.MatrixRun`); records,
    summaries and plots are written as each scenario ends (and `after_each(records, out)` is called); the
    runner calls `after_sync` after every sync (default: resource samples into the record); with
    `fresh_processes` no scenario's ranks or engines serve the next one. Every process started is stopped on
    the way out, Ctrl-C included."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from harness.matrix_run import MatrixRun, failure_message
    from harness.placement import order_for_reuse

    problem = ray_address_problem(ray_address) if ray_address else None  # before anything starts
    if problem:
        raise ValueError(problem)
    run_id = results_folder(results_dir, run_id, claim=True)  # made here: two runs never share one
    console = Console(stderr=True)
    run = MatrixRun(
        scenarios,
        results_dir,
        run_id,
        ray_address,
        after_each=after_each,
        after_sync=after_sync,
        fresh_processes=fresh_processes,
    )
    t0 = time.perf_counter()
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            task = progress.add_task("starting", total=len(scenarios))
            problems = {sc.id: validate(sc) for sc in scenarios}  # once per scenario, before anything starts
            for sc in order_for_reuse(scenarios):
                interrupts.raise_if_signalled()
                progress.update(task, description=sc.id)
                rec = run.run(sc, problems[sc.id], validated=True)
                met = expectation_met(rec, rec.verdict)
                progress.console.print(f"[{'green' if met else 'red'}]{rec.verdict:14s}[/] {rec.scenario_id}")
                why = None if met else failure_message(rec)
                if why:  # what to change, or the first failing check: also in summary.md and the record
                    progress.console.print(f"               {why[:400]}", markup=False, highlight=False, soft_wrap=True)
                progress.advance(task)
            interrupts.raise_if_signalled()
    finally:
        run.close()
    wall = time.perf_counter() - t0
    records, out = run.records, run.out
    bad = [r for r in records if not expectation_met(r, r.verdict)]
    scenarios_run = f"{len(records)} scenario{'' if len(records) == 1 else 's'}"
    console.print(f"{scenarios_run} in {wall:.0f} s, {len(bad)} unexpected; results in {out}")
    console.print(f"summary: {out / 'summary.md'}")
    return records, out


def cmd_run(args: argparse.Namespace) -> int:
    """Run the selected scenarios of a matrix."""
    scenarios = select(load_matrix(args.matrix), args.filter)
    if not scenarios:
        print(f"error: no scenario of matrix {args.matrix!r} matches filter {args.filter!r}", file=sys.stderr)
        return 2
    if args.baseline is not None:  # read now, not after the run: a folder that is no run's is refused up front
        from harness.report import load_baseline

        load_baseline(args.baseline)
    records, out = run_scenarios(scenarios, args.results_dir, args.run_id, args.ray_address)
    status = 0 if records and all(expectation_met(r, r.verdict) for r in records) else 1
    if args.baseline is not None:
        report_status = _report(out, args.baseline)
        if report_status and args.confirm:
            report_status = _confirm(scenarios, out, args) or report_status
        status = max(status, report_status)
    return status


def _confirm(scenarios: list[Scenario], out: Path, args: argparse.Namespace) -> int | None:
    """Run the scenarios the report flagged slower by time once more, into `out`/confirm/, and report again
    (`harness.confirm`: each judged by its faster attempt). Returns the new report's exit status, or None when
    no scenario was flagged by time alone (a verdict regression stands as it is)."""
    import pandas as pd

    from harness.confirm import CONFIRM_DIR, time_regressions

    flagged = set(time_regressions(pd.read_csv(out / "report.csv")))
    again = [sc for sc in scenarios if sc.id in flagged]
    if not again:
        return None
    print(f"re-running {len(again)} scenario(s) the report flagged slower, to confirm: {', '.join(sorted(flagged))}")
    run_scenarios(again, out, CONFIRM_DIR, args.ray_address)
    return _report(out, args.baseline)


def _report(run_dir: Path, baseline: Path) -> int:
    from harness.report import write_report

    status, md = write_report(run_dir, baseline)
    print(f"report: {md} ({'regressions found' if status else 'no regression'})")
    return status


def cmd_report(args: argparse.Namespace) -> int:
    """Compare a run's tables with a baseline's; write report.md / report.csv / plots/regression.png."""
    from harness.report import write_report

    if not 1 < args.threshold < float("inf"):
        print(
            f"error: --threshold {args.threshold} flags every row or none: pass a ratio above 1 (1.25)", file=sys.stderr
        )
        return 2
    status, md = write_report(args.run, args.baseline, args.threshold)
    print(md.read_text())
    return status


def cmd_baseline(args: argparse.Namespace) -> int:
    """Copy each `--add` run's tables into `--to`/runs/<run-id>/ (`harness.baseline.add_runs`: all are checked
    before any is copied), then print what the baseline now combines."""
    from harness.baseline import add_runs
    from harness.report import load_baseline

    for target in add_runs(args.add, args.to):
        print(f"added {target}")
    combined = load_baseline(args.to)
    runs = int(combined.env.get("runs", 1))
    print(f"{args.to}: {runs} run{'' if runs == 1 else 's'}, {len(combined.table)} scenarios (per-scenario medians)")
    if runs < 5:
        print(f"note: {runs} run{'' if runs == 1 else 's'}; keep five or more (README, 'A baseline of several runs')")
    return 0


def _fault_scenarios() -> list[Scenario]:
    """Every registered fault's scenarios (`harness.faults.fault_scenarios`, expanded)."""
    from harness.faults import fault_scenarios

    return [s for e in fault_scenarios() for s in expand(e)]


def cmd_faults(args: argparse.Namespace) -> int:
    """Run every registered fault's scenario and write the fault table (faults.md / faults.csv)."""
    from harness.results import write_fault_table

    scenarios = select(_fault_scenarios(), args.filter)
    if not scenarios:
        print(f"error: no fault scenario matches filter {args.filter!r}", file=sys.stderr)
        return 2
    planned = [sc.id for sc in scenarios]
    write_table = functools.partial(write_fault_table, planned=planned)  # lists faults not run, if interrupted
    records, out = run_scenarios(scenarios, args.results_dir, args.run_id, args.ray_address, write_table)
    write_table(records, out)
    print(f"fault table: {out / 'faults.md'}")
    return 0 if records and all(expectation_met(r, r.verdict) for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m harness`. SIGTERM ends a run like Ctrl-C: every process it started is
    stopped on the way out, also where Python drops the KeyboardInterrupt (`harness.interrupts`). SIGINT
    stays ignored where this process started with it ignored (a shell's background job), as Python leaves it.
    Exit status after an interrupt: 143 for SIGTERM (`interrupts.exit_status`); Ctrl-C or SIGINT ends the
    process by SIGINT (130 in a shell), Python's exit after the KeyboardInterrupt it raises again."""
    interrupts.install()
    args = _parser().parse_args(argv)
    if getattr(args, "filter", None) is not None:
        args.filter = " ".join(args.filter)
    try:
        commands = {
            "run": cmd_run,
            "list": cmd_list,
            "faults": cmd_faults,
            "report": cmd_report,
            "soak": cmd_soak,
            "baseline": cmd_baseline,
        }
        return commands[args.cmd](args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `list | head`: the reader is gone; end quietly as a process SIGPIPE ends would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would raise again
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        status = interrupts.exit_status()
        if status is None:
            raise  # `print_interrupt` prints its line; Python's exit ends the process by SIGINT
        print(f"interrupted by {interrupts.ended_by()}", file=sys.stderr)
        return status


def print_interrupt(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """`python -m harness`'s `sys.excepthook`: one line for the KeyboardInterrupt that ends an interrupted run
    (where the interrupted scenario was is in its record), instead of a traceback through the run's cleanup;
    any other exception as Python prints it. Python still ends the process by SIGINT after it."""
    if issubclass(kind, KeyboardInterrupt):
        print(f"interrupted by {interrupts.ended_by()}", file=sys.stderr)
        return
    sys.__excepthook__(kind, value, tb)


if __name__ == "__main__":
    sys.exit(main())

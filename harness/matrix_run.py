"""One run of scenarios into `results/<run-id>/`, the same for `python -m harness run` and for
`pytest scenarios --matrix NAME` (the repository's conftest.py).

A `MatrixRun` writes env.json at the start (versions, commit, command line, the host calibration),
runs scenarios one at a time on one `harness.runner.Runner` (Ray and trainer pools started on the first
scenario that validates, reused after), rewrites records and summary.csv/.parquet/.md as each scenario
ends and the plots at most once every `PLOTS_EVERY_S` seconds (and at the end), compares a scenario
group's members once the last of them ran, and on `close` stops every process it started and adds the
run's end to env.json.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from harness import interrupts
from harness.checks import interrupted
from harness.record import RunRecord
from harness.scenario import Scenario
from harness.validate import validate

# The plots of a run (`harness.plots`) take 0.4-1.2 s per write on a 2-core host: rewritten after every
# scenario they cost about a minute of a 79-scenario matrix. Records and summaries still go out at once.
PLOTS_EVERY_S = 60.0

if TYPE_CHECKING:
    import pandas as pd

    from harness.runner import SyncHook


class MatrixRun:
    """Scenarios run one by one into `results_dir/run_id` (default run id: a timestamp).

    `order` is the scenarios' ids in the order the tables list them (the matrix order); `after_each`
    is called with every record so far and the folder after each scenario's outputs are written;
    `after_sync` is the runner's hook after every sync (default: `harness.soak.sample_resources`). With
    `fresh_processes`, every scenario's trainer ranks and engines start anew and end with it (no reuse), so
    what a scenario's processes grow by is its own: the soak's resource samples.
    """

    def __init__(
        self,
        order: Sequence[Scenario],
        results_dir: Path,
        run_id: str | None = None,
        ray_address: str | None = None,
        after_each: Callable[[list[RunRecord], Path], None] | None = None,
        argv: Sequence[str] | None = None,
        after_sync: SyncHook | None = None,
        fresh_processes: bool = False,
    ) -> None:
        import ray

        from harness.driver_ray import descendants
        from harness.env import write_env

        self.before = {p.pid for p in descendants()}  # what ran before: never stopped by `close`
        # A Ray already up in this process belongs to whoever started it (another run, a test session's runner):
        # `close` leaves it and its engine servers' temp root alone.
        self.owns_ray = not ray.is_initialized()
        if after_sync is None:  # every driver samples resources after each sync (RESOURCE_LEAK's record)
            from harness.soak import sample_resources

            after_sync = sample_resources
        self.after_sync = after_sync
        self.fresh_processes = fresh_processes

        self.order = [sc.id for sc in order]
        self.run_id = run_id or time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(results_dir) / self.run_id
        self.out.mkdir(parents=True, exist_ok=True)
        self.ray_address = ray_address
        self.after_each = after_each
        self.records: list[RunRecord] = []
        self.pending = Counter(sc.group_key for sc in order if sc.group_key)
        self.finished_groups: dict[str, list[RunRecord]] = {}  # group key -> members, judged together
        self.runner = None
        self.closed = False
        self._plotted_at: float | None = None  # time.monotonic() of the last plots written
        try:
            self.env = write_env(self.out, calibrate=True, argv=argv)
        except KeyboardInterrupt:  # the host calibration fills the run's first seconds, before anything to close
            with interrupts.held():  # the run's folder still gets its env.json and tables, every scenario not run
                self.env = write_env(self.out, calibrate=False, argv=argv)
                self.write_tables()
            raise

    def run(self, sc: Scenario, config_error: str | None = None, validated: bool = False) -> RunRecord:
        """Run one scenario and return its record (as judged after its group, when it closed one). Unless
        `validated` (the caller ran `harness.validate.validate` and passes its answer as `config_error`),
        the scenario is validated here first."""
        from harness.driver_ray import ensure_ray
        from harness.runner import Runner

        if not validated:
            config_error = validate(sc)
        if config_error is None:
            ensure_ray(self.ray_address)
        if self.runner is None:
            self.runner = Runner(
                out_dir=self.out, run_id=self.run_id, on_record=self._on_record, after_sync=self.after_sync
            )
        self.runner.run_scenario(sc, config_error, validated=True)
        if self.fresh_processes:  # the next scenario's ranks and engines start anew (the fork servers stay)
            self.runner.close(fork_servers=False)
        return next(r for r in reversed(self.records) if r.scenario_id == sc.id)

    def _on_record(self, rec: RunRecord) -> None:
        self.records.append(rec)
        key = rec.scenario.group_key
        # an interrupted member (`checks.interrupted`) ran fewer syncs than the others; comparing it would re-judge
        # them; its group stays open and its members keep their own verdicts
        if key and self.runner is not None and not interrupted(rec):
            self.pending[key] -= 1
            if self.pending[key] == 0:  # the whole group has run: compare its members
                members = [r for r in self.records if r.scenario.group_key == key]
                updated = {r.scenario_id: r for r in self.runner.finish_group(members)}
                self.records[:] = [updated.get(r.scenario_id, r) for r in self.records]
                self.finished_groups[key] = list(updated.values())
        self.write_outputs()
        if self.after_each is not None:
            self.after_each(self.records, self.out)

    def write_outputs(self, plots: bool | None = None) -> None:
        """summary.csv / .parquet / .md (rows in matrix order) of the records so far, then their plots when
        `plots`; by default when none were written yet or the last were `PLOTS_EVERY_S` seconds ago."""
        df = self.write_tables()
        now = time.monotonic()
        if plots is None:
            plots = self._plotted_at is None or now - self._plotted_at >= PLOTS_EVERY_S
        if plots:
            self.write_plots(df)
            self._plotted_at = now

    def write_tables(self) -> pd.DataFrame:
        """summary.csv / .parquet / .md of the records so far, rows in matrix order, the planned scenarios
        without a record listed as not run, and the signal that ended the run, once one came (a run interrupted
        in its start or its close has no interrupted scenario to say so); returns the summary."""
        from harness.results import summarize, write_summary

        rank = {sid: i for i, sid in enumerate(self.order)}
        df = summarize(sorted(self.records, key=lambda r: rank.get(r.scenario_id, len(rank))))
        recorded = {r.scenario_id for r in self.records}
        not_run = [sid for sid in self.order if sid not in recorded]
        write_summary(df, self.out, self.run_id, self.env, not_run, interrupts.last_signal())
        return df

    def write_plots(self, df: pd.DataFrame) -> None:
        """plots/ of the summary `df`. matplotlib is imported here, after the tables are written: an interrupt
        in the middle of its import leaves it half-imported, and no later import of it works in this process."""
        from harness.plots import write_run_plots

        write_run_plots(df, self.out / "plots")

    def close(self) -> None:
        """Stop every process the run started (engines and trainer pools, Ray unless it was up before the run, then
        the fork servers, whose children are Ray workers that end with Ray, then whatever an interrupt in the middle
        of ray.init or a launch left running: `harness.driver_ray.end_leftovers`), unlink the colocate segments
        those processes made and left (`harness.shm.left_by`: a pool's kill cut short by a second signal left its
        sender's), remove its engine servers' temp folders (`remove_server_temp_root`, again only when the run
        started Ray: the folder is the process's, and the live servers of another run may still use it), write the
        run's end into env.json (`harness.env.finish_env`), then the tables, `after_each`'s outputs and the plots
        of every record (an interrupt may have cut the last writes short). A signal meanwhile is held until all
        that has ended, then raised (`harness.interrupts.held`); a second one raises at once, cutting short the
        step it lands in, and every later step still runs (before, a second Ctrl-C during the close skipped the
        tables, so `summary.md` did not say the run was interrupted, and left a segment in /dev/shm: 6 of 12
        tries). The first error a step raised is raised once all have run. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        with interrupts.held():
            self._close()

    def _close(self) -> None:
        from harness import shm
        from harness.driver_ray import descendants, end_leftovers, remove_server_temp_root, shutdown_ray
        from harness.env import finish_env

        started = [p for p in descendants() if p.pid not in self.before]  # before their parents end
        runner = self.runner

        def tables_and_outputs() -> None:
            # an interrupt may have cut the last writes short: the tables first (also with no record yet: the
            # scenarios not run are listed, and a report finds the run's summary.csv), then the plots
            df = self.write_tables()
            if self.records:
                if self.after_each is not None:  # e.g. faults.md, the soak's table
                    self.after_each(self.records, self.out)
                self.write_plots(df)

        steps: list[Callable[[], object]] = [
            lambda: runner.close(fork_servers=False) if runner is not None else None,
            shutdown_ray if self.owns_ray else lambda: None,
            # the rank fork server waits for its children, Ray workers: with Ray down, idle ones end too
            lambda: runner.forks.stop() if runner is not None else None,
            lambda: end_leftovers(started),
            # what a rank ended before its pool's kill unlinked them left: all of the run's processes are gone now
            lambda: shm.unlink(shm.left_by(p.pid for p in started)),
            # what a server ended by a signal left in its temp folder; the root is the process's, kept while its Ray is
            remove_server_temp_root if self.owns_ray else lambda: None,
            lambda: setattr(self, "env", finish_env(self.out)),
            tables_and_outputs,
        ]
        first: BaseException | None = None
        for step in steps:  # a second signal cuts short the step it lands in; the later steps still run
            try:
                step()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def report(self, baseline: Path) -> tuple[int, Path]:
        """Compare this run with `baseline` (`harness.report.write_report`): (exit status, report.md)."""
        from harness.report import write_report

        return write_report(self.out, baseline)


def failure_message(record: RunRecord, group: Sequence[RunRecord] = ()) -> str | None:
    """Why a scenario test fails, or None: the verdict and the first failing check's message when the
    verdict is not the expected one (`harness.checks.expectation_met`, `first_failure`); else, when
    the scenario closed a group (`group`: its members as judged together), the members whose verdict
    the group comparison made unexpected."""
    from harness.checks import expectation_met, expected_verdict, first_failure, judge

    verdict, results = judge(record)
    if not expectation_met(record, verdict):
        deciding = first_failure(results, verdict)
        expected = expected_verdict(record)
        if deciding is not None:
            return f"{verdict} (expected {expected}): {deciding.name}: {deciding.message}"
        note = f" saying {record.scenario.expect_note!r}" if record.scenario.expect_note else ""
        return f"{verdict}, expected {expected}{note}"
    others = [m for m in group if m.scenario_id != record.scenario_id and not expectation_met(m, m.verdict)]
    if others:
        listed = "; ".join(f"{m.scenario_id}: {failure_message(m)}" for m in others)
        return f"group {record.scenario.group_key!r} compared after this scenario: {listed}"
    return None

"""The regression report's noise model (`harness.report`) on real tables: what it flags on unchanged code and
what it catches, both measured, not assumed.

`tests/data/report_runs/` holds the columns the report reads of six CPU-matrix runs on 2-core hosts of one
kind (`summary.csv`, `env.json`): ``baseline``, the committed CPU baseline of c22dbc8; ``run_a`` to ``run_d``,
four fresh-clone matrices of code whose sync path is the baseline's (hosts whose bounds moved bytes about
1.9x faster than the baseline's while their syncs ran about 1.6x faster; ``run_d`` ran after the rules were
set); the report of the code before these rules flagged 2, 0, 2 and 0 of their rows slower. ``run_paced``,
the 15 TP 1 PP 1 rows of a run with a 15 ms sleep added after every answered chunk in the sender's send
thread (`reference_impl/transport/sync.py`), every row still PASS.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from harness.report import RunTables, compare, load_baseline, load_run, sensitivity
from harness.report_md import report_markdown
from harness.report_measure import MEASURE_EFFICIENCY

RUNS = Path(__file__).parent / "data" / "report_runs"
UNCHANGED = ("run_a", "run_b", "run_c", "run_d")  # fresh-clone matrices of the baseline's sync path


@pytest.fixture(scope="module")
def baseline() -> RunTables:
    return load_baseline(RUNS / "baseline")


def slowed(run: RunTables, scenario: str, factor: float) -> RunTables:
    """`run` with one row's steady seconds (median, fastest, slowest) `factor` times longer, and its
    efficiency `factor` times lower: what a change that slowed that scenario's syncs alone would write."""
    out = copy.deepcopy(run)
    table = out.table
    for col in ("steady_s", "steady_min_s", "steady_max_s"):
        table.at[scenario, col] *= factor
    table.at[scenario, "efficiency"] /= factor  # NaN stays NaN (a row without a bound)
    return out


@pytest.mark.parametrize("name", UNCHANGED)
def test_unchanged_code_on_a_faster_host_is_no_regression(baseline: RunTables, name: str) -> None:
    """No row flagged slower; one flagged faster in run_a: two engine replicas, 0.117 s a sync in the baseline and
    0.045 s in the run, 0.61x over the host speed the other rows' bounds give. run_c's full-size colocated
    bridge row (its 1.19 GB memcpy bound moved 0.71x while the colocated rows' median moved 0.47x, as the
    full-size bounds did in every run) was a regression of 1.92x by that host speed; by its own efficiency it
    is 1.28x."""
    rows = compare(load_run(RUNS / name), baseline).rows
    assert len(rows) == 90 and not (rows["change"] == "regression").any(), rows[rows["change"] == "regression"]
    assert (rows["change"] == "improvement").sum() <= 1
    full = rows.set_index("scenario").loc["qwen3-0.6b/tp2-pp1/colocate/bridge"]
    assert full["measure"] == MEASURE_EFFICIENCY, (full["measure"], full["note"])


def test_one_row_twice_as_slow_is_flagged_in_most_rows(baseline: RunTables) -> None:
    """Each of the 90 rows in turn made 2x slower, the others as they ran: how many of those rows the report
    flags. Measured 60, 63, 67 and 43 of 90 (233; run_d was not among the runs the rules were worked out on);
    36, 35, 41 and 36 (148) with the rules before (a row whose bound was at least 2 % of its sync, not 10 %,
    was judged by efficiency, whose small bounds scatter 3.2-3.7x between runs against 1.8x by the host speed
    the other rows' bounds give). What each report says it could catch, from its own bands, is within
    [-5, +20] rows of that (measured -1, +1, +16, +4)."""
    counts = {}
    for name in UNCHANGED:
        run = load_run(RUNS / name)
        flagged = [
            sid
            for sid in run.table.index
            if compare(slowed(run, sid, 2.0), baseline).rows.set_index("scenario").at[sid, "change"] == "regression"
        ]
        report = compare(run, baseline)
        stated = sensitivity(report.rows)[2.0]
        assert stated - 5 <= len(flagged) <= stated + 20, (name, stated, len(flagged))
        md = report_markdown(report)
        assert "of its 90 timed rows" in md and f", 2x in {stated}, " in md
        counts[name] = len(flagged)
    assert sum(counts.values()) >= 200 and min(counts.values()) >= 40, counts


def test_a_real_per_chunk_delay_is_flagged(baseline: RunTables) -> None:
    """15 ms after every chunk made the 15 small rows 1.0-2.6x slower in seconds on a host about 2x faster than
    the baseline's; the one whose seconds did not move (two engine replicas, 5 chunks) is the one not flagged."""
    rows = compare(load_run(RUNS / "run_paced"), baseline).rows.set_index("scenario")
    ran = rows[rows["change"] != "missing"]
    assert len(ran) == 15 and (ran["run_verdict"] == "PASS").all()
    regressions = set(ran.index[ran["change"] == "regression"])
    assert len(regressions) >= 13, sorted(set(ran.index) - regressions)
    assert "qwen3-vl/tp1-pp1/noncolocate/raw" in regressions  # 2.03x in seconds: missed by efficiency at 2 %

"""summary.md's "Trainer timers" section: rows whose trainer-side sync timer leaves out part of the sync.

The summary's first and steady times are the harness's own clock (`harness.record.SyncRecord.clocked_s`: the
ranks' sync call from handing it out to the last report, less the hold-up of hashing what was sent). The
trainer also times each sync (`SyncReport.total_s`, its phases beside it), and the summary keeps that median
as ``steady_reported_s``. The two differ by the cost of the call itself: 3-14 ms per sync on this
repository's 2-core CPU host, from 20 ms to 1.2 s syncs (Ray's dispatch and the reports' return). A timer
that starts after the export, or stops before the finish, makes the trainer's time much shorter than the
harness's; its phase times then leave the same part out. Such a row is named here, with both times.
"""

from __future__ import annotations

import math

import pandas as pd

from harness.markdown import fmt_float

# The trainer's steady time may fall short of the harness's by the call's own cost: at most this many seconds
# or this share of the harness's time, whichever is larger, before a row is named.
TIMER_SLACK_S = 0.03
TIMER_SHARE = 0.25

TIMERS_NOTE = (
    "Steady times in this summary are the harness's own clock. The trainer's timer of these rows leaves out "
    f"more than {TIMER_SHARE:.0%} (and more than {TIMER_SLACK_S * 1000:.0f} ms) of that time, so the trainer's "
    "phase times leave the same part out: check where its sync timer starts and stops."
)


def timer_short(steady_s: float, steady_reported_s: float) -> bool:
    """Whether the trainer's steady seconds fall short of the harness's by more than `TIMER_SLACK_S` and
    `TIMER_SHARE` of the harness's (False where either is NaN)."""
    if math.isnan(steady_s) or math.isnan(steady_reported_s):
        return False
    return steady_s - steady_reported_s > max(TIMER_SLACK_S, TIMER_SHARE * steady_s)


def timer_lines(df: pd.DataFrame) -> list[str]:
    """The "Trainer timers" section of summary.md: one line per row whose trainer timer is short
    (`timer_short`), with both steady times in seconds; none when no row is."""
    if not len(df) or "steady_reported_s" not in df:
        return []
    short = [
        r for r in df.to_dict(orient="records") if timer_short(float(r["steady_s"]), float(r["steady_reported_s"]))
    ]
    if not short:
        return []
    lines = ["## Trainer timers that leave part of the sync out", "", TIMERS_NOTE, ""]
    lines += [
        f"- `{r['scenario']}`: steady {fmt_float(r['steady_s'], 3)} s on the harness's clock, "
        f"{fmt_float(r['steady_reported_s'], 3)} s on the trainer's"
        for r in short
    ]
    return [*lines, ""]

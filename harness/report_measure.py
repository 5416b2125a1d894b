"""What a regression report compares for one scenario, and the noise it allows (`harness.report`'s module
doc has the rules): 1 / efficiency; else steady seconds over the host speed the other rows' same-run bounds
give; else steady seconds x the start-of-run calibration; else raw seconds over the rows' median ratio. A
row's noise: its per-sync spread, times its bound's spread where it is compared by efficiency."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

import pandas as pd

THRESHOLD = 1.25  # the smallest run/baseline ratio ever flagged
FENCE_MADS = 3.0
FENCE_MIN_ROWS = 6
MAD_SIGMA = 1.4826  # MAD -> standard deviation of a normal distribution

# Calibration key per placement: how that placement moves a chunk's bytes (`harness.calibrate`).
CALIBRATION_KEYS: dict[bool, tuple[str, str]] = {
    False: ("gloo_broadcast_gbps", "gloo broadcast"),
    True: ("memcpy_gbps", "memcpy"),
}
MEASURE_EFFICIENCY = "steady time / same-run bound (1 / efficiency)"
MEASURE_RAW = "raw seconds / median ratio"
# A row whose bound is a smaller share of its sync in either run is not judged by efficiency (`bound_departure`).
MIN_JUDGED_EFFICIENCY = 0.10
MEASURE_BOUNDS = "host speed from the same-run bounds"  # + " (non-colocate)" or " (colocate)"


MIN_UNEXPLAINED = 0.05  # the least share `unexplained_share` gives a row


def unexplained_share(row: Mapping[str, Any]) -> float:
    """The share of a report row's sync its measure does not explain, in (0, 1]: 1 - the baseline's efficiency
    (1 / ``baseline_value``) for a row compared by efficiency, at least `MIN_UNEXPLAINED`; 1 for the others.

    With a sync of bound part B and the rest U, efficiency ratio r = (1 + q X) / (1 + q), q = U/B from the
    baseline, X how much more the rest moved between hosts than the bound did: log r is about
    (1 - efficiency) log X. So unchanged code strays from 1 in proportion to this share, while a slowdown
    of the sync moves r by its whole factor. In four fresh-clone matrices the full-size raw rows (efficiency
    0.59-0.82) read 0.92-1.11x while the rows of 10-15 % efficiency strayed 2.3x (their fence)."""
    if row["measure"] != MEASURE_EFFICIENCY:
        return 1.0
    return max(MIN_UNEXPLAINED, 1.0 - 1.0 / float(row["baseline_value"]))


def bound_version(env: Mapping[str, Any]) -> int:
    """What a run's same-run bounds measured (env.json ``bound_version``,
    `reference_impl.transport.bound.BOUND_VERSION`); 1 for a run from before the field was written."""
    return int(env.get("bound_version") or 1)


def bounds_comparable(base_env: Mapping[str, Any], run_env: Mapping[str, Any]) -> bool:
    """Whether both runs' bounds measured the same steps (`bound_version`): if not, neither efficiency nor the
    bounds' host speed says anything about the code under test (the bound moved, not the sync)."""
    return bound_version(base_env) == bound_version(run_env)


def finite(value: Any) -> float | None:
    """`value` as a float where it is a finite number above 0, else None (a missing or empty cell, NaN)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def _spread(row: Mapping[str, Any], fastest: str, slowest: str) -> float:
    lo, hi = finite(row.get(fastest)), finite(row.get(slowest))
    return hi / lo if lo and hi else math.nan


def sync_spread(row: Mapping[str, Any]) -> float:
    """Slowest over fastest steady sync of one row (>= 1); NaN when the table does not carry them."""
    return _spread(row, "steady_min_s", "steady_max_s")


def bound_spread(row: Mapping[str, Any]) -> float:
    """Slowest over fastest repeat of one row's same-run bound (>= 1); NaN when the table does not carry
    ``bound_max_s`` or no bound was measured."""
    return _spread(row, "bound_s", "bound_max_s")


def band_spreads(row: Mapping[str, Any]) -> list[float]:
    """Each run's own noise of the row's measure (the band is at least the widest): the per-sync spread,
    times the bound's spread where the row is compared by efficiency; a side without a spread gives none."""
    spreads = []
    for side in ("baseline", "run"):
        spread = row[f"{side}_spread"]
        if math.isnan(spread):
            continue
        if row["measure"] == MEASURE_EFFICIENCY and not math.isnan(row[f"{side}_bound_spread"]):
            spread *= row[f"{side}_bound_spread"]
        spreads.append(spread)
    return spreads


def calibration(env: Mapping[str, Any], colocate: bool) -> tuple[float | None, str]:
    """The host speed (GB/s) a row of this placement is divided by, and its name; the other
    calibration when this one is missing; (None, "") when env.json has none."""
    cal = env.get("calibration") or {}
    preferred, other = CALIBRATION_KEYS[bool(colocate)], CALIBRATION_KEYS[not bool(colocate)]
    for key, label in (preferred, other):
        value = finite(cal.get(key))
        if value:
            return value, label
    return None, ""


def colocated(value: Any) -> bool:
    """A table's ``colocate`` cell as a bool (read back from CSV it is text: "True")."""
    return str(value).lower() == "true"


def placement_name(colocate: bool) -> str:
    """The report's name of a placement: "colocate" or "non-colocate"."""
    return "colocate" if colocate else "non-colocate"


def bound_host_ratios(base: pd.DataFrame, run: pd.DataFrame, min_rows: int = FENCE_MIN_ROWS) -> dict[bool, float]:
    """Per placement (colocate: True / False), how much slower the run's host moved bytes than the
    baseline's: the median over the scenarios both tables bound of run ``bound_s`` / baseline ``bound_s``
    (the bare collectives or copies of the same bytes, measured in each run beside its syncs; tables indexed
    by scenario id). Only placements with at least `min_rows` such scenarios; {} where a table has no bound.

    This is the host speed measured where and while each run ran, many times over, so one disturbed
    start-of-run calibration does not move every row: a run whose gloo calibration read 2.04 GB/s against
    its baseline's 3.20 (0.64x) while its syncs took the same seconds showed 28 of 56 rows "2x faster".
    """
    ratios = _bound_ratios(base, run)
    return {colocate: statistics.median(v) for colocate, v in ratios.items() if len(v) >= min_rows}


def _bound_ratios(base: pd.DataFrame, run: pd.DataFrame, least_efficiency: float = 0.0) -> dict[bool, list[float]]:
    """Per placement, run ``bound_s`` / baseline ``bound_s`` of the scenarios both tables bound (tables indexed by
    scenario id), only those whose efficiency is at least `least_efficiency` in both where it is above 0;
    empty lists where a table lacks a column this needs."""
    ratios: dict[bool, list[float]] = {False: [], True: []}
    needs = ["bound_s"] + (["efficiency"] if least_efficiency > 0 else [])
    if any(col not in table for col in needs for table in (base, run)):
        return ratios
    base_rows, run_rows = base[needs].to_dict(orient="index"), run[[*needs, "colocate"]].to_dict(orient="index")
    for sid in base.index.intersection(run.index):
        b, r = finite(base_rows[sid]["bound_s"]), finite(run_rows[sid]["bound_s"])
        if least_efficiency > 0:
            eff = min(finite(base_rows[sid]["efficiency"]) or 0.0, finite(run_rows[sid]["efficiency"]) or 0.0)
            if eff < least_efficiency:
                continue
        if b and r:
            ratios[colocated(run_rows[sid]["colocate"])].append(r / b)
    return ratios


def mad_fence(log_values: list[float], mads: float = FENCE_MADS, min_rows: int = FENCE_MIN_ROWS) -> float:
    """exp(mads x 1.4826 x MAD) of `log_values` (how far one of them strays from their median); 1.0 for fewer
    than `min_rows` values."""
    if len(log_values) < min_rows:
        return 1.0
    mid = statistics.median(log_values)
    return math.exp(mads * MAD_SIGMA * statistics.median(abs(x - mid) for x in log_values))


def bound_scatter(base: pd.DataFrame, run: pd.DataFrame, min_rows: int = FENCE_MIN_ROWS) -> dict[bool, float]:
    """Per placement, how far one row's run / baseline ``bound_s`` strays from the others' on unchanged code:
    `mad_fence` of their logs over the rows both tables bound whose efficiency is at least
    `MIN_JUDGED_EFFICIENCY` in both (the rows judged by it). Bounds of different sizes scale differently
    between hosts: in three fresh-clone matrices of unchanged code the colocated full-size rows' bounds (a
    1.19 GB memcpy) moved 0.59-0.80x while the median of the colocated rows' moved 0.47-0.54x, and these
    fences were 1.8-3.1x. Placements with fewer than `min_rows` such rows are left out."""
    ratios = _bound_ratios(base, run, MIN_JUDGED_EFFICIENCY)
    return {c: mad_fence([math.log(x) for x in v]) for c, v in ratios.items() if len(v) >= min_rows}


def bound_departure(
    base: Mapping[str, Any],
    run: Mapping[str, Any],
    host_ratios: Mapping[bool, float] | None,
    bound_fences: Mapping[bool, float] | None = None,
) -> str:
    """Why a row's own bound cannot stand for its host, or "" (and never without a host ratio to judge by
    instead). Its bound is under `MIN_JUDGED_EFFICIENCY` of its sync in either run: the sync is fixed costs
    its bound does not time, and a bound of microseconds scatters several-fold (a colocated qwen3 row's
    best memcpy took 183 us in one run and 28 us in the next, its steady time 0.026 and 0.024 s: "6x
    slower" by efficiency). In two fresh-clone matrices of unchanged code against the CPU baseline, the 42-44
    rows whose bound was 2-10 % of their sync scattered 3.2-3.7x (the fence) by efficiency and 1.8x by the
    other rows' bounds (what the report then catches: `tests/test_report_noise.py`). Or its run / baseline ``bound_s``
    departs from its placement's host ratio (`bound_host_ratios`, the other rows' bounds) by more than
    max(`THRESHOLD`, the product of both runs' bound spreads, how far the judged rows' bounds stray on
    unchanged code: `bound_fences`, from `bound_scatter`). Its bound then timed other work (the reference path moved
    other bytes: when each EP rank began exporting its own experts, the qwen3-moe EP 2 bounds fell 2.5x
    with no EP all-gather left to time) or scattered (two dense rows' bounds of a few ms fell 2.3-2.5x
    between runs while the placement's median moved 0.91x and their steady seconds 0.80-0.90x, which read "2x
    slower" by efficiency)."""
    colocate = colocated(run.get("colocate"))
    host = (host_ratios or {}).get(colocate)
    b, r = finite(base.get("bound_s")), finite(run.get("bound_s"))
    if not host or not b or not r:
        return ""
    least = min(finite(base.get("efficiency")) or 1.0, finite(run.get("efficiency")) or 1.0)
    if least < MIN_JUDGED_EFFICIENCY:
        return (
            f"its bound is {100 * least:.1f} % of its sync in one run (under {100 * MIN_JUDGED_EFFICIENCY:.0f} %): "
            "judged by steady time over the host's speed, not efficiency"
        )
    spreads = [s for s in (bound_spread(base), bound_spread(run)) if not math.isnan(s)]
    band = max(THRESHOLD, math.prod(spreads), (bound_fences or {}).get(colocate, 1.0))
    departure = r / b / host
    if 1 / band <= departure <= band:
        return ""
    return (
        f"its own bound moved {r / b:.2f}x against the {placement_name(colocate)} rows' {host:.2f}x "
        f"(beyond its bound noise {band:.2f}x): judged by steady time over the host's speed, not efficiency"
    )


def measure(
    base: Mapping[str, Any],
    run: Mapping[str, Any],
    base_env: Mapping[str, Any],
    run_env: Mapping[str, Any],
    host_ratios: Mapping[bool, float] | None = None,
    bound_fences: Mapping[bool, float] | None = None,
) -> tuple[str, float | None, float | None, str]:
    """What is compared for one scenario, both runs' values of it (larger = slower) and why efficiency was
    set aside ("" where it was not). Where the two runs' bounds measured other steps (`bounds_comparable`),
    raw steady seconds (the report divides them by the rows' median ratio): neither efficiency nor
    `host_ratios` says anything then, and the start-of-run calibration alone misjudged a host (a run whose
    calibration read 1.40-1.55x its baseline's while its syncs took the same seconds or more showed 52 of
    90 rows slower). Else 1 / efficiency, unless the row's own bound cannot stand for its host
    (`bound_departure`, whose reason is returned); else steady seconds, the run's divided by how much slower
    its host moved bytes (`host_ratios`, from `bound_host_ratios`: the other rows' same-run bounds of this
    placement); else steady seconds x calibration GB/s (the same calibration in both); else raw steady
    seconds."""
    eff_b, eff_r = finite(base.get("efficiency")), finite(run.get("efficiency"))
    if not bounds_comparable(base_env, run_env):
        return MEASURE_RAW, finite(base.get("steady_s")), finite(run.get("steady_s")), ""
    departed = bound_departure(base, run, host_ratios, bound_fences) if eff_b and eff_r else ""
    if eff_b and eff_r and not departed:
        return MEASURE_EFFICIENCY, 1 / eff_b, 1 / eff_r, ""
    t_b, t_r = finite(base.get("steady_s")), finite(run.get("steady_s"))
    colocate = colocated(run.get("colocate"))
    if host_ratios and colocate in host_ratios:
        name = f"{MEASURE_BOUNDS} ({placement_name(colocate)})"
        return name, t_b, (t_r / host_ratios[colocate] if t_r else None), departed
    cal_b, label_b = calibration(base_env, colocate)
    cal_r, label_r = calibration(run_env, colocate)
    if cal_b and cal_r and label_b == label_r:
        return f"calibration ({label_b})", (t_b * cal_b if t_b else None), (t_r * cal_r if t_r else None), ""
    return MEASURE_RAW, t_b, t_r, ""

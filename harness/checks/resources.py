"""Resources over a long run: no process of the scenario and none of its shared-memory segments grows
without bound (RESOURCE_LEAK).

The samples are the record's `resources` (one `ResourceSample` per sync, taken by the runner's per-sync
hook, `harness.soak.sample_resources`): per process (each trainer rank, the engine server, each with its
descendants) RSS, threads and open file descriptors; and the scenario's segments in `/dev/shm` with their
bytes: those its processes held (mapped or open) at some sample that are still there, so a segment closed
but never unlinked stays counted. The host's own /dev/shm totals are recorded too but not judged: other
programs share that folder, and their segments are not the scenario's. A leak is sustained growth, so
each series is judged by its least-squares slope over the second half of the samples (the first half
is warm-up: lazy imports, allocator pools, thread pools and the shared-memory segment are made during
the first syncs), in units per 100 syncs:

- the slope must not exceed the metric's allowance (`ALLOWANCES`): RSS a few MiB per 100 syncs
  (allocator fragmentation and Python's own caches creep that slowly; one chunk kept per sync is
  100 x the model's bytes), threads, descriptors and segments 0;
- growth below the metric's noise floor over the fitted window (slope x the syncs it spans) is never a
  leak: one late thread, one extra descriptor, a few MiB of allocator noise.

Fewer than `MIN_FIT_SAMPLES` samples in the fitted half (a short run, or none sampled) is a skip: a slope
over a handful of syncs says nothing about a long run. The growth table of a soak (`growth_table`) is
computed by the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.checks.base import CheckResult, failed, passed, skipped
from harness.record import ResourceSample, RunRecord

__all__ = [
    "ALLOWANCES",
    "HOST",
    "MIN_FIT_SAMPLES",
    "Allowance",
    "Growth",
    "check_resources",
    "fit_window",
    "growth_table",
    "slope",
]

VERDICT = "RESOURCE_LEAK"
HOST = "host"  # the label of the host's /dev/shm series
MIN_FIT_SAMPLES = 6  # samples in the fitted half below which nothing is judged
MIB = float(1 << 20)


@dataclass(frozen=True)
class Allowance:
    """What growth of one metric is tolerated: `per_100` units per 100 syncs (the fitted slope), and growth
    below `floor` units over the fitted window is noise. `scale` turns units into those of `unit` for
    messages and tables (bytes -> MiB)."""

    per_100: float
    floor: float
    unit: str = ""
    scale: float = 1.0


# Per process (rss_bytes, threads, fds) and for the host (shm_segments, shm_bytes).
ALLOWANCES: dict[str, Allowance] = {
    # RSS: clean 200-sync soaks grow at most 2.0 MiB per 100 syncs (five scenarios, PP 2 and EP 2 among them);
    # 4 MiB is twice that, and catches a list of a sync's HF names and layouts kept per sync (qwen3-moe's
    # bridge export, about 55 KB a sync, 5.3 MiB per 100 syncs), which 8 passed.
    "rss_bytes": Allowance(per_100=4 * MIB, floor=4 * MIB, unit="MiB", scale=MIB),
    "threads": Allowance(per_100=0.0, floor=4.0),
    "fds": Allowance(per_100=0.0, floor=4.0),
    "shm_segments": Allowance(per_100=0.0, floor=4.0),
    "shm_bytes": Allowance(per_100=0.0, floor=4 * MIB, unit="MiB", scale=MIB),
}
PROCESS_METRICS: tuple[str, ...] = ("rss_bytes", "threads", "fds")
HOST_METRICS: tuple[str, ...] = ("shm_segments", "shm_bytes")


@dataclass(frozen=True)
class Growth:
    """One series' growth over the fitted window: `process` ("rank0", "engine", or `HOST`), `metric`, the
    first and last value of the window, the least-squares slope per 100 syncs, the growth that slope makes
    over the window (`fitted`), the samples fitted and the syncs they span, and whether it is a leak."""

    process: str
    metric: str
    first: float
    last: float
    per_100: float
    fitted: float
    samples: int
    syncs: tuple[int, int]
    leak: bool

    def describe(self) -> str:
        """The growth in words: "rank0 rss_bytes grew 96.0 MiB per 100 syncs (allowed 4.0; syncs 6-12: 12.1
        -> 17.9 MiB)"."""
        a = ALLOWANCES[self.metric]
        unit = f" {a.unit}" if a.unit else ""

        def v(x: float, rate: bool = False) -> str:
            if a.scale != 1.0:
                return f"{x / a.scale:.1f}"
            return f"{x:.3g}" if rate else f"{x:g}"

        window = f"syncs {self.syncs[0]}-{self.syncs[1]}: {v(self.first)} -> {v(self.last)}{unit}"
        return (
            f"{self.process} {self.metric} grew {v(self.per_100, True)}{unit} per 100 syncs (allowed "
            f"{v(a.per_100, True)}{unit}; {window})"
        )


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0.0 for fewer than two distinct xs). Units: y per x.

    Raises:
        ValueError: xs and ys differ in length.
    """
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} xs but {len(ys)} ys")
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def fit_window(samples: list[ResourceSample]) -> list[ResourceSample]:
    """The samples a leak is judged on: the second half by sync index (the first is warm-up)."""
    ordered = sorted(samples, key=lambda s: s.sync)
    return ordered[len(ordered) // 2 :]


def _series(window: list[ResourceSample]) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
    """(process, metric) -> (syncs, values) over the window; a process counts only while it was alive."""
    out: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for s in window:
        for label, p in s.processes.items():
            if not p.alive:
                continue
            for metric in PROCESS_METRICS:
                xs, ys = out.setdefault((label, metric), ([], []))
                xs.append(float(s.sync))
                ys.append(float(getattr(p, metric)))
        for metric in HOST_METRICS:
            xs, ys = out.setdefault((HOST, metric), ([], []))
            xs.append(float(s.sync))
            ys.append(float(getattr(s, metric)))
    return out


def growth_table(samples: list[ResourceSample]) -> list[Growth]:
    """Every series' `Growth` over the fitted window, processes in order of appearance then the host; empty
    when the window holds fewer than `MIN_FIT_SAMPLES` samples."""
    window = fit_window(samples)
    if len(window) < MIN_FIT_SAMPLES:
        return []
    out = []
    for (process, metric), (xs, ys) in _series(window).items():
        if len(xs) < MIN_FIT_SAMPLES:
            continue
        allowance = ALLOWANCES[metric]
        per_sync = slope(xs, ys)
        fitted = per_sync * (xs[-1] - xs[0])
        leak = per_sync * 100 > allowance.per_100 and fitted > allowance.floor
        out.append(
            Growth(
                process=process,
                metric=metric,
                first=ys[0],
                last=ys[-1],
                per_100=per_sync * 100,
                fitted=fitted,
                samples=len(xs),
                syncs=(int(xs[0]), int(xs[-1])),
                leak=leak,
            )
        )
    return out


def check_resources(record: RunRecord) -> CheckResult:
    """No process of the scenario and no /dev/shm segment grows past its allowance per 100 syncs (module
    doc). The message names the first leaking series (processes first, then the host) with its slope, the
    allowance and the window's first and last values."""
    name = "resources"
    if not record.resources:
        return skipped(name, VERDICT, "no resource samples (sampled per sync by `python -m harness soak`)")
    window = fit_window(record.resources)
    if len(window) < MIN_FIT_SAMPLES:
        return skipped(
            name,
            VERDICT,
            f"{len(record.resources)} resource samples: a slope needs at least {MIN_FIT_SAMPLES} after the warm-up "
            f"half ({2 * MIN_FIT_SAMPLES - 1} samples or more, one per sync and the re-sync)",
        )
    leaks = [g for g in growth_table(record.resources) if g.leak]
    if not leaks:
        return passed(name, VERDICT)
    more = f" (+{len(leaks) - 1} more: {', '.join(f'{g.process} {g.metric}' for g in leaks[1:])})" if leaks[1:] else ""
    return failed(name, VERDICT, f"{leaks[0].describe()}{more}")

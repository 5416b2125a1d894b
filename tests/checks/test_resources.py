"""The resource check: sustained growth per 100 syncs past its allowance is a RESOURCE_LEAK; warm-up, noise
below the floor and short runs are not."""

from __future__ import annotations

import random

import numpy as np
import pytest

from harness.checks import judge
from harness.checks.resources import ALLOWANCES, MIN_FIT_SAMPLES, check_resources, fit_window, growth_table, slope
from harness.record import ProcessSample, ResourceSample, RunRecord

MIB = 1 << 20


def _samples(
    syncs: int,
    rss: list[float] | None = None,
    threads: list[int] | None = None,
    fds: list[int] | None = None,
    segments: list[int] | None = None,
    engine_rss: list[float] | None = None,
) -> list[ResourceSample]:
    """One sample per sync 0..syncs-1: rank0 and engine, flat unless a series is given."""
    out = []
    for i in range(syncs):
        rank0 = ProcessSample(
            pid=100,
            procs=1,
            rss_bytes=int(rss[i] if rss else 300 * MIB),
            threads=threads[i] if threads else 40,
            fds=fds[i] if fds else 70,
        )
        engine = ProcessSample(pid=200, procs=1, rss_bytes=int(engine_rss[i] if engine_rss else 500 * MIB), threads=9)
        seg = segments[i] if segments else 3
        processes = {"rank0": rank0, "engine": engine}
        out.append(ResourceSample(sync=i, t=1000.0 + i, processes=processes, shm_segments=seg, shm_bytes=seg * MIB))
    return out


def test_slope_is_the_least_squares_fit() -> None:
    rng = random.Random(7)
    xs = [float(x) for x in range(40)]
    ys = [3.5 * x + rng.gauss(0, 4) for x in xs]
    assert slope(xs, ys) == pytest.approx(np.polyfit(xs, ys, 1)[0], rel=1e-9)
    assert slope([1.0], [5.0]) == 0.0
    assert slope([2.0, 2.0], [1.0, 9.0]) == 0.0
    with pytest.raises(ValueError, match="3 xs but 2 ys"):
        slope([1.0, 2.0, 3.0], [1.0, 2.0])


def test_flat_run_passes(record: RunRecord) -> None:
    record.resources = _samples(13)
    assert check_resources(record).ok and not check_resources(record).skipped


def test_no_samples_or_too_few_is_a_skip(record: RunRecord) -> None:
    assert check_resources(record).skipped
    record.resources = _samples(2 * MIN_FIT_SAMPLES - 2, rss=[i * 50 * MIB for i in range(2 * MIN_FIT_SAMPLES - 2)])
    result = check_resources(record)
    assert result.skipped and f"at least {MIN_FIT_SAMPLES}" in result.reason


def test_one_buffer_per_sync_in_the_sender_is_a_leak(record: RunRecord) -> None:
    # 1.1 MiB kept per sync, over 12 syncs + the re-sync: 110 MiB per 100 syncs, allowance 4.
    record.resources = _samples(13, rss=[300 * MIB + 1.1 * MIB * i for i in range(13)])
    result = check_resources(record)
    assert result.failed and result.verdict_on_fail == "RESOURCE_LEAK"
    assert result.message.startswith("rank0 rss_bytes grew 110.0 MiB per 100 syncs (allowed 4.0 MiB; syncs 6-12:")
    verdict, _ = judge(record)
    assert verdict == "RESOURCE_LEAK"


def test_one_segment_per_sync_is_a_leak_of_the_host(record: RunRecord) -> None:
    record.resources = _samples(13, segments=[3 + i for i in range(13)])
    result = check_resources(record)
    assert result.failed
    assert result.message.startswith("host shm_segments grew 100 per 100 syncs (allowed 0;")
    assert "(+1 more: host shm_bytes)" in result.message


def test_engine_growth_is_named_after_the_engine(record: RunRecord) -> None:
    record.resources = _samples(13, engine_rss=[500 * MIB + 2 * MIB * i for i in range(13)])
    assert check_resources(record).message.startswith("engine rss_bytes grew 200.0 MiB")


def test_warm_up_growth_is_not_judged(record: RunRecord) -> None:
    # Threads, descriptors and RSS grow during the first half (lazy pools, imports), then stay flat.
    threads = [20 + min(i, 6) * 3 for i in range(13)]
    rss = [200 * MIB + min(i, 6) * 40 * MIB for i in range(13)]
    record.resources = _samples(13, rss=rss, threads=threads, fds=[50 + min(i, 6) for i in range(13)])
    assert [s.sync for s in fit_window(record.resources)] == list(range(6, 13))
    assert check_resources(record).ok


def test_a_one_off_step_below_the_floor_is_noise(record: RunRecord) -> None:
    # One descriptor opened for good in the middle of the window: a step, not a leak (fitted growth < 4).
    fds = [70] * 150 + [71] * 50
    record.resources = _samples(200, fds=fds)
    growth = {(g.process, g.metric): g for g in growth_table(record.resources)}
    assert growth[("rank0", "fds")].per_100 > 0 and growth[("rank0", "fds")].fitted < ALLOWANCES["fds"].floor
    assert check_resources(record).ok


def test_a_slow_thread_leak_over_a_long_run_is_caught(record: RunRecord) -> None:
    # One thread every other sync: 50 per 100 syncs.
    record.resources = _samples(200, threads=[40 + i // 2 for i in range(200)])
    result = check_resources(record)
    assert result.failed and result.message.startswith("rank0 threads grew 50 per 100 syncs")


def test_rss_within_its_allowance_passes_and_past_it_fails(record: RunRecord) -> None:
    # 2 MiB / 100 syncs: about the most a clean 200-sync soak grows
    record.resources = _samples(201, rss=[300 * MIB + 0.02 * MIB * i for i in range(201)])
    assert check_resources(record).ok
    # 55 KB a sync: a list of each sync's HF names and layouts kept on qwen3-moe's sender (5.3 MiB / 100)
    record.resources = _samples(201, rss=[300 * MIB + 0.053 * MIB * i for i in range(201)])
    result = check_resources(record)
    assert result.failed and "grew 5.3 MiB per 100 syncs" in result.message


def test_a_process_gone_is_left_out_of_its_series(record: RunRecord) -> None:
    samples = _samples(13)
    for s in samples[8:]:
        s.processes["engine"] = ProcessSample(pid=200, alive=False)
    record.resources = samples
    growth = {(g.process, g.metric) for g in growth_table(record.resources)}
    assert ("engine", "rss_bytes") not in growth and ("rank0", "rss_bytes") in growth
    assert check_resources(record).ok


def test_any_other_failure_outranks_a_leak(record: RunRecord) -> None:
    record.resources = _samples(13, segments=[3 + i for i in range(13)])
    record.syncs[1].engine_checksums[next(iter(record.syncs[1].engine_checksums))] = "stale"
    assert judge(record)[0] == "PARITY_FAIL"


def test_samples_round_trip_through_json(record: RunRecord) -> None:
    record.resources = _samples(13, segments=[3 + i for i in range(13)])
    again = RunRecord.model_validate_json(record.model_dump_json())
    assert again.resources == record.resources
    assert check_resources(again) == check_resources(record)

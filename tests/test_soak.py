"""The soak: resource samples of real processes and of /dev/shm, the tables and the plot written from them,
and `python -m harness soak` end to end at a small number of syncs (the 200-sync soak is `nox -s soak`)."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from harness import shm
from harness.record import RunRecord
from harness.scenario import Scenario
from harness.soak import (
    DEFAULT_SCENARIOS,
    growth_frame,
    growth_markdown,
    sample_process,
    sample_resources,
    samples_frame,
    soak_scenarios,
    write_soak_outputs,
)

MIB = 1 << 20


def _record(sid: str = "qwen3/tp1-pp1/colocate/raw/soak12") -> RunRecord:
    sc = Scenario(model="qwen3", colocate=True, syncs=12, suffix="soak12")
    return RunRecord(scenario_id=sid, scenario=sc)


def test_a_segment_held_is_seen_and_one_closed_but_not_unlinked_stays_counted(tmp_path: Path) -> None:
    seg = SharedMemory(create=True, size=3 * MIB)
    try:
        assert seg.name in shm.held_by(os.getpid())
        rec = _record()
        sample_resources(rec, 0, {"rank0": os.getpid()})
        assert seg.name in rec.resources[0].processes["rank0"].shm
        assert rec.resources[0].shm_segments >= 1 and rec.resources[0].shm_bytes >= 3 * MIB
        seg.close()  # no longer held by anyone, still in /dev/shm
        assert seg.name not in shm.held_by(os.getpid())
        sample_resources(rec, 1, {"rank0": os.getpid()})
        assert seg.name in shm.present([seg.name]) and rec.resources[1].shm_segments == rec.resources[0].shm_segments
    finally:
        seg.close()
        assert shm.unlink([seg.name]) == [seg.name]
    assert shm.present([seg.name]) == {}
    sample_resources(rec, 2, {"rank0": os.getpid()})
    assert rec.resources[2].shm_segments == rec.resources[0].shm_segments - 1


def test_a_process_tree_is_summed_and_a_gone_one_is_marked() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        me = sample_process(os.getpid())
        alone = sample_process(child.pid)
        assert me.alive and me.procs >= 2 and alone.procs == 1
        assert me.rss_bytes > alone.rss_bytes > 0 and me.threads >= 1 + alone.threads and me.fds > 0
    finally:
        child.kill()
        child.wait()
    assert sample_process(child.pid) == sample_process(child.pid).model_copy(update={"alive": False})
    assert not sample_process(child.pid).alive


def _synthetic(leak_per_sync: int) -> RunRecord:
    samples = []
    for i in range(13):
        samples.append(
            {
                "sync": i,
                "t": 100.0 + 2 * i,
                "processes": {
                    "rank0": {"pid": 11, "procs": 1, "rss_bytes": 500 * MIB + leak_per_sync * i, "threads": 30},
                    "engine": {"pid": 12, "procs": 1, "rss_bytes": 400 * MIB, "threads": 5, "fds": 9},
                },
                "shm_segments": 1,
                "shm_bytes": MIB,
                "host_shm_segments": 7,
                "host_shm_bytes": 9 * MIB,
            }
        )
    return RunRecord.model_validate(_record().model_dump() | {"resources": samples})


def test_tables_and_plot_from_samples(tmp_path: Path) -> None:
    steady, leaking = _synthetic(0), _synthetic(2 * MIB)
    leaking.scenario_id = "qwen3/tp1-pp1/noncolocate/raw/soak12"
    samples = samples_frame([steady, leaking])
    # 13 syncs x (2 processes x 3 metrics + the host's 4) per record
    assert len(samples) == 2 * 13 * (2 * 3 + 4)
    row = samples[(samples.scenario == leaking.scenario_id) & (samples.process == "rank0") & (samples.sync == 12)]
    assert row[row.metric == "rss_bytes"].value.item() == 500 * MIB + 24 * MIB
    assert samples[samples.metric == "host_shm_segments"].value.unique().tolist() == [7]
    assert samples.elapsed_s.max() == 24.0
    growth = growth_frame([steady, leaking])
    rss = growth[(growth.metric == "rss_mib") & (growth.process == "rank0")].set_index("scenario")
    assert rss.loc[leaking.scenario_id, "per_100_syncs"] == pytest.approx(200.0)
    assert bool(rss.loc[leaking.scenario_id, "leak"]) and not bool(rss.loc[steady.scenario_id, "leak"])
    assert rss.loc[steady.scenario_id, "per_100_syncs"] == 0.0 and rss.loc[steady.scenario_id, "window"] == "6-12"
    table = growth_markdown(growth)
    assert "+200.00 LEAK" in table and "rss_mib /100 syncs (allowed 4)" in table
    paths = write_soak_outputs([steady, leaking], tmp_path)
    assert pd.read_csv(paths["samples"]).shape == samples.shape
    assert pd.read_csv(paths["growth"]).shape == growth.shape
    width, height = Image.open(paths["plot"]).size
    assert 0 < width <= 1600 and height > 0


def test_soak_scenarios_come_from_the_matrix_with_their_own_ids() -> None:
    scs = soak_scenarios(list(DEFAULT_SCENARIOS), 200)
    assert [s.id for s in scs] == [f"{i}/soak200" for i in DEFAULT_SCENARIOS]
    assert [(s.colocate, s.export_mode, s.pp, s.ep) for s in scs] == [
        (False, "raw", 1, 1),
        (True, "raw", 1, 1),
        (False, "bridge", 2, 1),
        (False, "raw", 1, 2),
        (False, "bridge", 1, 2),
    ]
    assert all(s.syncs == 200 for s in scs)
    with pytest.raises(ValueError, match=r"has no scenario 'qwen3/tp9-pp1/noncolocate/raw'; e\.g\. qwen3/"):
        soak_scenarios(["qwen3/tp9-pp1/noncolocate/raw"], 10)
    with pytest.raises(ValueError, match="--syncs must be >= 1"):
        soak_scenarios(list(DEFAULT_SCENARIOS), 0)


def _soak(tmp_path: Path, run_id: str, *args: str) -> tuple[list[RunRecord], Path]:
    """`python -m harness soak *args` into `tmp_path/run_id`, which must exit 0: its records and folder."""
    where = ["--results-dir", str(tmp_path), "--run-id", run_id]
    done = subprocess.run(
        [sys.executable, "-m", "harness", "soak", *args, *where], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    out = tmp_path / run_id
    return [RunRecord.load(p) for p in sorted((out / "records").glob("*.json"))], out


def _picked(ids: tuple[str, ...]) -> list[str]:
    return [a for sid in ids for a in ("--scenario", sid)]


@pytest.mark.e2e
def test_soak_command_at_12_syncs_in_both_placements_each_in_processes_of_its_own(tmp_path: Path) -> None:
    """`nox -s soak`'s command as it runs by default, at 12 syncs in both placements: both pass with 13 samples
    each (12 syncs and the re-sync), every rank and the engine in the table, no growth past its allowance, and
    no rank or engine serves both scenarios (a reused rank carries what the scenario before it left: a leak
    injected into the raw EP export also read as RESOURCE_LEAK of the bridge scenario after it). A fresh rank
    grows by 2.5-3.5 MiB over syncs 6-12 (its allocator, the export's first buffers; 3.3 MiB warm), under the
    4 MiB noise floor a 12-sync soak judges; the other default scenarios (PP 2, EP 2) run at 200 syncs in
    `nox -s soak` only."""
    ids = DEFAULT_SCENARIOS[:2]
    records, out = _soak(tmp_path, "s", "--syncs", "12", *_picked(ids))
    assert sorted(r.scenario_id for r in records) == sorted(f"{i}/soak12" for i in ids)
    for rec in records:
        assert rec.verdict == "PASS" and [s.sync for s in rec.resources] == list(range(13))
        assert set(rec.resources[-1].processes) == {"rank0", "engine"}
        # The colocated sender holds one segment (reused by every chunk); the other holds none.
        assert rec.resources[-1].shm_segments == (1 if rec.scenario.colocate else 0)
        resources = next(c for c in rec.checks if c["name"] == "resources")
        assert resources["ok"] and not resources["skipped"], resources
    pids = [p.pid for rec in records for p in rec.resources[-1].processes.values()]
    assert len(pids) == 4 and len(set(pids)) == 4, pids
    growth = pd.read_csv(out / "soak.csv")
    assert set(growth.process) == {"rank0", "engine", "host"} and not growth.leak.any()
    assert (out / "plots" / "resources.png").stat().st_size > 0 and (out / "soak.md").exists()


@pytest.mark.parametrize("flag", [[], ["--reuse-processes"]])
def test_soak_asks_for_processes_of_its_own_unless_told_to_reuse_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flag: list[str]
) -> None:
    """What `harness soak` hands the runner: fresh processes per scenario by default, warm ones with
    `--reuse-processes` (the runner's side of both is the end-to-end test above and the matrix's reuse)."""
    from harness import cli, soak

    asked: list[bool] = []

    def run_scenarios(scenarios, results_dir, run_id, ray_address, **kwargs):  # type: ignore[no-untyped-def]
        asked.append(kwargs["fresh_processes"])
        assert [s.id for s in scenarios] == [f"{DEFAULT_SCENARIOS[0]}/soak3"]
        return [], tmp_path

    def outputs(records, out):  # type: ignore[no-untyped-def]
        (out / "soak.md").write_text("table")
        return {"table": out / "soak.md", "samples": out / "resources.csv", "plot": out / "resources.png"}

    monkeypatch.setattr(cli, "run_scenarios", run_scenarios)
    monkeypatch.setattr(soak, "write_soak_outputs", outputs)
    argv = ["soak", "--syncs", "3", "--scenario", DEFAULT_SCENARIOS[0], "--results-dir", str(tmp_path), *flag]
    assert soak.cmd_soak(cli._parser().parse_args(argv)) == 1  # no record: nothing passed
    assert asked == [not flag]

"""Soak: one scenario for many syncs, its processes and the host's shared memory sampled after every sync.

`python -m harness soak` runs each selected scenario (default `DEFAULT_SCENARIOS`: dense qwen3 raw in both
placements, its bridge export at PP 2, and qwen3-moe's EP 2 export raw and bridge, of the CPU matrix) for
`--syncs` syncs (default 200) through the ordinary runner; the runner calls `sample_resources` after every
sync (its `after_sync` hook), which appends one `ResourceSample` to the run record: RSS, threads and open
file descriptors of every trainer rank and of the engine server (each with its descendants), the scenario's
segments in `/dev/shm` (those its processes held at some sample and that are still there) and the host's
totals. The check `harness.checks.resources.check_resources` judges the samples (RESOURCE_LEAK); this module
writes them out as well:

- `resources.csv`: one row per scenario, sync, process (or `host`) and metric, with its value (the host's
  rows: the scenario's segments `shm_segments` / `shm_bytes`, and every segment on the host
  `host_shm_segments` / `host_shm_bytes`);
- `soak.csv` / `soak.md`: per scenario, process and metric the least-squares growth per 100 syncs over
  the second half of the samples, the allowance, and whether it is a leak;
- `plots/resources.png`: every series against the sync index (`harness.plots.plot_resources`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import psutil

from harness import shm
from harness.checks.resources import ALLOWANCES, HOST, HOST_METRICS, PROCESS_METRICS, growth_table
from harness.record import ProcessSample, ResourceSample, RunRecord
from harness.scenario import Scenario, load_matrix

# Both placements, then the paths whose per-sync state is largest: the bridge export's per-stage tasks (PP 2)
# and an EP 2 export of 16 experts (about 250 tensors a sync, raw and bridge). Objects a sync leaves behind
# grow with the tensor count: a reference cycle in the sync loop grew qwen3-moe's sender by 10 MiB per 100 syncs
# and qwen3's by less than the allowance.
DEFAULT_SCENARIOS: tuple[str, ...] = (
    "qwen3/tp1-pp1/noncolocate/raw",
    "qwen3/tp1-pp1/colocate/raw",
    "qwen3/tp1-pp2/noncolocate/bridge",
    "qwen3-moe/tp1-pp1-ep2/noncolocate/raw",
    "qwen3-moe/tp1-pp1-ep2/noncolocate/bridge",
)
DEFAULT_SYNCS = 200
SUFFIX = "soak{syncs}"  # soaked scenarios get their own ids: qwen3/tp1-pp1/noncolocate/raw/soak200


def sample_process(pid: int) -> ProcessSample:
    """RSS (bytes), threads and open descriptors of process `pid` and its descendants, summed, and the
    /dev/shm segments they hold; `alive` False (and zeros) when `pid` is gone or a zombie. A descendant
    that ends while it is read is left out."""
    try:
        root = psutil.Process(pid)
        if root.status() == psutil.STATUS_ZOMBIE:
            return ProcessSample(pid=pid, alive=False)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return ProcessSample(pid=pid, alive=False)
    out = ProcessSample(pid=pid)
    held: set[str] = set()
    for proc in tree:
        try:
            with proc.oneshot():
                rss, threads, fds = proc.memory_info().rss, proc.num_threads(), proc.num_fds()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        out.procs += 1
        out.rss_bytes += rss
        out.threads += threads
        out.fds += fds
        held |= shm.held_by(proc.pid)
    out.shm = sorted(held)
    return out


def sample_resources(record: RunRecord, sync: int, pids: dict[str, int | None]) -> None:
    """The runner's `after_sync` hook: append one `ResourceSample` of the scenario's processes (`pids`:
    label -> pid, e.g. "rank0", "engine"; None is skipped) and of /dev/shm to `record.resources`. The
    scenario's segments are those its processes held at this or an earlier sample of the record that are
    still in /dev/shm.

    Raises:
        psutil.AccessDenied: a process of the scenario cannot be read (the runner records that the sampler
            could not run for this sync; it is never a verdict of the system under test).
    """
    processes = {label: sample_process(pid) for label, pid in pids.items() if pid is not None}
    seen = shm.held_in(record.resources) | {n for p in processes.values() for n in p.shm}
    ours = shm.present(seen)
    host_segments, host_bytes = shm.host_usage()
    record.resources.append(
        ResourceSample(
            sync=sync,
            t=time.time(),
            processes=processes,
            shm_segments=len(ours),
            shm_bytes=sum(ours.values()),
            host_shm_segments=host_segments,
            host_shm_bytes=host_bytes,
        )
    )


def soak_scenarios(ids: Sequence[str], syncs: int, matrix: str = "cpu") -> list[Scenario]:
    """The scenarios of `matrix` named by `ids` (exact ids), each set to `syncs` syncs with the suffix
    `soak<syncs>` (its own id, records and logs).

    Raises:
        ValueError: an id the matrix does not hold (the message lists a few it does), or `syncs` < 1.
    """
    if syncs < 1:
        raise ValueError(f"--syncs must be >= 1, got {syncs}")
    by_id = {sc.id: sc for sc in load_matrix(matrix)}
    missing = [i for i in ids if i not in by_id]
    if missing:
        near = sorted(k for k in by_id if k.split("/")[0] == missing[0].split("/")[0])[:6] or sorted(by_id)[:6]
        raise ValueError(f"matrix {matrix!r} has no scenario {missing[0]!r}; e.g. {', '.join(near)}")
    return [by_id[i].model_copy(update={"syncs": syncs, "suffix": SUFFIX}) for i in ids]


def samples_frame(records: Sequence[RunRecord]) -> pd.DataFrame:
    """Every sample as one row per scenario, sync, process (or "host") and metric: columns scenario, sync,
    elapsed_s (since the scenario's first sample), process, pid, metric, value."""
    rows: list[dict[str, Any]] = []
    for rec in records:
        t0 = rec.resources[0].t if rec.resources else 0.0
        for s in rec.resources:
            base = {"scenario": rec.scenario_id, "sync": s.sync, "elapsed_s": round(s.t - t0, 3)}
            for label, p in s.processes.items():
                if p.alive:
                    rows.extend(
                        base | {"process": label, "pid": p.pid, "metric": m, "value": getattr(p, m)}
                        for m in PROCESS_METRICS
                    )
            rows.extend(
                base | {"process": HOST, "pid": None, "metric": m, "value": getattr(s, m)}
                for m in (*HOST_METRICS, "host_shm_segments", "host_shm_bytes")
            )
    return pd.DataFrame(rows, columns=["scenario", "sync", "elapsed_s", "process", "pid", "metric", "value"])


def growth_frame(records: Sequence[RunRecord]) -> pd.DataFrame:
    """Per scenario, process and metric: the fitted growth per 100 syncs (`checks.resources.growth_table`)
    in the metric's unit (MiB for bytes), the allowance, the window's syncs and values, and `leak`."""
    rows = []
    for rec in records:
        for g in growth_table(rec.resources):
            a = ALLOWANCES[g.metric]
            rows.append(
                {
                    "scenario": rec.scenario_id,
                    "process": g.process,
                    "metric": g.metric.removesuffix("_bytes") + (f"_{a.unit.lower()}" if a.unit else ""),
                    "per_100_syncs": round(g.per_100 / a.scale, 3),
                    "allowed_per_100": round(a.per_100 / a.scale, 3),
                    "noise_floor": round(a.floor / a.scale, 3),
                    "window": f"{g.syncs[0]}-{g.syncs[1]}",
                    "first": round(g.first / a.scale, 3),
                    "last": round(g.last / a.scale, 3),
                    "leak": g.leak,
                }
            )
    return pd.DataFrame(rows)


def growth_markdown(df: pd.DataFrame) -> str:
    """The growth table as markdown: one row per scenario and process, one column per metric ("+x.x" per
    100 syncs, "LEAK" appended when it is one)."""
    from harness.results import markdown_table

    if df.empty:
        return "No scenario has enough resource samples to fit a growth (at least 11: 10 syncs and the re-sync).\n"
    metrics = list(dict.fromkeys(df["metric"]))
    rows = []
    for (scenario, process), part in df.groupby(["scenario", "process"], sort=False):
        cells = {r.metric: f"{r.per_100_syncs:+.2f}" + (" LEAK" if r.leak else "") for r in part.itertuples()}
        rows.append([scenario, process, *(cells.get(m, "") for m in metrics)])
    allowed = df.drop_duplicates("metric").set_index("metric")["allowed_per_100"]
    header = ["scenario", "process", *(f"{m} /100 syncs (allowed {allowed[m]:g})" for m in metrics)]
    return markdown_table(header, rows)


def write_soak_outputs(records: Sequence[RunRecord], out: Path) -> dict[str, Path]:
    """Write resources.csv, soak.csv, soak.md and plots/resources.png under `out`; returns their paths."""
    from harness.plots import plot_resources

    samples = samples_frame(records)
    growth = growth_frame(records)
    paths = {
        "samples": out / "resources.csv",
        "growth": out / "soak.csv",
        "table": out / "soak.md",
        "plot": out / "plots" / "resources.png",
    }
    samples.to_csv(paths["samples"], index=False)
    growth.to_csv(paths["growth"], index=False)
    verdicts = "\n".join(f"- `{r.scenario_id}`: {r.verdict} ({len(r.resources)} samples)" for r in records)
    paths["table"].write_text(f"# Soak: growth per 100 syncs\n\n{growth_markdown(growth)}\n{verdicts}\n")
    plot_resources(samples, paths["plot"])
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `soak` subcommand's own arguments."""
    p.add_argument(
        "--scenario",
        action="append",
        default=None,
        help=f"a scenario id of --matrix, repeatable (default: {', '.join(DEFAULT_SCENARIOS)})",
    )
    p.add_argument("--syncs", type=int, default=DEFAULT_SYNCS, help=f"syncs per scenario (default {DEFAULT_SYNCS})")
    p.add_argument("--matrix", default="cpu", help="matrix the scenario ids come from (cpu) or a YAML path")
    p.add_argument(
        "--reuse-processes",
        action="store_true",
        help="let a scenario's trainer ranks and engine serve the next one, as the matrix does (warm processes, "
        "for short soaks: a fresh rank grows a few MiB over its first 30 syncs; a leak may then also show in the "
        "scenarios after the one that leaks)",
    )


def cmd_soak(args: argparse.Namespace) -> int:
    """Run the soak (module doc); exit 0 when every scenario passed, 1 otherwise, 2 on bad arguments."""
    from harness.checks import expectation_met
    from harness.cli import run_scenarios

    scenarios = soak_scenarios(args.scenario or list(DEFAULT_SCENARIOS), args.syncs, args.matrix)
    # By default each scenario in processes of its own: ranks reused from the one before carried its growth (a
    # leak in the raw export read as the next bridge scenario's RESOURCE_LEAK too, which alone passed).
    fresh = not args.reuse_processes
    records, out = run_scenarios(
        scenarios, args.results_dir, args.run_id, args.ray_address, after_each=write_soak_outputs, fresh_processes=fresh
    )
    paths = write_soak_outputs(records, out)
    print(paths["table"].read_text())
    print(f"samples: {paths['samples']}  plot: {paths['plot']}")
    return 0 if records and all(expectation_met(r, r.verdict) for r in records) else 1

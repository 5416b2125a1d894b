"""Each plot rendered from a recorded run of the real matrices (records built here, then `summarize`):
at most 1,600 px wide, tick labels of at least 9 pt, and every scenario on it."""

from __future__ import annotations

import struct
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.figure import Figure

from harness.plots import (
    CHANGE_COLORS,
    MAX_WIDTH_PX,
    gbps_figure,
    layout_label,
    phases_figure,
    plot_gbps_vs_bound,
    plot_phases,
    plot_regression,
    plot_steady_update_time,
    regression_figure,
    steady_figure,
    write_run_plots,
)
from harness.record import ChunkRecord, RunRecord, SyncRecord
from harness.report import RunTables, compare, normalise_table
from harness.results import summarize
from harness.scenario import Scenario, load_matrix
from reference_impl.engine import DEFAULT_ENGINE


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def recorded(sc: Scenario, steady: float) -> RunRecord:
    """A record of `sc` with sync 0 at 2x `steady`, syncs 1-3 at 0.9, 1.0, 1.1 x `steady`, and phases
    that cover 80 % of each sync."""
    syncs = []
    for i, factor in enumerate((2.0, 0.9, 1.0, 1.1)):
        total = steady * factor
        syncs.append(
            SyncRecord(
                index=i,
                weight_version=i,
                export_mode=sc.export_mode,
                chunks_planned=1,
                chunks=[ChunkRecord(index=0, names=["w"], bytes=4_000_000, sent=True, received=True)],
                bytes=4_000_000,
                phases={"gather": 0.1 * total, "convert": 0.2 * total, "transfer": 0.4 * total, "load": 0.1 * total},
                total_s=total,
                finished=True,
            )
        )
    return RunRecord(scenario_id=sc.id, scenario=sc, syncs=syncs, requested_export_mode=sc.export_mode)


@pytest.fixture(scope="module")
def table() -> pd.DataFrame:
    """The CPU matrix and the vLLM rows of the CPU-vLLM matrix, one record each (steady times spread
    over two decades), and one scenario whose syncs never finished (no steady time)."""
    scenarios = load_matrix("cpu") + [sc for sc in load_matrix("cpu_vllm") if sc.engine != DEFAULT_ENGINE]
    records = [recorded(sc, 0.01 * (1 + (i % 13) * 8)) for i, sc in enumerate(scenarios)]
    for s in records[5].syncs:
        s.finished = False
    return summarize(records)


def gids(fig: Figure) -> set[str]:
    return {a.get_gid() for a in fig.findobj() if a.get_gid()}


def tick_labels(fig: Figure, axis: str) -> list[str]:
    ticks = [t for ax in fig.axes for t in (ax.get_xticklabels() if axis == "x" else ax.get_yticklabels())]
    assert all(t.get_fontsize() >= 9 for t in ticks)  # legible at 100 %
    return [t.get_text() for t in ticks]


def test_steady_time_small_multiples(tmp_path: Path, table: pd.DataFrame) -> None:
    fig = steady_figure(table)
    assert fig.get_size_inches()[0] * fig.dpi <= MAX_WIDTH_PX
    assert gids(fig) == set(table["scenario"])  # every scenario is a mark (the unfinished one an "n/a")
    fig.canvas.draw()
    steady = table.set_index("scenario")["steady_s"]
    for ax in fig.axes:
        lo, hi = ax.get_ylim()
        for line in ax.get_lines():  # each point is drawn inside its panel, at its steady time
            (y,) = line.get_ydata()
            assert lo < y < hi and y == pytest.approx(steady[line.get_gid()])
        assert not any("$" in t.get_text() for t in ax.get_yticklabels())  # plain numbers, also on log axes
    titles = {ax.get_title() for ax in fig.axes if ax.get_title()}
    models = set(table["model"])
    on_vllm = set(table.loc[table["engine"] == "vllm", "model"])
    assert {"qwen3", "qwen3-vl", "qwen3-0.6b"} <= on_vllm
    assert titles == models | {f"{m} · vllm" for m in on_vllm}  # a panel per model and engine
    labels = tick_labels(fig, "x")
    assert {"TP1 PP1", "TP2 PP2", "TP1 PP2 EP2", "TP1 PP2 EP2\nchunk-1 MiB", "TP1 PP2 EP2\nchunk-1 TiB"} <= set(labels)
    assert {"TP1 PP1\n2 engines", "TP1 PP1\nengine TP2", "TP1 PP1\nengine TP4"} <= set(labels)
    for ax in fig.axes:  # no two scenarios of a panel share a place (engines, engine TP, ETP once did)
        places = [line.get_xdata()[0] for line in ax.get_lines()] + [t.get_position()[0] for t in ax.texts]
        assert len(places) == len(set(places)), ax.get_title()
    legend = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert legend == ["raw · non-colocate", "raw · colocate", "bridge · non-colocate", "bridge · colocate"]
    out = plot_steady_update_time(table, tmp_path / "steady.png")
    width, height = png_size(out)
    assert width <= MAX_WIDTH_PX and height > 600


def test_phase_breakdown_of_full_size_rows(tmp_path: Path, table: pd.DataFrame) -> None:
    full = sorted(table.loc[table["tags"].str.contains("full-size"), "scenario"])
    assert len(full) == 6  # 4 of the CPU matrix, 2 on vLLM
    fig = phases_figure(table)
    assert fig is not None and sorted(tick_labels(fig, "y")) == full
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["gather", "convert", "transfer", "load", "other"]
    out = plot_phases(table, tmp_path / "phases.png")
    assert out is not None and png_size(out)[0] <= MAX_WIDTH_PX
    assert plot_phases(table[~table["scenario"].isin(full)], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_gbps_against_the_bound_only_with_a_bound(tmp_path: Path, table: pd.DataFrame) -> None:
    assert gbps_figure(table) is None and plot_gbps_vs_bound(table, tmp_path / "g.png") is None
    bounded = table.assign(bound_s=table["steady_s"] / 2)
    fig = gbps_figure(bounded)
    assert fig is not None and tick_labels(fig, "y") == list(table["scenario"])
    out = plot_gbps_vs_bound(bounded, tmp_path / "gbps.png")
    assert out is not None and png_size(out)[0] <= MAX_WIDTH_PX
    written = {p.name for p in write_run_plots(bounded, tmp_path / "plots")}
    assert written == {"steady_update_time.png", "phases.png", "gbps_vs_bound.png"}


def test_regression_plot(tmp_path: Path, table: pd.DataFrame) -> None:
    base = table.assign(verdict="PASS", expect_met=True)  # every row timed (as expected in both runs)
    run = base.copy()
    run.loc[0, "steady_s"] *= 3
    run = run.drop(index=[1])  # missing from the run: not on the plot
    report = compare(
        RunTables("run", tmp_path, normalise_table(run)), RunTables("base", tmp_path, normalise_table(base))
    )
    fig = regression_figure(report.rows, "run vs base")
    common = list(run["scenario"])
    assert gids(fig) == set(common) and tick_labels(fig, "y") == common
    dots = {line.get_gid(): line for line in fig.axes[0].get_lines() if line.get_gid()}
    assert (
        dots[common[0]].get_xdata()[0] == pytest.approx(3.0) and dots[common[0]].get_color() == CHANGE_COLORS["slower"]
    )
    assert len(dots) == len(common) - 1  # the unfinished scenario has no steady time: "not timed"
    out = plot_regression(report.rows, tmp_path / "regression.png")
    assert png_size(out)[0] <= MAX_WIDTH_PX


def test_a_layout_label_names_what_the_id_sets_apart() -> None:
    row = {"scenario": "vllm/qwen3-moe/tp2-pp1-ep2-etp2/noncolocate-engine-tp2/raw/chunk-1048576", "engine": "vllm"}
    assert layout_label({**row, "tp": 2, "pp": 1, "ep": 2}) == "TP2 PP1 EP2 ETP2\nengine TP2 · chunk-1 MiB"
    assert layout_label({"scenario": "a run's own name", "tp": 4, "pp": 2, "ep": 1}) == "TP4 PP2"  # from columns
    both = {"scenario": "qwen3/tp1-pp1/noncolocate-engines2-engine-tp2/raw", "engine": "embedded"}
    assert layout_label(both) == "TP1 PP1\n2 engines, engine TP2"

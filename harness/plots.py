"""Matplotlib figures a person reads (Agg backend: no display needed).

Every figure is at most `MAX_WIDTH_PX` pixels wide at `DPI` with text of at least 9 pt, so it reads at
100 %; tall tables grow downwards. Each `*_figure` returns the figure (tests read its tick labels,
legend entries and the artists' gids, which are the scenario ids); each `plot_*` writes a PNG.

- `plot_steady_update_time`: steady-state time as small multiples, one panel per model (and engine,
  when it is not the default), the layouts (TP x PP x EP, and a scenario's suffix) on the x axis; raw
  and bridge side by side in colour, non-colocate and colocate as markers.
- `plot_phases`: the phase breakdown (gather / convert / transfer / load, stacked, and what the
  phases do not cover) of the rows tagged `full-size`; None when there are none.
- `plot_gbps_vs_bound`: achieved GB/s against the same run's bound (``bound_s``); None when no row
  has a measured bound.
- `plot_regression`: run / baseline per scenario with each row's noise band (`harness.report`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # after matplotlib.use: the backend must be chosen first
import pandas as pd
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from harness.record import PHASES
from reference_impl.engine import DEFAULT_ENGINE

DPI = 100
MAX_WIDTH_PX = 1600
FONT_PT = 10
MODES: tuple[str, ...] = ("raw", "bridge")
MODE_COLORS: dict[str, str] = {"raw": "#4C72B0", "bridge": "#DD8452"}
PLACEMENT_MARKERS: dict[bool, str] = {False: "o", True: "^"}
PHASE_COLORS: dict[str, str] = {"gather": "#4C72B0", "convert": "#DD8452", "transfer": "#55A868", "load": "#C44E52"}
CHANGE_COLORS: dict[str, str] = {"slower": "#C44E52", "faster": "#55A868", "within noise": "#555555"}
GROUP_KEYS: tuple[str, ...] = ("model", "tp", "pp", "ep", "etp", "colocate", "engine")
FULL_SIZE_TAG = "full-size"
RATIO_TICKS: tuple[float, ...] = (0.1, 0.2, 0.33, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)

# Offsets of the four (mode, placement) slots around a layout's x position.
SLOT_OFFSETS: dict[tuple[str, bool], float] = {
    ("raw", False): -0.27,
    ("raw", True): -0.09,
    ("bridge", False): 0.09,
    ("bridge", True): 0.27,
}


def _placement(colocate: object) -> str:
    return "colocate" if _truthy(colocate) else "non-colocate"


def _truthy(value: object) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes")


def _human_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return str(n)


def _id_parts(row: dict) -> list[str]:
    """The scenario id's levels after the engine (model, layout, placement, mode, suffix...)."""
    parts = str(row.get("scenario") or "").split("/")
    engine = row.get("engine") or DEFAULT_ENGINE
    return parts[1:] if engine != DEFAULT_ENGINE and parts and parts[0] == engine else parts


def _suffix(row: dict) -> str:
    """What follows the mode in a scenario id (``chunk-1048576`` -> ``chunk-1 MiB``), or ""."""
    suffix = "/".join(_id_parts(row)[4:])
    return re.sub(r"\d{4,}", lambda m: _human_bytes(int(m.group())), suffix)


def _engines(row: dict) -> str:
    """The engines a placement names beyond its kind (``noncolocate-engines2`` -> ``2 engines``,
    ``noncolocate-engine-tp2`` -> ``engine TP2``, both -> ``2 engines, engine TP2``), or ""."""
    parts = _id_parts(row)
    extra = parts[2].partition("-")[2] if len(parts) > 2 else ""
    extra = re.sub(r"engine-tp(\d+)", r"engine TP\1", extra)
    return re.sub(r"^engines(\d+)(-|$)", lambda m: f"{m[1]} engines" + (", " if m[2] else ""), extra)


def layout_label(row: dict) -> str:
    """'TP2 PP1 EP2' (the id's layout level: EP and ETP where the id names them), then what sets the scenario
    apart from others of that layout, on a second line: its engines (``2 engines``, ``engine TP2``) and its
    suffix."""
    parts = _id_parts(row)
    if len(parts) > 1 and re.fullmatch(r"tp\d+-pp\d+(-ep\d+)?(-etp\d+)?", parts[1]):
        text = " ".join(level.upper() for level in parts[1].split("-"))
    else:  # an id of another shape: the table's columns
        text = f"TP{row['tp']} PP{row['pp']}" + (f" EP{row['ep']}" if int(row.get("ep") or 1) > 1 else "")
    apart = " · ".join(filter(None, (_engines(row), _suffix(row))))
    return f"{text}\n{apart}" if apart else text


def _prepared(df: pd.DataFrame) -> pd.DataFrame:
    data = df.copy()
    if "export_mode" not in data and "mode" in data:
        data = data.rename(columns={"mode": "export_mode"})
    defaults = {"model": "", "engine": DEFAULT_ENGINE, "tp": 1, "pp": 1, "ep": 1, "etp": 1, "colocate": False}
    for key, value in defaults.items():
        if key not in data:
            data[key] = value
    data["engine"] = data["engine"].replace("", DEFAULT_ENGINE).fillna(DEFAULT_ENGINE)
    for col in ("steady_s", "bytes_per_sync", "bound_s", *(f"{p}_s" for p in PHASES)):
        if col in data:
            data[col] = pd.to_numeric(data[col], errors="coerce")
    return data


def steady_table(df: pd.DataFrame) -> pd.DataFrame:
    """Steady-state seconds per layout group (rows) and mode (columns: raw, bridge); NaN if absent.

    Several rows of one group and mode (e.g. tags) are combined by their median.
    """
    if df.empty or "steady_s" not in df:
        return pd.DataFrame(columns=list(MODES))
    data = _prepared(df)
    table = data.groupby([*GROUP_KEYS, "export_mode"], sort=True)["steady_s"].median().unstack("export_mode")
    return table.reindex(columns=list(MODES))


def _save(fig: Figure, out_path: Path | str) -> Path:
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, dpi=DPI)
    finally:
        plt.close(fig)
    return out


def _empty(title: str, text: str) -> Figure:
    fig, ax = plt.subplots(figsize=(8, 3), dpi=DPI)
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=FONT_PT)
    ax.set_axis_off()
    ax.set_title(title, fontsize=FONT_PT + 2)
    return fig


def _plain_log_axis(axis: Axis) -> None:
    """Log ticks at 1, 2, 5 x 10^k written as plain numbers (0.02, not 2 x 10^-2)."""
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _row_height_figure(n_rows: int, width_in: float = 12.0) -> tuple[Figure, plt.Axes]:
    """One axis with a row per item: 0.26 in per row, at least 3 in tall."""
    return plt.subplots(figsize=(width_in, max(3.0, 1.6 + 0.26 * n_rows)), dpi=DPI, layout="constrained")


def steady_figure(df: pd.DataFrame) -> Figure:
    """Small multiples of steady-state update time (s): a panel per (model, engine), layouts on x,
    raw/bridge as colours side by side, non-colocate/colocate as markers. A row without a steady time
    is an "n/a" at its slot. Every point or mark carries its scenario id as gid."""
    data = _prepared(df) if len(df) and "steady_s" in df else pd.DataFrame()
    if data.empty:
        return _empty("Steady-state update time", "no steady-state data")
    panels = list(dict.fromkeys(zip(data["model"], data["engine"], strict=True)))
    panels.sort(key=lambda p: p[1] != DEFAULT_ENGINE)
    ncols = min(2, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    width = MAX_WIDTH_PX / DPI if ncols == 2 else 9.0
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(width, 1.2 + 3.6 * nrows), dpi=DPI, squeeze=False, layout="constrained"
    )
    for ax in axes.ravel()[len(panels) :]:
        ax.set_axis_off()
    for ax, (model, engine) in zip(axes.ravel(), panels, strict=False):
        rows = data[(data["model"] == model) & (data["engine"] == engine)].to_dict(orient="records")
        layouts = list(dict.fromkeys(layout_label(r) for r in rows))
        finite = [float(r["steady_s"]) for r in rows if r["steady_s"] > 0]
        log = bool(finite) and max(finite) / min(finite) > 30
        for r in rows:
            x = layouts.index(layout_label(r)) + SLOT_OFFSETS.get((r["export_mode"], _truthy(r["colocate"])), 0.0)
            y = float(r["steady_s"])
            if math.isnan(y):
                mark = ax.text(x, 0.02, "n/a", transform=ax.get_xaxis_transform(), ha="center", fontsize=9, color="0.4")
                mark.set_gid(r["scenario"])
                continue
            color = MODE_COLORS.get(r["export_mode"], "0.3")
            ax.plot([x], [y], PLACEMENT_MARKERS[_truthy(r["colocate"])], color=color, markersize=8, gid=r["scenario"])
        ax.set_xticks(
            range(len(layouts)),
            layouts,
            fontsize=9,
            rotation=20 if len(layouts) > 5 else 0,
            ha="right" if len(layouts) > 5 else "center",
        )
        ax.set_xlim(-0.6, len(layouts) - 0.4)
        if log:
            ax.set_yscale("log")
            _plain_log_axis(ax.yaxis)
        elif finite:
            ax.set_ylim(0, max(finite) * 1.15)
        ax.tick_params(axis="y", labelsize=9)
        ax.set_title(model + (f" · {engine}" if engine != DEFAULT_ENGINE else ""), fontsize=FONT_PT + 1)
        ax.set_ylabel("steady time (s)", fontsize=FONT_PT)
        ax.grid(axis="y", alpha=0.3)
    handles = [
        Line2D(
            [],
            [],
            linestyle="",
            marker=PLACEMENT_MARKERS[co],
            color=MODE_COLORS[mode],
            markersize=8,
            label=f"{mode} · {_placement(co)}",
        )
        for mode in MODES
        for co in (False, True)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=FONT_PT, frameon=False)
    fig.suptitle("Steady-state update time per layout (median of syncs ≥ 1)", fontsize=FONT_PT + 2)
    return fig


def plot_steady_update_time(df: pd.DataFrame, out_path: Path | str) -> Path:
    """Write `steady_figure(df)` as a PNG (a figure that says so when there is no data); returns the path."""
    return _save(steady_figure(df), out_path)


def full_size_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Rows whose ``tags`` (comma-separated) include `FULL_SIZE_TAG`."""
    if not len(df) or "tags" not in df:
        return df.iloc[0:0]
    tagged = df["tags"].fillna("").astype(str).map(lambda t: FULL_SIZE_TAG in t.split(","))
    return df[tagged]


def phases_figure(df: pd.DataFrame) -> Figure | None:
    """Stacked horizontal bars of the phase medians (s) per full-size scenario, plus the part of the
    steady time the phases do not cover ("other"); None when no row is tagged full-size."""
    rows = _prepared(full_size_rows(df)) if len(full_size_rows(df)) else None
    if rows is None:
        return None
    fig, ax = _row_height_figure(len(rows))
    labels = list(rows["scenario"])
    left = [0.0] * len(rows)
    for phase in (*PHASES, "other"):
        if phase == "other":
            covered = rows[[f"{p}_s" for p in PHASES]].fillna(0).sum(axis=1)
            widths = [
                max(0.0, s - c) if not math.isnan(s) else 0.0 for s, c in zip(rows["steady_s"], covered, strict=True)
            ]
        else:
            widths = [0.0 if math.isnan(v) else float(v) for v in rows[f"{phase}_s"]]
        ax.barh(labels, widths, left=left, color=PHASE_COLORS.get(phase, "0.75"), label=phase, height=0.6)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=9)
    ax.set_xlabel("seconds (median of syncs ≥ 1)", fontsize=FONT_PT)
    ax.set_title("Where a steady sync's time goes (full-size scenarios)", fontsize=FONT_PT + 2)
    ax.legend(title="phase", fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return fig


def plot_phases(df: pd.DataFrame, out_path: Path | str) -> Path | None:
    """Write `phases_figure(df)` as a PNG; None (nothing written) when there is no full-size row."""
    fig = phases_figure(df)
    return _save(fig, out_path) if fig is not None else None


def gbps_figure(df: pd.DataFrame) -> Figure | None:
    """Achieved GB/s (``bytes_per_sync / steady_s``) per scenario beside the same run's bound
    (``bytes_per_sync / bound_s``); None when no row of the table has a measured ``bound_s``."""
    if "bound_s" not in df or not df["bound_s"].notna().any():
        return None
    rows = _prepared(df)
    fig, ax = _row_height_figure(len(rows))
    labels = list(rows["scenario"])
    achieved = (rows["bytes_per_sync"] / rows["steady_s"] / 1e9).tolist()
    bound = (rows["bytes_per_sync"] / rows["bound_s"] / 1e9).tolist()
    y = list(range(len(rows)))
    ax.scatter(achieved, y, color=MODE_COLORS["raw"], s=40, label="achieved", zorder=3)
    ax.scatter(bound, y, color="black", marker="|", s=200, label="bound (same run)", zorder=3)
    for yi, a, b in zip(y, achieved, bound, strict=True):
        if not (math.isnan(a) or math.isnan(b)):
            ax.plot([a, b], [yi, yi], color="0.7", zorder=2)
    ax.set_yticks(y, labels, fontsize=9)
    ax.invert_yaxis()
    positive = [v for v in achieved + bound if v > 0 and not math.isnan(v)]
    if positive and max(positive) / min(positive) > 30:
        ax.set_xscale("log")
        _plain_log_axis(ax.xaxis)
    ax.set_xlabel("GB/s per steady sync", fontsize=FONT_PT)
    ax.set_title("Achieved transfer rate against the same run's bound", fontsize=FONT_PT + 2)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return fig


def plot_gbps_vs_bound(df: pd.DataFrame, out_path: Path | str) -> Path | None:
    """Write `gbps_figure(df)` as a PNG; None (nothing written) when no row has a measured bound."""
    fig = gbps_figure(df)
    return _save(fig, out_path) if fig is not None else None


def regression_figure(rows: pd.DataFrame, title: str = "") -> Figure:
    """Run / baseline per scenario compared by a regression report (`harness.report.COLUMNS`): the
    noise band as a grey bar from 1/band to band, the ratio as a dot (red slower, green faster, grey
    within noise), "not timed" where there is no ratio, and "verdict" for a verdict regression."""
    shown = rows[~rows["change"].isin(["new", "missing"])] if len(rows) else rows
    if not len(shown):
        return _empty("Run against baseline", "no scenario in both runs")
    fig, ax = _row_height_figure(len(shown))
    labels = list(shown["scenario"])
    xs: list[float] = [1.0]
    for y, r in enumerate(shown.to_dict(orient="records")):
        ratio, band = float(r["ratio"]), float(r["band"])
        if not math.isnan(band):
            ax.plot([1 / band, band], [y, y], color="0.85", linewidth=7, solid_capstyle="butt", zorder=1)
            xs += [1 / band, band]
        if math.isnan(ratio):
            mark = ax.text(1.0, y, "not timed", ha="center", va="center", fontsize=8, color="0.45", zorder=3)
        else:
            (mark,) = ax.plot(
                [ratio], [y], "o", color=CHANGE_COLORS.get(r["time_change"], "0.3"), markersize=7, zorder=3
            )
            xs.append(ratio)
        mark.set_gid(r["scenario"])
        if r["verdict_change"] == "regressed":
            ax.annotate(
                f"verdict {r['run_verdict']}",
                (1, y),
                xycoords=("axes fraction", "data"),
                xytext=(-4, 0),
                textcoords="offset points",
                ha="right",
                va="center",
                fontsize=8,
                color=CHANGE_COLORS["slower"],
            )
    ax.axvline(1.0, color="0.3", linewidth=1)
    ax.set_xscale("log")
    lo, hi = min(xs) / 1.3, max(xs) * 1.3
    ax.set_xlim(lo, hi)
    ax.set_xticks([t for t in RATIO_TICKS if lo <= t <= hi], [f"{t:g}" for t in RATIO_TICKS if lo <= t <= hi])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yticks(range(len(labels)), labels, fontsize=9)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlabel("run / baseline (> 1: slower), measured as report.csv's `measure`", fontsize=FONT_PT)
    ax.set_title(("Run against baseline" + (f": {title}" if title else "")), fontsize=FONT_PT + 2)
    ax.grid(axis="x", alpha=0.3, which="both")
    handles = [Line2D([], [], color="0.85", linewidth=7, label="noise band")]
    handles += [Line2D([], [], linestyle="", marker="o", color=c, label=k) for k, c in CHANGE_COLORS.items()]
    ax.legend(handles=handles, fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_regression(rows: pd.DataFrame, out_path: Path | str, title: str = "") -> Path:
    """Write `regression_figure(rows, title)` as a PNG; returns the path."""
    return _save(regression_figure(rows, title), out_path)


def write_run_plots(df: pd.DataFrame, plots_dir: Path | str) -> list[Path]:
    """Every plot of one run's summary table into `plots_dir` (steady_update_time.png, phases.png when
    there are full-size rows, gbps_vs_bound.png when some row has a measured ``bound_s``); returns what
    was written."""
    out = Path(plots_dir)
    written: Sequence[Path | None] = (
        plot_steady_update_time(df, out / "steady_update_time.png"),
        plot_phases(df, out / "phases.png"),
        plot_gbps_vs_bound(df, out / "gbps_vs_bound.png"),
    )
    return [p for p in written if p is not None]


# (metrics drawn in the panel, y label, divisor of the values)
RESOURCE_PANELS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("rss_bytes",), "RSS (MiB)", float(1 << 20)),
    (("threads",), "threads", 1.0),
    (("fds",), "open file descriptors", 1.0),
    (("shm_segments", "host_shm_segments"), "/dev/shm segments", 1.0),
)
SERIES_NAMES: dict[str, str] = {"shm_segments": "the scenario's", "host_shm_segments": "whole host"}
RESOURCE_DPI = 100


def plot_resources(samples: pd.DataFrame, out_path: Path | str) -> Path:
    """Resource samples of a soak against the sync index: one column per scenario, one row per metric
    (RSS in MiB, threads, open descriptors, the host's /dev/shm segments), one line per process. `samples`
    is `harness.soak.samples_frame` (scenario, sync, process, metric, value). At most `MAX_WIDTH_PX` pixels
    wide whatever the number of scenarios; an empty table gives a figure that says so."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    scenarios = list(dict.fromkeys(samples["scenario"])) if not samples.empty else []
    cols = max(1, len(scenarios))
    width_in = min(MAX_WIDTH_PX / RESOURCE_DPI, 4.0 + 5.0 * cols)
    fig, axes = plt.subplots(
        len(RESOURCE_PANELS), cols, figsize=(width_in, 2.6 * len(RESOURCE_PANELS)), squeeze=False, sharex="col"
    )
    try:
        if not scenarios:
            axes[0][0].text(0.5, 0.5, "no resource samples", ha="center", va="center", transform=axes[0][0].transAxes)
        for c, scenario in enumerate(scenarios):
            part = samples[samples["scenario"] == scenario]
            for r, (metrics, label, scale) in enumerate(RESOURCE_PANELS):
                ax = axes[r][c]
                for metric in metrics:
                    rows = part[part["metric"] == metric]
                    for process, series in rows.groupby("process", sort=False):
                        name = SERIES_NAMES.get(metric, str(process))
                        ax.plot(series["sync"], series["value"] / scale, label=name, linewidth=1.0)
                ax.set_ylabel(label, fontsize=8)
                ax.grid(alpha=0.3)
                ax.tick_params(labelsize=7)
                if r == 0:
                    ax.set_title(scenario, fontsize=9)
                if r in (0, len(RESOURCE_PANELS) - 1):
                    ax.legend(fontsize=7, loc="best")
                if r == len(RESOURCE_PANELS) - 1:
                    ax.set_xlabel("sync", fontsize=8)
        fig.tight_layout()
        fig.savefig(out, dpi=RESOURCE_DPI)
    finally:
        plt.close(fig)
    return out

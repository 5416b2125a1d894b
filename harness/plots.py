"""Matplotlib figures of a run's summary table (Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # after matplotlib.use: the backend must be chosen first
import pandas as pd

from reference_impl.engine import DEFAULT_ENGINE

MODES: tuple[str, ...] = ("raw", "bridge")
MODE_COLORS: dict[str, str] = {"raw": "#4C72B0", "bridge": "#DD8452"}
GROUP_KEYS: tuple[str, ...] = ("model", "tp", "pp", "ep", "colocate", "engine")


def _group_label(model: str, tp: object, pp: object, ep: object, colocate: object, engine: object = "") -> str:
    place = "colocate" if bool(colocate) else "non-colocate"
    on = f" · {engine}" if engine and engine != DEFAULT_ENGINE else ""
    return f"{model}\nTP{tp} PP{pp} EP{ep}\n{place}{on}"


def steady_table(df: pd.DataFrame) -> pd.DataFrame:
    """Steady-state seconds per layout group (rows) and mode (columns: raw, bridge); NaN if absent.

    Several rows of one group and mode (e.g. tags) are combined by their median.
    """
    if df.empty or "steady_s" not in df:
        return pd.DataFrame(columns=list(MODES))
    data = df.copy()
    defaults = {"model": "", "engine": DEFAULT_ENGINE}
    for key in GROUP_KEYS:
        if key not in data:
            data[key] = defaults.get(key, 1)
    data["engine"] = data["engine"].replace("", DEFAULT_ENGINE).fillna(DEFAULT_ENGINE)
    data["steady_s"] = pd.to_numeric(data["steady_s"], errors="coerce")
    table = data.groupby([*GROUP_KEYS, "export_mode"], sort=True)["steady_s"].median().unstack("export_mode")
    return table.reindex(columns=list(MODES))


def plot_steady_update_time(df: pd.DataFrame, out_path: Path | str) -> Path:
    """Grouped bars of steady-state update time (s) per layout, raw beside bridge; writes a PNG.

    Missing values are drawn as no bar with an "n/a" mark; an empty table gives a figure that says
    so, so callers always get a file.
    """
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = steady_table(df)
    width = max(6.0, 1.6 * len(table) + 2.0)
    fig, ax = plt.subplots(figsize=(width, 4.8))
    try:
        if table.empty:
            ax.text(0.5, 0.5, "no steady-state data", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
        else:
            labels = [_group_label(*key) for key in table.index]
            finite = [v for v in table.to_numpy().ravel() if not math.isnan(float(v))]
            top = max(finite) if finite else 1.0
            bar_w = 0.38
            for i, mode in enumerate(MODES):
                offsets = [x + (i - 0.5) * bar_w for x in range(len(table))]
                values = [float(v) for v in table[mode]]
                heights = [0.0 if math.isnan(v) else v for v in values]
                bars = ax.bar(offsets, heights, bar_w, label=mode, color=MODE_COLORS[mode])
                for bar, value in zip(bars, values, strict=True):
                    text = "n/a" if math.isnan(value) else f"{value:.3g}"
                    ax.annotate(
                        text,
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        xytext=(0, 2),
                        textcoords="offset points",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
            ax.set_xticks(range(len(table)), labels, fontsize=7)
            positive = [v for v in finite if v > 0]
            if positive and top / min(positive) > 100:  # ms-scale small models beside s-scale real ones
                ax.set_yscale("log")
                ax.set_ylim(min(positive) / 2, top * 3)
            else:
                ax.set_ylim(0, top * 1.18 if top > 0 else 1.0)
            ax.legend(title="export mode")
        ax.set_xlabel("scenario (model, TP/PP/EP layout, placement)")
        ax.set_ylabel("steady-state update time (s)")
        ax.set_title("Weight-sync steady-state update time: raw vs bridge")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out


# (metrics drawn in the panel, y label, divisor of the values)
RESOURCE_PANELS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("rss_bytes",), "RSS (MiB)", float(1 << 20)),
    (("threads",), "threads", 1.0),
    (("fds",), "open file descriptors", 1.0),
    (("shm_segments", "host_shm_segments"), "/dev/shm segments", 1.0),
)
SERIES_NAMES: dict[str, str] = {"shm_segments": "the scenario's", "host_shm_segments": "whole host"}
MAX_WIDTH_PX = 1600
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

"""The model against a run table: predicted vs measured steady seconds for every row of a run.

Inputs: a run folder (`results/<run-id>/`: `summary.csv` and `records/*.json`) and this host's measured
links (`measure.measure`). Per row, the workload comes from the row (`bytes_per_sync`), the model entry's
config (`params.param_count(...).tensors`, by hand formula) and the record's scenario (`chunk_bytes`,
layout); the engine call cost is the median `/start_weight_update` round trip of that record (a call
that does nothing but answer). One number per export mode is calibrated, not measured: `tensor_s`, the
export's fixed cost per tensor, from that mode's single-rank rows (TP = PP = EP = 1) of the same run,
as (export seconds - bytes / memcpy) / tensors; every multi-rank row is then a prediction.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pandas as pd

from harness.scale.params import param_count
from harness.scale.update_time import Links, Topology, Workload, predict
from reference_impl.models.registry import load_model


def cpu_links(measured: dict[str, float], call_s: float, tensor_s: float) -> Links:
    """This host's `Links` (CPU: no NVLink, PCIe or HBM; those fields are unused on CPU)."""
    nan = float("nan")
    return Links(
        name="this host",
        nvlink=nan,
        pcie=nan,
        ib=nan,
        hbm_copy=nan,
        memcpy=measured["memcpy"],
        tcp=measured["tcp"],
        call_s=call_s,
        tensor_s=tensor_s,
        collective_s=measured["gloo_round_trip_s"],
    )


def _record(run: Path, scenario: str) -> dict[str, Any]:
    return json.loads((run / "records" / (scenario.replace("/", "__") + ".json")).read_text())


def _call_s(record: dict[str, Any]) -> float:
    ms = [c["ms"] for c in record.get("http", []) if c["route"].endswith("/start_weight_update") and c["status"] == 200]
    return statistics.median(ms) / 1e3 if ms else float("nan")


def _rows(run: Path) -> list[dict[str, Any]]:
    df = pd.read_csv(run / "summary.csv")
    out = []
    for row in df.to_dict("records"):
        if row["verdict"] != "PASS" or not isinstance(row["steady_s"], float) or math.isnan(row["steady_s"]):
            continue
        row["mode"] = row.get("export_mode", row.get("mode"))  # `mode` in tables written before the rename
        rec = _record(run, row["scenario"])
        sc = rec["scenario"]
        count = param_count(load_model(row["model"]).config)
        row |= {"tensors": count.tensors, "chunk_bytes": sc["chunk_bytes"], "call_s": _call_s(rec)}
        row["expert_bytes"] = count.experts * (row["bytes_per_sync"] // max(count.total, 1))
        row["stacked_experts"] = count.stacked_experts
        row["export_s"] = row["gather_s"] + row["convert_s"]
        out.append(row)
    return out


def _tensor_s(rows: list[dict[str, Any]], mode: str, memcpy_gbps: float) -> float:
    single = [r for r in rows if r["mode"] == mode and r["tp"] == r["pp"] == r["ep"] == 1 and not r["colocate"]]
    per = [(r["export_s"] - r["bytes_per_sync"] / (memcpy_gbps * 1e9)) / r["tensors"] for r in single]
    return max(statistics.median(per), 0.0) if per else float("nan")


def compare(run: Path, measured: dict[str, float]) -> pd.DataFrame:
    """One row per PASS row of `run`: scenario, mode, predicted and measured steady seconds, their
    ratio, the predicted bottleneck phase, and the constants used (`tensor_s`, `call_s`)."""
    rows = _rows(run)
    tensor_s = {m: _tensor_s(rows, m, measured["memcpy"]) for m in ("raw", "bridge")}
    out = []
    for r in rows:
        links = cpu_links(measured, r["call_s"], tensor_s[r["mode"]])
        topo = Topology(tp=r["tp"], pp=r["pp"], ep=r["ep"], colocate=bool(r["colocate"]), device="cpu")
        w = Workload(
            bytes=int(r["bytes_per_sync"]),
            tensors=r["tensors"],
            chunk_bytes=int(r["chunk_bytes"]),
            expert_bytes=int(r["expert_bytes"]),
            stacked_experts=bool(r["stacked_experts"]),
        )
        p = predict(w, topo, links)
        out.append(
            {
                "scenario": r["scenario"],
                "mode": r["mode"],
                "predicted_s": p.total,
                "steady_s": r["steady_s"],
                "ratio": r["steady_s"] / p.total,
                "bottleneck": p.bottleneck,
                "tensor_s": links.tensor_s,
                "call_s": links.call_s,
            }
        )
    return pd.DataFrame(out)

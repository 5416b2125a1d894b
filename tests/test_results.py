"""Unit tests of `harness.results` and `harness.plots` on two hand-built records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from harness.plots import plot_steady_update_time, steady_table
from harness.record import PHASES, Bound, ChunkRecord, HttpCall, OracleFailure, RunRecord, SyncRecord
from harness.results import (
    COLUMNS,
    MARKDOWN_HEADER,
    http_200_summary,
    markdown_table,
    summarize,
    summary_table_rows,
    write_env,
    write_summary,
)
from harness.scenario import Scenario
from harness.side_by_side import engine_comparison, export_mode_comparison
from reference_impl.engine import engine_kind

NAMES = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]


def make_record(mode: str, totals: list[float], nbytes: int, transfer: list[float]) -> RunRecord:
    """A passing record with one sync per entry of `totals` (2 chunks, 3 names each)."""
    sums = {name: f"c-{i}" for i, name in enumerate(NAMES)}
    http = []
    syncs = []
    for s, (total, tr) in enumerate(zip(totals, transfer, strict=True)):
        http.append(HttpCall(route="/start_weight_update", status=200, ms=1.0, sync=s))
        http += [HttpCall(route="/update_weights", status=200, ms=2.0, sync=s, chunk=c) for c in (0, 1)]
        http.append(HttpCall(route="/finish_weight_update", status=200, ms=1.0, sync=s))
        syncs.append(
            SyncRecord(
                index=s,
                weight_version=s,
                export_mode=mode,
                chunks_planned=2,
                chunks_sent=2,
                chunks_received=2,
                chunks=[
                    ChunkRecord(index=0, names=NAMES[:2], bytes=nbytes // 2, sent=True, received=True),
                    ChunkRecord(index=1, names=NAMES[2:], bytes=nbytes // 2, sent=True, received=True),
                ],
                bytes=nbytes,
                phases={"gather": 0.01 * (s + 1), "convert": 0.02, "transfer": tr, "load": 0.03},
                total_s=total,
                names_sent=list(NAMES),
                sent_checksums=dict(sums),
                engine_checksums=dict(sums),
                engine_update_counts=dict.fromkeys(NAMES, 1),
                finished=True,
            )
        )
    sid = f"qwen3-vl/tp2-pp2/noncolocate/{mode}"
    return RunRecord(
        scenario_id=sid,
        scenario=Scenario(
            model="qwen3-vl",
            tp=2,
            pp=2,
            export_mode=mode,
            syncs=len(totals),
            chunk_bytes=nbytes // 2,
            seed=0,
            tags=["cpu"],
        ),
        http=http,
        syncs=syncs,
        requested_export_mode=mode,
        checkpoint_checksums=dict(sums),
        engine_shards=list(NAMES),
    )


@pytest.fixture
def records() -> list[RunRecord]:
    raw = make_record("raw", [2.0, 0.5, 0.7, 0.6], 3_000_000_000, [0.9, 0.2, 0.4, 0.3])
    bridge = make_record("bridge", [3.0, 1.5, 1.0], 3_000_000_000, [1.0, 0.8, 0.6])
    bridge.syncs[2].engine_checksums[NAMES[1]] = "stale"  # -> PARITY_FAIL
    return [raw, bridge]


def test_summarize_numbers_by_hand(records: list[RunRecord]) -> None:
    df = summarize(records)
    assert list(df.columns) == list(COLUMNS)
    assert len(df) == 2
    raw, bridge = df.iloc[0], df.iloc[1]
    assert raw["first_s"] == pytest.approx(2.0)
    assert raw["steady_s"] == pytest.approx(0.6)  # median(0.5, 0.7, 0.6)
    assert raw["steady_gbps"] == pytest.approx(3.0 / 0.6)  # 3e9 bytes / 0.6 s / 1e9
    assert raw["transfer_s"] == pytest.approx(0.3)  # median(0.2, 0.4, 0.3)
    assert raw["gather_s"] == pytest.approx(0.03)  # median(0.02, 0.03, 0.04)
    assert raw["phases_sum_s"] == pytest.approx(0.39)  # median of the sums 0.27, 0.48, 0.39
    assert bridge["first_s"] == pytest.approx(3.0)
    assert bridge["steady_s"] == pytest.approx(1.25)  # median(1.5, 1.0)
    assert bridge["steady_gbps"] == pytest.approx(3.0 / 1.25)
    assert raw["bytes_per_sync"] == 3_000_000_000 and raw["chunks"] == 2 and raw["syncs"] == 4
    assert raw["http_200"] == "start 4/4 · update 8/8 · finish 4/4"
    assert (raw["tp"], raw["ep"], raw["pp"], raw["colocate"]) == (2, 1, 2, False)
    assert raw["verdict"] == "PASS" and raw["expect_met"] and raw["message"] == ""
    assert bridge["verdict"] == "PARITY_FAIL" and not bridge["expect_met"]
    assert f"'{NAMES[1]}'" in bridge["message"] and bridge["message"].startswith("sync 2")
    assert set(PHASES) == {c.removesuffix("_s") for c in COLUMNS if c.removesuffix("_s") in PHASES}


def test_times_are_the_harness_clock_and_a_trainer_timer_that_leaves_the_export_out_is_named(
    tmp_path: Path, records: list[RunRecord]
) -> None:
    # A sync timer started after the export: the trainer said 0.040 s where the harness clocked 0.097 s, and a
    # report against a baseline called it 2.67x faster.
    raw, bridge = records
    for s, harness_s in zip(raw.syncs, [2.1, 0.9, 1.3, 1.0], strict=True):
        s.harness_s, s.hashing_s = harness_s, 0.1  # the trainer's total_s: 2.0, 0.5, 0.7, 0.6
    for s in bridge.syncs:  # a timer that covers the sync: the call's own cost apart, the same time
        s.harness_s, s.hashing_s = s.total_s + 0.012, 0.0
    df = summarize(records).set_index("export_mode")
    assert df.loc["raw", "first_s"] == pytest.approx(2.0)  # 2.1 - 0.1 of hashing what was sent
    assert df.loc["raw", "steady_s"] == pytest.approx(0.9)  # median(0.8, 1.2, 0.9)
    assert (df.loc["raw", "steady_min_s"], df.loc["raw", "steady_max_s"]) == pytest.approx((0.8, 1.2))
    assert df.loc["raw", "steady_reported_s"] == pytest.approx(0.6)  # median(0.5, 0.7, 0.6), the trainer's
    assert df.loc["raw", "steady_gbps"] == pytest.approx(3.0 / 0.9)
    assert df.loc["bridge", "steady_s"] == pytest.approx(1.262)
    write_summary(summarize(records), tmp_path, "r", None)
    md = (tmp_path / "summary.md").read_text()
    section = md.split("## Trainer timers that leave part of the sync out")[1].split("##")[0]
    assert "- `qwen3-vl/tp2-pp2/noncolocate/raw`: steady 0.900 s on the harness's clock, 0.600 s on the trainer's" in (
        section
    )
    assert "bridge" not in section  # 12 ms apart: the call's own cost
    for s in raw.syncs:  # records made before the harness clocked syncs: the trainer's time, and no section
        s.harness_s = None
    assert summarize(records).iloc[0]["steady_s"] == pytest.approx(0.6)
    write_summary(summarize(records), tmp_path, "r2", None)
    assert "Trainer timers" not in (tmp_path / "summary.md").read_text()


def test_bound_and_efficiency_by_hand(records: list[RunRecord]) -> None:
    raw, bridge = records
    raw.bound = Bound(gather_s=0.15, wire_s=0.27, gather_repeats_s=[0.2, 0.15, 0.18], wire_repeats_s=[0.3, 0.4, 0.27])
    bridge.bound = Bound(gather_s=0.4, wire_s=None)  # a channel without a bare counterpart (vLLM's)
    df = summarize(records).set_index("export_mode")
    assert df.loc["raw", "bound_s"] == pytest.approx(0.42)  # 0.15 + 0.27
    assert df.loc["raw", "bound_max_s"] == pytest.approx(0.6)  # the slowest repeats: 0.2 + 0.4
    assert math.isnan(df.loc["bridge", "bound_max_s"])
    assert df.loc["raw", "efficiency"] == pytest.approx(0.42 / 0.6)  # bound / median steady (0.5, 0.7, 0.6)
    assert df.loc["bridge", "bound_gather_s"] == pytest.approx(0.4)
    assert math.isnan(df.loc["bridge", "bound_s"]) and math.isnan(df.loc["bridge", "efficiency"])
    cells = dict(zip(MARKDOWN_HEADER, summary_table_rows(summarize(records))[0], strict=True))
    assert cells["efficiency"] == "0.70"
    records[0].bound = None  # not measured (a fault, a failed sync): NaN, shown as a dash
    row = summarize(records).iloc[0]
    assert math.isnan(row["bound_s"]) and math.isnan(row["efficiency"])
    assert dict(zip(MARKDOWN_HEADER, summary_table_rows(summarize(records))[0], strict=True))["efficiency"] == "—"


def test_http_200_counts_non_200(records: list[RunRecord]) -> None:
    rec = records[0]
    rec.http[1].status = 400
    assert http_200_summary(rec) == "start 4/4 · update 7/8 · finish 4/4"


def test_unfinished_sync_gives_nan_not_error() -> None:
    rec = make_record("raw", [2.0], 1000, [0.5])
    rec.syncs[0].finished = False
    row = summarize([rec]).iloc[0]
    assert math.isnan(row["first_s"]) and math.isnan(row["steady_s"]) and math.isnan(row["steady_gbps"])
    assert row["verdict"] == "CRASH"


def test_write_summary(tmp_path: Path, records: list[RunRecord]) -> None:
    df = summarize(records)
    env = write_env(tmp_path)
    paths = write_summary(df, tmp_path, run_id="20250101-abc", env=env)
    for key in ("csv", "parquet", "md"):
        assert paths[key].exists() and paths[key].stat().st_size > 0
    assert len(pd.read_csv(paths["csv"])) == 2
    assert list(pd.read_parquet(paths["parquet"]).columns) == list(COLUMNS)

    md = paths["md"].read_text()
    assert md.startswith("# ")
    assert "20250101-abc" in md and "python " in md
    header = "| " + " | ".join(MARKDOWN_HEADER) + " |"
    lines = md.splitlines()
    header_lines = [line for line in lines if line.replace(" ", "") == header.replace(" ", "")]
    assert len(header_lines) == 1
    start = lines.index(header_lines[0])
    table = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        table.append(line)
    assert len(table) == 2
    cells = [c.strip() for c in table[0].strip("|").split("|")]
    assert cells == [
        "qwen3-vl", "embedded", "2", "1", "2", "no", "raw", "2.000", "0.600", "5.00", "—",
        "start 4/4 · update 8/8 · finish 4/4", "2", "—", "—", "PASS",
    ]  # fmt: skip
    assert "PARITY_FAIL" in table[1]
    failing = md.split("## Not passing", 1)[1]
    assert "qwen3-vl/tp2-pp2/noncolocate/bridge" in failing and NAMES[1] in failing
    assert "noncolocate/raw" not in failing


def test_not_passing_rows_name_the_other_failing_checks_and_oracle_notes(tmp_path: Path, records) -> None:
    """The deciding check's message first, then the other failing checks by name; an oracle that could not
    run is listed apart, never as a failure."""
    bad = records[1]
    bad.syncs[1].export_mode = "raw"  # a second failing check beside parity_sent
    bad.oracle_failures.append(OracleFailure(check="logprob_parity", sync=2, reason="TypeError: boom"))
    df = summarize(records)
    row = df.set_index("scenario").loc[bad.scenario_id]
    assert row["verdict"] == "PARITY_FAIL"
    also = row["also_failing"].split(",")
    assert also == ["requested_export_mode"] and NAMES[1] in row["message"]
    assert row["oracle_notes"] == "oracle could not run after sync 2: TypeError: boom"
    md = write_summary(df, tmp_path)["md"].read_text()
    failing = md.split("## Not passing", 1)[1]
    assert f"(also failing: {', '.join(also)})" in failing
    assert "## Oracles that could not run" in md and "TypeError: boom" in md.split("## Oracles that could not run")[1]


def test_write_env(tmp_path: Path) -> None:
    env = write_env(tmp_path)
    saved = json.loads((tmp_path / "env.json").read_text())
    assert saved == env
    for key in ("python", "platform", "hostname", "cpu_count", "packages", "cuda_devices"):
        assert key in saved
    assert {"torch", "transformers", "megatron-core", "megatron-bridge", "ray"} <= set(saved["packages"])


def test_markdown_table_escapes_pipes() -> None:
    text = markdown_table(["a", "b"], [["x|y", None]])
    assert text.splitlines()[2] == "| x\\|y |     |"


def test_plot_written(tmp_path: Path, records: list[RunRecord]) -> None:
    df = summarize(records)
    out = plot_steady_update_time(df, tmp_path / "plots" / "steady.png")
    assert out.exists() and out.stat().st_size > 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_handles_nan_and_missing_mode(tmp_path: Path, records: list[RunRecord]) -> None:
    df = summarize(records[:1])
    df.loc[0, "steady_s"] = float("nan")
    table = steady_table(df)
    assert list(table.columns) == ["raw", "bridge"] and table.isna().all().all()
    out = plot_steady_update_time(df, tmp_path / "nan.png")
    assert out.stat().st_size > 0
    empty = plot_steady_update_time(summarize([]), tmp_path / "empty.png")
    assert empty.stat().st_size > 0


def test_logprob_columns_take_the_worst_sync(records: list[RunRecord]) -> None:
    rec = records[0].model_copy(deep=True)
    rec.syncs[0].logprobs = {"max_abs": 2e-6, "mean_exp_abs": 1.000001, "tokens": 4}
    rec.syncs[1].logprobs = {"max_abs": 5e-6, "mean_exp_abs": 1.000002, "tokens": 4}
    row = summarize([rec]).iloc[0]
    assert row["logprob_max_abs"] == 5e-6 and row["logprob_mean_exp_abs"] == 1.000002


def as_vllm(record: RunRecord) -> RunRecord:
    """The same scenario as run on vLLM (id led by the engine, no engine-side reports; log-probs, vLLM's
    only engine-side evidence, within budget)."""
    rec = record.model_copy(deep=True)
    rec.scenario.engine = "vllm"
    rec.engine_capabilities = engine_kind("vllm").capabilities
    rec.scenario_id = rec.scenario.id
    rec.engine_shards = []
    rec.logprob_budget = {"max_abs": 1e-4, "mean_exp_abs": 1.0001}
    for s in rec.syncs:
        s.engine_checksums, s.engine_update_counts = {}, {}
        s.total_s *= 3
        s.logprobs = {"tokens": 4, "max_abs": 5e-7, "mean_abs": 1e-7, "mean_exp_abs": 1.0000001, "first_diff": ""}
    return rec


def test_engines_side_by_side(tmp_path: Path, records: list[RunRecord]) -> None:
    raw = records[0]
    df = summarize([raw, as_vllm(raw), records[1]])
    pairs = engine_comparison(df)
    assert len(pairs) == 1  # bridge ran on one engine only
    row = pairs.iloc[0].to_dict()
    assert (row["model"], row["tp"], row["pp"], row["export_mode"]) == ("qwen3-vl", 2, 2, "raw")
    # embedded: first 2.0, steady median(0.5, 0.7, 0.6) = 0.6; vLLM: three times each
    assert (row["embedded first (s)"], row["embedded steady (s)"]) == ("2.000", "0.600")
    assert (row["vllm first (s)"], row["vllm steady (s)"], row["vllm / embedded"]) == ("6.000", "1.800", "3.00")
    assert row["vllm verdict"] == row["embedded verdict"] == "PASS"
    md = write_summary(df, tmp_path)["md"].read_text()
    assert "## Engines side by side" in md and "| vllm / embedded |" in md.replace("  ", " ")
    vllm_line = next(line for line in md.splitlines() if line.startswith("| qwen3-vl | vllm "))
    assert "| raw " in vllm_line  # the mode cell is not confused by the engine-led id
    assert engine_comparison(summarize(records)).empty


def test_steady_plot_keeps_engines_apart(records: list[RunRecord]) -> None:
    table = steady_table(summarize([records[0], as_vllm(records[0])]))
    assert len(table) == 2
    by_engine = {key[-1]: row["raw"] for key, row in table.iterrows()}
    assert by_engine == {"embedded": pytest.approx(0.6), "vllm": pytest.approx(1.8)}


def test_wall_split_takes_checks_out_of_the_syncs() -> None:
    from harness.record import wall_split

    marks = {"start": 100.0, "syncs": 130.0, "teardown": 190.0, "end": 195.5}
    assert wall_split(marks, checks_s=20.0) == {"setup_s": 30.0, "syncs_s": 40.0, "checks_s": 20.0, "teardown_s": 5.5}
    # setup failed: no "syncs" mark, everything before teardown is setup
    assert wall_split({"start": 0.0, "teardown": 12.0, "end": 13.0}, 0.0) == {
        "setup_s": 12.0,
        "syncs_s": 0.0,
        "checks_s": 0.0,
        "teardown_s": 1.0,
    }


def test_where_the_time_went(tmp_path: Path, records: list[RunRecord]) -> None:
    records[0].wall = {"setup_s": 10.0, "syncs_s": 2.0, "checks_s": 3.0, "teardown_s": 1.0}
    records[1].wall = {"setup_s": 40.0, "syncs_s": 5.0, "checks_s": 6.0, "teardown_s": 2.0}
    df = summarize(records)
    assert df["setup_s"].tolist() == [10.0, 40.0]
    md = write_summary(df, tmp_path)["md"].read_text()
    section = md.split("## Where the time went", 1)[1].split("## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    totals = [c.strip() for c in lines[2].strip("| ").split("|")][1:]
    assert totals == ["50.0", "7.0", "9.0", "3.0", "69.0"]  # 10+40, 2+5, 3+6, 1+2 and their sum
    assert records[1].scenario_id in lines[3] and "53.0" in lines[3]  # the slowest scenario first


def test_engine_replicas_and_engine_tp_keep_their_own_rows(records: list[RunRecord]) -> None:
    """A two-engine row and an engine-TP-2 row beside the one-engine row of the same layout: the side-by-side
    table pairs each with its own kind on the other engine, and summary.md tells them apart."""
    raw = records[0]
    variants = [raw]
    for update in ({"engines": 2}, {"engine_tp": 2}):
        sc = raw.scenario.model_copy(update=update)
        variants.append(raw.model_copy(update={"scenario": sc, "scenario_id": sc.id}))
    df = summarize(variants + [as_vllm(r) for r in variants])
    pairs = engine_comparison(df)
    assert sorted(zip(pairs["engines"], pairs["engine_tp"], strict=True)) == [(1, 1), (1, 2), (2, 1)]
    cells = {row[5] for row in summary_table_rows(df)}
    assert cells == {"no", "no · 2 engines", "no · engine TP 2"}


def test_rows_that_differ_only_in_expert_tp_keep_their_own_pairs_and_cells(records: list[RunRecord]) -> None:
    """`tp2-pp1-ep2` and `tp2-pp1-ep2-etp2` share model, TP, EP and PP: the bridge-against-raw pairs, the
    engines side by side and summary.md's EP cell keep them apart (paired on those columns alone, one
    layout's pair replaced the other's)."""
    both = []
    for etp in (1, 2):
        for rec in records:
            sc = rec.scenario.model_copy(update={"etp": etp})
            both.append(rec.model_copy(update={"scenario": sc, "scenario_id": sc.id}))
    df = summarize(both + [as_vllm(r) for r in both])
    assert sorted(export_mode_comparison(df)["layout"]) == [
        "qwen3-vl/tp2-pp2-etp2/noncolocate",
        "qwen3-vl/tp2-pp2/noncolocate",
        "vllm/qwen3-vl/tp2-pp2-etp2/noncolocate",
        "vllm/qwen3-vl/tp2-pp2/noncolocate",
    ]
    assert sorted(zip(engine_comparison(df)["etp"], engine_comparison(df)["export_mode"], strict=True)) == [
        (1, "bridge"),
        (1, "raw"),
        (2, "bridge"),
        (2, "raw"),
    ]
    assert {row[3] for row in summary_table_rows(df)} == {"1", "1 · ETP 2"}


def test_bridge_against_raw_pairs_each_layout_and_counts_only_passing_pairs(
    tmp_path: Path, records: list[RunRecord]
) -> None:
    raw, bridge = records
    pairs = export_mode_comparison(summarize(records))
    assert len(pairs) == 1
    row = pairs.iloc[0].to_dict()
    assert row["layout"] == "qwen3-vl/tp2-pp2/noncolocate"
    # raw steady median(0.5, 0.7, 0.6) = 0.6; bridge median(1.5, 1.0) = 1.25
    assert (row["raw steady (s)"], row["bridge steady (s)"]) == (pytest.approx(0.6), pytest.approx(1.25))
    assert row["bridge / raw"] == pytest.approx(1.25 / 0.6)
    assert (row["raw verdict"], row["bridge verdict"]) == ("PASS", "PARITY_FAIL")
    md = write_summary(summarize(records), tmp_path)["md"].read_text()
    section = md.split("## Bridge against raw", 1)[1].split("## ", 1)[0]
    table = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    assert table[2] == ["qwen3-vl/tp2-pp2/noncolocate", "0.600", "1.250", "2.08", "PASS", "PARITY_FAIL"]
    assert "No pair where both modes passed." in section

    # Once the bridge run passes, the pair counts: 2.08 > 1.3. A chunk-size variant pairs only with its own kind.
    bridge.syncs[2].engine_checksums[NAMES[1]] = "c-1"
    variants = []
    for rec, totals in ((raw, [2.0, 1.0, 1.0, 1.0]), (bridge, [2.0, 1.1, 1.1])):
        v = rec.model_copy(deep=True)
        v.scenario_id = f"{rec.scenario_id}/chunk-1"
        for sync, total in zip(v.syncs, totals, strict=True):
            sync.total_s = total
        variants.append(v)
    df = summarize([*records, *variants])
    pairs = export_mode_comparison(df).set_index("layout")
    assert pairs.loc["qwen3-vl/tp2-pp2/noncolocate/chunk-1", "bridge / raw"] == pytest.approx(1.1)
    md = write_summary(df, tmp_path)["md"].read_text()
    assert "2 pairs where both passed: median bridge / raw 1.59, 1 above 1.3 (range 1.10-2.08)." in md
    assert export_mode_comparison(summarize([raw])).empty
    # one sync each: both pass, no steady time, nothing to count
    for rec in records:
        rec.syncs, rec.scenario.syncs = rec.syncs[:1], 1
    md = write_summary(summarize(records), tmp_path)["md"].read_text()
    assert "1 pair where both passed, none with a steady time (one sync)." in md


def test_an_interrupted_scenario_reads_as_interrupted_in_the_summary_and_the_report(
    tmp_path: Path, records: list[RunRecord]
) -> None:
    """A scenario Ctrl-C or a signal stopped is a CRASH of the runner that says nothing of the code under
    test: summary.md marks it interrupted (not UNEXPECTED), and a regression report against a baseline where
    it passed lists it as interrupted, not as a regression, through summary.csv as written."""
    from harness import interrupts
    from harness.report import write_report

    raw = records[0]
    write_summary(summarize([raw]), tmp_path / "base")
    stopped = raw.model_copy(deep=True)
    stopped.syncs = stopped.syncs[:2]
    stopped.progress = {"rank0": "sync 2: gather"}
    stopped.errors.append(interrupts.interrupted_error(KeyboardInterrupt("signal 15"), stopped, None))
    df = summarize([stopped])
    row = df.iloc[0]
    assert row["verdict"] == "CRASH" and bool(row["interrupted"]) and not row["expect_met"]
    assert not summarize([raw]).iloc[0]["interrupted"]
    md = write_summary(df, tmp_path / "run")["md"].read_text()
    assert "| CRASH (interrupted) |" in md
    failing = md.split("## Not passing", 1)[1]
    assert "interrupted by Ctrl-C or a signal" in failing and "UNEXPECTED" not in failing
    assert "after 2 of 5 planned syncs (4, then one that re-sends unchanged weights); last phases: rank0" in failing
    assert "last phases: rank0: sync 2: gather" in failing

    status, report_md = write_report(tmp_path / "run", tmp_path / "base")
    assert status == 0  # an interrupt is not a regression of the code under test
    report = pd.read_csv(tmp_path / "run" / "report.csv").set_index("scenario")
    assert report.loc[raw.scenario_id, "change"] == "interrupted"
    text = report_md.read_text()
    assert "0 regressions" in text and "1 interrupted" in text
    assert "(signal 15) after 2 of 5" in text.split("## Interrupted scenarios", 1)[1]

    # the other way round: a baseline that was interrupted is no verdict to improve on either
    status, report_md = write_report(tmp_path / "base", tmp_path / "run")
    report = pd.read_csv(tmp_path / "base" / "report.csv").set_index("scenario")
    assert status == 0 and report.loc[raw.scenario_id, "change"] == "interrupted"
    note = report.loc[raw.scenario_id, "note"]
    assert note.startswith("interrupted in the baseline: runner raised KeyboardInterrupt: the run was interrupted")
    assert "0 improvements" in report_md.read_text()


def test_the_fault_table_says_interrupted_where_a_signal_stopped_a_fault(
    tmp_path: Path, records: list[RunRecord]
) -> None:
    from harness import interrupts
    from harness.results import write_fault_table

    raw, bridge = records  # PASS, PARITY_FAIL
    caught = bridge.model_copy(deep=True, update={"scenario": bridge.scenario.model_copy(update={"fault": "stale"})})
    caught.scenario.expect = "PARITY_FAIL"
    missed = raw.model_copy(deep=True, update={"scenario": raw.scenario.model_copy(update={"fault": "missed"})})
    missed.scenario.expect = "PARITY_FAIL"
    stopped = missed.model_copy(deep=True, update={"scenario": missed.scenario.model_copy(update={"fault": "cut"})})
    stopped.errors.append(interrupts.interrupted_error(KeyboardInterrupt("signal 2"), stopped, None))
    planned = [r.scenario_id for r in (caught, missed, stopped)] + ["faults/never-reached"]
    md = write_fault_table([caught, missed, stopped], tmp_path, planned=planned)["md"].read_text()
    table, not_run = md.split("\n\n1 of 4 planned faults did not run (the run ended before them):\n\n")
    assert not_run == "- `faults/never-reached`\n"  # a run interrupted between faults does not read as complete
    cells = {line.split("|")[1].strip(): line.split("|")[5].strip() for line in table.splitlines()[6:]}
    assert cells == {"stale": "yes", "missed": "**NO**", "cut": "interrupted"}
    messages = [line.split("|")[6].strip() for line in table.splitlines()[6:]]
    whole = pd.read_csv(tmp_path / "faults.csv")["message"].fillna("").tolist()
    for shown, message in zip(messages, whole, strict=True):  # a cut message says so: once ended mid-word, bare
        assert shown == message or (len(shown) == 160 and shown.endswith("…") and message.startswith(shown[:-1]))
    assert any(shown.endswith("…") for shown in messages)
    assert "1 of 3 faults caught with their expected verdict (2 judged, 1 interrupted)." in md
    assert pd.read_csv(tmp_path / "faults.csv")["interrupted"].tolist() == [False, False, True]


def test_planned_scenarios_without_a_record_are_listed_as_not_run(tmp_path: Path, records: list[RunRecord]) -> None:
    # A run interrupted between scenarios wrote a summary of the ones that ran, "Every scenario passed."
    raw = records[0]
    md = write_summary(summarize([raw]), tmp_path, not_run=["qwen3/tp1-pp1/colocate/raw"])["md"].read_text()
    assert "Every scenario that ran passed." in md and "Every scenario passed." not in md
    assert md.endswith(
        "## Not run\n\n1 of 2 planned scenarios have no record: the run ended (or has not yet come) before them.\n"
        "- `qwen3/tp1-pp1/colocate/raw`\n"
    )
    assert "## Not run" not in write_summary(summarize([raw]), tmp_path)["md"].read_text()

"""Unit tests of `harness.checks`: one passing record, then one mutation per check."""

from __future__ import annotations

import json
import math

import pytest

from harness.checks import (
    CHECKS,
    LOGPROB_BUDGETS,
    PRIORITY,
    CheckResult,
    check_chunks,
    check_coverage,
    check_crash,
    check_http_status,
    check_names,
    check_parity_cross_mode,
    check_syncs_ran,
    expectation_met,
    group_differences,
    judge,
    judged,
    logprob_parity,
)
from harness.record import VERDICTS, ChunkRecord, ErrorRecord, HttpCall, RunRecord, SyncRecord
from reference_impl.engine import engine_kind

NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "lm_head.weight",
]
VISION = "model.visual.decoder.layers.0.self_attention.linear_proj.weight"


def make_record(syncs: int = 2, mode: str = "bridge") -> RunRecord:
    """A small record that passes every check: `syncs` syncs of 2 chunks over 3 names."""
    checkpoint = {name: f"ck-{i:02d}" for i, name in enumerate(NAMES)}
    http = [HttpCall(route="/init_weight_transfer_engine", status=200, ms=3.0)]
    sync_records = []
    for s in range(syncs):
        sums = checkpoint if s == 0 else {name: f"s{s}-{i:02d}" for i, name in enumerate(NAMES)}
        chunks = [
            ChunkRecord(index=0, names=NAMES[:2], bytes=800, sent=True, received=True),
            ChunkRecord(index=1, names=NAMES[2:], bytes=400, sent=True, received=True),
        ]
        http.append(HttpCall(route="/start_weight_update", status=200, ms=1.0, sync=s))
        http += [HttpCall(route="/update_weights", status=200, ms=5.0, sync=s, chunk=c) for c in (0, 1)]
        http.append(HttpCall(route="/finish_weight_update", status=200, ms=1.0, sync=s))
        sync_records.append(
            SyncRecord(
                index=s,
                weight_version=s + 1,
                mode=mode,
                chunks_planned=2,
                chunks_sent=2,
                chunks_received=2,
                chunks=chunks,
                bytes=1200,
                phases={"gather": 0.1, "convert": 0.2, "transfer": 0.3, "load": 0.1},
                total_s=1.0 if s == 0 else 0.5,
                names_sent=list(NAMES),
                names_accepted=list(NAMES),
                sent_checksums=dict(sums),
                engine_checksums=dict(sums),
                engine_update_counts={name: 1 for name in NAMES},
                finished=True,
                logprobs=logprob_parity([[-1.0, -2.0]], [[-1.0 + 2e-6, -2.0]]) | {"temperature": 0.7},
                engine_logprobs=[[-1.0 + 2e-6, -2.0 - 0.01 * s]],
            )
        )
    # A final re-sync of unchanged weights: same checksums, same engine log-probs.
    resync = sync_records[-1].model_copy(deep=True, update={"index": syncs, "weight_version": syncs + 1})
    resync.perturbed = False
    sync_records.append(resync)
    http.append(HttpCall(route="/start_weight_update", status=200, ms=1.0, sync=syncs))
    http += [HttpCall(route="/update_weights", status=200, ms=5.0, sync=syncs, chunk=c) for c in (0, 1)]
    http.append(HttpCall(route="/finish_weight_update", status=200, ms=1.0, sync=syncs))
    last = sync_records[-1].sent_checksums
    return RunRecord(
        scenario_id="qwen3/tp1-pp1/noncolocate/bridge",
        scenario={
            "id": "qwen3/tp1-pp1/noncolocate/bridge",
            "model": "qwen3",
            "tp": 1,
            "pp": 1,
            "ep": 1,
            "etp": 1,
            "colocate": False,
            "mode": mode,
            "engine": "embedded",
            "syncs": syncs,
            "bucket_bytes": 1024,
            "dtype": "float32",
            "seed": 0,
            "tags": [],
            "expect": "PASS",
            "fault": None,
        },
        http=http,
        syncs=sync_records,
        requested_mode=mode,
        checkpoint_checksums=dict(checkpoint),
        engine_slots=list(NAMES),
        cross_mode_checksums={"raw": dict(last), "bridge": dict(last)},
        logprob_budget=dict(LOGPROB_BUDGETS["float32"]),
    )


@pytest.fixture
def record() -> RunRecord:
    return make_record()


def verdict_of(record: RunRecord) -> tuple[str, str]:
    """(verdict, message of the check that decided it)."""
    verdict, results = judge(record)
    deciding = [r for r in results if r.failed and r.verdict_on_fail == verdict]
    return verdict, deciding[0].message if deciding else ""


def reject_chunk(record: RunRecord, sync: int, chunk: int, status: int, body: str) -> None:
    """Make the engine answer `status` with `body` to one chunk; the sync stops there."""
    for call in record.http:
        if call.sync == sync and call.chunk == chunk:
            call.status, call.error = status, body
    record.http = [c for c in record.http if not (c.sync == sync and (c.chunk or 0) > chunk)]
    record.http = [c for c in record.http if not (c.sync is not None and c.sync > sync)]
    record.http = [c for c in record.http if not (c.sync == sync and c.route == "/finish_weight_update")]
    s = record.syncs[sync]
    s.chunks_received = chunk
    s.chunks_sent = chunk + 1
    for c in s.chunks[chunk:]:
        c.received = False
    for c in s.chunks[chunk + 1 :]:
        c.sent = False
    s.finished = False
    record.syncs = record.syncs[: sync + 1]
    record.errors.append(
        ErrorRecord(where="trainer", rank=0, type="EngineRejected", message=f"engine answered {status}: {body}")
    )


def embedded_body(kinds: dict[str, str], reason: str = "rejected") -> str:
    return json.dumps(
        {"detail": {"error": "update rejected", "rejected": dict.fromkeys(kinds, reason), "kinds": kinds}}
    )


# ---------------------------------------------------------------------------------------------


def test_passing_record_passes(record: RunRecord) -> None:
    verdict, results = judge(record)
    assert verdict == "PASS"
    assert len(results) == len(CHECKS)
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    assert [r.name for r in results if r.skipped] == ["group_invariance"]  # not in a group
    assert expectation_met(record, verdict)


def test_group_members_with_identical_weights_pass(record: RunRecord) -> None:
    other = record.model_copy(deep=True, update={"scenario_id": "m/tp1-pp1/noncolocate/raw/bucket-1"})
    assert group_differences([record, other]) == []
    record.group_members = [other.scenario_id]
    assert judge(record)[0] == "PASS"


def test_group_member_with_different_weights_is_parity_fail(record: RunRecord) -> None:
    other = record.model_copy(deep=True, update={"scenario_id": "m/tp1-pp1/noncolocate/raw/bucket-1"})
    name = sorted(other.syncs[-1].engine_checksums)[0]
    other.syncs[-1].engine_checksums[name] = "f" * 32
    diffs = group_differences([record, other])
    assert len(diffs) == 1 and name in diffs[0] and f"sync {other.syncs[-1].index}" in diffs[0]
    record.group_members, record.group_differences = [other.scenario_id], diffs
    verdict, results = judge(record)
    assert verdict == "PARITY_FAIL"
    assert name in next(r for r in results if r.name == "group_invariance").message


def test_priority_covers_every_verdict() -> None:
    assert set(PRIORITY) == set(VERDICTS)
    assert PRIORITY.index("NAME_ERROR") < PRIORITY.index("HTTP_ERROR")


def test_check_result_rejects_unknown_verdict() -> None:
    with pytest.raises(ValueError):
        CheckResult(name="x", ok=False, verdict_on_fail="BROKEN")


def test_record_round_trips_through_json(record: RunRecord) -> None:
    again = RunRecord.model_validate_json(record.model_dump_json())
    assert judge(again)[0] == "PASS"
    out = judged(record)
    assert out.verdict == "PASS" and len(out.checks) == len(CHECKS) and record.verdict == ""


def test_config_error(record: RunRecord) -> None:
    bad = RunRecord(scenario_id="x", scenario={"id": "x", "syncs": 2}, config_error="PP=3 does not divide 28 layers")
    verdict, message = verdict_of(bad)
    assert verdict == "CONFIG_ERROR"
    assert "PP=3 does not divide 28 layers" in message
    # nothing ran, and that is explained by the config error, not a second CRASH
    results = {r.name: r for r in judge(bad)[1]}
    assert results["syncs_ran"].skipped and "CONFIG_ERROR" in results["syncs_ran"].reason


def test_deadlock(record: RunRecord) -> None:
    record.deadlock = True
    record.stacks = ["stacks/rank1.txt"]
    s = record.syncs[-1]
    s.chunks_sent, s.chunks_received, s.finished = 1, 1, False
    record.errors.append(ErrorRecord(where="runner", type="TimeoutError", message="watchdog fired"))
    verdict, message = verdict_of(record)
    assert verdict == "DEADLOCK"
    assert f"sync {s.index}" in message and "1/2 chunks" in message and "stacks/rank1.txt" in message


def test_crash_names_rank_type_and_first_line(record: RunRecord) -> None:
    record.errors.append(
        ErrorRecord(
            where="trainer",
            rank=3,
            type="RuntimeError",
            message="CUDA error: illegal memory access\nmore detail",
            traceback="Traceback ...",
        )
    )
    verdict, message = verdict_of(record)
    assert verdict == "CRASH"
    assert message == "rank 3 (trainer) raised RuntimeError: CUDA error: illegal memory access"


def test_engine_rejected_with_400_is_not_a_crash(record: RunRecord) -> None:
    reject_chunk(record, sync=1, chunk=1, status=400, body=embedded_body({NAMES[2]: "shape"}))
    verdict, message = verdict_of(record)
    assert verdict == "HTTP_ERROR"
    assert message.startswith("sync 1 chunk 1: /update_weights answered status 400")
    results = {r.name: r for r in judge(record)[1]}
    assert results["crash"].ok and not results["crash"].skipped
    assert results["syncs_ran"].skipped and "HTTP_ERROR" in results["syncs_ran"].reason


def test_http_non_200(record: RunRecord) -> None:
    record.http[2].status = 503
    record.http[2].error = "Service Unavailable"
    verdict, message = verdict_of(record)
    assert verdict == "HTTP_ERROR"
    assert message == "sync 0 chunk 0: /update_weights answered status 503: Service Unavailable"


def test_http_no_response(record: RunRecord) -> None:
    record.http[-1].status = 0
    verdict, message = verdict_of(record)
    assert verdict == "HTTP_ERROR"
    assert f"sync {record.syncs[-1].index}: /finish_weight_update answered no response" in message


def test_embedded_name_rejection_is_name_error(record: RunRecord) -> None:
    reject_chunk(record, sync=0, chunk=0, status=400, body=embedded_body({"x": "name"}, "unknown parameter"))
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR"
    assert "'x'" in message and "sync 0 chunk 0" in message


def test_embedded_dtype_rejection_is_http_error(record: RunRecord) -> None:
    reject_chunk(record, sync=0, chunk=0, status=400, body=embedded_body({"x": "dtype"}, "bfloat16 != float32"))
    verdict, message = verdict_of(record)
    assert verdict == "HTTP_ERROR"
    assert "400" in message and '"x"' in message
    assert check_names(record).ok


def test_truncated_embedded_body_still_classified(record: RunRecord) -> None:
    body = '{"detail": {"error": "update rejected", "kinds": {"x": "shape", "' + VISION + '": "name"}, "rej'
    reject_chunk(record, sync=0, chunk=1, status=400, body=body)
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR" and VISION in message


def test_vllm_500_with_parameter_name_is_name_error(record: RunRecord) -> None:
    body = (
        "Internal Server Error: Call to collective_rpc method failed: Traceback (most recent call last):\n"
        '  File "vllm/model_executor/models/utils.py", line 290, in _load_module\n'
        f"ValueError: There is no module or parameter named '{VISION}' in Qwen3VLForConditionalGeneration"
    )
    reject_chunk(record, sync=0, chunk=0, status=500, body=body)
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR"
    assert f"'{VISION}'" in message and "500" in message


def test_vllm_500_keyerror_is_name_error(record: RunRecord) -> None:
    body = "Call to collective_rpc method failed\nKeyError: 'visual.blocks.0.attn.qkv.weight'"
    reject_chunk(record, sync=1, chunk=0, status=500, body=body)
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR" and "'visual.blocks.0.attn.qkv.weight'" in message


def test_vllm_500_shape_error_is_http_error(record: RunRecord) -> None:
    body = (
        "Call to collective_rpc method failed\n"
        "ValueError: shape mismatch for 'model.layers.0.self_attn.q_proj.weight': [8, 4] vs [4, 8]"
    )
    reject_chunk(record, sync=0, chunk=0, status=500, body=body)
    assert verdict_of(record)[0] == "HTTP_ERROR"


def test_names_rejected_in_sync_is_name_error(record: RunRecord) -> None:
    record.syncs[1].names_rejected = {VISION: "no slot for this name"}
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR"
    assert message == f"sync 1: engine rejected name '{VISION}': no slot for this name"


def test_names_rejected_for_shape_is_not_name_error(record: RunRecord) -> None:
    record.syncs[1].names_rejected = {NAMES[0]: "shape [4, 8] != [8, 4]"}
    assert check_names(record).ok


def test_trainer_keyerror_is_name_error(record: RunRecord) -> None:
    record.errors.append(ErrorRecord(where="trainer", rank=1, type="KeyError", message=f"'{VISION}'"))
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR"
    assert "rank 1" in message and VISION in message
    assert check_crash(record).ok


def test_trainer_attribute_error_stays_crash(record: RunRecord) -> None:
    record.errors.append(
        ErrorRecord(where="trainer", rank=0, type="AttributeError", message="'NoneType' object has no attribute 'x'")
    )
    assert verdict_of(record)[0] == "CRASH"


def test_engine_error_behind_a_400_is_not_a_crash(record: RunRecord) -> None:
    reject_chunk(record, sync=0, chunk=0, status=400, body=embedded_body({"x": "bytes"}))
    record.errors.append(ErrorRecord(where="engine", type="ValueError", message="chunk has 12 bytes, header 16"))
    assert verdict_of(record)[0] == "HTTP_ERROR"


def test_engine_died_is_a_crash(record: RunRecord) -> None:
    record.http[-1].status = 0
    record.syncs[-1].finished = False
    record.errors.append(ErrorRecord(where="engine", type="SegmentationFault", message="engine exited -11"))
    verdict, message = verdict_of(record)
    assert verdict == "CRASH" and "engine raised SegmentationFault" in message


def test_engine_silently_ignoring_a_name_is_name_error(record: RunRecord) -> None:
    record.syncs[1].names_accepted = NAMES[:2]
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR"
    assert message == f"sync 1: engine answered 200 but silently ignored name '{NAMES[2]}'"


def test_dropped_chunk_is_chunk_mismatch(record: RunRecord) -> None:
    s = record.syncs[1]
    s.chunks_sent = 1
    s.chunks_received = 1
    s.chunks[1].sent = s.chunks[1].received = False
    verdict, message = verdict_of(record)
    assert verdict == "CHUNK_MISMATCH"
    assert message == "sync 1 chunk 1: planned 2 chunks, sent 1, received 1, 2 in the plan record"


def test_unacknowledged_chunk_flag_is_chunk_mismatch(record: RunRecord) -> None:
    record.syncs[0].chunks[1].received = False
    result = check_chunks(record)
    assert not result.ok and result.verdict_on_fail == "CHUNK_MISMATCH"
    assert result.message.startswith("sync 0 chunk 1: sent but not received")


def test_chunk_missing_from_plan_record(record: RunRecord) -> None:
    record.syncs[0].chunks = record.syncs[0].chunks[:1]
    verdict, message = verdict_of(record)
    assert verdict == "CHUNK_MISMATCH" and "1 in the plan record" in message


def test_slot_updated_twice_is_coverage_gap(record: RunRecord) -> None:
    record.syncs[1].engine_update_counts[NAMES[1]] = 2
    verdict, message = verdict_of(record)
    assert verdict == "COVERAGE_GAP"
    assert message == f"sync 1: engine slot '{NAMES[1]}' updated 2 times, expected exactly once"


def test_slot_never_updated_is_coverage_gap(record: RunRecord) -> None:
    del record.syncs[0].engine_update_counts[NAMES[2]]
    result = check_coverage(record)
    assert not result.ok
    assert result.message == f"sync 0: engine slot '{NAMES[2]}' never updated, expected exactly once"


def test_sync0_checksum_differs_is_parity_fail(record: RunRecord) -> None:
    record.syncs[0].engine_checksums[NAMES[1]] = "dummy"
    verdict, message = verdict_of(record)
    assert verdict == "PARITY_FAIL"
    assert message.startswith(f"sync 0: '{NAMES[1]}' engine checksum dummy != checkpoint ck-01")
    assert "1 of 3 tensors differ" in message


def test_sync0_missing_name_is_parity_fail(record: RunRecord) -> None:
    del record.syncs[0].engine_checksums[NAMES[0]]
    verdict, message = verdict_of(record)
    assert verdict == "PARITY_FAIL"
    assert f"'{NAMES[0]}' in checkpoint but missing from engine" in message


def test_sync0_extra_engine_name_is_parity_fail(record: RunRecord) -> None:
    record.syncs[0].engine_checksums["extra.weight"] = "e"
    verdict, message = verdict_of(record)
    assert verdict == "PARITY_FAIL" and "'extra.weight' on engine but not in checkpoint" in message


def test_later_sync_differs_from_sent_is_parity_fail(record: RunRecord) -> None:
    record.syncs[1].engine_checksums[NAMES[2]] = "stale"
    verdict, message = verdict_of(record)
    assert verdict == "PARITY_FAIL"
    assert message.startswith(f"sync 1: '{NAMES[2]}' engine checksum stale != sent s1-02")


def test_cross_mode_mismatch_is_parity_fail(record: RunRecord) -> None:
    record.cross_mode_checksums["raw"][NAMES[1]] = "gqa-wrong"
    verdict, message = verdict_of(record)
    assert verdict == "PARITY_FAIL"
    assert message.startswith(f"raw vs bridge: '{NAMES[1]}'")


def test_cross_mode_skipped_when_absent(record: RunRecord) -> None:
    record.cross_mode_checksums = {"raw": {"a": "1"}}
    result = check_parity_cross_mode(record)
    assert result.ok and result.skipped and "bridge" in result.reason


def test_mode_mismatch_is_parity_fail(record: RunRecord) -> None:
    record.syncs[1].mode = "raw"
    verdict, message = verdict_of(record)
    assert verdict == "PARITY_FAIL"
    assert message == "requested mode bridge but raw ran (sync 1)"


def test_unfinished_sync_without_cause_is_crash(record: RunRecord) -> None:
    record.syncs[1].finished = False
    verdict, message = verdict_of(record)
    assert verdict == "CRASH" and "sync 1 did not finish" in message


def test_missing_syncs_is_crash(record: RunRecord) -> None:
    record.syncs = record.syncs[:1]
    result = check_syncs_ran(record)
    assert not result.ok and result.message == "1 of 2 syncs recorded (last: sync 0)"
    record.syncs = []
    assert verdict_of(record) == ("CRASH", "no sync recorded")


def test_priority_name_over_http_over_chunks(record: RunRecord) -> None:
    reject_chunk(record, sync=0, chunk=0, status=400, body=embedded_body({"x": "name"}))
    verdict, results = judge(record)
    failing = {r.verdict_on_fail for r in results if r.failed}
    assert {"NAME_ERROR", "HTTP_ERROR", "CHUNK_MISMATCH"} <= failing
    assert verdict == "NAME_ERROR"


def test_expectation_met_uses_scenario_expect(record: RunRecord) -> None:
    record.scenario["expect"] = "CHUNK_MISMATCH"
    assert not expectation_met(record, "PASS")
    assert expectation_met(record, "CHUNK_MISMATCH")
    del record.scenario["expect"]
    assert expectation_met(record, "PASS")


def test_http_check_reports_unlogged_rejection(record: RunRecord) -> None:
    record.errors.append(ErrorRecord(where="trainer", rank=0, type="EngineRejected", message="409 conflict"))
    result = check_http_status(record)
    assert not result.ok and "409 conflict" in result.message


def test_vllm_json_wrapped_500_is_name_error(record: RunRecord) -> None:
    text = f"Call to collective_rpc method failed\nValueError: There is no module or parameter named '{VISION}'"
    reject_chunk(record, sync=0, chunk=1, status=500, body=json.dumps({"error": {"message": text, "code": 500}}))
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR" and f"'{VISION}'" in message and "sync 0 chunk 1" in message


def test_vllm_attribute_error_on_model_is_name_error(record: RunRecord) -> None:
    body = "Call to collective_rpc method failed\nAttributeError: 'Qwen3VLModel' object has no attribute 'visual'"
    reject_chunk(record, sync=0, chunk=0, status=500, body=body)
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR" and "'visual'" in message


def test_embedded_request_and_session_kinds_are_http_errors(record: RunRecord) -> None:
    reject_chunk(record, sync=0, chunk=0, status=409, body=embedded_body({"session": "session"}))
    assert verdict_of(record)[0] == "HTTP_ERROR"
    other = make_record()
    reject_chunk(other, sync=0, chunk=0, status=400, body=embedded_body({"body.update_info.names": "request"}))
    assert verdict_of(other)[0] == "HTTP_ERROR"


def test_embedded_500_with_keyerror_traceback_is_name_error(record: RunRecord) -> None:
    body = json.dumps(
        {
            "detail": {
                "error": f"KeyError in /update_weights: '{VISION}'",
                "rejected": {},
                "kinds": {},
                "traceback": f"Traceback (most recent call last):\n  ...\nKeyError: '{VISION}'\n",
            }
        }
    )
    reject_chunk(record, sync=0, chunk=0, status=500, body=body)
    verdict, message = verdict_of(record)
    assert verdict == "NAME_ERROR" and VISION in message


def test_logprob_parity_numbers_by_hand() -> None:
    got = logprob_parity([[-1.0, -2.0], [-0.5]], [[-1.5, -2.0], [-0.25]])
    assert got["tokens"] == 3
    assert got["max_abs"] == pytest.approx(0.5)
    assert got["mean_abs"] == pytest.approx(0.25)
    assert got["mean_exp_abs"] == pytest.approx((math.exp(0.5) + 1.0 + math.exp(0.25)) / 3)
    assert got["first_diff"].startswith("prompt 0 position 1")
    with pytest.raises(ValueError, match="do not line up"):
        logprob_parity([[-1.0]], [[-1.0, -2.0]])


def test_logprobs_over_budget_is_parity_fail(record: RunRecord) -> None:
    record.syncs[1].logprobs = logprob_parity([[-1.0, -2.0]], [[-1.0, -2.3]]) | {"temperature": 0.7}
    verdict, results = judge(record)
    assert verdict == "PARITY_FAIL"
    msg = next(r for r in results if r.name == "logprob_parity").message
    assert "sync 1" in msg and "0.3" in msg and "position 2" in msg


def test_resync_that_moves_logprobs_is_parity_fail(record: RunRecord) -> None:
    record.syncs[-1].engine_logprobs = [[-1.0, -2.5]]
    verdict, results = judge(record)
    assert verdict == "PARITY_FAIL"
    assert "re-sent unchanged weights" in next(r for r in results if r.name == "resync_logprobs_unchanged").message


# --- engines without per-tensor reports (vLLM): coverage from names sent, parity from log-probs ---


def vllm_record() -> RunRecord:
    """`make_record()` as vLLM reports it: no slots, counts or HF-name engine checksums."""
    rec = make_record()
    rec.scenario["engine"] = "vllm"
    rec.engine_capabilities = engine_kind("vllm").capabilities
    rec.engine_slots = []
    for s in rec.syncs:
        s.engine_checksums = {}
        s.engine_update_counts = {}
    return rec


def test_vllm_record_passes_without_engine_reports() -> None:
    verdict, results = judge(vllm_record())
    assert verdict == "PASS"
    by_name = {r.name: r for r in results}
    assert by_name["coverage"].ok and not by_name["coverage"].skipped
    assert by_name["parity_sent"].skipped and "log-prob" in by_name["parity_sent"].reason


def test_vllm_name_never_sent_is_coverage_gap() -> None:
    rec = vllm_record()
    rec.syncs[1].names_sent.remove(NAMES[1])
    verdict, message = verdict_of(rec)
    assert verdict == "COVERAGE_GAP"
    assert message.startswith(f"sync 1: checkpoint tensor '{NAMES[1]}' was never sent")


def test_vllm_name_sent_twice_is_coverage_gap() -> None:
    rec = vllm_record()
    rec.syncs[2].names_sent.append(NAMES[0])
    assert verdict_of(rec) == ("COVERAGE_GAP", f"sync 2: '{NAMES[0]}' was sent 2 times, expected exactly once")


def test_vllm_sync0_sent_differs_from_checkpoint_is_parity_fail() -> None:
    rec = vllm_record()
    rec.syncs[0].sent_checksums[NAMES[2]] = "wrong"
    verdict, message = verdict_of(rec)
    assert verdict == "PARITY_FAIL" and f"'{NAMES[2]}' sent checksum" in message


def test_vllm_200_for_a_name_the_checkpoint_lacks_is_name_error() -> None:
    rec = vllm_record()
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    rec.syncs[1].names_sent.append(extra)
    rec.syncs[1].names_accepted.append(extra)
    verdict, message = verdict_of(rec)
    assert verdict == "NAME_ERROR" and f"answered 200 for '{extra}'" in message


def test_vllm_module_name_is_mapped_to_the_hf_name_sent() -> None:
    rec = vllm_record()
    body = (
        '{"error":{"message":"Call to collective_rpc method failed: Worker failed with error \'There is no module '
        "or parameter named 'layers.0.self_attn.q_proj' in Qwen3Model'\"}}"
    )
    reject_chunk(rec, sync=1, chunk=0, status=500, body=body)
    rec.syncs[1].names_rejected = {n: f"chunk rejected: {body}" for n in NAMES[:2]}
    verdict, message = verdict_of(rec)
    assert verdict == "NAME_ERROR"
    assert f"'{NAMES[1]}' (the engine says 'layers.0.self_attn.q_proj')" in message


def test_generic_chunk_rejection_alone_is_not_a_name_error() -> None:
    """A 500 that names no tensor (e.g. vLLM's shape assertion) stays an HTTP error, although the sender
    records every name of the chunk as rejected with the answer's text."""
    rec = vllm_record()
    body = "Call to collective_rpc method failed: Worker failed with error 'Attempted to load weight'"
    reject_chunk(rec, sync=0, chunk=0, status=500, body=body)
    rec.syncs[0].names_rejected = {n: f"chunk rejected: {body}" for n in NAMES[:2]}
    assert verdict_of(rec)[0] == "HTTP_ERROR"


def test_chunk_not_sent_for_lack_of_session_says_why() -> None:
    rec = vllm_record()
    chunk = rec.syncs[1].chunks[1]
    chunk.sent, chunk.received = False, False
    chunk.note = "not sent: no open update session (the engine ended the session when chunk 0 failed)"
    rec.syncs[1].chunks_sent = rec.syncs[1].chunks_received = 1
    verdict, message = verdict_of(rec)
    assert verdict == "CHUNK_MISMATCH" and "the engine ended the session when chunk 0 failed" in message


def test_vllm_sync_without_logprobs_cannot_pass() -> None:
    """Log-probs are vLLM's only engine-side evidence; the embedded engine's checksums stand in otherwise."""
    rec = vllm_record()
    rec.syncs[1].logprobs = {}
    verdict, message = verdict_of(rec)
    assert verdict == "PARITY_FAIL" and message.startswith("sync 1: no log-prob comparison")
    embedded = make_record()
    embedded.syncs[1].logprobs = {}
    assert verdict_of(embedded)[0] == "PASS"

"""The transfer checks: config, deadlock, crash, HTTP status, chunks, syncs ran."""

from __future__ import annotations

from harness.checks import check_chunks, check_crash, check_http_status, check_recovery, check_syncs_ran, judge
from harness.record import ErrorRecord, RecoveryRecord, RunRecord
from harness.scenario import Scenario

from .records import NAMES, reject_chunk, rejection, verdict_of, vllm_record


def test_config_error_and_nothing_ran_is_explained() -> None:
    bad = RunRecord(
        scenario_id="x", scenario=Scenario(model="qwen3", syncs=2), config_error="PP=3 does not divide 28 layers"
    )
    assert verdict_of(bad) == ("CONFIG_ERROR", "invalid scenario: PP=3 does not divide 28 layers")
    results = {r.name: r for r in judge(bad)[1]}
    assert results["syncs_ran"].skipped and "CONFIG_ERROR" in results["syncs_ran"].reason


def test_deadlock_says_where_and_which_stacks(record: RunRecord) -> None:
    record.deadlock = True
    record.stacks = ["stacks/rank1.txt"]
    s = record.syncs[-1]
    s.chunks_sent, s.chunks_received, s.finished = 1, 1, False
    record.errors.append(ErrorRecord(where="runner", type="TimeoutError", message="watchdog fired"))
    assert verdict_of(record) == (
        "DEADLOCK",
        f"no progress before the deadline after sync {s.index} (1/2 chunks sent, 1 received); "
        "stacks saved: stacks/rank1.txt",
    )


def test_deadlock_in_sync_0_names_the_sync_and_each_rank_s_phase(record: RunRecord) -> None:
    """A hang in the very first sync is not "before the first sync": the runner knows what was in flight
    and every rank's last phase."""
    record.deadlock, record.deadlock_at, record.syncs = True, "sync 0", []
    record.progress = {
        "rank0": "sync 0: chunk 3 of 9 on the wire: /update_weights in flight",
        "rank1": "sync 0: handing its tensors of 9 chunks to the sender point to point (gather)",
    }
    assert verdict_of(record) == (
        "DEADLOCK",
        "no progress before the deadline in sync 0 (last phases: rank0: sync 0: chunk 3 of 9 on the wire: "
        "/update_weights in flight; rank1: sync 0: handing its tensors of 9 chunks to the sender point to point "
        "(gather)); no stacks saved",
    )


def test_crash_names_rank_type_and_first_line(record: RunRecord) -> None:
    for rank in (3, 0):
        record.errors.append(
            ErrorRecord(where="trainer", rank=rank, type="RuntimeError", message="CUDA error: illegal access\nmore")
        )
    assert verdict_of(record) == ("CRASH", "rank 3 (trainer) raised RuntimeError: CUDA error: illegal access (+1 more)")


def test_trainer_attribute_error_stays_crash(record: RunRecord) -> None:
    record.errors.append(
        ErrorRecord(where="trainer", rank=0, type="AttributeError", message="'NoneType' object has no attribute 'x'")
    )
    verdict, message = verdict_of(record)
    assert verdict == "CRASH" and "AttributeError: 'NoneType' object has no attribute 'x'" in message


def test_engine_rejected_is_never_a_crash(record: RunRecord) -> None:
    reject_chunk(record, sync=1, chunk=1, status=400, rejections=[rejection(NAMES[2], "shape", "shape [4] != [8]")])
    record.errors.append(ErrorRecord(where="trainer", rank=0, type="EngineRejected", message="engine answered 400"))
    verdict, message = verdict_of(record)
    assert verdict == "HTTP_ERROR"
    assert message == f"sync 1 chunk 1: /update_weights answered status 400: shape of '{NAMES[2]}': shape [4] != [8]"
    results = {r.name: r for r in judge(record)[1]}
    assert results["crash"].ok and not results["crash"].skipped
    assert results["syncs_ran"].skipped and "HTTP_ERROR" in results["syncs_ran"].reason


def test_engine_error_behind_an_error_answer_is_not_a_crash(record: RunRecord) -> None:
    reject_chunk(record, sync=0, chunk=0, status=400, rejections=[rejection(NAMES[0], "bytes", "12 bytes, header 16")])
    record.errors.append(ErrorRecord(where="engine", type="ValueError", message="chunk has 12 bytes, header 16"))
    assert check_crash(record).ok
    assert verdict_of(record)[0] == "HTTP_ERROR"


def test_engine_died_is_a_crash(record: RunRecord) -> None:
    record.http[-1].status = 0
    record.http[-1].rejections = [rejection("/finish_weight_update", "other", "ConnectError: connection refused")]
    record.syncs[-1].finished = False
    record.errors.append(ErrorRecord(where="engine", type="SegmentationFault", message="engine exited -11"))
    assert verdict_of(record) == ("CRASH", "engine raised SegmentationFault: engine exited -11")


def test_a_second_rank_that_died_is_named_not_counted_among_the_follow_on_errors(record: RunRecord) -> None:
    record.syncs[-1].finished = False
    record.errors += [
        ErrorRecord(
            where="trainer", rank=2, type="ActorDiedError", message="the rank's process died: SIGSEGV received"
        ),
        ErrorRecord(where="trainer", rank=3, type="ActorDiedError", message="the rank's process died without ..."),
        ErrorRecord(where="trainer", rank=0, type="RuntimeError", message="Connection reset by peer"),
    ]
    assert check_crash(record).message == (
        "rank 2 (trainer) raised ActorDiedError: the rank's process died: SIGSEGV received; rank 3 died too (+2 more)"
    )


def test_http_non_200_quotes_the_engines_reason(record: RunRecord) -> None:
    record.http[2].status = 503
    record.http[2].rejections = [rejection("/update_weights", "other", "Service Unavailable")]
    record.http[-1].status = 500
    assert verdict_of(record) == (
        "HTTP_ERROR",
        "sync 0 chunk 0: /update_weights answered status 503: Service Unavailable (+1 more non-200)",
    )


def test_http_message_counts_more_rejections_in_the_answer(record: RunRecord) -> None:
    refused = [rejection(NAMES[0], "dtype", "declared bfloat16, engine float32"), rejection(NAMES[1], "dtype", "x")]
    reject_chunk(record, sync=0, chunk=0, status=400, rejections=refused)
    result = check_http_status(record)
    assert result.message == (
        f"sync 0 chunk 0: /update_weights answered status 400: dtype of '{NAMES[0]}': declared bfloat16, "
        "engine float32 (+1 more rejected)"
    )


def test_session_and_request_rejections_are_http_errors(record: RunRecord) -> None:
    refused = [rejection("/start_weight_update", "session", "start_weight_update called while a session is open")]
    record.http[1].status, record.http[1].rejections = 400, refused
    assert verdict_of(record) == (
        "HTTP_ERROR",
        "sync 0: /start_weight_update answered status 400: session: start_weight_update called while a session is open",
    )
    other = vllm_record()
    reject_chunk(other, 0, 0, 400, [rejection("body.update_info.names", "request", "Input should be a valid list")])
    assert verdict_of(other) == (
        "HTTP_ERROR",
        "sync 0 chunk 0: /update_weights answered status 400: request of 'body.update_info.names': Input should be "
        "a valid list",
    )


def test_http_without_rejections_quotes_the_stored_answer(record: RunRecord) -> None:
    """A record whose calls carry no parsed rejections still says what the engine answered."""
    record.http[-1].status, record.http[-1].error = 502, "Bad Gateway\n  upstream closed"
    message = check_http_status(record).message
    assert (
        message
        == f"sync {record.syncs[-1].index}: /finish_weight_update answered status 502: Bad Gateway upstream closed"
    )


def test_http_no_response(record: RunRecord) -> None:
    record.http[-1].status = 0
    verdict, message = verdict_of(record)
    assert verdict == "HTTP_ERROR"
    assert message.startswith(f"sync {record.syncs[-1].index}: /finish_weight_update answered no response (status 0)")


def test_http_check_reports_unlogged_rejection(record: RunRecord) -> None:
    record.errors.append(ErrorRecord(where="trainer", rank=0, type="EngineRejected", message="409 conflict"))
    result = check_http_status(record)
    assert result.failed and result.verdict_on_fail == "HTTP_ERROR"
    assert result.message == "rank 0 (trainer): engine rejected a call not in the HTTP log: 409 conflict"


def test_dropped_chunk_is_chunk_mismatch(record: RunRecord) -> None:
    s = record.syncs[1]
    s.chunks_sent = s.chunks_received = 1
    s.chunks[1].sent = s.chunks[1].received = False
    assert verdict_of(record) == (
        "CHUNK_MISMATCH",
        "sync 1 chunk 1: planned 2 chunks, sent 1, received 1, 2 in the plan record",
    )


def test_unacknowledged_chunk_flag_is_chunk_mismatch(record: RunRecord) -> None:
    record.syncs[0].chunks[1].received = False
    result = check_chunks(record)
    assert result.failed and result.verdict_on_fail == "CHUNK_MISMATCH"
    assert result.message == "sync 0 chunk 1: sent but not received (1 names, 400 bytes)"


def test_chunk_missing_from_plan_record(record: RunRecord) -> None:
    record.syncs[0].chunks = record.syncs[0].chunks[:1]
    verdict, message = verdict_of(record)
    assert verdict == "CHUNK_MISMATCH" and message.endswith("1 in the plan record")


def test_chunk_not_sent_for_lack_of_session_says_why() -> None:
    rec = vllm_record()
    chunk = rec.syncs[1].chunks[1]
    chunk.sent, chunk.received = False, False
    chunk.note = "not sent: no open update session (the engine ended the session when chunk 0 failed)"
    rec.syncs[1].chunks_sent = rec.syncs[1].chunks_received = 1
    verdict, message = verdict_of(rec)
    assert verdict == "CHUNK_MISMATCH" and "the engine ended the session when chunk 0 failed" in message


def test_unfinished_sync_without_cause_is_crash(record: RunRecord) -> None:
    record.syncs[1].finished = False
    assert verdict_of(record) == (
        "CRASH",
        "sync 1 did not finish (no 200 from /finish_weight_update) and no error explains it",
    )


def test_missing_syncs_is_crash(record: RunRecord) -> None:
    record.syncs = record.syncs[:1]
    result = check_syncs_ran(record)
    assert result.failed and result.message == "1 of 2 syncs recorded (last: sync 0)"
    record.syncs = []
    assert verdict_of(record) == ("CRASH", "no sync recorded")


def test_chunk_recorded_as_received_without_its_call_on_the_wire_is_chunk_mismatch(record: RunRecord) -> None:
    """The sender marks its last chunk done without handing it to the channel: its own counts agree, the
    client's log of the wire does not."""
    record.http = [c for c in record.http if not (c.route == "/update_weights" and c.sync == 1 and c.chunk == 1)]
    verdict, message = verdict_of(record)
    assert verdict == "CHUNK_MISMATCH"
    assert message == (
        "sync 1: the sender recorded 2 chunks as received but the engine answered 1 /update_weights calls with 200 "
        "(first: chunk 1, 1 names)"
    )


def test_chunk_indexes_on_the_wire_that_are_not_the_records_are_chunk_mismatch(record: RunRecord) -> None:
    """A chunk counter never reset between syncs: sync 1 goes out as chunks 2 and 3 while the sender's record,
    and every count, says chunks 0 and 1."""
    calls = [c for c in record.http if c.route == "/update_weights" and c.sync == 1]
    assert sorted(c.chunk for c in calls) == [0, 1]
    assert verdict_of(record)[0] == "PASS"
    for c in calls:
        c.chunk += 2
    verdict, message = verdict_of(record)
    assert verdict == "CHUNK_MISMATCH"
    assert message == (
        "sync 1: /update_weights calls answered 200 carry chunk indexes [2, 3], but the sender's record has chunks "
        "[0, 1] as received: the chunk index on the wire is not the chunk's place in this sync's plan"
    )


def test_chunk_indexes_that_are_not_0_to_n_once_each_are_chunk_mismatch(record: RunRecord) -> None:
    """An off-by-one counter: chunk 1 sent twice, chunk 0 never, the record and the wire agreeing."""
    for c in record.syncs[1].chunks:
        c.index = 1
    for call in record.http:
        if call.route == "/update_weights" and call.sync == 1:
            call.chunk = 1
    verdict, message = verdict_of(record)
    assert (verdict, message) == (
        "CHUNK_MISMATCH",
        "sync 1: the sender's record has chunk indexes [1, 1], not 0 to 1 once each",
    )


def test_a_chunk_of_several_tensors_over_chunk_bytes_is_chunk_mismatch(record: RunRecord) -> None:
    """The plan's greedy rule checked the size before adding a tensor: a bucket went over its limit."""
    first = record.syncs[0].chunks[0]
    assert len(first.names) > 1
    record.scenario.chunk_bytes = first.bytes  # at the limit: fine
    assert verdict_of(record)[0] == "PASS"
    record.scenario.chunk_bytes = first.bytes - 1
    assert verdict_of(record) == (
        "CHUNK_MISMATCH",
        f"sync 0 chunk 0: {first.bytes} bytes in {len(first.names)} tensors, over the scenario's chunk_bytes "
        f"{first.bytes - 1} (only a single tensor larger than a chunk may exceed it)",
    )
    record.scenario.chunk_bytes = 1  # every chunk of several tensors is over it now; one tensor alone never is
    for s in record.syncs:
        for c in s.chunks:
            c.names = c.names[:1]
    assert verdict_of(record)[0] == "PASS"


def test_second_transfer_group_init_names_both_ranks(record: RunRecord) -> None:
    init = next(c for c in record.http if c.route == "/init_weight_transfer_engine")
    init.rank = 0
    record.http.insert(1, init.model_copy(update={"rank": 1, "t": init.t + 0.01}))
    record.syncs = []
    assert verdict_of(record) == (
        "CRASH",
        "the engine accepted 2 /init_weight_transfer_engine calls (rank 0, then rank 1): one transfer group per "
        "engine, and the later init replaces the earlier one, so the sender's broadcasts would reach nobody",
    )


def test_engine_that_died_after_a_failed_sync_is_a_crash_over_the_name_error(record: RunRecord) -> None:
    """The engine answered a rejected name, then died: the name error must not hide it."""
    reject_chunk(record, 0, 1, 400, [rejection(NAMES[2], "name", "tied to model.embed_tokens.weight")])
    record.recovery = RecoveryRecord(after_sync=0, health_status=0, engine_log_tail="INFO: serving\nKilled\n")
    assert verdict_of(record) == (
        "CRASH",
        "the engine died after the failed sync 0: GET /health got no response (status 0); its log ends: Killed",
    )


def test_engine_that_survived_but_refuses_a_clean_sync_is_http_error(record: RunRecord) -> None:
    record.recovery = RecoveryRecord(after_sync=1, health_status=200, completion_status=200, clean_sync=3)
    result = check_recovery(record)
    assert (result.verdict_on_fail, result.message) == (
        "HTTP_ERROR",
        "the engine survived after the failed sync 1 but the clean sync 3 did not run to its end",
    )
    record.recovery.clean_sync_finished = True
    assert check_recovery(record).ok


def test_a_clean_sync_the_engine_refused_says_what_it_refused(record: RunRecord) -> None:
    # A bug every sync meets (an export that always sends a padded vocabulary): the recovery's message decides
    # the HTTP_ERROR, and said only that the clean sync did not finish, not that the engine refused a shape.
    reject_chunk(record, 1, 0, 400, [rejection(NAMES[0], "shape", "shape [504, 64] but the engine expects [503, 64]")])
    record.recovery = RecoveryRecord(after_sync=0, health_status=200, completion_status=200, clean_sync=1)
    verdict, message = verdict_of(record)
    assert verdict == "HTTP_ERROR"
    assert message == (
        "the engine survived after the failed sync 0 but the clean sync 1 did not run to its end: sync 1 chunk 0: "
        f"/update_weights answered status 400: shape of '{NAMES[0]}': shape [504, 64] but the engine expects [503, 64]"
    )


def test_rank_that_raised_because_the_engine_died_is_blamed_on_the_engine(record: RunRecord) -> None:
    """The engine dies while a chunk is on the wire: the sender's broadcast raises (gloo: "Read error") and the
    sync never returns. The session asks /health before giving up (`harness.recovery.engine_died`); the verdict
    names the engine, not the broken group it left behind."""
    from types import SimpleNamespace

    from harness.recovery import engine_died

    record.syncs = record.syncs[:1]
    record.errors.append(ErrorRecord(rank=0, where="trainer", type="RuntimeError", message="gloo pair.cc: Read error"))
    alive, dead = SimpleNamespace(health=lambda: 200), SimpleNamespace(health=lambda: 0)
    tails = {1: "INFO: serving\nKilled\n"}
    assert engine_died(record, [alive, dead], lambda i: tails.get(i, ""), after=1)
    assert record.recovery is not None and record.recovery.engine == 1  # the replica that died, not engine 0
    assert verdict_of(record)[0] == "CRASH"
    assert (
        "died after the failed sync 1: GET /health got no response (status 0); its log ends: Killed"
        in verdict_of(record)[1]
    )
    record.recovery = None
    assert not engine_died(record, [alive, alive], lambda i: tails.get(i, ""), after=1)
    assert record.recovery is None
    assert verdict_of(record)[1].startswith("rank 0 (trainer) raised RuntimeError: gloo pair.cc: Read error")

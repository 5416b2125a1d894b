"""The engine's state beyond its weights: the committed weight version and caches that outlive an update."""

from __future__ import annotations

from harness.checks import (
    check_completions_in_session,
    check_engine_caches,
    check_engine_fresh,
    check_weight_version,
)
from harness.checks.engine_state import committed_before, pause_problem
from harness.record import OracleFailure, RunRecord
from reference_impl.engine import engine_kind

from .records import verdict_of, vllm_record


def test_engine_started_from_the_checkpoint_is_parity_fail(record: RunRecord) -> None:
    record.engine_start_checksums = [dict(record.checkpoint_checksums)]  # every sync still looks right
    assert [c.name for c in (check_engine_fresh(record),) if not c.ok] == ["engine_fresh"]
    assert verdict_of(record) == (
        "PARITY_FAIL",
        "before sync 0 the engine already held the checkpoint's bytes in 3 of 3 tensors (e.g. "
        "'model.embed_tokens.weight'): sync 0 cannot show that the update moved them; start the engine from "
        "other weights (vLLM: --load-format dummy; embedded: an engine seed other than the checkpoint's)",
    )


def test_one_tensor_already_in_place_is_named(record: RunRecord) -> None:
    record.engine_start_checksums[0]["lm_head.weight"] = record.checkpoint_checksums["lm_head.weight"]
    result = check_engine_fresh(record)
    assert not result.ok and "in 1 of 3 tensors (e.g. 'lm_head.weight')" in result.message


def test_an_engine_that_kept_an_earlier_scenarios_weights_is_parity_fail(record: RunRecord) -> None:
    # what a reused engine that kept its weights holds: the last state of the scenario before, not the checkpoint
    record.engine_start_checksums = [{name: f"earlier-{i:02d}" for i, name in enumerate(record.engine_shards)}]
    assert verdict_of(record) == (
        "PARITY_FAIL",
        "before sync 0 the engine held other weights than a fresh engine of seed 4321 in 3 of 3 tensors (e.g. "
        "'model.embed_tokens.weight'): it did not start fresh (an engine reused from an earlier scenario that "
        "kept its weights?), so an update that skips a tensor can pass",
    )


def test_a_version_left_from_before_is_parity_fail(record: RunRecord) -> None:
    record.engine_start_versions = ["5"]
    result = check_engine_fresh(record)
    assert not result.ok and "weight version '5', not '0'" in result.message


def test_engine_start_not_read_is_skipped_and_its_oracle_failure_said(record: RunRecord) -> None:
    record.engine_start_checksums = []
    assert check_engine_fresh(record).skipped
    record.oracle_failures.append(OracleFailure(check="engine_fresh", reason="RuntimeError: no answer"))
    result = check_engine_fresh(record)
    assert result.skipped and "oracle could not run: RuntimeError: no answer" in result.reason


def test_an_engine_without_per_tensor_checksums_is_not_judged_by_it() -> None:
    rec = vllm_record()
    rec.engine_start_checksums = []
    assert check_engine_fresh(rec).skipped


def test_weight_version_not_committed_is_parity_fail(record: RunRecord) -> None:
    record.syncs[1].engine_weight_version = "1"  # still the version of sync 0
    assert verdict_of(record) == (
        "PARITY_FAIL",
        "sync 1: the engine reports weight version '1' after finishing version '2': its rollouts would be "
        "attributed to another policy",
    )


def test_weight_version_not_read_is_skipped(record: RunRecord) -> None:
    for s in record.syncs:
        s.engine_weight_version = s.served_weight_version = None
        for ask in s.mid_session:
            ask.weight_version = None
    assert check_weight_version(record).skipped


def test_completions_tagged_with_another_version_are_parity_fail(record: RunRecord) -> None:
    # /weight_info says the new version, but the rollouts served after the update carry the first one
    assert verdict_of(record)[0] == "PASS"
    record.syncs[1].served_weight_version = "0"
    assert verdict_of(record) == (
        "PARITY_FAIL",
        "sync 1: the engine's completions after finishing version '2' are tagged weight version '0' (it reports "
        "'2'): its rollouts would be attributed to another policy",
    )
    for s in record.syncs:  # an engine whose answers carry no version (vLLM's): nothing to judge there
        s.served_weight_version = None
    assert verdict_of(record)[0] == "PASS"


def test_a_version_committed_at_the_start_of_a_session_is_parity_fail(record: RunRecord) -> None:
    # the held re-sync (version 3): /weight_info said 3 while its chunks were still arriving, then 3 again
    first, last = record.syncs[-1].mid_session
    assert (first.point, last.point) == ("after_first_chunk", "before_finish") and verdict_of(record)[0] == "PASS"
    first.weight_version = last.weight_version = "3"
    assert verdict_of(record) == (
        "PARITY_FAIL",
        "sync 2: while its update session was open (its first chunk answered) the engine reported weight version "
        "'3', not '2', the version committed before it: a version committed before the update finished claims "
        "weights that are not all loaded, or not finished loading: its rollouts would be attributed to another "
        "policy",
    )


def test_a_version_adopted_once_every_chunk_arrived_is_parity_fail(record: RunRecord) -> None:
    # right after the first chunk, wrong before the finish: only the second point sees it
    record.syncs[-1].mid_session[1].weight_version = "3"
    result = check_weight_version(record)
    assert not result.ok and result.message.startswith(
        "sync 2: while its update session was open (every chunk answered, the finish not yet sent) the engine "
        "reported weight version '3', not '2'"
    )


def test_the_version_before_a_session_is_the_last_finished_syncs_else_the_engines_start(record: RunRecord) -> None:
    assert committed_before(record, record.syncs[2]) == "2"
    record.syncs[1].finished = False  # a failed sync commits nothing: the one before it is still in place
    assert committed_before(record, record.syncs[2]) == "1"
    assert committed_before(record, record.syncs[0]) == "0"  # read before sync 0
    record.engine_start_versions = []
    assert committed_before(record, record.syncs[0]) is None


def test_a_completion_served_while_a_session_is_open_is_parity_fail(record: RunRecord) -> None:
    record.syncs[-1].mid_session[0].completion = 200
    assert verdict_of(record) == (
        "PARITY_FAIL",
        "sync 2: the engine served a completion while the update session was open (its first chunk answered): a "
        "rollout from half-updated weights, tagged with a version it was not made by",
    )


def test_a_completion_asked_during_a_session_must_be_refused_not_fail_otherwise(record: RunRecord) -> None:
    ask = record.syncs[-1].mid_session[1]
    ask.completion, ask.note = 503, "/v1/completions -> 503: updating"
    assert check_completions_in_session(record).ok
    ask.completion, ask.note = 500, "/v1/completions -> 500: Traceback"
    result = check_completions_in_session(record)
    assert not result.ok and result.message == (
        "sync 2: a completion asked while the update session was open (every chunk answered, the finish not yet "
        "sent) got 500 (/v1/completions -> 500: Traceback), not a refusal (409 or 503)"
    )
    record.syncs[-1].mid_session = []  # nothing asked
    assert check_completions_in_session(record).skipped


def test_an_engine_that_serves_between_chunks_must_be_paused_during_a_session() -> None:
    rec = vllm_record()  # vLLM is asked /is_paused, not a completion (one killed its engine core mid-session)
    asks = rec.syncs[-1].mid_session
    assert [(a.completion, a.paused) for a in asks] == [(None, True), (None, True)]
    assert check_completions_in_session(rec).ok
    asks[1].paused = False
    assert verdict_of(rec) == (
        "PARITY_FAIL",
        "sync 2: the engine's generation was not paused while the update session was open (every chunk answered, "
        "the finish not yet sent), and this engine serves requests between chunks: a rollout then runs on "
        "half-updated weights (on vLLM 0.32 it killed the engine core, its layers not yet reloaded being on the "
        "meta device); POST /pause before /start_weight_update and /resume after the finish",
    )


def test_stale_prefix_cache_is_parity_fail_naming_the_probe(record: RunRecord) -> None:
    record.syncs[2].probe = {"token": 7, "engine": -2.25, "expected": -2.5}
    verdict, message = verdict_of(record)
    assert verdict == "PARITY_FAIL"
    assert message.startswith("sync 2: the probe prompt served again after the sync generated token 7 with log-prob")
    assert "(|diff| 0.25 > 0.0001)" in message
    assert message.endswith(
        "the weights match it, so a cache (prefix or encoder) or a copy of the weights the generation path keeps "
        "(a transposed lm_head, a fused buffer) answered with the old weights"
    )


def test_a_probe_off_on_wrong_weights_blames_the_weights_not_a_cache(record: RunRecord) -> None:
    sync = record.syncs[2]
    assert sync.expected_checksums and sync.engine_checksums == sync.expected_checksums
    name = sorted(sync.expected_checksums)[0]
    sync.engine_checksums = {**sync.engine_checksums, name: "0" * 16}
    sync.probe = {"token": 7, "engine": -2.25, "expected": -2.5}
    message = check_engine_caches(record).message
    assert message.endswith(
        f"the engine's weights themselves differ from the expected state (1 tensor, e.g. {name!r}), so no cache "
        "is to blame for it yet"
    ), message
    assert "prefix cache" not in message


def test_probe_within_budget_passes_and_its_oracle_failure_is_a_note(record: RunRecord) -> None:
    assert check_engine_caches(record).ok
    record.oracle_failures.append(OracleFailure(check="engine_caches", sync=1, reason="RuntimeError: no view"))
    result = check_engine_caches(record)
    assert result.skipped and result.reason == "oracle could not run after sync 1: RuntimeError: no view"


def test_a_sync_started_before_vllm_was_paused_is_parity_fail() -> None:
    rec = vllm_record()
    assert check_completions_in_session(rec).ok
    rec.http = [c for c in rec.http if not (c.sync == 1 and c.route == "/pause")]
    result = check_completions_in_session(rec)
    assert not result.ok and result.message.startswith(
        "sync 1: /start_weight_update was sent with no /pause answered 200 before it: this engine serves requests "
        "between chunks"
    )
    for c in rec.http:  # a pause refused is no pause
        if c.route == "/pause" and c.sync == 1:
            c.status = 500
    assert "sync 1: /start_weight_update was sent with no /pause" in check_completions_in_session(rec).message


def test_vllm_resumed_before_the_finish_answered_is_parity_fail() -> None:
    rec = vllm_record()
    finish = next(c for c in rec.http if c.sync == 0 and c.route == "/finish_weight_update")  # sent at +40 ms
    resume = next(c for c in rec.http if c.sync == 0 and c.route == "/resume")
    resume.t = finish.t - 0.015  # after the last chunk, before the finish
    result = check_completions_in_session(rec)
    assert not result.ok and result.message.startswith(
        "sync 0: /resume was sent 20 ms before /finish_weight_update answered, with the session still open"
    )
    rec.http = [c for c in rec.http if not (c.sync == 0 and c.route == "/finish_weight_update")]
    assert pause_problem(rec) is None  # a session the engine ended (no finish): resuming then is not early


def test_the_embedded_engine_is_not_asked_to_pause(record: RunRecord) -> None:
    record.engine_capabilities = engine_kind("embedded").capabilities  # refuses completions in a session
    assert not [c for c in record.http if c.route == "/pause"] and pause_problem(record) is None

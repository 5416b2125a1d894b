"""Names (every name sent could be placed) and coverage (every engine shard updated exactly once)."""

from __future__ import annotations

from harness.checks import check_coverage, check_names
from harness.record import ErrorRecord, RunRecord

from .records import NAMES, VISION, reject_chunk, rejection, verdict_of, vllm_record

VLLM_UNPLACEABLE = (
    "There is no module or parameter named 'layers.0.self_attn.q_proj' in Qwen3Model. The available parameters "
    "belonging to layers.0.self_attn (Qwen3Attention) are: {'layers.0.self_attn.qkv_proj.weight'}"
)


def test_engine_name_rejection_is_name_error(record: RunRecord) -> None:
    reject_chunk(record, sync=0, chunk=0, status=400, rejections=[rejection("x", "name", "unknown parameter")])
    assert verdict_of(record) == (
        "NAME_ERROR",
        "sync 0 chunk 0: engine cannot place name 'x' (/update_weights status 400: unknown parameter)",
    )


def test_name_rejection_from_vllm_names_the_hf_name_and_quotes_vllms_words() -> None:
    rec = vllm_record()
    reject_chunk(rec, sync=1, chunk=0, status=500, rejections=[rejection(NAMES[1], "name", VLLM_UNPLACEABLE)])
    verdict, message = verdict_of(rec)
    assert verdict == "NAME_ERROR"
    assert message.startswith(f"sync 1 chunk 0: engine cannot place name '{NAMES[1]}' (/update_weights status 500: ")
    assert "no module or parameter named 'layers.0.self_attn.q_proj'" in message and message.endswith("…)")


def test_first_name_problem_is_the_first_answers(record: RunRecord) -> None:
    reject_chunk(record, 0, 1, 400, [rejection(NAMES[2], "shape", "[2] != [4]"), rejection(VISION, "name", "no shard")])
    message = check_names(record).message
    assert message == f"sync 0 chunk 1: engine cannot place name '{VISION}' (/update_weights status 400: no shard)"


def test_dtype_and_shape_rejections_are_not_name_errors(record: RunRecord) -> None:
    reject_chunk(record, 0, 0, 400, [rejection(NAMES[0], "dtype", "bfloat16 != float32"), rejection(NAMES[1], "shape")])
    assert record.syncs[0].names_rejected == {NAMES[0]: "bfloat16 != float32", NAMES[1]: "rejected"}
    assert check_names(record).ok
    assert verdict_of(record)[0] == "HTTP_ERROR"


def test_generic_chunk_rejection_alone_is_not_a_name_error() -> None:
    """An answer that names no tensor (e.g. vLLM's shape assertion) stays an HTTP error, although the sender
    records every name of the chunk as rejected with the answer's text."""
    rec = vllm_record()
    text = "Attempted to load weight (torch.Size([63])) into parameter (torch.Size([64]))"
    reject_chunk(rec, 0, 0, 500, [rejection("/update_weights", "other", text)], body=f'{{"error": "{text}"}}')
    assert set(rec.syncs[0].names_rejected) == set(NAMES[:2])
    assert all(r.startswith("chunk rejected: /update_weights -> 500") for r in rec.syncs[0].names_rejected.values())
    assert check_names(rec).ok
    assert verdict_of(rec) == ("HTTP_ERROR", f"sync 0 chunk 0: /update_weights answered status 500: {text}")


def test_names_rejected_without_an_answer_of_another_kind_is_name_error(record: RunRecord) -> None:
    record.syncs[1].names_rejected = {VISION: "no shard for this name"}
    assert verdict_of(record) == ("NAME_ERROR", f"sync 1: engine rejected name '{VISION}': no shard for this name")


def test_names_rejected_of_another_kind_in_that_sync_is_not_name_error(record: RunRecord) -> None:
    record.syncs[1].names_rejected = {NAMES[0]: "shape [4, 8] != [8, 4]"}
    record.http[6].status, record.http[6].rejections = 400, [rejection(NAMES[0], "shape", "shape [4, 8] != [8, 4]")]
    assert (record.http[6].sync, record.http[6].chunk) == (1, 0)
    assert check_names(record).ok


def test_trainer_keyerror_is_a_crash_not_a_name_error(record: RunRecord) -> None:
    """A KeyError in the trainer's own planner or converter is a bug of the trainer, not a name an engine
    could not place."""
    record.errors.append(ErrorRecord(where="trainer", rank=1, type="KeyError", message=f"'{VISION}'"))
    assert verdict_of(record) == ("CRASH", f"rank 1 (trainer) raised KeyError: '{VISION}'")
    assert check_names(record).ok


def test_trainer_exception_saying_no_parameter_named_is_a_crash(record: RunRecord) -> None:
    text = f"There is no parameter named '{VISION}' in the reference model"
    record.errors.append(ErrorRecord(where="trainer", rank=0, type="ValueError", message=text))
    assert verdict_of(record) == ("CRASH", f"rank 0 (trainer) raised ValueError: {text}")
    assert check_names(record).ok


def test_engine_rejected_error_text_is_not_read_for_names(record: RunRecord) -> None:
    """The HTTP log's rejections judge an engine's answer; an EngineRejected's message is never re-read."""
    text = f"/update_weights -> 500: There is no module or parameter named '{VISION}'"
    record.errors.append(ErrorRecord(where="trainer", rank=0, type="EngineRejected", message=text))
    assert check_names(record).ok
    assert verdict_of(record)[0] == "HTTP_ERROR"


def test_engine_silently_ignoring_a_name_is_name_error(record: RunRecord) -> None:
    record.syncs[1].names_accepted = NAMES[:1]
    assert verdict_of(record) == (
        "NAME_ERROR",
        f"sync 1: engine answered 200 but silently ignored name '{NAMES[1]}' (+1 more)",
    )


def test_vllm_200_for_a_name_the_checkpoint_lacks_is_name_error() -> None:
    rec = vllm_record()
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    rec.syncs[1].names_sent.append(extra)
    rec.syncs[1].names_accepted.append(extra)
    verdict, message = verdict_of(rec)
    assert verdict == "NAME_ERROR"
    assert message.startswith(f"sync 1: engine answered 200 for '{extra}', which the checkpoint does not have")


def test_shard_updated_twice_is_coverage_gap(record: RunRecord) -> None:
    record.syncs[1].engine_update_counts[NAMES[1]] = 2
    assert verdict_of(record) == (
        "COVERAGE_GAP",
        f"sync 1: engine shard '{NAMES[1]}' updated 2 times, expected exactly once",
    )


def test_shards_never_updated_is_coverage_gap(record: RunRecord) -> None:
    del record.syncs[0].engine_update_counts[NAMES[2]]
    del record.syncs[0].engine_update_counts[NAMES[0]]
    result = check_coverage(record)
    assert result.failed
    assert result.message == f"sync 0: engine shard '{NAMES[0]}' never updated, expected exactly once (+1 more shards)"


def test_coverage_skipped_without_shards_or_counts(record: RunRecord) -> None:
    record.engine_shards = []
    for s in record.syncs:
        s.engine_update_counts = {}
    result = check_coverage(record)
    assert result.skipped and "no engine shards" in result.reason


def test_vllm_record_coverage_from_names_sent() -> None:
    result = check_coverage(vllm_record())
    assert result.ok and not result.skipped


def test_vllm_name_never_sent_is_coverage_gap() -> None:
    rec = vllm_record()
    rec.syncs[1].names_sent.remove(NAMES[1])
    verdict, message = verdict_of(rec)
    assert verdict == "COVERAGE_GAP"
    assert message.startswith(f"sync 1: checkpoint tensor '{NAMES[1]}' was never sent (judged from the names sent")


def test_vllm_name_sent_twice_is_coverage_gap() -> None:
    rec = vllm_record()
    rec.syncs[2].names_sent.append(NAMES[0])
    assert verdict_of(rec) == ("COVERAGE_GAP", f"sync 2: '{NAMES[0]}' was sent 2 times, expected exactly once")

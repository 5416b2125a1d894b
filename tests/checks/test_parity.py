"""Parity of the weights: sync 0 against the checkpoint, later syncs against what was sent, raw against
bridge, the requested export mode, and scenario groups."""

from __future__ import annotations

from harness.checks import (
    check_group,
    check_parity_cross_mode,
    check_parity_expected,
    check_parity_sent,
    check_parity_sync0,
    check_sent_layout,
    group_differences,
    judge,
)
from harness.record import OracleFailure, RunRecord, TensorLayout

from .records import NAMES, reject_chunk, rejection, verdict_of, vllm_record


def test_sync0_checksum_differs_is_parity_fail(record: RunRecord) -> None:
    record.syncs[0].engine_checksums[NAMES[1]] = "dummy"
    assert verdict_of(record) == (
        "PARITY_FAIL",
        f"sync 0: '{NAMES[1]}' engine checksum dummy != checkpoint ck-01 (1 of 3 tensors differ)",
    )


def test_sync0_missing_and_extra_names_are_parity_fail(record: RunRecord) -> None:
    del record.syncs[0].engine_checksums[NAMES[0]]
    message = check_parity_sync0(record).message
    assert message == f"sync 0: '{NAMES[0]}' in checkpoint but missing from engine (1 of 3 tensors differ)"
    record.syncs[0].engine_checksums[NAMES[0]] = "ck-00"
    record.syncs[0].engine_checksums["extra.weight"] = "e" * 40
    message = check_parity_sync0(record).message
    assert message == "sync 0: 'extra.weight' on engine but not in checkpoint (1 of 4 tensors differ)"


def test_sync0_without_checksums_is_parity_fail(record: RunRecord) -> None:
    record.syncs[0].engine_checksums, record.checkpoint_checksums = {}, {}
    result = check_parity_sync0(record)
    assert result.failed and "no checksums recorded" in result.message


def test_vllm_sync0_sent_differs_from_checkpoint_is_parity_fail() -> None:
    rec = vllm_record()
    rec.syncs[0].sent_checksums[NAMES[2]] = "wrong"
    assert verdict_of(rec) == (
        "PARITY_FAIL",
        f"sync 0: '{NAMES[2]}' sent checksum wrong != checkpoint ck-02 (1 of 3 tensors differ)",
    )


def test_later_sync_differs_from_sent_is_parity_fail(record: RunRecord) -> None:
    record.syncs[1].engine_checksums[NAMES[2]] = "stale-" + "0" * 30
    assert verdict_of(record) == (
        "PARITY_FAIL",
        f"sync 1: '{NAMES[2]}' engine checksum stale-0000000000… != sent s1-02 (1 of 3 tensors differ)",
    )


def test_later_sync_without_sent_checksums_is_parity_fail(record: RunRecord) -> None:
    record.syncs[1].sent_checksums = {}
    result = check_parity_sent(record)
    assert result.failed and result.message == "sync 1: no sent checksums recorded"


def test_parity_sent_skipped_on_vllm() -> None:
    result = check_parity_sent(vllm_record())
    assert result.skipped and "log-prob" in result.reason


def test_cross_mode_mismatch_is_parity_fail(record: RunRecord) -> None:
    record.cross_mode_checksums["raw"][NAMES[1]] = "gqa-wrong"
    record.syncs[-1].expected_checksums = {}  # no expected state to settle which export is wrong
    verdict, message = verdict_of(record)
    assert verdict == "PARITY_FAIL"
    assert (
        message
        == f"raw vs bridge: '{NAMES[1]}' bridge export checksum s1-01 != raw export gqa-wrong (1 of 3 tensors differ)"
    )


def test_a_cross_mode_mismatch_the_expected_state_puts_on_the_other_mode_is_that_modes_finding(
    record: RunRecord,
) -> None:
    # The bridge export of Megatron-Bridge 0.6.2 keeps a padded vocabulary's rows: the raw scenarios' second
    # export path then differed, and every raw row failed for the library's export.
    assert record.scenario.export_mode == "bridge"
    record.cross_mode_checksums["raw"][NAMES[1]] = "gqa-wrong"  # this record's bridge export equals the expected
    result = check_parity_cross_mode(record)
    assert result.skipped and result.reason.endswith(
        "the bridge export equals the expected state, the raw export does not: a finding of the raw mode's scenarios"
    )
    record.cross_mode_checksums["bridge"][NAMES[0]] = "also-wrong"  # now this scenario's own export is wrong too
    assert check_parity_cross_mode(record).failed


def test_cross_mode_skipped_when_absent(record: RunRecord) -> None:
    record.cross_mode_checksums = {"raw": {"a": "1"}}
    result = check_parity_cross_mode(record)
    assert result.ok and result.skipped and "bridge" in result.reason


def test_mode_mismatch_is_parity_fail(record: RunRecord) -> None:
    record.syncs[1].export_mode = "raw"
    assert verdict_of(record) == ("PARITY_FAIL", "requested mode bridge but raw ran (sync 1)")


def test_group_members_with_identical_weights_pass(record: RunRecord) -> None:
    other = record.model_copy(deep=True, update={"scenario_id": "m/tp1-pp1/noncolocate/raw/chunk-1"})
    assert group_differences([record, other]) == []
    record.group_members = [other.scenario_id]
    assert judge(record)[0] == "PASS"


def test_group_member_with_different_weights_is_parity_fail(record: RunRecord) -> None:
    other = record.model_copy(deep=True, update={"scenario_id": "m/tp1-pp1/noncolocate/raw/chunk-1"})
    name = sorted(other.syncs[-1].engine_checksums)[0]
    other.syncs[-1].engine_checksums[name] = "f" * 32
    other.syncs[1].engine_logprobs = [[-1.0, -2.5]]
    diffs = group_differences([record, other])
    assert diffs == [
        f"sync 1: engine log-probs differ between {record.scenario_id} and {other.scenario_id} by up to 0.49 "
        "(prompt 0 position 2: trainer -2.010000 engine -2.500000)",
        f"sync 2: {name} differs between {record.scenario_id} and {other.scenario_id} (1 tensors differ)",
    ]
    record.group_members, record.group_differences = [other.scenario_id], diffs
    assert verdict_of(record)[0] == "PARITY_FAIL"
    assert check_group(record).message == diffs[0] + " (and 1 more)"


def test_group_member_with_fewer_syncs_is_named(record: RunRecord) -> None:
    other = record.model_copy(deep=True, update={"scenario_id": "other"})
    other.syncs = other.syncs[:1]
    assert group_differences([record, other]) == [f"other ran 1 syncs, {record.scenario_id} ran 3"]


def test_stale_resend_that_the_engine_holds_is_parity_fail_against_the_expected_state(record: RunRecord) -> None:
    """Sync 1 re-sends sync 0's tensors and the engine holds exactly them: only the expected state sees it."""
    record.syncs[1].sent_checksums = dict(record.syncs[0].sent_checksums)
    record.syncs[1].engine_checksums = dict(record.syncs[0].sent_checksums)
    assert check_parity_sent(record).ok and check_parity_sync0(record).ok
    assert verdict_of(record) == (
        "PARITY_FAIL",
        f"sync 1: '{NAMES[0]}' sent checksum ck-00 != expected s1-00 (3 of 3 tensors differ)",
    )


def test_engine_differs_from_the_expected_state_after_a_right_send(record: RunRecord) -> None:
    record.syncs[2].engine_checksums[NAMES[1]] = "old"
    result = check_parity_expected(record)
    assert result.failed and result.message.startswith(f"sync 2: '{NAMES[1]}' engine checksum old != expected")


def test_vllm_later_sync_sent_differs_from_the_expected_state() -> None:
    rec = vllm_record()
    rec.syncs[1].sent_checksums[NAMES[2]] = "unstepped"
    result = check_parity_expected(rec)
    assert result.failed and f"sync 1: '{NAMES[2]}' sent checksum unstepped != expected s1-02" in result.message


def test_without_an_expected_state_the_check_is_skipped(record: RunRecord) -> None:
    for sync in record.syncs:
        sync.expected_checksums = {}
    result = check_parity_expected(record)
    assert result.skipped and "no expected state" in result.reason


def test_transposed_tensor_the_engine_refused_is_http_error_naming_the_swapped_dims(record: RunRecord) -> None:
    name = NAMES[2]
    record.checkpoint_layout[name] = TensorLayout(shape=[16, 128, 96], dtype="float32")
    record.syncs[0].sent_layout[name] = TensorLayout(shape=[16, 96, 128], dtype="float32")
    reason = "shape [16, 96, 128] but the engine shard expects [16, 128, 96]"
    reject_chunk(record, 0, 1, 400, [rejection(name, "shape", reason)])
    expected = (
        "HTTP_ERROR",
        f"sync 0: '{name}' sent as [16, 96, 128] float32 but the checkpoint holds [16, 128, 96] float32: the last "
        "two dims are swapped; the engine refused it",
    )
    result = check_sent_layout(record)
    assert (result.verdict_on_fail, result.message) == expected
    assert verdict_of(record) == expected


def test_wrong_layout_the_engine_took_is_parity_fail(record: RunRecord) -> None:
    record.syncs[1].sent_layout[NAMES[0]] = TensorLayout(shape=[4, 8], dtype="bfloat16")
    assert verdict_of(record) == (
        "PARITY_FAIL",
        f"sync 1: '{NAMES[0]}' sent as [4, 8] bfloat16 but the checkpoint holds [4, 8] float32; the engine answered "
        "200",
    )


def test_oracle_that_could_not_run_skips_its_check_and_never_fails_the_scenario(record: RunRecord) -> None:
    for check in ("parity_expected", "parity_cross_mode", "logprob_parity", "group_invariance"):
        record.oracle_failures.append(OracleFailure(check=check, sync=1, reason="RuntimeError: boom"))
    verdict, results = judge(record)
    assert verdict == "PASS"
    skipped = {r.name: r.reason for r in results if r.skipped}
    assert skipped["parity_expected"] == "oracle could not run after sync 1: RuntimeError: boom"
    assert {"parity_cross_mode", "logprob_parity", "group_invariance"} <= set(skipped)


def test_oracle_failure_on_an_engine_without_reports_fails_the_logprob_check() -> None:
    rec = vllm_record()
    rec.oracle_failures.append(OracleFailure(check="logprob_parity", sync=0, reason="RuntimeError: boom"))
    for s in rec.syncs:  # neither view could run
        s.logprobs = s.logprobs_expected = {}
    assert verdict_of(rec) == (
        "PARITY_FAIL",
        "sync 0: oracle could not run after sync 0: RuntimeError: boom; and this engine reports nothing else about "
        "the weights it holds",
    )

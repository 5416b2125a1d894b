"""Several engine replicas in one record: every check judges every engine, on that engine's view of the
record, and a failure of one engine names it; and an engine's TP ranks are judged rank by rank."""

from __future__ import annotations

from harness.checks import check_engine_tp_shards, judge
from harness.record import EngineSync, HttpCall, RunRecord
from reference_impl.transport.observed import Rejection

from .records import make_record, verdict_of

MEASURED = ("engine_checksums", "engine_weight_version", "probe", "logprobs", "logprobs_expected", "engine_logprobs")


def two_engines() -> RunRecord:
    """`make_record()` with two engine replicas that both took every chunk and hold the same state."""
    rec = make_record()
    rec.scenario.engines = 2
    rec.http = [c for c in rec.http] + [c.model_copy(update={"engine": 1}) for c in rec.http]
    for s in rec.syncs:
        s.engines = [
            EngineSync(
                engine=i,
                chunks_received=[c.index for c in s.chunks],
                names_accepted=list(s.names_accepted),
                engine_update_counts=dict(s.engine_update_counts),
                finished=s.finished,
                **{f: getattr(s, f) for f in MEASURED},
            )
            for i in (0, 1)
        ]
    return rec


def test_two_engines_that_agree_pass() -> None:
    verdict, results = judge(two_engines())
    assert verdict == "PASS", [r for r in results if r.failed]


def test_engine_view_is_that_engines_calls_and_account() -> None:
    rec = two_engines()
    rec.syncs[1].engines[1].engine_checksums = {"x": "y"}
    view = rec.engine_view(1)
    assert {c.engine for c in view.http} == {1} and len(view.http) == len(rec.http) // 2
    assert view.syncs[1].engine_checksums == {"x": "y"} and view.syncs[1].engines == []
    assert rec.engine_view(0).syncs[1].engine_checksums == rec.syncs[1].engine_checksums


def test_one_engine_holding_stale_weights_is_named() -> None:
    rec = two_engines()
    stale = rec.syncs[0].engine_checksums  # engine 1 kept sync 0's weights after sync 1
    rec.syncs[1].engines[1].engine_checksums = dict(stale)
    verdict, message = verdict_of(rec)
    assert verdict == "PARITY_FAIL"
    assert message.startswith("engine 1: sync 1: ") and "also failing" not in message, message


def test_one_engine_off_in_logprobs_is_named() -> None:
    rec = two_engines()
    lp = dict(rec.syncs[2].engines[1].logprobs_expected)
    off = {"max_abs": 0.5, "first_diff": "prompt 0 position 1"}
    rec.syncs[2].engines[1].logprobs_expected = lp | off
    verdict, message = verdict_of(rec)
    assert verdict == "PARITY_FAIL" and message.startswith("engine 1: sync 2: expected state vs engine"), message


def test_one_engine_that_refused_a_chunk_is_named() -> None:
    rec = two_engines()
    call = next(c for c in rec.http if c.engine == 1 and c.sync == 1 and c.chunk == 1)
    call.status, call.rejections = 400, [Rejection(name="lm_head.weight", kind="dtype", reason="bfloat16 sent")]
    account = rec.syncs[1].engines[1]
    account.chunks_received = [0]
    account.names_rejected = {"lm_head.weight": "bfloat16 sent"}
    verdict, message = verdict_of(rec)
    assert verdict == "HTTP_ERROR"
    assert message.startswith("engine 1: sync 1 chunk 1: /update_weights answered status 400: dtype"), message


def test_a_failure_every_engine_shares_is_said_once() -> None:
    rec = two_engines()
    rec.syncs[1].sent_checksums["lm_head.weight"] = "wrong"  # the sender's, the same for both engines
    verdict, message = verdict_of(rec)
    assert verdict == "PARITY_FAIL" and message.startswith("sync 1: "), message


def test_both_engines_failing_differently_name_the_first_and_the_others() -> None:
    rec = two_engines()
    for i, version in ((0, "7"), (1, "8")):
        rec.syncs[1].engines[i].engine_weight_version = version
    results = {r.name: r for r in judge(rec)[1]}
    assert results["weight_version"].message.startswith("engine 0: sync 1: the engine reports weight version '7'")
    assert results["weight_version"].message.endswith("(also failing on engine 1)")


def test_a_second_engine_that_never_answered_its_init_is_an_http_error() -> None:
    rec = two_engines()
    rec.http.append(HttpCall(route="/init_weight_transfer_engine", status=0, ms=1.0, engine=1, error="gone"))
    assert verdict_of(rec)[0] == "HTTP_ERROR"


def _tp_record() -> RunRecord:
    rec = make_record()
    rec.scenario.engine_tp = 2
    for s in rec.syncs:
        s.expected_tp_checksums = {"0": {"a.qkv_proj.weight": f"q0-{s.index}"}, "1": {"a.qkv_proj.weight": "q1"}}
        s.engine_tp_checksums = {r: dict(v) for r, v in s.expected_tp_checksums.items()}
    return rec


def test_tp_ranks_holding_their_partition_pass_and_a_wrong_rank_is_named() -> None:
    rec = _tp_record()
    assert check_engine_tp_shards(rec).ok and not check_engine_tp_shards(rec).skipped
    rec.syncs[1].engine_tp_checksums["1"]["a.qkv_proj.weight"] = "other"
    result = check_engine_tp_shards(rec)
    assert result.failed and result.message.startswith("sync 1: TP rank 1: 'a.qkv_proj.weight' TP rank 1 checksum")
    rec.syncs[1].engine_tp_checksums = {}
    assert "reported no TP shards" in check_engine_tp_shards(rec).message


def test_tp_shards_are_not_judged_without_engine_tp_or_per_tensor_reports() -> None:
    from reference_impl.engine import engine_kind

    assert check_engine_tp_shards(make_record()).skipped
    rec = _tp_record()
    rec.engine_capabilities = engine_kind("vllm").capabilities
    assert "log-prob parity judges" in check_engine_tp_shards(rec).reason

"""Run records for the check tests: one that passes every check, and the mutations the engines make.

`make_record()` is a small embedded-engine record (2 syncs of 2 chunks over 3 names, then a re-sync of
unchanged weights) that passes every check; `vllm_record()` is the same as vLLM reports it (no shards,
counts or HF-name engine checksums). `reject_chunk` makes the engine refuse one chunk the way the sender
records it: the call's status and `Rejection`s (what the engine's parser returns), the sync stopped there,
and `names_rejected` as `transport.client.names_rejected` fills it.
"""

from __future__ import annotations

from harness.checks import LOGPROB_BUDGETS, judge, logprob_parity
from harness.record import ChunkRecord, HttpCall, MidSessionAsk, RunRecord, SyncRecord, TensorLayout
from harness.scenario import Scenario
from reference_impl.engine import engine_kind
from reference_impl.transport.client import EngineRejected, names_rejected
from reference_impl.transport.observed import Rejection, RejectionKind

NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "lm_head.weight",
]
LAYOUT = TensorLayout(shape=[4, 8], dtype="float32")
VISION = "model.visual.decoder.layers.0.self_attention.linear_proj.weight"


def _sync(s: int, checkpoint: dict[str, str], mode: str) -> SyncRecord:
    sums = checkpoint if s == 0 else {name: f"s{s}-{i:02d}" for i, name in enumerate(NAMES)}
    return SyncRecord(
        index=s,
        weight_version=s + 1,
        export_mode=mode,
        chunks_planned=2,
        chunks_sent=2,
        chunks_received=2,
        chunks=[
            ChunkRecord(index=0, names=NAMES[:2], bytes=800, sent=True, received=True),
            ChunkRecord(index=1, names=NAMES[2:], bytes=400, sent=True, received=True),
        ],
        bytes=1200,
        phases={"gather": 0.1, "convert": 0.2, "transfer": 0.3, "load": 0.1},
        total_s=1.0 if s == 0 else 0.5,
        names_sent=list(NAMES),
        names_accepted=list(NAMES),
        sent_checksums=dict(sums),
        sent_layout={name: LAYOUT for name in NAMES},
        engine_checksums=dict(sums),
        expected_checksums=dict(sums),
        engine_update_counts=dict.fromkeys(NAMES, 1),
        finished=True,
        logprobs=logprob_parity([[-1.0, -2.0]], [[-1.0 + 2e-6, -2.0]]) | {"temperature": 0.7},
        logprobs_expected=logprob_parity([[-1.0, -2.0]], [[-1.0 + 3e-6, -2.0]]) | {"temperature": 0.7},
        probe={"token": 7, "engine": -2.5, "expected": -2.5 + 4e-6},
        engine_logprobs=[[-1.0 + 2e-6, -2.0 - 0.01 * s]],
    )


def _session_calls(s: int) -> list[HttpCall]:
    return [
        HttpCall(route="/start_weight_update", status=200, ms=1.0, sync=s),
        *(HttpCall(route="/update_weights", status=200, ms=5.0, sync=s, chunk=c) for c in (0, 1)),
        HttpCall(route="/finish_weight_update", status=200, ms=1.0, sync=s),
    ]


def paused_session_calls(s: int) -> list[HttpCall]:
    """The sender's calls of sync `s` to an engine that serves between chunks (vLLM), on the wire in this order,
    each answered before the next is sent: /pause, the session's calls, /resume (unix seconds from 1000 + 10 s)."""
    routes = ["/pause", *(c.route for c in _session_calls(s)), "/resume"]
    chunks = [None, None, 0, 1, None, None]
    return [
        HttpCall(route=r, status=200, t=1000.0 + 10 * s + 0.01 * i, ms=5.0, sync=s, chunk=c, rank=0)
        for i, (r, c) in enumerate(zip(routes, chunks, strict=True))
    ]


def make_record(syncs: int = 2, mode: str = "bridge") -> RunRecord:
    """A small record that passes every check: `syncs` syncs of 2 chunks over 3 names, then a re-sync of
    unchanged weights (same checksums, same engine log-probs)."""
    checkpoint = {name: f"ck-{i:02d}" for i, name in enumerate(NAMES)}
    http = [HttpCall(route="/init_weight_transfer_engine", status=200, ms=3.0)]
    sync_records = [_sync(s, checkpoint, mode) for s in range(syncs)]
    resync = sync_records[-1].model_copy(deep=True, update={"index": syncs, "weight_version": syncs + 1})
    resync.perturbed = False
    # held after its first chunk and before its finish (`harness.mid_session`): the engine still reported the
    # version before, and refused a completion, as the embedded engine does
    resync.mid_session = [
        MidSessionAsk(point=p, weight_version=str(syncs), completion=409, note="/v1/completions -> 409: a session")
        for p in ("after_first_chunk", "before_finish")
    ]
    sync_records.append(resync)
    for sync in sync_records:  # what each finish committed, read back
        sync.engine_weight_version = str(sync.weight_version)
        sync.served_weight_version = str(sync.weight_version)  # the probe's answer, tagged as the embedded engine's
    for s in range(syncs + 1):
        http += _session_calls(s)
    scenario_id = f"qwen3/tp1-pp1/noncolocate/{mode}"
    last = sync_records[-1].sent_checksums
    return RunRecord(
        scenario_id=scenario_id,
        scenario=Scenario(model="qwen3", export_mode=mode, syncs=syncs, chunk_bytes=1024, seed=0),
        http=http,
        syncs=sync_records,
        requested_export_mode=mode,
        checkpoint_checksums=dict(checkpoint),
        checkpoint_layout={name: LAYOUT for name in NAMES},
        engine_shards=list(NAMES),
        engine_start_checksums=[{name: f"dummy-{i:02d}" for i, name in enumerate(NAMES)}],
        engine_fresh_checksums=[{name: f"dummy-{i:02d}" for i, name in enumerate(NAMES)}],
        engine_start_versions=["0"],
        cross_mode_checksums={"raw": dict(last), "bridge": dict(last)},
        logprob_budget=dict(LOGPROB_BUDGETS["float32"]),
        trainer_logprob_budget=dict(LOGPROB_BUDGETS["float32"]),
    )


def vllm_record() -> RunRecord:
    """`make_record()` as vLLM reports it: no shards, counts or HF-name engine checksums."""
    rec = make_record()
    rec.scenario.engine = "vllm"
    rec.engine_capabilities = engine_kind("vllm").capabilities
    rec.engine_shards = []
    for ask in rec.syncs[-1].mid_session:  # vLLM is asked whether it is paused, not for a completion
        ask.completion, ask.paused, ask.note = None, True, ""
    rec.http = [rec.http[0], *(c for s in rec.syncs for c in paused_session_calls(s.index))]
    for s in rec.syncs:
        s.engine_checksums = {}
        s.engine_update_counts = {}
    return rec


def rejection(name: str, kind: RejectionKind, reason: str = "rejected") -> Rejection:
    """One thing the engine refused, as its parser returns it."""
    return Rejection(name=name, kind=kind, reason=reason)


def reject_chunk(
    record: RunRecord, sync: int, chunk: int, status: int, rejections: list[Rejection], body: str = ""
) -> None:
    """Make the engine answer `status` with `rejections` to one chunk; the sync stops there, unfinished,
    and later syncs never run. `body` is the stored answer (what the parser read)."""
    call = next(c for c in record.http if c.sync == sync and c.chunk == chunk)
    call.status, call.rejections, call.error = status, rejections, body or None

    def made(c: HttpCall) -> bool:
        if c.sync is None or c.sync < sync:
            return True
        return c.sync == sync and c.route != "/finish_weight_update" and (c.chunk or 0) <= chunk

    record.http = [c for c in record.http if made(c)]
    s = record.syncs[sync]
    s.chunks_received, s.chunks_sent, s.finished = chunk, chunk + 1, False
    for c in s.chunks[chunk:]:
        c.received = False
    for c in s.chunks[chunk + 1 :]:
        c.sent = False
    s.names_sent = [n for c in s.chunks[: chunk + 1] for n in c.names]
    s.names_accepted = [n for c in s.chunks[:chunk] for n in c.names]
    s.names_rejected = names_rejected(s.chunks[chunk].names, EngineRejected(call, body))
    record.syncs = record.syncs[: sync + 1]


def verdict_of(record: RunRecord) -> tuple[str, str]:
    """(verdict, message of the check that decided it)."""
    verdict, results = judge(record)
    deciding = [r for r in results if r.failed and r.verdict_on_fail == verdict]
    return verdict, deciding[0].message if deciding else ""

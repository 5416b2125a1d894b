"""The transfer itself: the scenario was valid, made progress, raised nothing unexplained, every call
answered 200, every chunk planned was sent and received, and every sync ran to its end.

Every exception raised in the trainer's or the harness's code is a crash (a ``KeyError`` too: NAME_ERROR
is only for names an engine could not place), except (they are judged by the HTTP / name checks):

- ``EngineRejected``: the update client's exception when the engine answers non-200.
- Engine-side exceptions when the engine did answer some call with an error status (>= 400): the engine
  handled the exception and the trainer saw it as that non-200. An engine that died (no response,
  status 0) stays a crash.
"""

from __future__ import annotations

from collections.abc import Callable

from harness.checks.base import (
    ENGINE_REJECTED,
    CheckResult,
    describe,
    error_origin,
    excerpt,
    failed,
    first_line,
    more,
    passed,
    prefix,
    skipped,
    status_text,
)
from harness.checks.names import check_names
from harness.record import DIED, ErrorRecord, HttpCall, RunRecord, SyncRecord


def check_config(record: RunRecord) -> CheckResult:
    """The scenario was valid (CONFIG_ERROR carries the sentence that says what to change)."""
    name, verdict = "config", "CONFIG_ERROR"
    if record.config_error:
        return failed(name, verdict, f"invalid scenario: {record.config_error}")
    return passed(name, verdict)


def check_deadlock(record: RunRecord) -> CheckResult:
    """The run made progress until its end (the watchdog did not fire)."""
    name, verdict = "deadlock", "DEADLOCK"
    if not record.deadlock:
        return passed(name, verdict)
    if record.deadlock_at:
        where = f"in {record.deadlock_at}"
    elif record.syncs:
        last = record.syncs[-1]
        where = (
            f"after sync {last.index} ({last.chunks_sent}/{last.chunks_planned} chunks sent, "
            f"{last.chunks_received} received)"
        )
    else:
        where = "before the first sync"
    phases = "; ".join(f"{label}: {phase}" for label, phase in record.progress.items())
    in_flight = f" (last phases: {phases})" if phases else ""
    stacks = f"; stacks saved: {', '.join(record.stacks)}" if record.stacks else "; no stacks saved"
    return failed(name, verdict, f"no progress before the deadline {where}{in_flight}{stacks}")


INIT_ROUTE = "/init_weight_transfer_engine"


def check_transfer_init(record: RunRecord) -> CheckResult:
    """Exactly one transfer-group init per engine per scenario: a second successful
    /init_weight_transfer_engine (e.g. from another PP stage's first rank) replaces the engine's group, and
    the sender's broadcasts then reach nobody. The message names the rank that sent each init."""
    name, verdict = "transfer_init", "CRASH"
    inits = [c for c in record.http if c.route == INIT_ROUTE and c.status == 200]
    if len(inits) <= 1:
        return passed(name, verdict)
    ranks = ", then ".join("the harness" if c.rank is None else f"rank {c.rank}" for c in inits)
    return failed(
        name,
        verdict,
        f"the engine accepted {len(inits)} {INIT_ROUTE} calls ({ranks}): one transfer group per engine, and the "
        "later init replaces the earlier one, so the sender's broadcasts would reach nobody",
    )


def check_recovery(record: RunRecord) -> CheckResult:
    """After a failed sync the engine is alive (/health and one completion answer 200) and one clean sync
    of the unchanged weights, with every fault undone, runs to its end with every call answered 200 (what
    the engine then holds is judged by the parity checks, as after every sync). An engine that died is a
    CRASH naming the sync it died after and its log's last line; one that survived but refuses a clean
    sync is an HTTP_ERROR."""
    name = "recovery"
    rec = record.recovery
    if rec is None:
        return skipped(name, "CRASH", "no sync failed (or the run stopped before the liveness probe)")
    after = f"after the failed sync {rec.after_sync}"
    who = f"engine {rec.engine}" if record.engine_count > 1 else "the engine"  # several replicas: which one
    tail = first_line(rec.engine_log_tail.strip().splitlines()[-1]) if rec.engine_log_tail.strip() else ""
    last = f"; its log ends: {excerpt(tail)}" if tail else ""
    if rec.health_status != 200:
        return failed(name, "CRASH", f"{who} died {after}: GET /health got {status_text(rec.health_status)}{last}")
    if rec.completion_status not in (None, 200):
        return failed(
            name,
            "CRASH",
            f"{who} {after} answers /health but not a completion ({status_text(rec.completion_status)}){last}",
        )
    if rec.clean_sync is not None and not rec.clean_sync_finished:
        why = f"{'the engines' if record.engine_count > 1 else 'the engine'} survived {after} but the clean sync "
        refused = next((c for c in record.http if c.sync == rec.clean_sync and c.status != 200), None)
        said = f": {_call_said(refused)}" if refused is not None else ""  # a bug every sync meets says what it is
        return failed(name, "HTTP_ERROR", f"{why}{rec.clean_sync} did not run to its end{said}")
    return passed(name, "CRASH")


def _call_said(call: HttpCall) -> str:
    """A non-200 call in words: "sync S chunk C: /route answered status N: <its first rejection, or the stored
    body>"."""
    if call.rejections:
        said = f": {describe(call.rejections[0], call.route)}{more(len(call.rejections) - 1, 'more rejected')}"
    else:
        said = f": {excerpt(call.error)}" if call.error else ""
    return f"{prefix(call)}{call.route} answered {status_text(call.status)}{said}"


def is_crash(record: RunRecord, err: ErrorRecord) -> bool:
    """Whether an error is a crash, or is judged by the HTTP / name checks instead (module doc)."""
    if err.type == ENGINE_REJECTED:
        return False
    return not (err.where == "engine" and any(call.status >= 400 for call in record.http))


def check_crash(record: RunRecord) -> CheckResult:
    """No exception other than engine rejections and name problems (those have their own checks)."""
    name, verdict = "crash", "CRASH"
    crashes = [err for err in record.errors if is_crash(record, err)]
    if not crashes:
        return passed(name, verdict)
    first = crashes[0]
    text = first_line(first.message) or "<no message>"
    # other ranks whose process died too: named, not counted among the peers' follow-on errors
    died = sorted({e.rank for e in crashes[1:] if e.type == DIED and e.rank is not None and e.rank != first.rank})
    also = f"; rank {', '.join(map(str, died))} died too" if died else ""
    return failed(name, verdict, f"{error_origin(first)} raised {first.type}: {text}{also}{more(len(crashes) - 1)}")


def check_http_status(record: RunRecord) -> CheckResult:
    """Every call to the engine answered 200 (and no EngineRejected went unrecorded). The message names the
    first non-200 call and what the engine refused in it (its first rejection, or the stored body)."""
    name, verdict = "http_status", "HTTP_ERROR"
    bad = [call for call in record.http if call.status != 200]
    if bad:
        return failed(name, verdict, f"{_call_said(bad[0])}{more(len(bad) - 1, 'more non-200')}")
    rejected = [err for err in record.errors if err.type == ENGINE_REJECTED]
    if rejected:
        first_err = rejected[0]
        return failed(
            name,
            verdict,
            f"{error_origin(first_err)}: engine rejected a call not in the HTTP log: {excerpt(first_err.message)}",
        )
    return passed(name, verdict)


def _chunk_problem(sync: SyncRecord) -> str | None:
    planned, sent, received = sync.chunks_planned, sync.chunks_sent, sync.chunks_received
    if planned == sent == received == len(sync.chunks):
        lost = next((c for c in sync.chunks if not (c.sent and c.received)), None)
        if lost is None:
            return None
        state = "not sent" if not lost.sent else "sent but not received"
        why = f"; {lost.note}" if lost.note else ""
        return f"sync {sync.index} chunk {lost.index}: {state} ({len(lost.names)} names, {lost.bytes} bytes){why}"
    first = next((c for c in sync.chunks if not c.sent), None) if sent < planned else None
    if first is None and received < planned:
        first = next((c for c in sync.chunks if not c.received), None)
    where = f"sync {sync.index}" + (f" chunk {first.index}" if first is not None else "")
    why = f"; {first.note}" if first is not None and first.note else ""
    return (
        f"{where}: planned {planned} chunks, sent {sent}, received {received}, {len(sync.chunks)} in the plan "
        f"record{why}"
    )


def _wire_problem(record: RunRecord, sync: SyncRecord) -> str | None:
    """The sender's own account of a sync against the client's log of the calls on the wire: every chunk
    recorded as received has one /update_weights call answered 200, and those calls carry the indexes of the
    chunks recorded as received (a chunk counter never reset between syncs sent chunks 2, 3 at sync 1 while the
    record said 0, 1). With several engines, `record` is one engine's view (`RunRecord.engine_view`)."""
    calls = [c for c in record.http if c.route == "/update_weights" and c.sync == sync.index]
    answered = sum(1 for c in calls if c.status == 200)
    if answered != sync.chunks_received:
        indexes = {c.chunk for c in calls}
        missing = next((c for c in sync.chunks if c.received and c.index not in indexes), None)
        where = f" (first: chunk {missing.index}, {len(missing.names)} names)" if missing is not None else ""
        return (
            f"sync {sync.index}: the sender recorded {sync.chunks_received} chunks as received but the engine "
            f"answered {answered} /update_weights calls with 200{where}"
        )
    on_wire = sorted(c.chunk for c in calls if c.status == 200 and c.chunk is not None)
    recorded = sorted(c.index for c in sync.chunks if c.received)
    if on_wire != recorded:
        return (
            f"sync {sync.index}: /update_weights calls answered 200 carry chunk indexes {_indexes(on_wire)}, but the "
            f"sender's record has chunks {_indexes(recorded)} as received: the chunk index on the wire is not the "
            "chunk's place in this sync's plan"
        )
    return None


def _indexes(values: list[int]) -> str:
    """`[0, 1, 2]`, or its first and last few (`[0, 1, 2, ..., 40, 41]`) when long."""
    shown = values if len(values) <= 8 else [*values[:3], "...", *values[-2:]]
    return "[" + ", ".join(str(v) for v in shown) + "]"


def _plan_problem(record: RunRecord, sync: SyncRecord) -> str | None:
    """The sync's chunks as the plan makes them: indexes 0..n-1, each once (an off-by-one counter sent chunk 1
    twice and chunk 0 never, with the record and the wire agreeing), and no chunk of several tensors over the
    scenario's `chunk_bytes` (the plan's greedy rule: only a tensor larger than a chunk may stand alone over it;
    a bucket over its limit is memory the receiver did not plan for)."""
    indexes = sorted(c.index for c in sync.chunks)
    if indexes != list(range(len(indexes))):
        return (
            f"sync {sync.index}: the sender's record has chunk indexes {_indexes(indexes)}, not 0 to "
            f"{len(indexes) - 1} once each"
        )
    limit = record.scenario.chunk_bytes
    over = next((c for c in sync.chunks if len(c.names) > 1 and c.bytes > limit), None)
    if over is not None:
        return (
            f"sync {sync.index} chunk {over.index}: {over.bytes} bytes in {len(over.names)} tensors, over the "
            f"scenario's chunk_bytes {limit} (only a single tensor larger than a chunk may exceed it)"
        )
    return None


def check_chunks(record: RunRecord) -> CheckResult:
    """Per sync: chunks planned == sent == received, every planned chunk is in the record, indexed 0..n-1 once
    each and within `chunk_bytes` unless a single tensor, and the chunks recorded as received match the
    /update_weights calls answered 200 on the wire."""
    name, verdict = "chunks", "CHUNK_MISMATCH"
    if not record.syncs:
        return skipped(name, verdict, "no sync recorded")
    for sync in record.syncs:
        problem = _chunk_problem(sync) or _plan_problem(record, sync) or _wire_problem(record, sync)
        if problem:
            return failed(name, verdict, problem)
    return passed(name, verdict)


# Failures that explain syncs missing or unfinished (so syncs_ran does not add a CRASH of its own).
_EXPLAINING: tuple[Callable[[RunRecord], CheckResult], ...] = (
    check_config,
    check_deadlock,
    check_transfer_init,
    check_recovery,
    check_crash,
    check_names,
    check_http_status,
    check_chunks,
)


def check_syncs_ran(record: RunRecord) -> CheckResult:
    """At least one sync (and as many as the scenario asks) ran, and every sync finished."""
    name, verdict = "syncs_ran", "CRASH"
    problem: str | None = None
    wanted = record.scenario.syncs
    if not record.syncs:
        problem = "no sync recorded"
    elif wanted and len(record.syncs) < wanted:
        problem = f"{len(record.syncs)} of {wanted} syncs recorded (last: sync {record.syncs[-1].index})"
    else:
        unfinished = next((s for s in record.syncs if not s.finished), None)
        if unfinished is not None:
            problem = (
                f"sync {unfinished.index} did not finish (no 200 from /finish_weight_update) and no error explains it"
            )
    if problem is None:
        return passed(name, verdict)
    for check in _EXPLAINING:
        earlier = check(record)
        if earlier.failed:
            return skipped(name, verdict, f"{problem}; explained by {earlier.verdict_on_fail}")
    return failed(name, verdict, problem)

"""What a scenario's syncs came to, as pure functions of the run record: one `SyncRecord` from every
rank's report (`merge_sync`), whether a sync failed (`sync_failed`), and whether the scenario ended
cleanly enough for its processes to serve the next one (`ended_clean`, and for its engines alone
`engines_reusable`; `in_step` for the trainer ranks of a scenario that faulted or failed a sync, which the
runner then asks whether the fault is undone)."""

from __future__ import annotations

from harness.record import RunRecord, SyncRecord
from reference_impl.engine.process import STOP_GRACE_S
from reference_impl.transport.observed import HttpCall, SyncReport


def merge_sync(index: int, per_rank: list[tuple[SyncReport, list[HttpCall]]], record: RunRecord) -> SyncRecord:
    """One `SyncRecord` from every rank's report: the sender's (rank 0) observations; gather and convert as
    the slowest rank's, transfer and load as the sender's; the sender's calls go into the record."""
    reports = [report for report, _ in per_rank]
    sender = reports[0]
    record.http.extend(per_rank[0][1])
    phases = {k: max(r.phases.get(k, 0.0) for r in reports) for k in ("gather", "convert")}
    phases.update({k: sender.phases.get(k, 0.0) for k in ("transfer", "load")})
    return SyncRecord(
        **sender.model_dump(exclude={"rank", "phases", "total_s"}),
        index=index,
        weight_version=index,
        chunks_sent=sum(c.sent for c in sender.chunks),
        chunks_received=sum(c.received for c in sender.chunks),
        phases=phases,
        total_s=max(r.total_s for r in reports),
    )


def sync_failed(record: RunRecord, sync: SyncRecord) -> bool:
    """Whether a sync did not end cleanly: unfinished, or some call of it answered non-200."""
    return not sync.finished or any(c.sync == sync.index and c.status != 200 for c in record.http)


OUT_OF_STEP_GRACE_S = 1.0  # seconds between SIGTERM and SIGKILL for an engine its scenario left out of step


def stop_grace_s(record: RunRecord, healthy: bool) -> float:
    """Seconds between SIGTERM and SIGKILL for the scenario's engine servers, when they are ended rather than
    shelved: `STOP_GRACE_S` after a scenario that ended `in_step`, else `OUT_OF_STEP_GRACE_S`. An engine left
    out of step may be inside a request that never returns (a transfer-group join, a broadcast whose sender is
    gone); a server's graceful shutdown waits for its requests, so the whole grace passed before the SIGKILL
    every time (10 s of each DEADLOCK scenario's teardown). What it logged is on disk already, and
    `ServerProcess.stop` unlinks the segments its group held when it first answered /health either way (vLLM
    makes its own while it starts). A shelved engine whose restart in place failed is ended with the short
    grace too: it is discarded, and a restart that timed out may be stuck."""
    return STOP_GRACE_S if in_step(record, healthy) else OUT_OF_STEP_GRACE_S


def engines_reusable(record: RunRecord, healthy: bool) -> bool:
    """Whether the scenario's engines may serve the next scenario after a restart in place (they become
    fresh engines: new dummy weights, state and caches; `engine_fresh` then checks the starting weights of
    engines that report per-tensor checksums): it
    ended `in_step`, with or without a fault. An engine fault hook is undone by that restart, which refuses
    when the engine's seams do not all run what they ran before the hook, or while an update session is
    open (the runner then starts a new engine). A failed sync with no clean recovery sync after it leaves
    the engines unreused: an update session may still be open, or a chunk still loading."""
    return in_step(record, healthy)


def in_step(record: RunRecord, healthy: bool) -> bool:
    """Whether the scenario's last sync left every process in step: it ran through (`ran_through`) or its
    syncs stopped early and the recovery sync after them was clean (`recovered`)."""
    return ran_through(record, healthy) or recovered(record, healthy)


def recovered(record: RunRecord, healthy: bool) -> bool:
    """Whether the syncs stopped early (a sync failed, or an engine refused one of the harness's own calls)
    and the scenario then ended with a clean recovery sync (`ScenarioSession.recover`): it ran to its end
    (`healthy`) without an error, every engine answered /health (and a completion, when the scenario asks for
    log-probs), and the recovery sync (the trainer fault's patches undone; an engine hook stays loaded until
    the engine's restart undoes it) ran start -> updates -> finish with every call answered 200. Every rank's
    calls returned (a rank that raised is an error) and every rank took part in a whole sync after the failed
    one, so none is left inside a collective or a hand-off of it, and no engine holds an open update session:
    the engine's refusal (NAME_ERROR, HTTP_ERROR) broke the sync, not the processes."""
    rec = record.recovery
    if not healthy or record.errors or rec is None or not rec.clean_sync_finished or rec.clean_sync is None:
        return False
    clean = [s for s in record.syncs if s.index == rec.clean_sync]
    return len(clean) == 1 and not sync_failed(record, clean[0])


def ended_clean(record: RunRecord, healthy: bool) -> bool:
    """Whether the scenario's trainer ranks and engines may serve the next scenario as they are: it ran
    through (`ran_through`) without a fault (its patches live in those processes; after a fault that ran
    through, the runner keeps the ranks only once they show the fault undone)."""
    return not record.scenario.fault and ran_through(record, healthy)


def ran_through(record: RunRecord, healthy: bool) -> bool:
    """Whether the scenario ran to its end (`healthy`) without an error or a recovery, every sync ran (the
    harness's own call to an engine that refused stops them, raising nothing) and none failed (an engine
    that died under a transfer, an answer that was not 200 may leave something behind)."""
    if not healthy or record.errors or record.recovery is not None:
        return False
    return len(record.syncs) == record.scenario.syncs + 1 and not any(sync_failed(record, s) for s in record.syncs)


def in_flight_at_death(record: RunRecord, engine: int) -> str:
    """What was in flight when engine `engine`'s server went away, for its `EngineExited` message: the sync of
    the first call to it that got no response (status 0), else the first failed sync (a colocated sender's
    calls to a dead engine fail fast and it moves on, so its phase says nothing of the death), else "the
    scenario". Faults that fail every sync with a 4xx before the engine dies make the first failed sync
    the wrong answer: the engine died in the sync whose call found nobody."""
    unanswered = next(
        (c.sync for c in record.http if c.status == 0 and c.engine == engine and c.sync is not None), None
    )
    if unanswered is not None:
        return f"sync {unanswered}"
    failed = [s.index for s in record.syncs if sync_failed(record, s)]
    return f"sync {failed[0]}" if failed else "the scenario"

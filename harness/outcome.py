"""What a scenario's syncs came to, as pure functions of the run record: one `SyncRecord` from every
rank's report (`merge_sync`), whether a sync failed (`sync_failed`), and whether the scenario ended
cleanly enough for its processes to serve the next one (`ended_clean`, and for its engines alone
`engines_reusable`; `ran_through` for a faulted scenario's trainer ranks, which the runner then asks whether
the fault is undone)."""

from __future__ import annotations

from harness.record import RunRecord, SyncRecord
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


def engines_reusable(record: RunRecord, healthy: bool) -> bool:
    """Whether the scenario's engines may serve the next scenario after a restart in place (they become
    fresh engines: a new model, state and caches; `engine_fresh` then checks their starting weights): it
    ran through (`ran_through`), with or without a fault. An engine fault hook is undone by that restart,
    which refuses when the engine's seams do not all run what they ran before the hook (the runner then
    starts a new engine). A fault that broke a sync leaves the engines unreused: an update session may still
    be open, or a chunk still loading."""
    return ran_through(record, healthy)


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

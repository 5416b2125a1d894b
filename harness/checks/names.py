"""Names and coverage: every name sent could be placed (NAME_ERROR), every engine shard was updated
exactly once per sync (COVERAGE_GAP).

Name problems are read from data: the engine's answers as its parser turned them into `Rejection`s
(`HttpCall.rejections`, kind "name"), the sender's `SyncRecord.names_rejected`, and names an engine
answered 200 for but never placed. NAME_ERROR is only for names an engine could not place: an exception
raised in the trainer's own code (a ``KeyError`` of its planner or converter included) is a CRASH.
"""

from __future__ import annotations

from collections.abc import Iterator

from harness.checks.base import (
    CheckResult,
    engine_reports_tensors,
    excerpt,
    failed,
    more,
    passed,
    prefix,
    skipped,
    status_text,
)
from harness.record import RunRecord
from reference_impl.transport.observed import GENERIC_REJECTION

NAME_KIND = "name"
_REASON = 160  # characters of an engine's reason in a name message


def _in_answers(record: RunRecord) -> Iterator[str]:
    for call in record.http:
        for rejection in call.rejections if call.status != 200 else []:
            if rejection.kind == NAME_KIND:
                yield (
                    f"{prefix(call)}engine cannot place name '{rejection.name}' "
                    f"({call.route} {status_text(call.status)}: {excerpt(rejection.reason, _REASON)})"
                )


def _in_syncs(record: RunRecord) -> Iterator[str]:
    """Names the sender recorded as rejected: a name problem unless the engine's answer in that sync gave
    the name another kind (shape, dtype, session...). Generic chunk rejections named no tensor."""
    kinds: dict[int | None, dict[str, str]] = {}
    for call in record.http:
        for rejection in call.rejections:
            kinds.setdefault(call.sync, {}).setdefault(rejection.name, rejection.kind)
    for sync in record.syncs:
        known = kinds.get(sync.index, {})
        for key, reason in sync.names_rejected.items():
            if not reason.startswith(GENERIC_REJECTION) and known.get(key, NAME_KIND) == NAME_KIND:
                yield f"sync {sync.index}: engine rejected name '{key}': {excerpt(reason, _REASON)}"


def _silently_ignored(record: RunRecord) -> Iterator[str]:
    """Names sent in an all-200 sync that the engine neither accepted nor rejected."""
    for sync in record.syncs:
        if not sync.names_accepted:
            continue  # the engine did not report acceptances; coverage judges this sync
        if any(call.status != 200 for call in record.http if call.sync == sync.index):
            continue
        answered = set(sync.names_accepted) | set(sync.names_rejected)
        missing = [key for key in sync.names_sent if key not in answered]
        if missing:
            ignored = f"'{missing[0]}'{more(len(missing) - 1)}"
            yield f"sync {sync.index}: engine answered 200 but silently ignored name {ignored}"


def _accepted_unknown(record: RunRecord) -> Iterator[str]:
    """Engines without per-name reports (vLLM): a name the checkpoint does not have, answered 200.

    vLLM's loaders skip some names without a word (`lm_head.weight` of a tied model, rotary buffers): a
    200 says nothing about whether the name went anywhere, and the checkpoint's names are what the engine's
    model was built from."""
    if engine_reports_tensors(record) or not record.checkpoint_checksums:
        return
    for sync in record.syncs:
        extra = [key for key in sync.names_accepted if key not in record.checkpoint_checksums]
        if extra:
            yield (
                f"sync {sync.index}: engine answered 200 for '{extra[0]}'{more(len(extra) - 1)}, which the checkpoint "
                "does not have: the engine may drop it silently (e.g. lm_head.weight of a tied model)"
            )


def name_problems(record: RunRecord) -> Iterator[str]:
    """A message for every name problem in the record, the engine's answers first."""
    yield from _in_answers(record)
    yield from _in_syncs(record)
    yield from _silently_ignored(record)
    yield from _accepted_unknown(record)


def check_names(record: RunRecord) -> CheckResult:
    """Every name the trainer sent could be placed by the engine."""
    name, verdict = "names", "NAME_ERROR"
    first = next(name_problems(record), None)
    return failed(name, verdict, first) if first else passed(name, verdict)


def _sender_coverage(record: RunRecord) -> str | None:
    """For engines without per-shard counts: every checkpoint tensor sent exactly once per sync."""
    expected = set(record.checkpoint_checksums)
    for sync in record.syncs:
        seen: dict[str, int] = {}
        for key in sync.names_sent:
            seen[key] = seen.get(key, 0) + 1
        missing = sorted(expected - set(seen))
        twice = sorted(k for k, n in seen.items() if n > 1)
        if missing:
            return (
                f"sync {sync.index}: checkpoint tensor '{missing[0]}' was never sent{more(len(missing) - 1)} "
                "(judged from the names sent: this engine reports no per-shard counts)"
            )
        if twice:
            return f"sync {sync.index}: '{twice[0]}' was sent {seen[twice[0]]} times, expected exactly once"
    return None


def check_coverage(record: RunRecord) -> CheckResult:
    """Per sync: every engine shard updated exactly once (and every known shard present). For an engine
    that reports no shards or counts (vLLM), every checkpoint tensor sent exactly once instead."""
    name, verdict = "coverage", "COVERAGE_GAP"
    if not record.syncs:
        return skipped(name, verdict, "no sync recorded")
    if not record.engine_shards and not any(s.engine_update_counts for s in record.syncs):
        if engine_reports_tensors(record) or not record.checkpoint_checksums:
            return skipped(name, verdict, "no engine shards or update counts recorded")
        problem = _sender_coverage(record)
        return failed(name, verdict, problem) if problem else passed(name, verdict)
    for sync in record.syncs:
        counts = sync.engine_update_counts
        shards = list(record.engine_shards) + [k for k in counts if k not in set(record.engine_shards)]
        bad = [(shard, counts.get(shard, 0)) for shard in shards if counts.get(shard, 0) != 1]
        if bad:
            shard, count = bad[0]
            times = "never updated" if count == 0 else f"updated {count} times"
            others = more(len(bad) - 1, "more shards")
            message = f"sync {sync.index}: engine shard '{shard}' {times}, expected exactly once{others}"
            return failed(name, verdict, message)
    return passed(name, verdict)

"""Parity of the weights: what was sent and what the engine holds equal the expected state after every
sync, the engine holds the checkpoint after sync 0 and what was sent after later syncs, raw and bridge
exports of one trainer state agree, the requested export mode is the one that ran, and members of a
scenario group leave identical engine weights (PARITY_FAIL)."""

from __future__ import annotations

from collections.abc import Sequence

from harness.checks.base import CheckResult, engine_reports_tensors, failed, oracle_failure, passed, short, skipped
from harness.checks.logprobs import logprob_parity
from harness.record import RunRecord, TensorLayout

VERDICT = "PARITY_FAIL"


def first_difference(
    expected: dict[str, str], actual: dict[str, str], expected_label: str, actual_label: str
) -> str | None:
    """Sentence naming the first name whose checksums differ (or that one side lacks), with a count; None
    when both maps are equal."""
    keys = list(expected) + [k for k in actual if k not in expected]
    differing = [key for key in keys if expected.get(key) != actual.get(key)]
    if not differing:
        return None
    key = differing[0]
    count = f"{len(differing)} of {len(set(expected) | set(actual))} tensors differ"
    if key not in actual:
        return f"'{key}' in {expected_label} but missing from {actual_label} ({count})"
    if key not in expected:
        return f"'{key}' on {actual_label} but not in {expected_label} ({count})"
    return f"'{key}' {actual_label} checksum {short(actual[key])} != {expected_label} {short(expected[key])} ({count})"


def check_parity_sync0(record: RunRecord) -> CheckResult:
    """After sync 0 the engine holds the checkpoint's tensors bit for bit (same names, same sums)."""
    name = "parity_sync0"
    sync0 = next((s for s in record.syncs if s.index == 0), None)
    if sync0 is None:
        return skipped(name, VERDICT, "no sync 0 recorded")
    if not sync0.engine_checksums and not record.checkpoint_checksums:
        return failed(name, VERDICT, "sync 0: no checksums recorded, parity with the checkpoint unshown")
    if engine_reports_tensors(record):
        diff = first_difference(record.checkpoint_checksums, sync0.engine_checksums, "checkpoint", "engine")
    else:  # vLLM: what the trainer sent must be the checkpoint; what the engine holds is judged by log-probs
        diff = first_difference(record.checkpoint_checksums, sync0.sent_checksums, "checkpoint", "sent")
    return failed(name, VERDICT, f"sync 0: {diff}") if diff else passed(name, VERDICT)


def _layout_difference(sent: TensorLayout, held: TensorLayout) -> str:
    """What differs between a sent tensor's layout and the checkpoint's, in words."""
    what = f"sent as {sent} but the checkpoint holds {held}"
    if sent.dtype == held.dtype and len(sent.shape) >= 2 and sent.shape[:-2] + sent.shape[-2:][::-1] == held.shape:
        what += ": the last two dims are swapped"
    return what


def check_sent_layout(record: RunRecord) -> CheckResult:
    """Every sent tensor has the checkpoint's shape and dtype, judged by name before any forward runs.

    A finding of its own (a transposed fused expert, a wrong dtype), whatever the engine made of it: the
    verdict is HTTP_ERROR when the engine refused the chunk that carried it (its answer supports the
    finding) and PARITY_FAIL when the engine took it."""
    name = "sent_layout"
    if not record.checkpoint_layout:
        return skipped(name, VERDICT, "no checkpoint layout recorded")
    for sync in record.syncs:
        bad = [
            (n, layout)
            for n, layout in sync.sent_layout.items()
            if n in record.checkpoint_layout and layout != record.checkpoint_layout[n]
        ]
        if not bad:
            continue
        first, layout = bad[0]
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        refused = first in sync.names_rejected
        message = f"sync {sync.index}: '{first}' {_layout_difference(layout, record.checkpoint_layout[first])}{more}"
        if refused:
            return failed(name, "HTTP_ERROR", message + "; the engine refused it")
        return failed(name, VERDICT, message + "; the engine answered 200")
    return passed(name, VERDICT)


def check_parity_expected(record: RunRecord) -> CheckResult:
    """After every sync, what was sent and what the engine holds equal the expected state bit for bit: the
    checkpoint for sync 0, then the trainer's elementwise step applied to it (`harness.oracles.expected`,
    computed from the checkpoint alone, so a sync that re-sends stale tensors, a step that missed a
    parameter or an expert updated twice cannot hide behind "the engine holds what was sent"). What was
    sent is judged first (the export and the sync loop), then what the engine holds (transport and load);
    an engine without per-tensor reports is judged on what was sent here and on log-probs elsewhere."""
    name = "parity_expected"
    why = oracle_failure(record, name)
    if why is not None:
        return skipped(name, VERDICT, why)
    judged = [s for s in record.syncs if s.expected_checksums]
    if not judged:
        return skipped(name, VERDICT, "no expected state recorded")
    for sync in judged:
        sent = {k: v for k, v in sync.sent_checksums.items() if k in sync.expected_checksums}
        diff = first_difference({k: sync.expected_checksums[k] for k in sent}, sent, "expected", "sent")
        if diff is None and engine_reports_tensors(record):
            diff = first_difference(sync.expected_checksums, sync.engine_checksums, "expected", "engine")
        if diff:
            return failed(name, VERDICT, f"sync {sync.index}: {diff}")
    return passed(name, VERDICT)


def check_parity_sent(record: RunRecord) -> CheckResult:
    """After syncs >= 1 the engine holds exactly what the trainer sent, for every name sent."""
    name = "parity_sent"
    later = [s for s in record.syncs if s.index >= 1]
    if not later:
        return skipped(name, VERDICT, "no sync after sync 0 recorded")
    if not engine_reports_tensors(record):
        return skipped(name, VERDICT, "the engine reports no HF-name checksums: log-prob parity judges what it holds")
    for sync in later:
        if not sync.sent_checksums:
            if sync.names_sent or sync.chunks_sent:
                return failed(name, VERDICT, f"sync {sync.index}: no sent checksums recorded")
            continue
        engine = {k: sync.engine_checksums[k] for k in sync.sent_checksums if k in sync.engine_checksums}
        diff = first_difference(sync.sent_checksums, engine, "sent", "engine")
        if diff:
            return failed(name, VERDICT, f"sync {sync.index}: {diff}")
    return passed(name, VERDICT)


def check_parity_cross_mode(record: RunRecord) -> CheckResult:
    """Raw and bridge exports of the same trainer state agree name for name, bit for bit. Where they differ
    but the expected state of the last sync settles it (this scenario's mode equals it on every tensor, the
    other mode does not), the other mode is wrong and its own scenarios fail on it: skipped, saying so."""
    name = "parity_cross_mode"
    why = oracle_failure(record, name)
    if why is not None:
        return skipped(name, VERDICT, why)
    maps = record.cross_mode_checksums
    missing = [mode for mode in ("raw", "bridge") if mode not in maps]
    if missing:
        return skipped(name, VERDICT, f"no cross-mode checksums for {' and '.join(missing)}")
    diff = first_difference(maps["raw"], maps["bridge"], "raw export", "bridge export")
    if not diff:
        return passed(name, VERDICT)
    mode = record.scenario.export_mode
    other = "bridge" if mode == "raw" else "raw"
    expected = record.syncs[-1].expected_checksums if record.syncs else {}
    if expected and maps[mode] == expected and maps[other] != expected:  # both modes' maps are there (above)
        return skipped(
            name,
            VERDICT,
            f"raw vs bridge: {diff}; the {mode} export equals the expected state, the {other} export does not: "
            f"a finding of the {other} mode's scenarios",
        )
    return failed(name, VERDICT, f"raw vs bridge: {diff}")


def check_requested_mode(record: RunRecord) -> CheckResult:
    """Every sync ran the export mode the scenario asked for (else it did not test what it claims)."""
    name = "requested_export_mode"
    requested = record.requested_export_mode or record.scenario.export_mode
    if not requested:
        return skipped(name, VERDICT, "no requested mode recorded")
    for sync in record.syncs:
        if sync.export_mode != requested:
            ran = sync.export_mode or "<none>"
            return failed(name, VERDICT, f"requested mode {requested} but {ran} ran (sync {sync.index})")
    return passed(name, VERDICT)


def group_differences(records: Sequence[RunRecord]) -> list[str]:
    """Differences between the engine checksums (and engine log-probs, where both have them) of group
    members, sync by sync (pure; first member is the reference). Each entry names the sync, the tensor
    or prompt position, and the two scenarios."""
    if len(records) < 2:
        return []
    ref = records[0]
    out: list[str] = []
    for other in records[1:]:
        if len(other.syncs) != len(ref.syncs):
            out.append(f"{other.scenario_id} ran {len(other.syncs)} syncs, {ref.scenario_id} ran {len(ref.syncs)}")
            continue
        pair = f"between {ref.scenario_id} and {other.scenario_id}"
        for a, b in zip(ref.syncs, other.syncs, strict=True):
            if a.engine_logprobs and b.engine_logprobs and a.engine_logprobs != b.engine_logprobs:
                moved = logprob_parity(a.engine_logprobs, b.engine_logprobs)
                by = f"by up to {moved['max_abs']:.3g} ({moved['first_diff']})"
                out.append(f"sync {a.index}: engine log-probs differ {pair} {by}")
            names = set(a.engine_checksums) | set(b.engine_checksums)
            diff = sorted(n for n in names if a.engine_checksums.get(n) != b.engine_checksums.get(n))
            if diff:
                out.append(f"sync {a.index}: {diff[0]} differs {pair} ({len(diff)} tensors differ)")
    return out


def check_group(record: RunRecord) -> CheckResult:
    """Members of a group (e.g. one scenario at several chunk sizes) left identical engine weights."""
    name = "group_invariance"
    why = oracle_failure(record, name)
    if why is not None:
        return skipped(name, VERDICT, why)
    if not record.group_members:
        return skipped(name, VERDICT, "not part of a group (or the group has not finished)")
    if record.group_differences:
        extra = len(record.group_differences) - 1
        return failed(name, VERDICT, record.group_differences[0] + (f" (and {extra} more)" if extra else ""))
    return passed(name, VERDICT)

"""Pure checks: one `RunRecord` in, `CheckResult`s and one verdict out.

Every function here reads only the record (no I/O, no processes, no clocks), so a saved
`records/<scenario>.json` can be re-judged anywhere. Each check answers one question and, when it
fails, says which sync / chunk / tensor / route was the *first* to go wrong and by how much.

`judge` runs all checks and picks the overall verdict by priority::

    CONFIG_ERROR > DEADLOCK > CRASH > NAME_ERROR > HTTP_ERROR > CHUNK_MISMATCH > COVERAGE_GAP
    > PARITY_FAIL > PASS

NAME_ERROR outranks HTTP_ERROR because an engine that cannot place a name answers non-200 too.

Which exceptions are *not* crashes (they are judged by the HTTP / name checks instead):

- ``EngineRejected``: the update client's exception when the engine answers non-200.
- Name-class exceptions: ``KeyError`` (DESIGN.md: "NAME_ERROR (KeyError or any name the engine
  cannot place)") and exceptions whose text says a parameter name cannot be placed
  (vLLM's "There is no module or parameter named '...'").
- Engine-side exceptions when the engine did answer some call with an error status (>= 400): the
  engine handled the exception and the trainer saw it as that non-200. An engine that died (no
  response, status 0) stays a crash.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from pydantic import BaseModel, field_validator

from harness.record import VERDICTS, ErrorRecord, HttpCall, RunRecord, SyncRecord

# Overall verdict priority, most severe first; PASS when nothing failed.
PRIORITY: tuple[str, ...] = (
    "CONFIG_ERROR",
    "DEADLOCK",
    "CRASH",
    "NAME_ERROR",
    "HTTP_ERROR",
    "CHUNK_MISMATCH",
    "COVERAGE_GAP",
    "PARITY_FAIL",
    "PASS",
)

ENGINE_REJECTED = "EngineRejected"
# The reason the sender records for every name of a chunk whose rejection named no tensor
# (`reference_impl.transport.sync.run_sync`): says nothing about which name, or whether a name, is wrong.
GENERIC_REJECTION = "chunk rejected: "
NAME_KIND = "name"
NON_NAME_KINDS: frozenset[str] = frozenset({"shape", "dtype", "bytes"})
_EXCERPT = 200


class CheckResult(BaseModel):
    """The outcome of one check.

    ``ok`` is True for a pass *and* for a skip (``skipped`` True with ``reason``: nothing to judge,
    or an earlier failure explains it). When ``ok`` is False, ``message`` is a sentence naming the
    first offending sync / chunk / tensor / route, and ``verdict_on_fail`` is what it means.
    """

    name: str
    ok: bool
    verdict_on_fail: str
    message: str = ""
    skipped: bool = False
    reason: str = ""

    @field_validator("verdict_on_fail")
    @classmethod
    def _known_verdict(cls, value: str) -> str:
        if value not in VERDICTS:
            raise ValueError(f"unknown verdict {value!r}; expected one of {', '.join(VERDICTS)}")
        return value

    @property
    def failed(self) -> bool:
        """True when the check ran and found a problem."""
        return not self.ok and not self.skipped


def _passed(name: str, verdict: str) -> CheckResult:
    return CheckResult(name=name, ok=True, verdict_on_fail=verdict)


def _failed(name: str, verdict: str, message: str) -> CheckResult:
    return CheckResult(name=name, ok=False, verdict_on_fail=verdict, message=message)


def _skipped(name: str, verdict: str, reason: str) -> CheckResult:
    return CheckResult(name=name, ok=True, verdict_on_fail=verdict, skipped=True, reason=reason)


# ---------------------------------------------------------------------------------------------
# Small text helpers
# ---------------------------------------------------------------------------------------------


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


def _excerpt(text: str | None, limit: int = _EXCERPT) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _short(checksum: str | None) -> str:
    if checksum is None:
        return "<missing>"
    return checksum if len(checksum) <= 16 else checksum[:16] + "…"


def _where(call: HttpCall) -> str:
    parts = []
    if call.sync is not None:
        parts.append(f"sync {call.sync}")
    if call.chunk is not None:
        parts.append(f"chunk {call.chunk}")
    return " ".join(parts)


def _prefix(call: HttpCall) -> str:
    where = _where(call)
    return f"{where}: " if where else ""


def _status_text(status: int) -> str:
    return "no response (status 0)" if status == 0 else f"status {status}"


def _error_origin(err: ErrorRecord) -> str:
    if err.rank is not None:
        return f"rank {err.rank} ({err.where})"
    return err.where or "unknown"


# ---------------------------------------------------------------------------------------------
# Name problems in engine answers and exception texts
# ---------------------------------------------------------------------------------------------

# Explicit "this name cannot be placed" phrasings (vLLM loaders, torch load_state_dict, our engine).
_NAME_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"no (?:module or )?parameter named\s+['\"]([^'\"]+)['\"]", re.IGNORECASE),
    re.compile(r"KeyError:\s*['\"]([^'\"]+)['\"]"),
    re.compile(
        r"(?:unexpected|unknown|unrecognized|missing|unused)\s+(?:key|parameter|weight|tensor|name)s?"
        r"(?:\s+named)?\s*[:=(\[]?\s*\[?\s*['\"]([^'\"]+)['\"]",
        re.IGNORECASE,
    ),
    re.compile(
        r"['\"]([^'\"]+)['\"]\s+(?:is\s+)?not\s+(?:found\s+)?in\s+"
        r"(?:params_dict|the model|model|state_dict|parameters|engine)",
        re.IGNORECASE,
    ),
)
# A ValueError / AttributeError / KeyError line quoting a parameter-like dotted name.
_EXC_LINE = re.compile(r"\b(?:ValueError|AttributeError|KeyError)\b[^\n]*")
_DOTTED = re.compile(r"['\"]((?:[A-Za-z_][\w]*\.)+[A-Za-z_][\w]*)['\"]")
_NOT_NAME_WORDS = re.compile(r"\b(?:shape|size|dtype|bytes|mismatch|numel)\b", re.IGNORECASE)
# "'Qwen3VLModel' object has no attribute 'visual'" (not 'NoneType' / tensor / builtin objects).
_NO_ATTR = re.compile(r"AttributeError:\s*'(\w+)' object has no attribute '(\w+)'")
_PLAIN_OBJECTS = frozenset(
    {
        "NoneType",
        "Tensor",
        "Parameter",
        "int",
        "float",
        "str",
        "list",
        "dict",
        "tuple",
        "bool",
        "bytes",
        "function",
        "method",
        "module",
    }
)
_KIND_PAIR = re.compile(r"\"([^\"]+)\"\s*:\s*\"(name|shape|dtype|bytes)\"")


def _kind_of_reason(reason: str) -> str:
    """Classify a free-text rejection reason: 'shape' / 'dtype' / 'bytes', else 'name'."""
    low = reason.lower()
    if "dtype" in low:
        return "dtype"
    if "shape" in low or "size mismatch" in low or "numel" in low:
        return "shape"
    if re.search(r"\bbytes?\b", low):
        return "bytes"
    return NAME_KIND


def _names_in_text(text: str, loose: bool = True) -> Iterator[tuple[str, str]]:
    """Yield (name, sentence) for every name problem stated in free text.

    Explicit phrasings always count. With `loose` (engine answers, where vLLM wraps its loader's
    exception in a 500), so does a ValueError / AttributeError / KeyError line that quotes a
    parameter-like dotted name, or an AttributeError on a model object; exception records from the
    trainer use only the explicit phrasings, so an AttributeError in trainer code stays a crash.
    """
    for pattern in _NAME_PATTERNS:
        for match in pattern.finditer(text):
            yield match.group(1), _first_line(text[match.start() :]) or match.group(0)
    if not loose:
        return
    for match in _EXC_LINE.finditer(text):
        line = match.group(0)
        if _NOT_NAME_WORDS.search(line):
            continue
        dotted = _DOTTED.search(line)
        if dotted:
            yield dotted.group(1), line.strip()
    for match in _NO_ATTR.finditer(text):
        if match.group(1) not in _PLAIN_OBJECTS:
            yield match.group(2), match.group(0)


def _strings_in(value: Any) -> Iterator[str]:
    """Every string inside parsed JSON (so an error text wrapped in JSON reads as plain lines)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings_in(item)


def _rejections_in_body(body: str | None) -> list[tuple[str, str, str]]:
    """(name, kind, reason) for each rejection an engine's error body states, in order.

    Understands the embedded engine's JSON ``{"detail": {"error", "rejected", "kinds"}}`` (also when
    the stored body is truncated and no longer parses; kinds "request" / "session" are not name
    problems) and free text such as vLLM's 500 answers or the embedded engine's 500 (empty
    rejected/kinds, the exception text and traceback in the JSON), read like vLLM's.
    """
    if not body:
        return []
    detail: Any = None
    try:
        parsed = json.loads(body)
    except (ValueError, TypeError):
        parsed = None
    if isinstance(parsed, dict):
        detail = parsed.get("detail", parsed)
    if isinstance(detail, dict) and (detail.get("rejected") or detail.get("kinds")):
        rejected = detail.get("rejected") or {}
        kinds = detail.get("kinds") or {}
        out: list[tuple[str, str, str]] = []
        for name in list(kinds) + [n for n in rejected if n not in kinds]:
            reason = str(rejected.get(name, detail.get("error", "")))
            kind = str(kinds.get(name) or _kind_of_reason(reason))
            out.append((str(name), kind, reason))
        return out
    text = "\n".join(_strings_in(parsed)) if parsed is not None else body
    pairs = _KIND_PAIR.findall(text)
    if pairs:  # truncated JSON: recover what the kinds map still shows
        return [(name, kind, _excerpt(text)) for name, kind in pairs]
    return [(name, NAME_KIND, sentence) for name, sentence in _names_in_text(text)]


def _is_name_error(err: ErrorRecord) -> bool:
    if err.type == "KeyError":
        return True
    return err.type != ENGINE_REJECTED and any(True for _ in _names_in_text(err.message, loose=False))


def _engine_answered_error(record: RunRecord) -> bool:
    return any(call.status >= 400 for call in record.http)


def _is_crash(record: RunRecord, err: ErrorRecord) -> bool:
    """Whether an error is a crash, or is judged by the HTTP / name checks instead."""
    if err.type == ENGINE_REJECTED or _is_name_error(err):
        return False
    return not (err.where == "engine" and _engine_answered_error(record))


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


def check_config(record: RunRecord) -> CheckResult:
    """The scenario was valid (CONFIG_ERROR carries the sentence that says what to change)."""
    name, verdict = "config", "CONFIG_ERROR"
    if record.config_error:
        return _failed(name, verdict, f"invalid scenario: {record.config_error}")
    return _passed(name, verdict)


def check_deadlock(record: RunRecord) -> CheckResult:
    """The run made progress until its end (the watchdog did not fire)."""
    name, verdict = "deadlock", "DEADLOCK"
    if not record.deadlock:
        return _passed(name, verdict)
    where = "before the first sync"
    if record.syncs:
        last = record.syncs[-1]
        where = (
            f"in sync {last.index} after {last.chunks_sent}/{last.chunks_planned} chunks sent, "
            f"{last.chunks_received} received"
        )
    stacks = f"; stacks saved: {', '.join(record.stacks)}" if record.stacks else "; no stacks saved"
    return _failed(name, verdict, f"no progress before the deadline {where}{stacks}")


def check_crash(record: RunRecord) -> CheckResult:
    """No exception other than engine rejections and name problems (those have their own checks)."""
    name, verdict = "crash", "CRASH"
    crashes = [err for err in record.errors if _is_crash(record, err)]
    if not crashes:
        return _passed(name, verdict)
    first = crashes[0]
    more = f" (+{len(crashes) - 1} more)" if len(crashes) > 1 else ""
    text = _first_line(first.message) or "<no message>"
    return _failed(name, verdict, f"{_error_origin(first)} raised {first.type}: {text}{more}")


def check_http_status(record: RunRecord) -> CheckResult:
    """Every call to the engine answered 200 (and no EngineRejected went unrecorded)."""
    name, verdict = "http_status", "HTTP_ERROR"
    bad = [call for call in record.http if call.status != 200]
    if bad:
        first = bad[0]
        more = f" (+{len(bad) - 1} more non-200)" if len(bad) > 1 else ""
        body = f": {_excerpt(first.error)}" if first.error else ""
        return _failed(
            name, verdict, f"{_prefix(first)}{first.route} answered {_status_text(first.status)}{body}{more}"
        )
    rejected = [err for err in record.errors if err.type == ENGINE_REJECTED]
    if rejected:
        first = rejected[0]
        return _failed(
            name,
            verdict,
            f"{_error_origin(first)}: engine rejected a call not in the HTTP log: {_excerpt(first.message)}",
        )
    return _passed(name, verdict)


def _sent_name_for(record: RunRecord, call: HttpCall, key: str) -> str | None:
    """The HF name the trainer sent in `call`'s chunk that an engine's name `key` refers to.

    vLLM's errors name modules or parameters as its model sees them, without the `model.` prefix of the
    HF name and often without `.weight` ("There is no module or parameter named
    'layers.0.self_attn.no_such' in Qwen3Model"): the sent name equal to `key`, else the first sent name
    that contains it as a dotted run of parts. None when the chunk is unknown or nothing matches.
    """
    sync = next((s for s in record.syncs if s.index == call.sync), None)
    chunk = next((c for c in sync.chunks if c.index == call.chunk), None) if sync else None
    if chunk is None:
        return None
    if key in chunk.names:
        return key
    return next((n for n in chunk.names if f".{key}." in f".{n}."), None)


def _name_problems(record: RunRecord) -> Iterator[str]:
    """Messages for every name problem in the record, first offender first."""
    kinds_by_sync: dict[int | None, dict[str, str]] = {}
    for call in record.http:
        if call.status == 200:
            continue
        for key, kind, reason in _rejections_in_body(call.error):
            hf = _sent_name_for(record, call, key)
            kinds_by_sync.setdefault(call.sync, {})[hf or key] = kind
            if kind == NAME_KIND:
                said = f"'{hf}' (the engine says '{key}')" if hf and hf != key else f"'{key}'"
                yield (
                    f"{_prefix(call)}engine cannot place name {said} "
                    f"({call.route} {_status_text(call.status)}: {_excerpt(reason, 160)})"
                )
    for sync in record.syncs:
        known = kinds_by_sync.get(sync.index, {})
        for key, reason in sync.names_rejected.items():
            if key not in known and reason.startswith(GENERIC_REJECTION):
                continue  # the engine named no tensor (vLLM's 500): its answer's text was judged above
            kind = known.get(key) or _kind_of_reason(reason)
            if kind == NAME_KIND:
                yield f"sync {sync.index}: engine rejected name '{key}': {_excerpt(reason, 160)}"
    for err in record.errors:
        if err.type == ENGINE_REJECTED:
            for key, kind, reason in _rejections_in_body(err.message):
                if kind == NAME_KIND:
                    yield f"{_error_origin(err)}: engine cannot place name '{key}': {_excerpt(reason, 160)}"
        elif _is_name_error(err):
            found = next(_names_in_text(err.message, loose=False), None)
            key = found[0] if found else _first_line(err.message).strip("'\"")
            yield (f"{_error_origin(err)} raised {err.type} on name '{key}': {_excerpt(_first_line(err.message), 160)}")
    yield from _silently_ignored(record)
    yield from _accepted_unknown(record)


def _accepted_unknown(record: RunRecord) -> Iterator[str]:
    """Engines without per-name reports (vLLM): a name the checkpoint does not have, answered 200.

    vLLM's loaders skip some names without a word (`lm_head.weight` of a tied model, rotary buffers):
    a 200 says nothing about whether the name went anywhere, and the checkpoint's names are what the
    engine's model was built from."""
    if engine_reports_tensors(record) or not record.checkpoint_checksums:
        return
    for sync in record.syncs:
        extra = [key for key in sync.names_accepted if key not in record.checkpoint_checksums]
        if extra:
            more = f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""
            yield (
                f"sync {sync.index}: engine answered 200 for '{extra[0]}'{more}, which the checkpoint does not have: "
                "the engine may drop it silently (e.g. lm_head.weight of a tied model)"
            )


def _silently_ignored(record: RunRecord) -> Iterator[str]:
    """Names sent in an all-200 sync that the engine neither accepted nor rejected."""
    for sync in record.syncs:
        if not sync.names_accepted:
            continue  # the engine did not report acceptances; coverage judges this sync
        calls = [call for call in record.http if call.sync == sync.index]
        if any(call.status != 200 for call in calls):
            continue
        accepted = set(sync.names_accepted) | set(sync.names_rejected)
        missing = [key for key in sync.names_sent if key not in accepted]
        if missing:
            more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
            yield (f"sync {sync.index}: engine answered 200 but silently ignored name '{missing[0]}'{more}")


def check_names(record: RunRecord) -> CheckResult:
    """Every name the trainer sent could be placed by the engine."""
    name, verdict = "names", "NAME_ERROR"
    first = next(_name_problems(record), None)
    return _failed(name, verdict, first) if first else _passed(name, verdict)


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
    recorded as received has one /update_weights call answered 200."""
    answered = sum(1 for c in record.http if c.route == "/update_weights" and c.sync == sync.index and c.status == 200)
    if answered == sync.chunks_received:
        return None
    calls = {c.chunk for c in record.http if c.route == "/update_weights" and c.sync == sync.index}
    missing = next((c for c in sync.chunks if c.received and c.index not in calls), None)
    where = f" (first: chunk {missing.index}, {len(missing.names)} names)" if missing is not None else ""
    return (
        f"sync {sync.index}: the sender recorded {sync.chunks_received} chunks as received but the engine answered "
        f"{answered} /update_weights calls with 200{where}"
    )


def check_chunks(record: RunRecord) -> CheckResult:
    """Per sync: chunks planned == sent == received, every planned chunk is in the record, and the chunks
    recorded as received match the /update_weights calls answered 200 on the wire."""
    name, verdict = "chunks", "CHUNK_MISMATCH"
    if not record.syncs:
        return _skipped(name, verdict, "no sync recorded")
    for sync in record.syncs:
        problem = _chunk_problem(sync) or _wire_problem(record, sync)
        if problem:
            return _failed(name, verdict, problem)
    return _passed(name, verdict)


def engine_reports_tensors(record: RunRecord) -> bool:
    """Whether the record's engine reports per-shard counts and HF-name checksums (its capabilities; a
    record without them, e.g. a CONFIG_ERROR, is judged as if it did)."""
    caps = record.engine_capabilities
    return caps is None or caps.per_tensor_reports


def _sender_coverage(record: RunRecord) -> str | None:
    """For engines without per-slot counts: every checkpoint tensor sent exactly once per sync."""
    expected = set(record.checkpoint_checksums)
    for sync in record.syncs:
        seen: dict[str, int] = {}
        for key in sync.names_sent:
            seen[key] = seen.get(key, 0) + 1
        missing = sorted(expected - set(seen))
        twice = sorted(k for k, n in seen.items() if n > 1)
        if missing:
            more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
            return (
                f"sync {sync.index}: checkpoint tensor '{missing[0]}' was never sent{more} (judged from the names "
                "sent: this engine reports no per-slot counts)"
            )
        if twice:
            return f"sync {sync.index}: '{twice[0]}' was sent {seen[twice[0]]} times, expected exactly once"
    return None


def check_coverage(record: RunRecord) -> CheckResult:
    """Per sync: every engine slot updated exactly once (and every known slot present). For an engine
    that reports no slots or counts (vLLM), every checkpoint tensor sent exactly once instead."""
    name, verdict = "coverage", "COVERAGE_GAP"
    if not record.syncs:
        return _skipped(name, verdict, "no sync recorded")
    if not record.engine_slots and not any(s.engine_update_counts for s in record.syncs):
        if engine_reports_tensors(record) or not record.checkpoint_checksums:
            return _skipped(name, verdict, "no engine slots or update counts recorded")
        problem = _sender_coverage(record)
        return _failed(name, verdict, problem) if problem else _passed(name, verdict)
    for sync in record.syncs:
        counts = sync.engine_update_counts
        slots = list(record.engine_slots) + [k for k in counts if k not in set(record.engine_slots)]
        bad = [(slot, counts.get(slot, 0)) for slot in slots if counts.get(slot, 0) != 1]
        if bad:
            slot, count = bad[0]
            more = f" (+{len(bad) - 1} more slots)" if len(bad) > 1 else ""
            times = "never updated" if count == 0 else f"updated {count} times"
            return _failed(
                name, verdict, f"sync {sync.index}: engine slot '{slot}' {times}, expected exactly once{more}"
            )
    return _passed(name, verdict)


def _first_difference(
    expected: dict[str, str], actual: dict[str, str], expected_label: str, actual_label: str
) -> str | None:
    """Sentence naming the first name whose checksums differ (or that one side lacks), with a count."""
    differing: list[str] = []
    for key in list(expected) + [k for k in actual if k not in expected]:
        if expected.get(key) != actual.get(key):
            differing.append(key)
    if not differing:
        return None
    key = differing[0]
    total = len(set(expected) | set(actual))
    count = f"{len(differing)} of {total} tensors differ"
    if key not in actual:
        return f"'{key}' in {expected_label} but missing from {actual_label} ({count})"
    if key not in expected:
        return f"'{key}' on {actual_label} but not in {expected_label} ({count})"
    return (
        f"'{key}' {actual_label} checksum {_short(actual[key])} != {expected_label} {_short(expected[key])} ({count})"
    )


def check_parity_sync0(record: RunRecord) -> CheckResult:
    """After sync 0 the engine holds the checkpoint's tensors bit for bit (same names, same sums)."""
    name, verdict = "parity_sync0", "PARITY_FAIL"
    sync0 = next((s for s in record.syncs if s.index == 0), None)
    if sync0 is None:
        return _skipped(name, verdict, "no sync 0 recorded")
    if not sync0.engine_checksums and not record.checkpoint_checksums:
        return _failed(name, verdict, "sync 0: no checksums recorded, parity with the checkpoint unshown")
    if not engine_reports_tensors(record):
        # vLLM: what the trainer sent must be the checkpoint; what the engine holds is judged by log-probs.
        diff = _first_difference(record.checkpoint_checksums, sync0.sent_checksums, "checkpoint", "sent")
        return _failed(name, verdict, f"sync 0: {diff}") if diff else _passed(name, verdict)
    diff = _first_difference(record.checkpoint_checksums, sync0.engine_checksums, "checkpoint", "engine")
    return _failed(name, verdict, f"sync 0: {diff}") if diff else _passed(name, verdict)


def check_parity_sent(record: RunRecord) -> CheckResult:
    """After syncs >= 1 the engine holds exactly what the trainer sent, for every name sent."""
    name, verdict = "parity_sent", "PARITY_FAIL"
    later = [s for s in record.syncs if s.index >= 1]
    if not later:
        return _skipped(name, verdict, "no sync after sync 0 recorded")
    if not engine_reports_tensors(record):
        return _skipped(name, verdict, "the engine reports no HF-name checksums: log-prob parity judges what it holds")
    for sync in later:
        if not sync.sent_checksums:
            if sync.names_sent or sync.chunks_sent:
                return _failed(name, verdict, f"sync {sync.index}: no sent checksums recorded")
            continue
        engine = {k: sync.engine_checksums[k] for k in sync.sent_checksums if k in sync.engine_checksums}
        diff = _first_difference(sync.sent_checksums, engine, "sent", "engine")
        if diff:
            return _failed(name, verdict, f"sync {sync.index}: {diff}")
    return _passed(name, verdict)


def check_parity_cross_mode(record: RunRecord) -> CheckResult:
    """Raw and bridge exports of the same trainer state agree name for name, bit for bit."""
    name, verdict = "parity_cross_mode", "PARITY_FAIL"
    maps = record.cross_mode_checksums
    missing = [mode for mode in ("raw", "bridge") if mode not in maps]
    if missing:
        return _skipped(name, verdict, f"no cross-mode checksums for {' and '.join(missing)}")
    diff = _first_difference(maps["raw"], maps["bridge"], "raw export", "bridge export")
    return _failed(name, verdict, f"raw vs bridge: {diff}") if diff else _passed(name, verdict)


def check_requested_mode(record: RunRecord) -> CheckResult:
    """Every sync ran the export mode the scenario asked for (else it did not test what it claims)."""
    name, verdict = "requested_mode", "PARITY_FAIL"
    requested = record.requested_mode or str(record.scenario.get("mode") or "")
    if not requested:
        return _skipped(name, verdict, "no requested mode recorded")
    for sync in record.syncs:
        if sync.mode != requested:
            return _failed(
                name,
                verdict,
                f"requested mode {requested} but {sync.mode or '<none>'} ran (sync {sync.index})",
            )
    return _passed(name, verdict)


# Failures that explain syncs missing or unfinished (so syncs_ran does not add a CRASH of its own).
_EXPLAINING: tuple[Callable[[RunRecord], CheckResult], ...] = (
    check_config,
    check_deadlock,
    check_crash,
    check_names,
    check_http_status,
    check_chunks,
)


def check_syncs_ran(record: RunRecord) -> CheckResult:
    """At least one sync (and as many as the scenario asks) ran, and every sync finished."""
    name, verdict = "syncs_ran", "CRASH"
    problem: str | None = None
    wanted = _as_int(record.scenario.get("syncs"))
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
        return _passed(name, verdict)
    for check in _EXPLAINING:
        earlier = check(record)
        if earlier.failed:
            return _skipped(name, verdict, f"{problem}; explained by {earlier.verdict_on_fail}")
    return _failed(name, verdict, problem)


def _as_int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


# Log-prob budgets by checkpoint dtype. fp32 on CPU: trainer (fused, chunked, fp32 logits from the
# hidden states) and engine (full logits, log_softmax) differ only by summation order, ~1e-6; 1e-4
# leaves room for long prompts. bf16: both forwards run in bf16 but the trainer's fused path multiplies
# in fp32 and the engine's lm_head in bf16; logits of magnitude ~10 carry ~0.04 of rounding (8-bit
# mantissa), so max |diff| <= 0.1 and NeMo-RL's mean exp|diff| <= 1.02 (they flag ~1.05 as a broken sync).
LOGPROB_BUDGETS: dict[str, dict[str, float]] = {
    "float32": {"max_abs": 1e-4, "mean_exp_abs": 1.0001},
    "bfloat16": {"max_abs": 0.1, "mean_exp_abs": 1.02},
}


def logprob_parity(trainer: Sequence[Sequence[float]], engine: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Differences between trainer and engine log-probs of the same prompts (pure): tokens, max_abs,
    mean_abs, mean_exp_abs (mean of exp|diff|, NeMo-RL's token_mult_prob_error) and the first position
    where they differ most.

    Raises:
        ValueError: the two sides have different prompt counts or lengths.
    """
    if len(trainer) != len(engine) or any(len(a) != len(b) for a, b in zip(trainer, engine, strict=False)):
        raise ValueError(
            f"trainer and engine log-probs do not line up: {[len(a) for a in trainer]} vs {[len(b) for b in engine]}"
        )
    diffs = [
        (abs(a - b), p, i, a, b)
        for p, (ta, tb) in enumerate(zip(trainer, engine, strict=True))
        for i, (a, b) in enumerate(zip(ta, tb, strict=True))
    ]
    if not diffs:
        return {"tokens": 0, "max_abs": 0.0, "mean_abs": 0.0, "mean_exp_abs": 1.0, "first_diff": ""}
    worst = max(diffs)
    return {
        "tokens": len(diffs),
        "max_abs": worst[0],
        "mean_abs": sum(d[0] for d in diffs) / len(diffs),
        "mean_exp_abs": sum(math.exp(d[0]) for d in diffs) / len(diffs),
        "first_diff": f"prompt {worst[1]} position {worst[2] + 1}: trainer {worst[3]:.6f} engine {worst[4]:.6f}",
    }


def check_logprobs(record: RunRecord) -> CheckResult:
    """After every sync, engine log-probs on the fixed prompts match the trainer's within the budget."""
    name = "logprob_parity"
    measured = [s for s in record.syncs if s.logprobs]
    if not engine_reports_tensors(record):
        # Log-probs are the only evidence of what such an engine (vLLM) holds: a finished sync without them
        # shows nothing, so it cannot pass.
        bare = next((s for s in record.syncs if s.finished and not s.logprobs), None)
        if bare is not None:
            return _failed(
                name,
                "PARITY_FAIL",
                f"sync {bare.index}: no log-prob comparison, and this engine reports nothing else about the "
                "weights it holds",
            )
    if not measured or not record.logprob_budget:
        return _skipped(name, "PARITY_FAIL", "no log-prob measurement in this record")
    budget = record.logprob_budget
    for s in measured:
        lp = s.logprobs
        if lp["max_abs"] > budget["max_abs"] or lp["mean_exp_abs"] > budget["mean_exp_abs"]:
            return _failed(
                name,
                "PARITY_FAIL",
                f"sync {s.index}: log-prob max |diff| {lp['max_abs']:.3g} (budget {budget['max_abs']:.3g}), "
                f"mean exp|diff| {lp['mean_exp_abs']:.6f} (budget {budget['mean_exp_abs']}); worst at "
                f"{lp['first_diff']} (temperature {lp.get('temperature')})",
            )
    return _passed(name, "PARITY_FAIL")


def check_resync_unchanged(record: RunRecord) -> CheckResult:
    """A sync of unchanged weights leaves the engine's log-probs exactly as they were."""
    name = "resync_logprobs_unchanged"
    for prev, s in zip(record.syncs, record.syncs[1:], strict=False):
        if s.perturbed or not s.engine_logprobs or not prev.engine_logprobs:
            continue
        if s.engine_logprobs != prev.engine_logprobs:
            diff = logprob_parity(prev.engine_logprobs, s.engine_logprobs)
            return _failed(
                name,
                "PARITY_FAIL",
                f"sync {s.index} re-sent unchanged weights but the engine's "
                f"log-probs moved by up to {diff['max_abs']:.3g} ({diff['first_diff']})",
            )
        return _passed(name, "PARITY_FAIL")
    return _skipped(name, "PARITY_FAIL", "no re-sync of unchanged weights with log-probs in this record")


def check_group(record: RunRecord) -> CheckResult:
    """Members of a group (e.g. one scenario at several bucket sizes) left identical engine weights."""
    name = "group_invariance"
    if not record.group_members:
        return _skipped(name, "PARITY_FAIL", "not part of a group (or the group has not finished)")
    if record.group_differences:
        more = f" (and {len(record.group_differences) - 1} more)" if len(record.group_differences) > 1 else ""
        return _failed(name, "PARITY_FAIL", record.group_differences[0] + more)
    return _passed(name, "PARITY_FAIL")


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
        for a, b in zip(ref.syncs, other.syncs, strict=True):
            if a.engine_logprobs and b.engine_logprobs and a.engine_logprobs != b.engine_logprobs:
                moved = logprob_parity(a.engine_logprobs, b.engine_logprobs)
                out.append(
                    f"sync {a.index}: engine log-probs differ between {ref.scenario_id} and {other.scenario_id} "
                    f"by up to {moved['max_abs']:.3g} ({moved['first_diff']})"
                )
            diff = sorted(
                n
                for n in set(a.engine_checksums) | set(b.engine_checksums)
                if a.engine_checksums.get(n) != b.engine_checksums.get(n)
            )
            if diff:
                out.append(
                    f"sync {a.index}: {diff[0]} differs between {ref.scenario_id} and {other.scenario_id} "
                    f"({len(diff)} tensors differ)"
                )
    return out


CHECKS: tuple[Callable[[RunRecord], CheckResult], ...] = (
    check_config,
    check_deadlock,
    check_crash,
    check_http_status,
    check_names,
    check_chunks,
    check_coverage,
    check_parity_sync0,
    check_parity_sent,
    check_parity_cross_mode,
    check_requested_mode,
    check_syncs_ran,
    check_group,
    check_logprobs,
    check_resync_unchanged,
)


def overall_verdict(results: Iterable[CheckResult]) -> str:
    """The most severe failing verdict by `PRIORITY`, or PASS."""
    failing = {result.verdict_on_fail for result in results if result.failed}
    return next((verdict for verdict in PRIORITY if verdict in failing), "PASS")


def first_failure(results: Iterable[CheckResult], verdict: str) -> CheckResult | None:
    """The first failing check whose verdict is `verdict` (the one that decided the run)."""
    return next((r for r in results if r.failed and r.verdict_on_fail == verdict), None)


def judge(record: RunRecord) -> tuple[str, list[CheckResult]]:
    """Run every check on the record; return the overall verdict and all results."""
    results = [check(record) for check in CHECKS]
    return overall_verdict(results), results


def judged(record: RunRecord) -> RunRecord:
    """A copy of the record with `verdict` and `checks` filled in from `judge` (record unchanged)."""
    verdict, results = judge(record)
    return record.model_copy(update={"verdict": verdict, "checks": [r.model_dump() for r in results]})


def expected_verdict(record: RunRecord) -> str:
    """The verdict the scenario expects (``expect:``), PASS by default."""
    return str(record.scenario.get("expect") or "PASS")


def expectation_met(record: RunRecord, verdict: str) -> bool:
    """Whether `verdict` is the one the scenario expects."""
    return verdict == expected_verdict(record)

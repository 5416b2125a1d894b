"""What every check returns (`CheckResult`), how it says pass / fail / skip, and the words of its messages.

A failure message is one sentence naming the first offending sync / chunk / tensor / route and, where the
engine answered, an excerpt of its reason; these helpers keep that wording the same across checks.
"""

from __future__ import annotations

from pydantic import BaseModel, field_validator

from harness.record import VERDICTS, ErrorRecord, HttpCall, RunRecord
from reference_impl.engine.exception_text import excerpt as one_line
from reference_impl.engine.exception_text import first_line
from reference_impl.transport.observed import Rejection

__all__ = [
    "ENGINE_REJECTED",
    "EXCERPT",
    "CheckResult",
    "describe",
    "engine_reports_tensors",
    "error_origin",
    "excerpt",
    "failed",
    "first_line",
    "more",
    "oracle_failure",
    "passed",
    "prefix",
    "short",
    "skipped",
    "status_text",
]

ENGINE_REJECTED = "EngineRejected"  # the update client's exception: the engine answered non-200
EXCERPT = 200  # characters of an engine's reason or an exception's text quoted in a message


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


def passed(name: str, verdict: str) -> CheckResult:
    """Check `name` found nothing wrong (`verdict` is what a failure would have meant)."""
    return CheckResult(name=name, ok=True, verdict_on_fail=verdict)


def failed(name: str, verdict: str, message: str) -> CheckResult:
    """Check `name` failed with `verdict`; `message` names the first offender."""
    return CheckResult(name=name, ok=False, verdict_on_fail=verdict, message=message)


def skipped(name: str, verdict: str, reason: str) -> CheckResult:
    """Check `name` had nothing to judge, or an earlier failure explains what it would judge."""
    return CheckResult(name=name, ok=True, verdict_on_fail=verdict, skipped=True, reason=reason)


def excerpt(text: str | None, limit: int = EXCERPT) -> str:
    """`text` on one line, cut to `limit` characters with an ellipsis."""
    return one_line(text, limit)


def more(count: int, what: str = "more") -> str:
    """ " (+N more)" when `count` > 0, else ""."""
    return f" (+{count} {what})" if count > 0 else ""


def short(checksum: str | None) -> str:
    """A checksum cut to 16 characters ("<missing>" for None)."""
    if checksum is None:
        return "<missing>"
    return checksum if len(checksum) <= 16 else checksum[:16] + "…"


def prefix(call: HttpCall) -> str:
    """ "sync S chunk C: " for a call made in a sync (and chunk), else ""."""
    parts = [f"sync {call.sync}"] if call.sync is not None else []
    if call.chunk is not None:
        parts.append(f"chunk {call.chunk}")
    return f"{' '.join(parts)}: " if parts else ""


def status_text(status: int) -> str:
    """ "status N", or "no response (status 0)"."""
    return "no response (status 0)" if status == 0 else f"status {status}"


def error_origin(err: ErrorRecord) -> str:
    """ "rank R (where)" for a trainer rank's exception, else where it happened."""
    if err.rank is not None:
        return f"rank {err.rank} ({err.where})"
    return err.where or "unknown"


def describe(rejection: Rejection, route: str = "", limit: int = EXCERPT) -> str:
    """One rejection in words: "dtype of 'model.norm.weight': <reason>"; "session: <reason>" for one about
    the call's `route` itself; the reason alone for kind "other"."""
    reason = excerpt(rejection.reason, limit)
    if rejection.kind == "other":
        return reason
    if rejection.name == route:
        return f"{rejection.kind}: {reason}"
    return f"{rejection.kind} of '{rejection.name}': {reason}"


def engine_reports_tensors(record: RunRecord) -> bool:
    """Whether the record's engine reports per-shard counts and HF-name checksums (its capabilities; a
    record without them, e.g. a CONFIG_ERROR, is judged as if it did)."""
    caps = record.engine_capabilities
    return caps is None or caps.per_tensor_reports


def oracle_failure(record: RunRecord, check: str) -> str | None:
    """Why the oracle serving `check` could not run ("oracle could not run: ..." with the sync), or None."""
    failure = next((f for f in record.oracle_failures if f.check == check), None)
    if failure is None:
        return None
    where = f" after sync {failure.sync}" if failure.sync is not None else ""
    return f"oracle could not run{where}: {failure.reason}"

"""The embedded engine's error answers, as `Rejection`s (pure).

Every 4xx body is `{"detail": {"error": sentence, "rejected": {name: reason}, "kinds": {name: kind}}}`
(`reference_impl.engine.embedded.server`, module doc): names are the HF names sent (kinds "name" | "shape" |
"dtype" | "bytes" | "session"), request fields for a malformed body (kind "request"), or a route for a
refused completion (kind "session"). A 500 carries empty maps, the exception's text in `error` and its
traceback in `traceback`; names are read out of those texts as out of vLLM's (`exception_text`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, cast

from reference_impl.engine.exception_text import excerpt, stated_names
from reference_impl.transport.observed import REJECTION_KINDS, Rejection, RejectionKind

# `"name": "kind"` pairs of the kinds map, still readable in a body cut short (no longer JSON).
_KIND_PAIR = re.compile(r"\"([^\"]+)\"\s*:\s*\"(" + "|".join(REJECTION_KINDS) + r")\"")


def _kind(value: Any) -> RejectionKind:
    return cast(RejectionKind, value) if value in REJECTION_KINDS else "other"


def _detail(body: str) -> Any:
    try:
        parsed = json.loads(body)
    except (ValueError, TypeError):
        return None
    return parsed.get("detail", parsed) if isinstance(parsed, dict) else parsed


def parse_rejections(route: str, status: int, body: str, sent_names: Sequence[str]) -> list[Rejection]:
    """What the embedded engine refused in one non-200 answer to `route`.

    `status` is the HTTP status (0: no answer, `body` then holds the connection error); `sent_names` the
    HF names of the chunk for /update_weights (unused: this engine answers in HF names), else empty.
    Returns one `Rejection` per name of the answer's `kinds` / `rejected` maps (kind from `kinds`, reason
    from `rejected`, else the answer's sentence), in the answer's order; for a 500, one per name its
    exception text states (kind "name"); for a body that names nothing, one Rejection of `route` with
    kind "other" and an excerpt of the answer. A body cut short is read for the `"name": "kind"` pairs it
    still shows. Never raises.
    """
    detail = _detail(body)
    if isinstance(detail, dict):
        error = str(detail.get("error", ""))
        rejected = detail.get("rejected") if isinstance(detail.get("rejected"), dict) else {}
        kinds = detail.get("kinds") if isinstance(detail.get("kinds"), dict) else {}
        names = list(kinds) + [n for n in rejected if n not in kinds]
        if names:
            return [
                Rejection(name=str(n), kind=_kind(kinds.get(n)), reason=excerpt(str(rejected.get(n, error))))
                for n in names
            ]
        text = "\n".join([error, str(detail.get("traceback", ""))])
        named = [Rejection(name=n, kind="name", reason=excerpt(s)) for n, s in stated_names(text)]
        return named or [Rejection(name=route, kind="other", reason=excerpt(error or body))]
    if detail is None:
        pairs = _KIND_PAIR.findall(body)
        if pairs:
            return [Rejection(name=n, kind=_kind(k), reason=excerpt(body)) for n, k in dict(pairs).items()]
    return [Rejection(name=route, kind="other", reason=excerpt(body) or f"status {status}, empty answer")]

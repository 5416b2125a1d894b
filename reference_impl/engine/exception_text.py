"""What the text of a Python exception says about tensor names an engine (or loader) cannot place.

Both engines put an exception's text into their error answers: vLLM's 500 carries the worker's exception
("Call to collective_rpc method failed: Worker failed with error '...'", or the bare text when the worker runs
inside the engine core), the embedded engine's 500 carries
the exception and its traceback. The answer parsers of `reference_impl.engine.embedded.answers` and
`reference_impl.engine.vllm.answers` read names out of those texts here; the harness reads a trainer
exception's text with the explicit phrasings only (`loose=False`).

Pure functions over strings; nothing here knows an engine's answer format.
"""

from __future__ import annotations

import re

# Explicit "this name cannot be placed" phrasings: vLLM's loaders ("There is no module or parameter named
# '...' in Qwen3Model", vllm/model_executor/models/utils.py AutoWeightsLoader), torch's load_state_dict
# ("Unexpected key(s) in state_dict: ..."), a `KeyError: '...'` line of a traceback, and "'...' not in
# params_dict" style assertions.
_EXPLICIT: tuple[re.Pattern[str], ...] = (
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
# A ValueError / AttributeError / KeyError line quoting a parameter-like dotted name (not about its size).
_EXC_LINE = re.compile(r"\b(?:ValueError|AttributeError|KeyError)\b[^\n]*")
_DOTTED = re.compile(r"['\"]((?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*)['\"]")
_NOT_NAME_WORDS = re.compile(r"\b(?:shape|size|dtype|bytes|mismatch|numel)\b", re.IGNORECASE)
# "'Qwen3VLModel' object has no attribute 'visual'" on a model object (not NoneType / tensors / builtins).
_NO_ATTR = re.compile(r"AttributeError:\s*'(\w+)' object has no attribute '(\w+)'")
_PLAIN_OBJECTS = frozenset(
    {"NoneType", "Tensor", "Parameter", "int", "float", "str", "list", "dict", "tuple", "bool", "bytes"}
    | {"function", "method", "module"}
)


def first_line(text: str) -> str:
    """The first non-blank line of `text`, stripped ("" when there is none)."""
    return next((line.strip() for line in text.strip().splitlines() if line.strip()), "")


def excerpt(text: str | None, limit: int = 300) -> str:
    """`text` on one line (runs of whitespace as one space), cut to `limit` characters with an ellipsis."""
    flat = " ".join((text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def stated_names(text: str, loose: bool = True) -> list[tuple[str, str]]:
    """(name, sentence) for each distinct name `text` says cannot be placed, in order of appearance.

    The explicit phrasings always count. With `loose` (an engine's answer, where the engine wrapped a
    loader's exception), so does a ValueError / AttributeError / KeyError line that quotes a dotted,
    parameter-like name and says nothing of shape / size / dtype / bytes, and an AttributeError on a model
    object ("'Qwen3VLModel' object has no attribute 'visual'"). A trainer's own AttributeError is a bug,
    not a name problem: read those texts with `loose=False`.
    """
    found: list[tuple[int, str, str]] = []
    for pattern in _EXPLICIT:
        for match in pattern.finditer(text):
            line = first_line(text[text.rfind("\n", 0, match.start()) + 1 :])  # the whole line that says it
            found.append((match.start(), match.group(1), line or match.group(0)))
    if loose:
        for match in _EXC_LINE.finditer(text):
            line = match.group(0)
            dotted = _DOTTED.search(line)
            if dotted and not _NOT_NAME_WORDS.search(line):
                found.append((match.start(), dotted.group(1), line.strip()))
        for match in _NO_ATTR.finditer(text):
            if match.group(1) not in _PLAIN_OBJECTS:
                found.append((match.start(), match.group(2), match.group(0)))
    out: dict[str, str] = {}
    for _, name, sentence in sorted(found, key=lambda item: item[0]):
        out.setdefault(name, sentence)
    return list(out.items())

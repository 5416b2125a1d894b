"""vLLM's error answers, as `Rejection`s (pure).

vLLM answers every error as `{"error": {"message", "type", "param", "code"}}`
(vllm/entrypoints/serve/exception_handling: `create_error_response`). A weight-update route whose worker
raised is a 500 whose message is "Call to collective_rpc method failed: Worker failed with error '<the
worker's exception text>', please check the stack trace above for the root cause" when the worker is a
process of its own (vllm/v1/engine/core.py `_invoke_utility_method`, vllm/v1/executor/multiproc_executor.py),
and "Call to collective_rpc method failed: <the worker's exception text>" when it runs inside the engine core
(`UniProcExecutor`: a CPU server at TP 1, see `launcher.VllmEngineProcess.launch`); a body that fails request
validation is a 400 with the offending field in `param`.

What the worker's text says, as vLLM 0.32 and the harness's gloo plugin word it:
- a name the model cannot place: "There is no module or parameter named 'layers.0.self_attn.no_such' in
  Qwen3Model. ..." (a vLLM module path, without the HF `model.` prefix and often without `.weight`),
  other loader phrasings (`exception_text`), or a bare quoted name (the text of a `KeyError`);
- a dtype the engine does not run: "dtype mismatch for 'model.norm.weight': sent bfloat16 but ..."
  (the plugin, `wsh_vllm_plugin.engine`);
- no session: "start_weight_update must be called before update_weights.", "... called while a weight update
  is already active ...", "... called without a matching start_weight_update.", "gloo weight transfer not
  initialized ..." (vllm/v1/worker/gpu_worker.py, the plugin);
- anything else (e.g. a wrong shape: "Attempted to load weight (torch.Size([63])) into parameter
  (torch.Size([64]))") names no tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from reference_impl.engine.exception_text import excerpt, stated_names
from reference_impl.transport.observed import Rejection

_WORKER_ERROR = re.compile(r"Worker failed with error '(.*)', please check the stack trace", re.DOTALL)
_IN_CORE_ERROR = re.compile(r"Call to \w+ method failed: (.*)", re.DOTALL)  # a worker inside the engine core
_BARE_NAME = re.compile(r"'([A-Za-z_]\w*(?:\.\w+)+)'")  # 'model.layers.0.mlp.up_proj.weight'
_DTYPE = re.compile(r"dtype mismatch for '([^']+)'")
_SESSION_PHRASES: tuple[str, ...] = (
    "start_weight_update must be called before",
    "while a weight update is already active",
    "without a matching start_weight_update",
    "weight transfer not initialized",
)


def sent_name_for(key: str, sent_names: Sequence[str]) -> str:
    """The HF name of `sent_names` that vLLM's name `key` refers to, else `key` itself.

    vLLM names modules and parameters as its model sees them, without the HF `model.` prefix and often
    without `.weight` ('layers.0.self_attn.q_proj' for 'model.layers.0.self_attn.q_proj.weight'): the sent
    name equal to `key`, else the first sent name that contains `key` as a dotted run of whole parts.
    """
    if key in sent_names:
        return key
    return next((name for name in sent_names if f".{key}." in f".{name}."), key)


def _message(body: str) -> tuple[str, str]:
    """(message, param) of a vLLM error body; the body itself when it is not vLLM's JSON."""
    try:
        parsed: Any = json.loads(body)
    except (ValueError, TypeError):
        return body, ""
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", "")), str(error.get("param") or "")
    if isinstance(parsed, dict) and "detail" in parsed:
        return str(parsed["detail"]), ""
    return body, ""


def parse_rejections(route: str, status: int, body: str, sent_names: Sequence[str]) -> list[Rejection]:
    """What vLLM refused in one non-200 answer to `route` (see the module doc for the texts read).

    `status` is the HTTP status (0: no answer, `body` then holds the connection error); `sent_names` the HF
    names of the chunk for /update_weights, else empty: names in vLLM's text are mapped back to them
    (`sent_name_for`). Returns kind "request" (name: the offending field, else `route`) for a 400 / 422;
    kind "session" (name: `route`) for an answer about the update session; one Rejection per name the
    worker's text states (kind "name", or "dtype" for the plugin's dtype refusal); else one Rejection of
    `route` with kind "other" whose reason is an excerpt of the worker's text (or of the body). Never raises.
    """
    message, param = _message(body)
    worker = _WORKER_ERROR.search(message) or _IN_CORE_ERROR.fullmatch(message.strip())
    text = worker.group(1) if worker else message
    reason = excerpt(text) or f"status {status}, empty answer"
    if status in (400, 422):
        return [Rejection(name=param or route, kind="request", reason=reason)]
    if any(phrase in text for phrase in _SESSION_PHRASES):
        return [Rejection(name=route, kind="session", reason=reason)]
    dtype = _DTYPE.search(text)
    if dtype:
        return [Rejection(name=sent_name_for(dtype.group(1), sent_names), kind="dtype", reason=reason)]
    stated = stated_names(text)
    bare = _BARE_NAME.fullmatch(text.strip()) if worker and not stated else None
    if bare:  # str(KeyError('x')) is "'x'": the worker looked a name up and the model has no such key
        stated = [(bare.group(1), f"KeyError {text.strip()}")]
    named = [Rejection(name=sent_name_for(key, sent_names), kind="name", reason=excerpt(s)) for key, s in stated]
    return named or [Rejection(name=route, kind="other", reason=reason)]

"""The update-session client: vLLM's RLHF routes over HTTP (httpx), every call recorded.

A sync is one session: `start()`, `update(...)` once per chunk, `finish(version)`. Each call appends
a `harness.record.HttpCall`-shaped dict to `self.calls` (route, status, ms, sync, chunk, error). A
non-200 answer raises `EngineRejected` carrying the status and body; a connection failure raises it
with status 0.

The client also tracks whether the engine holds an open update session (`session_open`), so that a
sender never broadcasts a chunk nobody will receive: both engines refuse /update_weights without a
session before taking any bytes, and vLLM's worker also ends the session when a chunk fails
(`vllm/v1/worker/gpu_worker.py` update_weights: the exception handler clears the session), which the
client mirrors when built with `session_ends_on_error=True`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import httpx
from wsh_vllm_plugin.protocol import InitInfo, UpdateInfo


class EngineRejected(RuntimeError):
    """The engine answered a route with a non-200 status (or did not answer: status 0)."""

    def __init__(self, route: str, status: int, body: str) -> None:
        super().__init__(f"{route} -> {status}: {body[:500]}")
        self.route, self.status, self.body = route, status, body

    def rejected_names(self) -> dict[str, str]:
        """HF name -> reason, from an embedded-engine 4xx body ({"detail": {"rejected": ...}})."""
        try:
            detail = json.loads(self.body).get("detail", {})
        except (ValueError, AttributeError):
            return {}
        return dict(detail.get("rejected", {})) if isinstance(detail, dict) else {}


class UpdateClient:
    """Client of one engine's weight-update routes (base_url like http://127.0.0.1:PORT)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, session_ends_on_error: bool = False) -> None:
        """`session_ends_on_error`: the engine closes its update session when a chunk fails (vLLM)."""
        self.base_url, self.timeout_s = base_url, timeout_s
        self.session_ends_on_error = session_ends_on_error
        self.http = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.calls: list[dict[str, Any]] = []
        self.session_open = False
        self.session_closed_by = ""  # why the last session ended early (for the record)

    def _post(self, route: str, body: dict[str, Any], sync: int | None = None, chunk: int | None = None) -> Any:
        t0 = time.perf_counter()
        try:
            resp = self.http.post(route, json=body)
            status, text = resp.status_code, resp.text
        except httpx.HTTPError as e:
            status, text = 0, f"{type(e).__name__}: {e}"
        ms = (time.perf_counter() - t0) * 1e3
        self.calls.append(
            {
                "route": route,
                "status": status,
                "ms": ms,
                "sync": sync,
                "chunk": chunk,
                "error": None if status == 200 else text[:4000],
            }
        )
        if status != 200:
            # vLLM's server closes the connection after an error answer; start a fresh pool so the next
            # call does not land on the closed keep-alive connection.
            self.http.close()
            self.http = httpx.Client(base_url=self.base_url, timeout=self.timeout_s)
            raise EngineRejected(route, status, text)
        return json.loads(text) if text else {}

    def init_transfer(self, init_info: InitInfo | Mapping[str, Any]) -> Any:
        """POST /init_weight_transfer_engine {"init_info": ...} (blocks until the engine joined).

        A mapping is read as `InitInfo` keyword arguments (TypeError on an unknown key); the body always
        carries every `InitInfo` field.
        """
        info = init_info if isinstance(init_info, InitInfo) else InitInfo(**init_info)
        return self._post("/init_weight_transfer_engine", {"init_info": asdict(info)})

    def start(self, sync: int, weight_version: int | None = None) -> Any:
        """POST /start_weight_update (the version travels as a string, as vLLM declares it)."""
        body = {} if weight_version is None else {"weight_version": str(weight_version)}
        self.session_open, self.session_closed_by = False, "/start_weight_update was refused"
        answer = self._post("/start_weight_update", body, sync=sync)
        self.session_open, self.session_closed_by = True, ""
        return answer

    def update(self, update_info: UpdateInfo, sync: int, chunk: int) -> Any:
        """POST /update_weights {"update_info": {names, dtype_names, shapes, packed, src, chunk_index, handle}}."""
        try:
            return self._post("/update_weights", {"update_info": asdict(update_info)}, sync=sync, chunk=chunk)
        except EngineRejected:
            if self.session_ends_on_error:
                self.session_open = False
                self.session_closed_by = f"the engine ended the session when chunk {chunk} failed"
            raise

    def finish(self, sync: int, weight_version: int) -> Any:
        """POST /finish_weight_update {"weight_version"} (a string, as vLLM declares it)."""
        self.session_open, self.session_closed_by = False, ""
        return self._post("/finish_weight_update", {"weight_version": str(weight_version)}, sync=sync)

    def checksums(self) -> dict[str, str]:
        """POST /weight_checker {"action": "checksum"} -> HF name -> checksum."""
        return self._post("/weight_checker", {"action": "checksum"})["checksums"]

    def slots(self) -> list[str]:
        """POST /weight_checker {"action": "slots"} -> every engine parameter slot."""
        return self._post("/weight_checker", {"action": "slots"})["slots"]

    def prompt_logprobs(
        self, prompt: list[int], temperature: float, image_url: str | None = None, sync: int | None = None
    ) -> list[float]:
        """POST /v1/completions with `prompt_logprobs`: the log-prob of each prompt token t >= 1 given the
        tokens before it, at `temperature` (vLLM's prompt_logprobs entries, the first one None)."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": temperature, "prompt_logprobs": 0}
        if image_url is not None:
            body["multi_modal_data"] = {"image": image_url}
        entries = self._post("/v1/completions", body, sync=sync)["choices"][0]["prompt_logprobs"]
        return [float(entries[i][str(tok)]["logprob"]) for i, tok in enumerate(prompt) if i > 0]

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self.http.close()

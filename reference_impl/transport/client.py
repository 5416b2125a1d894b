"""The update-session client: vLLM's RLHF routes over HTTP (httpx), every call recorded.

A sync is one session: `start()`, `update(...)` once per chunk, `finish(version)`. Each call appends
an `observed.HttpCall` to `self.calls` (route, status, ms, sync, chunk, error). A non-200 answer
raises `EngineRejected` carrying the call; a connection failure raises it with status 0. The engine's
answer to a non-200 becomes data here, once: the client is built with its engine kind's parser
(`EngineKind.parse_rejections`), which turns the whole body into `Rejection`s before the
stored body is cut to 4000 characters.

Prompt log-probs (`prompt_logprobs`) go to `/v1/completions` as token ids; a prompt with an image goes
there too with `multi_modal_data` (the embedded engine's extension), or, for a client built with
`image_prompts_via_chat=True` (the engine kind's capability; vLLM takes images only on its chat route), to
`/v1/chat/completions` as one chat message whose ids the engine makes with the checkpoint's chat template
and tokenizer: the answer's `prompt_token_ids` must then be the prompt's ids exactly (`PromptMismatch`).

The client also tracks whether the engine holds an open update session (`session_open`), so that a
sender never broadcasts a chunk nobody will receive: both engines refuse /update_weights without a
session before taking any bytes, and vLLM's worker also ends the session when a chunk fails
(`vllm/v1/worker/gpu_worker.py` update_weights: the exception handler clears the session), which the
client mirrors when built with `session_ends_on_error=True`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from wsh_vllm_plugin.auth import bearer_header
from wsh_vllm_plugin.protocol import InitInfo, UpdateInfo

from reference_impl.transport.observed import GENERIC_REJECTION, HttpCall, Rejection

MAX_STORED_BODY = 4000  # characters of a non-200 body kept in `HttpCall.error`

# (route, status, body, sent_names) -> what the engine refused; sent_names are the chunk's HF names for
# /update_weights, empty otherwise. One per engine kind (`EngineKind.parse_rejections`).
RejectionParser = Callable[[str, int, str, Sequence[str]], list[Rejection]]


class Generated(NamedTuple):
    """One generated token of `EngineClient.generate`: its id, its log-prob, and the weight version the
    engine's answer is tagged with (as text; None where the answer carries none)."""

    token: int
    logprob: float
    weight_version: str | None


class EngineRejected(RuntimeError):
    """The engine answered a route with a non-200 status (or did not answer: status 0)."""

    def __init__(self, call: HttpCall, body: str) -> None:
        super().__init__(f"{call.route} -> {call.status}: {body[:500]}")
        self.call = call
        self.route, self.status, self.body = call.route, call.status, body

    @property
    def rejections(self) -> list[Rejection]:
        """What the engine refused in this answer, as its engine's parser read it (`HttpCall.rejections`)."""
        return self.call.rejections


def names_rejected(names: list[str], rejected: EngineRejected) -> dict[str, str]:
    """HF name -> the engine's reason, for the names of a chunk (`names`) that the engine's answer refused.

    The tensors the answer's rejections name; when they name none of the chunk's tensors (vLLM's 500 for a
    wrong shape, a refused session), every name of the chunk with the generic reason
    `GENERIC_REJECTION` + the exception's text, which says nothing about which name (if any) was wrong.
    """
    sent = set(names)
    named = {r.name: r.reason for r in rejected.rejections if r.name in sent}
    return named or {n: f"{GENERIC_REJECTION}{rejected}" for n in names}


class PromptMismatch(ValueError):
    """The engine made other token ids from a chat message than the prompt it stands for (its chat template
    or tokenizer disagrees with the fixed prompt): its log-probs would be of another prompt."""


class EngineClient:
    """Client of one engine's weight-update routes (base_url like http://127.0.0.1:PORT)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        session_ends_on_error: bool = False,
        *,
        parse_rejections: RejectionParser,
        rank: int | None = None,
        call_log: str | Path | None = None,
        engine: int = 0,
        token: str | None = None,
        image_prompts_via_chat: bool = False,
        pauses_generation: bool = False,
    ) -> None:
        """`session_ends_on_error`: the engine closes its update session when a chunk fails (vLLM).
        `parse_rejections`: the engine kind's answer parser (`EngineKind.parse_rejections`). `engine`: which
        engine replica this client calls (recorded on every call). `token`: the run's bearer token, sent as
        `Authorization: Bearer <token>` on every call (`wsh_vllm_plugin.auth`); None sends none.
        `image_prompts_via_chat`: image prompts go to the chat route (`Capabilities.image_prompts_via_chat`).
        `pauses_generation`: the sender pauses the engine's generation around every update (`pause`,
        `resume`): an engine that serves requests between chunks (`Capabilities.refuses_completions_in_session`
        false) would otherwise serve them from half-updated weights."""
        self.base_url, self.timeout_s = base_url, timeout_s
        self.rank = rank  # the trainer rank making the calls (None: the harness itself)
        self.engine = engine
        self.headers = bearer_header(token) if token else {}
        # Every call is also appended to `call_log` as it completes (one JSON line), so the calls of a
        # sync that never returns (a hang, a crash) are not lost with it.
        self.call_log = Path(call_log) if call_log else None
        if self.call_log is not None:
            self.call_log.parent.mkdir(parents=True, exist_ok=True)
        self.session_ends_on_error = session_ends_on_error
        self.image_prompts_via_chat = image_prompts_via_chat
        self.pauses_generation = pauses_generation
        self.parse_rejections = parse_rejections
        self.http = self._new_http()
        self.calls: list[HttpCall] = []
        self.session_open = False
        self.session_closed_by = ""  # why the last session ended early (for the record)
        self._token = token

    def twin(self) -> EngineClient:
        """A client of the same engine, with the same token, parser and options, that keeps its own calls (no
        call log): for asks whose refusal is the answer sought, which must not land in the run's HTTP log
        (`harness.mid_session`)."""
        return EngineClient(
            self.base_url,
            self.timeout_s,
            self.session_ends_on_error,
            parse_rejections=self.parse_rejections,
            rank=self.rank,
            engine=self.engine,
            token=self._token,
            image_prompts_via_chat=self.image_prompts_via_chat,
            pauses_generation=self.pauses_generation,
        )

    def _post(
        self,
        route: str,
        body: dict[str, Any] | None,
        sync: int | None = None,
        chunk: int | None = None,
        sent_names: Sequence[str] = (),
        params: dict[str, str] | None = None,
    ) -> Any:
        """POST `body` to `route` (GET when `body` is None), with query `params`; every call is recorded
        (`calls`, `call_log`; the route without its query).

        Raises:
            EngineRejected: a non-200 answer, or none (status 0).
        """
        t_sent, t0 = time.time(), time.perf_counter()
        try:
            if body is None:
                resp = self.http.get(route, params=params)
            else:
                resp = self.http.post(route, json=body, params=params)
            status, text = resp.status_code, resp.text
        except httpx.HTTPError as e:
            status, text = 0, f"{type(e).__name__}: {e}"
        ms = (time.perf_counter() - t0) * 1e3
        call = HttpCall(
            route=route, status=status, t=t_sent, ms=ms, sync=sync, chunk=chunk, rank=self.rank, engine=self.engine
        )
        if status != 200:  # parsed whole, stored cut short
            call.rejections = self.parse_rejections(route, status, text, sent_names)
            call.error = text[:MAX_STORED_BODY]
        self.calls.append(call)
        if self.call_log is not None:
            with open(self.call_log, "a") as log:
                log.write(call.model_dump_json() + "\n")
        if status != 200:
            # vLLM's server closes the connection after an error answer; start a fresh pool so the next
            # call does not land on the closed keep-alive connection.
            self.http.close()
            self.http = self._new_http()
            raise EngineRejected(call, text)
        return json.loads(text) if text else {}

    def _new_http(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=self.timeout_s, headers=self.headers)

    def init_transfer(self, init_info: InitInfo | dict[str, Any]) -> Any:
        """POST /init_weight_transfer_engine {"init_info": ...}: every `InitInfo` field, or a body already in
        the engine backend's own format (a dict, e.g. vLLM's `packed.nccl_init_info`). Blocks until the
        engine joined."""
        body = init_info if isinstance(init_info, dict) else asdict(init_info)
        return self._post("/init_weight_transfer_engine", {"init_info": body})

    def start(self, sync: int, weight_version: int | None = None) -> Any:
        """POST /start_weight_update (the version travels as a string, as vLLM declares it)."""
        body = {} if weight_version is None else {"weight_version": str(weight_version)}
        self.session_open, self.session_closed_by = False, "/start_weight_update was refused"
        answer = self._post("/start_weight_update", body, sync=sync)
        self.session_open, self.session_closed_by = True, ""
        return answer

    def update(self, update_info: UpdateInfo | dict[str, Any], sync: int, chunk: int | None) -> Any:
        """POST /update_weights {"update_info": {names, dtype_names, shapes, packed, src, chunk_index, handle}},
        or a body already in the engine backend's own format (a dict with "names", e.g. vLLM's
        `packed.nccl_update_info`)."""
        try:
            info = update_info if isinstance(update_info, dict) else asdict(update_info)
            body = {"update_info": info}
            return self._post("/update_weights", body, sync=sync, chunk=chunk, sent_names=info["names"])
        except EngineRejected:
            if self.session_ends_on_error:
                self.session_open = False
                self.session_closed_by = f"the engine ended the session when chunk {chunk} failed"
            raise

    def transfer_probe(self, sizes: list[int]) -> Any:
        """POST /transfer_probe {"sizes"} (the embedded engine's own route): the engine takes one bare
        broadcast of each size in bytes from the sender and drops it (`transport.bound`). Blocks until it
        took them all.

        Raises:
            EngineRejected: a non-200 answer (an engine without the route: 404).
        """
        return self._post("/transfer_probe", {"sizes": list(sizes)})

    def finish(self, sync: int, weight_version: int) -> Any:
        """POST /finish_weight_update {"weight_version"} (a string, as vLLM declares it). The sender then drops
        the engine's caches (`transport.sync.reset_engine_caches`).

        Raises:
            EngineRejected: a non-200 answer.
        """
        self.session_open, self.session_closed_by = False, ""
        return self._post("/finish_weight_update", {"weight_version": str(weight_version)}, sync=sync)

    def pause(self, sync: int | None = None) -> Any:
        """POST /pause?mode=wait&clear_cache=false (vLLM's RL route, `entrypoints/rl/online/api_router.py`): the
        engine schedules no new request until `resume` (they wait), after its requests in flight ended (mode
        "wait"; "abort" would drop them); its caches are left to the resets after the finish.

        Raises:
            EngineRejected: a non-200 answer.
        """
        return self._post("/pause", {}, sync=sync, params={"mode": "wait", "clear_cache": "false"})

    def resume(self, sync: int | None = None) -> Any:
        """POST /resume (vLLM's RL route): the engine schedules requests again.

        Raises:
            EngineRejected: a non-200 answer.
        """
        return self._post("/resume", {}, sync=sync)

    def is_paused(self, sync: int | None = None) -> bool:
        """GET /is_paused (vLLM's RL route) -> whether the engine's generation is paused.

        Raises:
            EngineRejected: a non-200 answer.
        """
        return bool(self._post("/is_paused", None, sync=sync)["is_paused"])

    def reset_prefix_cache(self, sync: int | None = None) -> Any:
        """POST /reset_prefix_cache (vLLM's dev route): the engine drops its cached prompt prefixes."""
        return self._post("/reset_prefix_cache", {}, sync=sync)

    def reset_encoder_cache(self, sync: int | None = None) -> Any:
        """POST /reset_encoder_cache (vLLM's dev route): the engine drops its cached image features."""
        return self._post("/reset_encoder_cache", {}, sync=sync)

    def weight_version(self, sync: int | None = None) -> str:
        """GET /weight_info (vLLM's route) -> the engine's committed weight version (a string).

        Raises:
            EngineRejected: a non-200 answer.
        """
        return str(self._post("/weight_info", None, sync=sync)["weight_version"])

    def generate(
        self, prompt: list[int], temperature: float, image_url: str | None = None, sync: int | None = None
    ) -> Generated:
        """POST /v1/completions with `max_tokens` 1 and `logprobs` 0 (no prompt log-probs, so an engine may
        serve the prompt from its prefix cache) -> the generated token id, its log-prob, and the weight version
        the answer is tagged with (None where the engine tags none: vLLM 0.32's /v1/completions answers carry
        none; it tags spans of output tokens, `weight_versions`, on its token-in-token-out route only)."""
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": temperature,
            "logprobs": 0,
            "return_token_ids": True,  # vLLM's field; the embedded engine always returns them
            "return_tokens_as_token_ids": True,  # vLLM needs it to write logprobs without a tokenizer
        }
        if image_url is not None:
            body["multi_modal_data"] = {"image": image_url}
        answer = self._post("/v1/completions", body, sync=sync)
        choice = answer["choices"][0]
        version = answer.get("weight_version")
        return Generated(
            int(choice["token_ids"][0]),
            float(choice["logprobs"]["token_logprobs"][0]),
            None if version is None else str(version),
        )

    def health(self) -> int:
        """GET /health: the status code, 0 when no answer arrives (the call is not recorded as an HttpCall:
        it says whether the engine is alive, nothing about the update)."""
        try:
            return self.http.get("/health", timeout=10).status_code
        except httpx.HTTPError:
            return 0

    def checksums(self) -> dict[str, str]:
        """POST /weight_checker {"action": "checksum"} -> HF name -> checksum."""
        return self.checksum_report()["checksums"]

    def checksum_report(self) -> dict[str, Any]:
        """POST /weight_checker {"action": "checksum"}: the whole answer ({"checksums": HF name -> checksum,
        "weight_version", and from an engine with TP ranks "tp_checksums": TP rank -> vLLM name -> checksum})."""
        return dict(self._post("/weight_checker", {"action": "checksum"}))

    def shards(self) -> list[str]:
        """POST /weight_checker {"action": "shards"} -> every engine parameter shard."""
        return self._post("/weight_checker", {"action": "shards"})["shards"]

    def prompt_logprobs(
        self,
        prompt: list[int],
        temperature: float,
        image_url: str | None = None,
        sync: int | None = None,
        chat_content: list[dict[str, Any]] | None = None,
    ) -> list[float]:
        """The log-prob of each prompt token t >= 1 given the tokens before it, at `temperature` (vLLM's
        `prompt_logprobs` entries, the first one None): POST /v1/completions with `prompt_logprobs` 0; for an
        image prompt (`image_url`) on a chat-route client, POST /v1/chat/completions with `chat_content` as
        one user message (`_chat_prompt_logprobs`).

        Raises:
            EngineRejected: a non-200 answer.
            PromptMismatch: the chat route made other ids than `prompt`.
            ValueError: an image prompt for a chat-route client without `chat_content`.
        """
        if image_url is not None and self.image_prompts_via_chat:
            if chat_content is None:
                raise ValueError("this engine takes image prompts on its chat route: pass the prompt's chat_content")
            return self._chat_prompt_logprobs(prompt, temperature, chat_content, sync)
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": temperature, "prompt_logprobs": 0}
        if image_url is not None:
            body["multi_modal_data"] = {"image": image_url}
        entries = self._post("/v1/completions", body, sync=sync)["choices"][0]["prompt_logprobs"]
        return _own_logprobs(entries, prompt)

    def _chat_prompt_logprobs(
        self, prompt: list[int], temperature: float, chat_content: list[dict[str, Any]], sync: int | None
    ) -> list[float]:
        """POST /v1/chat/completions {"messages": [{"role": "user", "content": chat_content}], "max_tokens": 1,
        "prompt_logprobs": 0, "return_token_ids": true, "add_generation_prompt": false}: vLLM answers
        `prompt_token_ids` (the ids its chat template, tokenizer and multimodal processor made, image
        placeholder expanded) and `prompt_logprobs` at the top level (vLLM ChatCompletionResponse).

        Raises:
            EngineRejected: a non-200 answer.
            PromptMismatch: `prompt_token_ids` is not `prompt`.
        """
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": chat_content}],
            "max_tokens": 1,
            "temperature": temperature,
            "prompt_logprobs": 0,
            "return_token_ids": True,
            "add_generation_prompt": False,
        }
        answer = self._post("/v1/chat/completions", body, sync=sync)
        made = list(answer.get("prompt_token_ids") or [])
        if made != prompt:
            pairs = zip(made, prompt, strict=False)
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(made), len(prompt)))
            raise PromptMismatch(
                f"the engine's chat template and tokenizer made {len(made)} ids from the chat message, the prompt "
                f"has {len(prompt)}; first difference at position {first}: engine {made[first : first + 4]} vs "
                f"prompt {prompt[first : first + 4]}"
            )
        return _own_logprobs(answer["prompt_logprobs"], prompt)

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self.http.close()


def _own_logprobs(entries: list[dict[str, Any] | None], prompt: list[int]) -> list[float]:
    """Each prompt token's own log-prob from vLLM's `prompt_logprobs` list (entry i keyed by the token id as a
    string; entry 0 is None)."""
    return [float(entries[i][str(tok)]["logprob"]) for i, tok in enumerate(prompt) if i > 0]

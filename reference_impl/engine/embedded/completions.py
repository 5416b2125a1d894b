"""POST /v1/completions of the embedded engine: prompt log-probs the way vLLM's OpenAI server answers them.

Request (a subset of vLLM's `CompletionRequest`, `vllm/entrypoints/openai/protocol.py`, plus vLLM's
offline `multi_modal_data` input; any other field is a 400 naming it, where vLLM ignores unknown fields
with a warning: a misspelt `prompt_logprobs` must not come back as an answer without log-probs)::

    {"model": "optional name (echoed back as the served name, never checked)",
     "prompt": [token ids, at least one; at most the engine's max_model_len],
     "max_tokens": 0 | 1 (default 1; 1 generates one greedy token),
     "temperature": float >= 1e-5 (default 1.0),
     "prompt_logprobs": null | 0..20 (0: only each prompt token's own entry),
     "logprobs": null | 0..20 (the generated token's, when max_tokens is 1),
     "multi_modal_data": {"image": "data:image/png;base64,..."} (Qwen3-VL models only),
     "return_token_ids": bool, "return_tokens_as_token_ids": bool (accepted; always answered as true)}

Response (vLLM's `CompletionResponse`; the engine has no tokenizer, so every decoded token is written
`"token_id:<id>"` as vLLM's `--return-tokens-as-token-ids` does and `text` is "")::

    {"id": "cmpl-<hex>", "object": "text_completion", "created": unix_s, "model": served_name,
     "choices": [{"index": 0, "text": "", "token_ids": [generated ids], "prompt_token_ids": [...],
                  "finish_reason": "length", "stop_reason": null,
                  "logprobs": null | {"text_offset": [0], "token_logprobs": [lp], "tokens": ["token_id:g"],
                                      "top_logprobs": [{"token_id:i": lp, ...}]},
                  "prompt_logprobs": null | [null, {"<id>": {"logprob": lp, "rank": r,
                                                             "decoded_token": "token_id:<id>"}, ...}, ...]}],
     "usage": {"prompt_tokens": T, "completion_tokens": n, "total_tokens": T + n},
     "weight_version": v}

`prompt_logprobs` has one entry per prompt token; the first is null (nothing precedes it); entry i is a
dict that always holds prompt[i] (first, with its vocabulary rank: 1 + the number of tokens with a
strictly higher log-prob, ties counted against it, vLLM's `batched_count_greater_than`), then the top
`prompt_logprobs` tokens with ranks 1..k (a top-k token that is prompt[i] keeps its first place in the
dict and takes the top-k rank, as vLLM's `_make_logprob_dict` does). A log-prob of -inf is written
-9999.0 (vLLM's `clamp_prompt_logprobs`). `weight_version` is ours (vLLM has none): the version of the
weights the forward ran on.

Computation: the engine's transformers model, under `torch.no_grad`, in its own dtype, over the whole
prompt at once (Qwen3-VL: `pixel_values`, `image_grid_thw` and `mm_token_type_ids` = (ids ==
image_token_id), computed here from the data URL with `forward.prompts.process_image`); then
`log_softmax(logits[:-1].float() / temperature)` gathered at prompt[1:]. A request without prompt
log-probs reuses the keys/values of a cached prompt prefix, and an image's features come from the
encoder cache when it holds them, as in vLLM (`caches`: cleared only by /reset_prefix_cache and
/reset_encoder_cache).

Temperature, on purpose unlike vLLM: vLLM computes prompt log-probs from the raw logits whatever the
request's temperature (its `logprobs_mode` defaults to `raw_logprobs`, and the processed modes are not
applied to prompt log-probs; a separate `prompt_logprobs_temperature` sampling parameter was proposed
in vllm-project/vllm#37082 and verl patches the model runner for it). This engine divides the logits
by the request's temperature for prompt and sample log-probs alike, which is what the trainer's
log-prob path computes (`forward.logprobs`, temperature applied before the log-softmax), so the parity
check compares like with like. At temperature 1.0 both agree with vLLM. The generated token (max_tokens
1) is the argmax, whatever the temperature.

Errors (4xx bodies shaped like the rest of the server's, `{"detail": {"error", "rejected", "kinds"}}`):
400 for a malformed body, a prompt longer than the engine's `max_model_len` (the smaller of the model's
`max_position_embeddings` and `MAX_MODEL_LEN`; vLLM refuses such prompts too, by its `--max-model-len`),
a prompt id outside the vocabulary (naming its position), an image for a
text-only model, an image that cannot be decoded, or an image whose token count in the prompt differs
from what its grid gives (both numbers); 409 while an update session is open or the engine is paused
(where vLLM would queue the request until /resume).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from reference_impl.engine.embedded.caches import EncoderCache, PrefixCache

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
# vLLM's _SAMPLING_EPS (vllm/sampling_params.py): below it vLLM samples greedily; here logits / T would
# overflow float32 into NaN log-probs long before T reaches 0.
MIN_TEMPERATURE = 1e-5
MAX_MODEL_LEN = 4096  # tokens of one prompt at most (one forward over the whole prompt; memory grows as T^2)
CLAMPED_LOGPROB = -9999.0  # what vLLM writes for a prompt log-prob of -inf
ROUTE = "/v1/completions"


def decoded(token_id: int) -> str:
    """How a token is spelled without a tokenizer (vLLM `--return-tokens-as-token-ids`)."""
    return f"token_id:{token_id}"


class MultiModalData(BaseModel):
    """`multi_modal_data` of a request: one image as a data URL (nothing else is supported)."""

    model_config = ConfigDict(extra="forbid")

    image: str


class CompletionRequest(BaseModel):
    """The fields of vLLM's `CompletionRequest` this engine serves (see the module docstring), with exact
    JSON types (`"1"` or `true` is no max_tokens)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: list[StrictInt] = Field(min_length=1)
    max_tokens: StrictInt = Field(1, ge=0, le=1)
    temperature: StrictFloat = Field(1.0, ge=MIN_TEMPERATURE, allow_inf_nan=False)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    multi_modal_data: MultiModalData | None = None
    # vLLM's fields for ids in the answer; this engine has no tokenizer, so it always answers as if both
    # were true (`token_ids` present, tokens written "token_id:<id>").
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None


class CompletionError(Exception):
    """A request the engine refuses: HTTP `status`, `error` sentence, `rejected` {field: reason}, `kinds`."""

    def __init__(self, status: int, error: str, rejected: dict[str, str], kind: str = "request") -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.rejected = dict(rejected)
        self.kinds = dict.fromkeys(rejected, kind)


def _bad(field_name: str, msg: str) -> CompletionError:
    return CompletionError(400, f"bad request body for {ROUTE}: {field_name}: {msg}", {field_name: msg})


@dataclass
class ForwardInputs:
    """What one forward takes: input ids [1, T], the model's extra keyword arguments (VL: image) and the
    image's encoder-cache key (`caches.EncoderCache.image_key`, None without an image)."""

    input_ids: torch.Tensor
    kwargs: dict[str, torch.Tensor] = field(default_factory=dict)
    image_key: str | None = None


class CompletionEngine:
    """Prompt log-probs over the engine's transformers model (the weights the loader writes into).

    Args:
        model: the engine's transformers model (`EngineLoader.model`).
        config: the checkpoint's `config.json` dict (for the image processing of VL models).
        served_name: the model name answered in `"model"`.
    """

    def __init__(self, model: torch.nn.Module, config: dict[str, Any], served_name: str) -> None:
        self.model = model
        self.config = config
        self.served_name = served_name
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.image_token_id: int | None = getattr(model.config, "image_token_id", None)
        self.is_vl = self.image_token_id is not None and hasattr(model.config, "vision_config")
        text = getattr(model.config, "text_config", model.config)
        self.max_model_len = min(MAX_MODEL_LEN, int(getattr(text, "max_position_embeddings", MAX_MODEL_LEN)))
        vision = getattr(model.config, "vision_config", None)
        self.merge_size = int(getattr(vision, "spatial_merge_size", 1)) if vision is not None else 1
        self.prefix_cache = PrefixCache()
        self.encoder_cache = EncoderCache()
        if self.is_vl:
            self.encoder_cache.install(model.model)

    def prepare(self, req: CompletionRequest) -> ForwardInputs:
        """Check the prompt and turn the image (if any) into the model's inputs; touches no weights.

        Raises:
            CompletionError: 400 for a prompt longer than `max_model_len`, an id outside the vocabulary,
                an image on a text-only model, an undecodable image, or image tokens that do not match the
                image's grid.
        """
        if len(req.prompt) + req.max_tokens > self.max_model_len:
            raise _bad(
                "body.prompt",
                f"a prompt of {len(req.prompt)} tokens and max_tokens {req.max_tokens} exceed this engine's "
                f"max_model_len of {self.max_model_len} tokens",
            )
        for i, t in enumerate(req.prompt):
            if not 0 <= t < self.vocab_size:
                raise _bad(
                    f"body.prompt.{i}",
                    f"prompt[{i}] = {t} is outside the vocabulary [0, {self.vocab_size}) of this model",
                )
        ids = torch.tensor([req.prompt], dtype=torch.long)
        if not self.is_vl:
            if req.multi_modal_data is not None:
                raise _bad(
                    "body.multi_modal_data.image",
                    f"this model ({type(self.model).__name__}) is text-only; send no multi_modal_data",
                )
            return ForwardInputs(ids)
        assert self.image_token_id is not None
        image_mask = ids == self.image_token_id
        n_tokens = int(image_mask.sum())
        if req.multi_modal_data is None:
            if n_tokens:
                raise _bad(
                    "body.prompt",
                    f"the prompt holds {n_tokens} image tokens (id {self.image_token_id}) but the request has no "
                    "image (0 image tokens expected); send multi_modal_data.image or drop them",
                )
            return ForwardInputs(ids)
        pixel_values, grid = self._process_image(req.multi_modal_data.image)
        expected = int(grid.prod(dim=-1).sum()) // self.merge_size**2
        if n_tokens != expected:
            raise _bad(
                "body.multi_modal_data.image",
                f"the prompt holds {n_tokens} image tokens (id {self.image_token_id}) but the image's grid "
                f"{grid.tolist()} gives {expected} (t*h*w / {self.merge_size}^2)",
            )
        dtype = next(self.model.parameters()).dtype
        return ForwardInputs(
            ids,
            {
                "pixel_values": pixel_values.to(dtype),
                "image_grid_thw": grid,
                "mm_token_type_ids": image_mask.int(),
            },
            EncoderCache.image_key(req.multi_modal_data.image),
        )

    def _process_image(self, url: str) -> tuple[torch.Tensor, torch.Tensor]:
        from reference_impl.forward import prompts

        try:
            image = prompts.decode_image_url(url)
        except Exception as e:
            raise _bad(
                "body.multi_modal_data.image", f"not a decodable image data URL ({type(e).__name__}: {e})"
            ) from None
        pixel_values, grid = prompts.process_image(self.config, image)
        return torch.as_tensor(pixel_values), torch.as_tensor(grid, dtype=torch.long).reshape(-1, 3)

    @torch.no_grad()
    def logits(self, inputs: ForwardInputs, prefix_cache: bool = False) -> torch.Tensor:
        """Logits [T', V] in the model's dtype (call under the engine's lock): of the whole prompt (T' = T),
        or, with `prefix_cache` and a cached prefix of L tokens, of the last T - L positions only. An
        image's features come from the encoder cache when it holds them (`caches`)."""
        self.encoder_cache.key = inputs.image_key
        try:
            if not prefix_cache or self.is_vl or inputs.kwargs:
                return self.model(input_ids=inputs.input_ids, use_cache=False, **inputs.kwargs).logits[0]
            prompt = inputs.input_ids[0].tolist()
            cached, kv = self.prefix_cache.lookup(prompt)
            out = self.model(input_ids=inputs.input_ids[:, cached:], past_key_values=kv, use_cache=True)
            self.prefix_cache.store(prompt, out.past_key_values)
            return out.logits[0]
        finally:
            self.encoder_cache.key = None

    def complete(self, req: CompletionRequest, inputs: ForwardInputs, weight_version: int) -> dict[str, Any]:
        """Run the forward and build vLLM's `CompletionResponse` (module docstring) for `req`.

        Call under the engine's lock: the forward reads the weights.

        Raises:
            CompletionError: 500 when the forward gives NaN log-probs (JSON has no NaN).
        """
        # As vLLM: a request for prompt log-probs needs every position computed, so it skips the prefix cache.
        logits = self.logits(inputs, prefix_cache=req.prompt_logprobs is None)
        prompt = req.prompt
        generated: list[int] = []
        sample_logprobs: dict[str, Any] | None = None
        if req.max_tokens >= 1:
            last = torch.log_softmax(logits[-1].float() / req.temperature, dim=-1)
            token = int(last.argmax())
            generated.append(token)
            if req.logprobs is not None:
                sample_logprobs = _sample_logprobs(last, token, req.logprobs)
        prompt_lp = None
        if req.prompt_logprobs is not None:
            prompt_lp = _prompt_logprobs(logits, prompt, req.temperature, req.prompt_logprobs)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_name,
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "token_ids": generated,
                    "prompt_token_ids": list(prompt),
                    "finish_reason": "length",
                    "stop_reason": None,
                    "logprobs": sample_logprobs,
                    "prompt_logprobs": prompt_lp,
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(generated),
                "total_tokens": len(prompt) + len(generated),
            },
            "weight_version": weight_version,
        }


def _value(x: float, where: str) -> float:
    if x != x:  # NaN
        raise CompletionError(
            500, f"the forward gave a NaN log-prob at {where}; the engine's weights are not finite", {where: "NaN"}
        )
    return CLAMPED_LOGPROB if x == float("-inf") else x


def _prompt_logprobs(
    logits: torch.Tensor, prompt: list[int], temperature: float, k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` list: None, then per prompt[1:] token its entry and the top `k`."""
    lp = torch.log_softmax(logits[:-1].float() / temperature, dim=-1)  # [T-1, V]
    targets = torch.tensor(prompt[1:], dtype=torch.long)
    own = lp.gather(-1, targets[:, None])  # [T-1, 1]
    ranks = (lp >= own).sum(-1).tolist()
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    own_l, top_vl, top_il = own[:, 0].tolist(), top_v.tolist(), top_i.tolist()
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for pos, tok in enumerate(prompt[1:], start=1):
        ids = [tok, *top_il[pos - 1]]
        values = [own_l[pos - 1], *top_vl[pos - 1]]
        rank_list = [int(ranks[pos - 1]), *range(1, k + 1)]
        out.append(
            {
                str(t): {"logprob": _value(v, f"prompt position {pos}"), "rank": r, "decoded_token": decoded(t)}
                for t, v, r in zip(ids, values, rank_list, strict=True)
            }
        )
    return out


def _sample_logprobs(last: torch.Tensor, token: int, k: int) -> dict[str, Any]:
    """vLLM's `CompletionLogProbs` for one generated token: its log-prob and the step's top `k`."""
    value = _value(float(last[token]), "the generated token")
    top: dict[str, float] = {decoded(token): value}
    if k:
        top_v, top_i = last.topk(k)
        for v, i in zip(top_v.tolist(), top_i.tolist(), strict=True):
            top[decoded(i)] = _value(v, "the generated token")
    return {"text_offset": [0], "token_logprobs": [value], "tokens": [decoded(token)], "top_logprobs": [top]}

"""POST /v1/completions of the embedded engine: vLLM's prompt_logprobs format, log-probs equal to an
independent computation here, refusal while weights may change, and the 400s.

Two real servers (tiny qwen3 and qwen3-vl) are started through `EngineProcess` and stopped by pid.
The expected log-probs come from a transformers model built in this process from the checkpoint's
config.json with the engine's seed (the engine's dummy weights), run by plain transformers, then
log_softmax(logits / T) here.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from wsh_vllm_plugin import protocol

from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.fork_client import ForkServerAddress
from reference_impl.forward import prompts
from reference_impl.models.checkpoint import build_hf_model, make_checkpoint
from reference_impl.models.registry import ModelSpec, load_model
from reference_impl.transport.handles import SharedMemoryBuffer

CKPT_SEED = 1234
ENGINE_SEED = 4321
MODELS = ("qwen3", "qwen3-vl")
TOL = 1e-5


@dataclass
class Served:
    """A running engine and, built here, a model holding the same (dummy) weights."""

    proc: EngineProcess
    config: dict[str, Any]
    model: torch.nn.Module

    def post(self, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return httpx.post(f"{self.proc.url}{route}", json=body if body is not None else {}, timeout=60)

    def complete(self, **body: Any) -> httpx.Response:
        return self.post("/v1/completions", body)


def _reference_model(checkpoint: Path, seed: int) -> torch.nn.Module:
    """The checkpoint's architecture filled by `seed`, built from its config.json here."""
    config = json.loads((checkpoint / "config.json").read_text())
    family = {"qwen3": "qwen3", "qwen3_vl": "qwen3_vl"}[config["model_type"]]
    spec = ModelSpec(checkpoint.name, family, config["architectures"][0], config, config, scaled=False)
    return build_hf_model(spec, str(config.get("dtype") or "float32"), seed)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServerAddress) -> Iterator[dict[str, Served]]:
    """One engine per model of MODELS, started in parallel; stopped by pid at the end."""
    tmp = tmp_path_factory.mktemp("completions")
    ckpts = {m: make_checkpoint(load_model(m), seed=CKPT_SEED) for m in MODELS}
    procs = {
        m: EngineProcess(str(c), ENGINE_SEED, log_path=str(tmp / f"{m}.log"), fork_server=fork_server)
        for m, c in ckpts.items()
    }
    try:
        with ThreadPoolExecutor(len(procs)) as ex:
            started = [ex.submit(p.start, 120) for p in procs.values()]
            models = {m: _reference_model(c, ENGINE_SEED) for m, c in ckpts.items()}
            for f in started:
                f.result()
        yield {m: Served(procs[m], json.loads((ckpts[m] / "config.json").read_text()), models[m]) for m in MODELS}
    finally:
        for p in procs.values():
            p.stop()


def _expected(model: torch.nn.Module, inputs: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
    """log_softmax(logits[:-1] / T) [T-1, V], fp32, by plain transformers in this process."""
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    return torch.log_softmax(logits[:-1].float() / temperature, dim=-1)


def _check_format(entries: list[Any], prompt: list[int], k: int) -> None:
    """vLLM's prompt_logprobs shape: None first, then dicts holding the prompt token and the top k."""
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for tok, entry in zip(prompt[1:], entries[1:], strict=True):
        assert str(tok) in entry and next(iter(entry)) == str(tok)
        assert k <= len(entry) <= k + 1
        for tid, lp in entry.items():
            assert set(lp) == {"logprob", "rank", "decoded_token"}
            assert lp["decoded_token"] == f"token_id:{tid}"
            assert lp["logprob"] <= 0 and lp["rank"] >= 1
        # The top k hold ranks 1..k; the prompt token is one of them when the dict has only k entries.
        first, *rest = entry.values()
        top = [*rest, first] if len(entry) == k else rest
        assert sorted(v["rank"] for v in top) == list(range(1, k + 1))


def test_response_format(served: dict[str, Served]) -> None:
    s = served["qwen3"]
    prompt = prompts.text_prompts(s.config, 1, 10, seed=3)[0]
    r = s.complete(model="x", prompt=prompt, max_tokens=1, temperature=1.0, prompt_logprobs=3, logprobs=2)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
    assert body["weight_version"] == 0
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["prompt_token_ids"] == prompt
    _check_format(choice["prompt_logprobs"], prompt, 3)
    (gen,) = choice["token_ids"]
    sample = choice["logprobs"]
    assert sample["tokens"] == [f"token_id:{gen}"] and len(sample["top_logprobs"][0]) == 2  # greedy: in the top
    assert sample["token_logprobs"][0] == max(sample["top_logprobs"][0].values())
    # prompt_logprobs 0: only the prompt token; max_tokens 0: nothing generated; no logprobs asked: null.
    r = s.complete(prompt=prompt, max_tokens=0, prompt_logprobs=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [] and choice["logprobs"] is None
    assert all(len(e) == 1 for e in choice["prompt_logprobs"][1:])
    assert s.complete(prompt=prompt, max_tokens=0).json()["choices"][0]["prompt_logprobs"] is None


def _inputs(s: Served, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(request fields, transformers forward inputs) of the fixed text or image prompt."""
    if kind == "image":
        ip = prompts.image_prompt(s.config, seed=5)
        return {"prompt": ip.input_ids, "multi_modal_data": {"image": ip.image_url}}, ip.model_inputs()
    prompt = prompts.text_prompts(s.config, 1, 16, seed=7)[0]
    return {"prompt": prompt}, {"input_ids": torch.tensor([prompt])}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("model", "kind"), [("qwen3", "text"), ("qwen3-vl", "image"), ("qwen3-vl", "text")])
def test_logprobs_equal_independent_forward(
    served: dict[str, Served], model: str, kind: str, temperature: float
) -> None:
    s = served[model]
    fields, inputs = _inputs(s, kind)
    r = s.complete(**fields, max_tokens=0, temperature=temperature, prompt_logprobs=1)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    prompt = fields["prompt"]
    _check_format(entries, prompt, 1)
    lp = _expected(s.model, inputs, temperature)
    targets = torch.tensor(prompt[1:])
    own = lp.gather(-1, targets[:, None])[:, 0]
    got = torch.tensor([e[str(t)]["logprob"] for t, e in zip(prompt[1:], entries[1:], strict=True)])
    assert (got - own).abs().max().item() < TOL
    ranks = [e[str(t)]["rank"] for t, e in zip(prompt[1:], entries[1:], strict=True)]
    assert ranks == (lp >= own[:, None]).sum(-1).tolist()
    top = lp.argmax(-1).tolist()
    assert all(str(t) in e and e[str(t)]["rank"] == 1 for t, e in zip(top, entries[1:], strict=True))


def test_temperature_changes_logprobs(served: dict[str, Served]) -> None:
    """Temperature is applied to prompt log-probs (unlike vLLM, on purpose; see `completions`)."""
    s = served["qwen3"]
    prompt = prompts.text_prompts(s.config, 1, 6, seed=1)[0]

    def first(t: float) -> float:
        return s.complete(prompt=prompt, max_tokens=0, temperature=t, prompt_logprobs=0).json()["choices"][0][
            "prompt_logprobs"
        ][1][str(prompt[1])]["logprob"]

    assert abs(first(1.0) - first(0.7)) > 1e-4


def test_refused_while_session_open_or_paused(served: dict[str, Served]) -> None:
    s = served["qwen3"]
    body = {"prompt": [1, 2, 3], "max_tokens": 0, "prompt_logprobs": 0}
    assert s.post("/start_weight_update").status_code == 200
    try:
        r = s.post("/v1/completions", body)
        assert r.status_code == 409, r.text
        assert "update session is open" in r.json()["detail"]["error"]
        assert set(r.json()["detail"]["kinds"].values()) == {"session"}
    finally:
        assert s.post("/finish_weight_update").status_code == 200
    assert s.post("/v1/completions", body).status_code == 200
    assert s.post("/pause").status_code == 200
    try:
        r = s.post("/v1/completions", body)
        assert r.status_code == 409 and "paused" in r.json()["detail"]["error"]
    finally:
        assert s.post("/resume").status_code == 200
    assert s.post("/v1/completions", body).status_code == 200


def test_bad_requests_are_400(served: dict[str, Served]) -> None:
    text, vl = served["qwen3"], served["qwen3-vl"]
    vocab = prompts.vocab_size(text.config)
    ip = prompts.image_prompt(vl.config, seed=5)
    image = {"image": ip.image_url}

    def err(s: Served, **body: Any) -> str:
        r = s.complete(**{"max_tokens": 0, "prompt_logprobs": 0, **body})
        assert r.status_code == 400, r.text
        return r.json()["detail"]["error"]

    msg = err(text, prompt=[1, 2, 3, vocab])
    assert "prompt[3]" in msg and str(vocab) in msg
    assert "prompt[0]" in err(text, prompt=[-1, 2])
    assert "text-only" in err(text, prompt=[1, 2], multi_modal_data=image)
    fewer = list(ip.input_ids)
    fewer.remove(ip.image_token_id)
    msg = err(vl, prompt=fewer, multi_modal_data=image)
    assert f"{ip.num_image_tokens - 1} image tokens" in msg and f"gives {ip.num_image_tokens}" in msg
    assert "no image" in err(vl, prompt=ip.input_ids)
    assert "data URL" in err(vl, prompt=ip.input_ids, multi_modal_data={"image": "http://example.com/a.png"})
    assert "max_tokens" in err(text, prompt=[1, 2], max_tokens=2)
    assert "temperature" in err(text, prompt=[1, 2], temperature=0)
    assert "prompt" in err(text, prompt="hello")
    assert "prompt" in err(text, prompt=[])


def test_completions_read_the_updated_weights(served: dict[str, Served]) -> None:
    """After a sync (one tensor over a shared-memory handle) the log-probs follow the new weights and
    the answer carries the new weight_version; the old value is restored afterwards."""
    s = served["qwen3"]
    name = "model.norm.weight"
    changed = copy.deepcopy(s.model)
    with torch.no_grad():
        changed.get_parameter(name).mul_(-2.0)
    fields, inputs = _inputs(s, "text")
    assert s.post("/init_weight_transfer_engine", {"init_info": {"backend": "shm"}}).status_code == 200

    def sync(t: torch.Tensor, version: int) -> None:
        n = t.numel() * t.element_size()
        buf.grow(n)
        protocol.pack([t], out=buf.tensor(n))
        info = {"names": [name], "dtype_names": ["float32"], "shapes": [list(t.shape)], "handle": buf.handle(n)}
        assert s.post("/start_weight_update").status_code == 200
        assert s.post("/update_weights", {"update_info": info}).status_code == 200
        assert s.post("/finish_weight_update", {"weight_version": version}).status_code == 200

    with SharedMemoryBuffer(1) as buf:
        sync(changed.get_parameter(name).detach().clone(), 7)
        try:
            r = s.complete(**fields, max_tokens=0, temperature=0.7, prompt_logprobs=0)
            assert r.json()["weight_version"] == 7
            lp = _expected(changed, inputs, 0.7)
            prompt = fields["prompt"]
            own = lp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
            entries = r.json()["choices"][0]["prompt_logprobs"][1:]
            got = torch.tensor([e[str(t)]["logprob"] for t, e in zip(prompt[1:], entries, strict=True)])
            assert (got - own).abs().max().item() < TOL
            assert not math.isclose(got[0].item(), _expected(s.model, inputs, 0.7)[0, prompt[1]].item(), abs_tol=TOL)
        finally:
            sync(s.model.get_parameter(name).detach().clone(), 8)

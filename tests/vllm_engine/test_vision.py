"""Qwen3-VL on vLLM and the embedded engine: bad vision-tower inputs get the same verdicts on both, vLLM's
chat route makes exactly the fixed image prompt's ids, and both engines' log-probs (the image prompt
included) follow every sync, changed vision weights included."""

from __future__ import annotations

import json

import pytest

from reference_impl.forward.prompts import image_prompt
from reference_impl.transport.client import PromptMismatch

from .engines import (
    Connected,
    checkpoint_tensors,
    measure_logprobs,
    short_tensor_refused,
    unknown_name_refused,
    verdict_of,
)


def test_unknown_vision_name_is_name_error_on_both(vl_engines: dict[str, Connected]) -> None:
    records = unknown_name_refused(vl_engines, "model.visual.blocks.0.attn.no_such.weight", 1)
    vllm_call = next(c for c in records["vllm"].http if c.status != 200)
    # vLLM's own prose names the parameter relative to the module that refused it (its vision tower)
    assert vllm_call.status == 500 and "blocks.0.attn.no_such" in (vllm_call.error or "")


def test_wrong_vision_shape_is_http_error_on_both(vl_engines: dict[str, Connected]) -> None:
    target = "model.visual.blocks.1.norm1.weight"
    width = checkpoint_tensors(vl_engines["vllm"].checkpoint)[target].shape[0]
    assert f"torch.Size([{width - 1}])" in short_tensor_refused(vl_engines, target, 2)


def test_vllm_chat_route_makes_the_fixed_image_prompts_ids(vl_engines: dict[str, Connected]) -> None:
    """The checkpoint's chat template, tokenizer and processor make exactly the fixed image prompt's ids
    (image placeholder expanded), and vLLM answers a log-prob for every prompt position, image pads
    included; a chat message that stands for other ids is refused by the client."""
    conn = vl_engines["vllm"]
    config = json.loads((conn.checkpoint / "config.json").read_text())
    prompt = image_prompt(config)
    body = {
        "messages": [{"role": "user", "content": prompt.chat_content}],
        "max_tokens": 1,
        "prompt_logprobs": 0,
        "return_token_ids": True,
        "add_generation_prompt": False,
    }
    answer = conn.client._post("/v1/chat/completions", body)
    assert answer["prompt_token_ids"] == prompt.input_ids
    assert prompt.input_ids.count(config["image_token_id"]) == prompt.num_image_tokens > 1
    entries = answer["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt.input_ids)
    assert all(str(tok) in entries[i] for i, tok in enumerate(prompt.input_ids) if i > 0)
    other = [dict(part) for part in prompt.chat_content]
    other[0]["text"] = "t7 " + other[0]["text"]
    with pytest.raises(PromptMismatch, match="first difference at position 0"):
        conn.client.prompt_logprobs(prompt.input_ids, 1.0, prompt.image_url, chat_content=other)


def test_vl_logprobs_on_vllm_follow_every_sync(vl_engines: dict[str, Connected]) -> None:
    """A clean sync of the Qwen3-VL checkpoint in several chunks, then one of changed weights: after each,
    both engines' log-probs (text prompts, and the image prompt through each engine's image route) equal a
    transformers forward over what was sent within the fp32 budget; the second shows that the engine's
    vision path follows the new weights (nothing computed from the old ones is reused)."""
    for kind, conn in vl_engines.items():
        ckpt = checkpoint_tensors(conn.checkpoint)
        changed = {n: t * 1.25 if n.startswith("model.visual.") else t for n, t in ckpt.items()}
        for index, state in ((11, ckpt), (12, changed)):
            rec = conn.sync(list(state.items()), index, chunk_bytes=1 << 20)
            measure_logprobs(conn, rec, state)
            verdict, message = verdict_of(rec)
            assert verdict == "PASS", (kind, index, verdict, message)
            assert rec.syncs[0].chunks_planned > 1
            assert rec.syncs[0].logprobs["max_abs"] < 1e-4, (kind, index, rec.syncs[0].logprobs)

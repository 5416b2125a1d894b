"""Log-prob kernels (naive vs chunked) and the fixed parity prompts (reference_impl.forward)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference_impl.forward.logprobs import fused_logprobs, logprobs_from_logits, naive_logprobs, output_weight
from reference_impl.forward.prompts import (
    decode_image_url,
    image_processor_kwargs,
    image_prompt,
    process_image,
    special_token_ids,
    text_prompts,
)
from reference_impl.models.checkpoint import build_hf_model
from reference_impl.models.registry import load_model


def _inputs(t: int = 37, h: int = 48, v: int = 300, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.3
    targets = torch.randint(0, v, (t,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("chunk", [1, 8, 10, 37, 256])
def test_fused_matches_naive(temperature: float, chunk: int) -> None:
    hidden, weight, targets = _inputs()
    lp_n, ent_n = naive_logprobs(hidden, weight, targets, temperature)
    lp_f, ent_f = fused_logprobs(hidden, weight, targets, temperature, chunk_tokens=chunk)
    assert lp_f.dtype == ent_f.dtype == torch.float32
    assert lp_f.shape == ent_f.shape == (37,)
    torch.testing.assert_close(lp_f, lp_n, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_f, ent_n, atol=1e-5, rtol=0)


def test_naive_is_log_softmax_with_temperature() -> None:
    hidden, weight, targets = _inputs(t=5, v=20)
    logits = (hidden.double() @ weight.double().T) / 1.7
    logp = torch.log_softmax(logits, -1)
    lp, ent = naive_logprobs(hidden, weight, targets, 1.7)
    torch.testing.assert_close(lp, logp.gather(-1, targets[:, None]).squeeze(-1).float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, (-(logp.exp() * logp).sum(-1)).float(), atol=1e-5, rtol=0)
    lp2, ent2 = logprobs_from_logits(hidden @ weight.T, targets, 1.7)
    torch.testing.assert_close(lp2, lp)
    torch.testing.assert_close(ent2, ent)
    assert bool((ent >= 0).all()) and bool((lp <= 0).all())


def test_bf16_inputs_give_fp32() -> None:
    hidden, weight, targets = _inputs()
    lp_n, _ = naive_logprobs(hidden.bfloat16(), weight.bfloat16(), targets)
    lp_f, ent_f = fused_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, chunk_tokens=7)
    assert lp_f.dtype == ent_f.dtype == torch.float32
    torch.testing.assert_close(lp_f, lp_n, atol=1e-5, rtol=0)


def test_empty_sequence() -> None:
    lp, ent = fused_logprobs(torch.zeros(0, 4), torch.zeros(6, 4), torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hidden": torch.zeros(4, 5)}, "hidden size mismatch"),
        ({"targets": torch.zeros(3, dtype=torch.long)}, "length of T=4|length T=4"),
        ({"targets": torch.zeros(4)}, "integer"),
        ({"targets": torch.full((4,), 6)}, r"\[0, V=6\)"),
        ({"hidden": torch.zeros(2, 4, 4)}, "2-D"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
    ],
)
def test_errors(kwargs: dict, match: str) -> None:
    args = {"hidden": torch.zeros(4, 4), "weight": torch.zeros(6, 4), "targets": torch.zeros(4, dtype=torch.long)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fused_logprobs(**args)
    if "chunk_tokens" not in kwargs:
        with pytest.raises(ValueError, match=match):
            naive_logprobs(**args)


@pytest.fixture(scope="module")
def qwen3_model() -> torch.nn.Module:
    return build_hf_model(load_model("qwen3"), "float32", seed=1)


def test_output_weight_tied(qwen3_model: torch.nn.Module) -> None:
    w = output_weight(qwen3_model)
    emb = qwen3_model.get_input_embeddings().weight
    assert w.shape == (512, 64)
    assert w.data_ptr() == emb.data_ptr()
    ids = torch.tensor([text_prompts(load_model("qwen3").config, n=1, length=12)[0]])
    with torch.no_grad():
        out = qwen3_model(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states[-1][0]  # after the final norm
    ref = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    lp, _ = fused_logprobs(hidden[:-1], w, ids[0, 1:], chunk_tokens=5)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


def test_output_weight_untied() -> None:
    m = build_hf_model(load_model("qwen3-untied"), "float32", seed=1)
    w = output_weight(m)
    assert w is m.get_output_embeddings().weight
    assert w.data_ptr() != m.get_input_embeddings().weight.data_ptr()


def test_output_weight_untied_vl_moe_follows_the_top_level_flag() -> None:
    # Qwen3-VL-MoE: top level tie_word_embeddings false while its text_config class defaults to true.
    m = build_hf_model(load_model("qwen3-vl-moe"), "float32", seed=1)
    assert not m.config.tie_word_embeddings
    w = output_weight(m)
    assert w is m.lm_head.weight
    assert w.untyped_storage().data_ptr() != m.get_input_embeddings().weight.untyped_storage().data_ptr()


def test_output_weight_detects_broken_tie(qwen3_model: torch.nn.Module) -> None:
    import copy

    m = copy.deepcopy(qwen3_model)
    m.get_output_embeddings().weight = torch.nn.Parameter(m.get_input_embeddings().weight.detach().clone())
    with pytest.raises(AssertionError, match="share storage"):
        output_weight(m)


def test_text_prompts_deterministic_and_avoid_specials() -> None:
    for name in ("qwen3", "qwen3-vl"):
        cfg = load_model(name).config
        a = text_prompts(cfg, n=3, length=40, seed=7)
        assert a == text_prompts(cfg, n=3, length=40, seed=7)
        assert a != text_prompts(cfg, n=3, length=40, seed=8)
        assert len(a) == 3 and all(len(p) == 40 for p in a)
        special = special_token_ids(cfg)
        vocab = (cfg.get("text_config") or cfg)["vocab_size"]
        assert all(0 <= x < vocab and x not in special and isinstance(x, int) for p in a for x in p)
    vl = load_model("qwen3-vl").config
    assert {1000, 1001, 1002, 1003, 1004, 1005} <= special_token_ids(vl)
    assert {500, 501} <= special_token_ids(load_model("qwen3").config)
    with pytest.raises(ValueError):
        text_prompts(vl, n=0)


def test_text_prompt_avoids_all_but_one_id() -> None:
    cfg = {"vocab_size": 4, "bos_token_id": 0, "eos_token_id": [1, 2]}
    assert text_prompts(cfg, n=1, length=5) == [[3] * 5]


@pytest.fixture(scope="module")
def vl_prompt():
    return image_prompt(load_model("qwen3-vl").config)


def test_image_prompt_shapes(vl_prompt) -> None:
    cfg = load_model("qwen3-vl").config
    vc = cfg["vision_config"]
    p = vl_prompt
    t, h, w = (int(x) for x in p.image_grid_thw[0])
    merge = vc["spatial_merge_size"]
    # not resized: the grid is the image in patches
    assert (t, h * vc["patch_size"], w * vc["patch_size"]) == (1, *p.image.shape[:2])
    assert p.image_grid_thw.dtype == torch.int64 and p.image_grid_thw.shape == (1, 3)
    assert p.pixel_values.shape == (t * h * w, 3 * vc["temporal_patch_size"] * vc["patch_size"] ** 2)
    n_img = sum(x == cfg["image_token_id"] for x in p.input_ids)
    assert n_img == t * h * w // merge**2 == p.num_image_tokens
    assert p.mm_token_type_ids == [int(x == cfg["image_token_id"]) for x in p.input_ids]
    start = p.input_ids.index(cfg["vision_start_token_id"])
    assert p.input_ids[start + 1 + n_img] == cfg["vision_end_token_id"]
    assert p.collapsed_input_ids.count(cfg["image_token_id"]) == 1
    text = [x for x in p.input_ids if x not in special_token_ids(cfg)]
    assert len(text) == len(p.input_ids) - n_img - 2 > 0


def test_image_prompt_deterministic_and_url_roundtrip(vl_prompt) -> None:
    cfg = load_model("qwen3-vl").config
    again = image_prompt(cfg)
    assert again.input_ids == vl_prompt.input_ids and again.image_url == vl_prompt.image_url
    assert np.array_equal(again.image, vl_prompt.image)
    assert not np.array_equal(image_prompt(cfg, seed=1).image, vl_prompt.image)
    assert vl_prompt.image_url.startswith("data:image/png;base64,")
    decoded = decode_image_url(vl_prompt.image_url)
    assert decoded.dtype == np.uint8 and np.array_equal(decoded, vl_prompt.image)
    pv, grid = process_image(cfg, decoded)  # the engine side recomputes from the image itself
    assert torch.equal(pv, vl_prompt.pixel_values) and torch.equal(grid, vl_prompt.image_grid_thw)
    with pytest.raises(ValueError):
        decode_image_url("http://example.com/x.png")
    with pytest.raises(ValueError):
        image_prompt(load_model("qwen3").config)


def test_image_processor_does_not_resize(vl_prompt) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = load_model("qwen3-vl").config
    proc = Qwen2VLImageProcessorPil(**image_processor_kwargs(cfg))
    out = proc(images=[vl_prompt.image], do_resize=False, return_tensors="pt")
    torch.testing.assert_close(out["pixel_values"].float(), vl_prompt.pixel_values, atol=0, rtol=0)


def test_qwen3_vl_forward_accepts_image_prompt(vl_prompt) -> None:
    spec = load_model("qwen3-vl")
    model = build_hf_model(spec, "float32", seed=1)
    inputs = vl_prompt.model_inputs()
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    n = len(vl_prompt.input_ids)
    vocab = spec.config["text_config"]["vocab_size"]
    assert out.logits.shape == (1, n, vocab)
    assert torch.isfinite(out.logits).all()
    ids = inputs["input_ids"][0]
    lp, ent = fused_logprobs(out.hidden_states[-1][0, :-1], output_weight(model), ids[1:], chunk_tokens=32)
    ref = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, ids[1:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    assert torch.isfinite(ent).all()

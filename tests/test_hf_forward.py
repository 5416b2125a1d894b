"""The trainer-side transformers forward: the vision path's extras reach the language model, mRoPE
position ids are computed or rejected with the expected layout, temperature reaches the fused path."""

from __future__ import annotations

import pytest
import torch

from reference_impl.forward import logprobs as lp
from reference_impl.forward.hf import (
    HfForward,
    IncompleteState,
    PositionIdsError,
    check_position_ids,
    fixed_prompts,
    vl_hidden_states,
)
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model


@pytest.fixture(scope="module")
def vl() -> HfForward:
    ckpt = make_checkpoint(load_model("qwen3-vl"), seed=1234)
    ref = HfForward(ckpt)
    ref.load(read_checkpoint(ckpt))
    return ref


def image_prompt(ref: HfForward):  # type: ignore[no-untyped-def]
    return next(p for p in fixed_prompts(ref.config) if p.pixel_values is not None)


def test_vision_kwargs_pass_through_equal_the_models_own_forward(vl: HfForward) -> None:
    prompt = image_prompt(vl)
    ids = torch.tensor([prompt.input_ids])
    with torch.no_grad():
        ours = vl_hidden_states(vl.model, ids, prompt.pixel_values, prompt.image_grid_thw)
        theirs = vl.model.model(
            input_ids=ids,
            pixel_values=prompt.pixel_values,
            image_grid_thw=prompt.image_grid_thw,
            mm_token_type_ids=(ids == vl.model.config.image_token_id).int(),
        ).last_hidden_state
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_dropping_the_deepstack_embeddings_changes_the_result(vl: HfForward) -> None:
    # The deepstack features matter: without them the hidden states differ (so passing them is checked).
    prompt = image_prompt(vl)
    ids = torch.tensor([prompt.input_ids])
    inner = vl.model.model
    with torch.no_grad():
        full = vl_hidden_states(vl.model, ids, prompt.pixel_values, prompt.image_grid_thw)
        vision = inner.get_image_features(prompt.pixel_values, prompt.image_grid_thw, return_dict=True)
        embeds = inner.get_input_embeddings()(ids)
        mask = ids == vl.model.config.image_token_id
        embeds = embeds.masked_scatter(mask[..., None].expand_as(embeds), torch.cat(vision.pooler_output))
        pos, _ = inner.get_rope_index(ids, image_grid_thw=prompt.image_grid_thw, mm_token_type_ids=mask.int())
        bare = inner.language_model(inputs_embeds=embeds, position_ids=pos).last_hidden_state
    assert not torch.allclose(full, bare, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 24), (2, 1, 24), (3, 1, 23), (3, 24)])
def test_position_ids_of_the_wrong_shape_are_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(PositionIdsError, match=r"\(3 or 4, batch, seq\) = \(3, 1, 24\)"):
        check_position_ids(torch.zeros(shape, dtype=torch.long), 1, 24)
    check_position_ids(torch.zeros(3, 1, 24, dtype=torch.long), 1, 24)
    check_position_ids(torch.zeros(4, 1, 24, dtype=torch.long), 1, 24)


def test_given_position_ids_are_used_and_computed_ones_match(vl: HfForward) -> None:
    prompt = image_prompt(vl)
    ids = torch.tensor([prompt.input_ids])
    mask = (ids == vl.model.config.image_token_id).int()
    pos, _ = vl.model.model.get_rope_index(ids, image_grid_thw=prompt.image_grid_thw, mm_token_type_ids=mask)
    with torch.no_grad():
        auto = vl.logprobs(prompt, 1.0)[0]
        given = vl.logprobs(prompt, 1.0, position_ids=pos)[0]
        wrong = vl.logprobs(prompt, 1.0, position_ids=torch.zeros_like(pos))[0]
    assert torch.equal(auto, given)
    assert not torch.allclose(auto, wrong)


def test_temperature_reaches_the_fused_path(vl: HfForward) -> None:
    prompt = fixed_prompts(vl.config)[0]
    ids = torch.tensor([prompt.input_ids])
    with torch.no_grad():
        logits = vl.model(input_ids=ids).logits[0, :-1]
        for t in (0.5, 1.0, 1.7):
            expected, _ = lp.naive_logprobs(logits, torch.eye(logits.shape[1]), ids[0, 1:], temperature=t)
            got, _ = vl.logprobs(prompt, t)
            assert torch.allclose(got, expected, atol=1e-5)


def test_load_refuses_an_incomplete_state(vl: HfForward) -> None:
    state = dict(read_checkpoint(make_checkpoint(load_model("qwen3-vl"), seed=1234)))
    state.pop("model.visual.pos_embed.weight")
    with pytest.raises(IncompleteState, match="pos_embed"):
        vl.load(state)

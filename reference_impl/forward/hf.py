"""The transformers forward: log-probs of the fixed prompts from a transformers model of the checkpoint.

It runs over a given set of HF tensors (HF names, checkpoint
layout), placed into a transformers model of the checkpoint's architecture (`models.hf_model`) through
the family's checkpoint views (`models.checkpoint_views`). It shares only these HF checkpoint facts
(`models/`) with the engine, never the engine's own code. The harness runs it over the expected state
after every sync (`harness.oracles`), a third view beside the trainer's own Megatron forward
(`forward.megatron`) and the engine; the record names each forward (`FORWARD_NAME`):

- text: the decoder's last hidden states [T, H] and the output weight [V, H] (the embedding when
  tied) go through `logprobs.fused_logprobs` in token chunks, with the temperature;
- Qwen3-VL: our own composition of the vision path: the vision tower's image embeddings and deepstack
  features, `visual_pos_masks` (where the image tokens are), mRoPE position ids (computed here when
  none are given; a given tensor must be (3 or 4, batch, seq)), all passed through to the language
  model, then the fused log-prob path with the temperature.
The engine instead runs the plain transformers model forward and a full log_softmax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reference_impl.forward import logprobs as lp
from reference_impl.models.checkpoint_views import checkpoint_tensors
from reference_impl.models.families import model_family
from reference_impl.models.hf_model import build_engine_model

FORWARD_NAME = "transformers forward over the sent tensors (fused log-probs)"


class IncompleteState(ValueError):
    """The sent tensors do not cover the model (a broken sync): no forward is possible."""


class PositionIdsError(ValueError):
    """Position ids of the wrong shape for an mRoPE model."""


@dataclass
class Prompt:
    """One fixed prompt: token ids [T] and, for VL models, the image inputs."""

    input_ids: list[int]
    pixel_values: torch.Tensor | None = None  # [N, C * temporal * patch * patch]
    image_grid_thw: torch.Tensor | None = None  # [1, 3]
    image_url: str | None = None  # the same image as a data URL, for the engine
    # the prompt as one chat message's OpenAI content parts (for engines whose image route is chat)
    chat_content: list[dict[str, Any]] | None = None

    def key(self) -> tuple[Any, ...]:
        """What a forward's output over this prompt depends on, hashable: the token ids, the image URL and the
        checksums (`checksum.tensor_checksum`) of the image tensors."""
        from reference_impl.checksum import tensor_checksum

        images = tuple(tensor_checksum(t) if t is not None else None for t in (self.pixel_values, self.image_grid_thw))
        return (tuple(self.input_ids), self.image_url, images)


def fixed_prompts(config: dict[str, Any]) -> list[Prompt]:
    """The prompts trainer and engine log-probs are compared on: seeded text prompts and, for a VL model,
    one prompt with a synthetic image (`forward.prompts`)."""
    from reference_impl.forward import prompts

    out = [Prompt(ids) for ids in prompts.text_prompts(config)]
    if "vision_config" in config:
        ip = prompts.image_prompt(config)
        out.append(Prompt(list(ip.input_ids), ip.pixel_values, ip.image_grid_thw, ip.image_url, ip.chat_content))
    return out


def check_position_ids(position_ids: torch.Tensor, batch: int, seq: int) -> None:
    """mRoPE position ids must be [3 or 4, batch, seq] (t/h/w sections, optionally a text row first).

    Raises:
        PositionIdsError: any other shape, with the expected layout in the message.
    """
    if position_ids.ndim != 3 or position_ids.shape[0] not in (3, 4) or tuple(position_ids.shape[1:]) != (batch, seq):
        raise PositionIdsError(
            f"position_ids has shape {tuple(position_ids.shape)}; an mRoPE model needs (3 or 4, batch, seq) = "
            f"(3, {batch}, {seq}); pass None to have them computed from input_ids and image_grid_thw"
        )


def vl_hidden_states(
    model: Any,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Last hidden states [B, T, H] of a Qwen3-VL model with the vision path's extras passed through.

    Raises:
        PositionIdsError: `position_ids` given with the wrong shape.
    """
    inner = model.model
    embeds = inner.get_input_embeddings()(input_ids)
    visual_pos_masks = deepstack = None
    mm_token_type_ids = (input_ids == model.config.image_token_id).int()
    if pixel_values is not None:
        vision = inner.get_image_features(pixel_values, image_grid_thw, return_dict=True)
        image_embeds = torch.cat(vision.pooler_output, dim=0).to(embeds.dtype)
        visual_pos_masks = input_ids == model.config.image_token_id
        if int(visual_pos_masks.sum()) != image_embeds.shape[0]:
            raise ValueError(
                f"{int(visual_pos_masks.sum())} image tokens in the prompt but the image gives {image_embeds.shape[0]}"
            )
        embeds = embeds.masked_scatter(visual_pos_masks[..., None].expand_as(embeds), image_embeds)
        deepstack = vision.deepstack_features
    if position_ids is None:
        position_ids, _ = inner.get_rope_index(
            input_ids, image_grid_thw=image_grid_thw, mm_token_type_ids=mm_token_type_ids
        )
    check_position_ids(position_ids, *input_ids.shape)
    out = inner.language_model(
        input_ids=None,
        inputs_embeds=embeds,
        position_ids=position_ids,
        visual_pos_masks=visual_pos_masks,
        deepstack_visual_embeds=deepstack,
    )
    return out.last_hidden_state


class HfForward:
    """A transformers model of a checkpoint's architecture that takes the tensors a sync sent."""

    def __init__(self, checkpoint: Path) -> None:
        self.config = json.loads((Path(checkpoint) / "config.json").read_text())
        self.model, self.model_type = build_engine_model(checkpoint, seed=None)
        self.model.eval()
        params = dict(self.model.named_parameters())
        views = model_family(self.model_type).views
        self.views = {n: ct.view(params[ct.param]) for n, ct in checkpoint_tensors(views, params).items()}

    @property
    def is_vl(self) -> bool:
        """A vision-language model."""
        return "vision_config" in self.config

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy the sent tensors (HF checkpoint names and layout) into the model.

        Raises:
            IncompleteState: a tensor the model has no place for, or a model tensor that was not sent.
        """
        missing = sorted(set(self.views) - set(tensors))
        extra = sorted(set(tensors) - set(self.views))
        if missing or extra:
            raise IncompleteState(
                f"sent tensors do not cover the model: {len(missing)} missing (e.g. {missing[:2]}), "
                f"{len(extra)} unplaceable (e.g. {extra[:2]})"
            )
        with torch.no_grad():
            for name, view in self.views.items():
                view.copy_(tensors[name])

    @torch.no_grad()
    def logprobs(
        self, prompt: Prompt, temperature: float, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [T-1] of prompt[1:] given the prefix, and entropies [T-1] (fp32), at `temperature`."""
        ids = torch.tensor([prompt.input_ids], dtype=torch.long)
        if self.is_vl:
            hidden = vl_hidden_states(self.model, ids, prompt.pixel_values, prompt.image_grid_thw, position_ids)
        else:
            hidden = self.model.model(input_ids=ids).last_hidden_state
        weight = lp.output_weight(self.model)
        return lp.fused_logprobs(hidden[0, :-1], weight, ids[0, 1:], temperature=temperature)

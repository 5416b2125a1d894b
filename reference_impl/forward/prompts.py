"""The fixed prompts on which trainer and engine log-probs are compared.

Every function here is a pure function of the model config dict (`ModelSpec.config`, the HF
config.json) and a seed, so the trainer process and the engine process build identical prompts
without talking to each other. Token ids come from numpy's PCG64 generator (`default_rng`), whose
stream is stable across numpy versions and platforms.

Image prompts (Qwen3-VL families) use transformers' PIL/numpy `Qwen2VLImageProcessorPil` (the
torchvision-backed `Qwen2VLImageProcessor` needs torchvision), configured as the released Qwen3-VL
`preprocessor_config.json` is (mean/std 0.5, min/max pixels 65536 / 16777216, patch, temporal patch
and merge sizes from `vision_config`); see `image_processor_kwargs`, the same values the scaled-down
checkpoints' own `preprocessor_config.json` holds (`models.tokenizer`). The synthetic image is sized so
that this processor does not resize it: both sides a multiple of patch_size * merge_size and at least
min_pixels in area. The image also travels as a PNG data URL, the way vLLM's OpenAI routes receive one;
the engine decodes it (`decode_image_url`) and recomputes pixel values (`process_image`).

Token ids are drawn from the ordinary ids of the config (neither a `*_token_id` of the config nor, for a
VL config, a special token of its checkpoint's tokenizer, `models.tokenizer.special_tokens`), so an image
prompt can also be written as a chat message (`ImagePrompt.chat_content`: text parts in the tokenizer's
ordinary-token text, and the image as an `image_url` part) that the checkpoint's chat template and
tokenizer turn back into exactly `ImagePrompt.input_ids` (before the image placeholder's expansion).
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from reference_impl.models import tokenizer

# The released Qwen3-VL preprocessor_config.json values not read from the model config.
QWEN3_VL_IMAGE_MEAN = tokenizer.IMAGE_MEAN
QWEN3_VL_IMAGE_STD = tokenizer.IMAGE_STD
QWEN3_VL_MIN_PIXELS = tokenizer.MIN_PIXELS
QWEN3_VL_MAX_PIXELS = tokenizer.MAX_PIXELS

_IMAGE_SEED_SALT = 0x1A6E  # keeps the image's random stream apart from the text tokens'
_DATA_URL_PREFIX = "data:image/png;base64,"


def vocab_size(config: dict[str, Any]) -> int:
    """The text vocabulary size (`text_config.vocab_size` for Qwen3-VL configs)."""
    text = config.get("text_config") or config
    return int(text["vocab_size"])


def special_token_ids(config: dict[str, Any]) -> set[int]:
    """Every id named by a `*_token_id` / `*_token_ids` key of the config, its text_config or vision_config.

    Covers bos/eos/pad and image/video/vision start/end ids; list values (several eos ids) are flattened.
    """
    out: set[int] = set()
    for d in (config, config.get("text_config") or {}, config.get("vision_config") or {}):
        for k, v in d.items():
            if not (k.endswith("_token_id") or k.endswith("_token_ids")) or v is None:
                continue
            for x in v if isinstance(v, (list, tuple)) else [v]:
                if isinstance(x, int) and not isinstance(x, bool):
                    out.add(x)
    return out


def _ordinary_ids(config: dict[str, Any]) -> np.ndarray:
    special = special_token_ids(config)
    if "vision_config" in config and "image_token_id" in config:  # its checkpoint's tokenizer adds <|im_start|>
        special |= set(tokenizer.special_tokens(config))
    allowed = np.setdiff1d(np.arange(vocab_size(config), dtype=np.int64), np.array(sorted(special)))
    if allowed.size == 0:
        raise ValueError("the config's vocabulary holds only special token ids")
    return allowed


def _draw(config: dict[str, Any], rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    allowed = _ordinary_ids(config)
    return allowed[rng.integers(0, allowed.size, size=shape)]


def text_prompts(config: dict[str, Any], n: int = 2, length: int = 24, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` seeded token ids in [0, vocab), none of them a special id of the config.

    Raises:
        ValueError: n or length < 1.
    """
    if n < 1 or length < 1:
        raise ValueError(f"n and length must be >= 1, got n={n} length={length}")
    ids = _draw(config, np.random.default_rng(seed), (n, length))
    return [[int(x) for x in row] for row in ids]


def _vision(config: dict[str, Any]) -> dict[str, Any]:
    vc = config.get("vision_config")
    if not vc or "image_token_id" not in config:
        raise ValueError("image prompts need a Qwen3-VL config (vision_config and image_token_id)")
    return vc


def image_processor_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of the image processor both sides use (the released Qwen3-VL values).

    The scaled-down checkpoints carry the same values in their `preprocessor_config.json`
    (`models.tokenizer.image_processor_kwargs`, which this is).

    Raises:
        ValueError: not a Qwen3-VL config.
    """
    _vision(config)
    return tokenizer.image_processor_kwargs(config)


def image_size(config: dict[str, Any]) -> tuple[int, int]:
    """(height, width) of the synthetic image: multiples of patch*merge, area >= min_pixels, not square.

    For the Qwen3-VL sizes (patch 16, merge 2) this is 256 x 288: a 16 x 18 patch grid, 72 image tokens.
    """
    vc = _vision(config)
    factor = int(vc["patch_size"]) * int(vc["spatial_merge_size"])
    h = math.ceil(math.sqrt(QWEN3_VL_MIN_PIXELS) / factor) * factor
    return h, h + factor


def process_image(config: dict[str, Any], image: np.ndarray) -> tuple[Tensor, Tensor]:
    """Pixel values and grid of an RGB image, as the Qwen3-VL processor makes them.

    Args:
        config: a Qwen3-VL config dict.
        image: [H, W, 3] uint8 RGB.

    Returns:
        (pixel_values [t*h*w, 3*temporal_patch*patch*patch] fp32, image_grid_thw [1, 3] int64).

    Raises:
        ValueError: not a Qwen3-VL config, or image not [H, W, 3] uint8.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be [H, W, 3] uint8 RGB, got shape {image.shape} dtype {image.dtype}")
    proc = Qwen2VLImageProcessorPil(**image_processor_kwargs(config))
    out = proc(images=[image], return_tensors="pt")
    return out["pixel_values"].to(torch.float32), out["image_grid_thw"].to(torch.int64)


def encode_image_url(image: np.ndarray) -> str:
    """A `data:image/png;base64,...` URL of an [H, W, 3] uint8 RGB image (lossless)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image, mode="RGB").save(buf, format="PNG")
    return _DATA_URL_PREFIX + base64.b64encode(buf.getvalue()).decode("ascii")


def decode_image_url(url: str) -> np.ndarray:
    """The [H, W, 3] uint8 RGB image of a `data:image/...;base64,` URL.

    Raises:
        ValueError: not a base64 image data URL.
    """
    from PIL import Image

    head, sep, data = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ValueError(f"expected a data:image/...;base64, URL, got {url[:40]!r}")
    with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as img:
        return np.asarray(img.convert("RGB"), dtype=np.uint8).copy()


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with one image, in the form transformers' Qwen3-VL forward takes.

    Attributes:
        input_ids: text ids, vision_start, image_token_id repeated `num_image_tokens` times, vision_end,
            text ids (the processor-expanded form).
        mm_token_type_ids: 1 where input_ids == image_token_id, else 0 (same length as input_ids).
        image: [H, W, 3] uint8 RGB.
        image_url: PNG data URL of `image`.
        pixel_values: [t*h*w, 3*temporal_patch*patch*patch] fp32.
        image_grid_thw: [1, 3] int64 (t, h, w) in patches.
        image_token_id: the config's image token id.
        merge_size: vision_config.spatial_merge_size.
        text_before: the ordinary ids before vision_start.
        text_after: the ordinary ids after vision_end.
    """

    input_ids: list[int]
    mm_token_type_ids: list[int]
    image: np.ndarray
    image_url: str
    pixel_values: Tensor
    image_grid_thw: Tensor
    image_token_id: int
    merge_size: int
    text_before: tuple[int, ...] = ()
    text_after: tuple[int, ...] = ()

    @property
    def chat_content(self) -> list[dict[str, Any]]:
        """The prompt as the content of one OpenAI chat message: the text before the image, the image as an
        `image_url` part (the PNG data URL), the text after it. Rendered by a scaled-down checkpoint's chat
        template and tokenized by its tokenizer (`models.tokenizer`), it is `collapsed_input_ids`; the
        engine's processor then expands the image placeholder into `input_ids`."""
        parts: list[dict[str, Any]] = []
        if self.text_before:
            parts.append({"type": "text", "text": tokenizer.ordinary_text(list(self.text_before))})
        parts.append({"type": "image_url", "image_url": {"url": self.image_url}})
        if self.text_after:
            parts.append({"type": "text", "text": tokenizer.ordinary_text(list(self.text_after))})
        return parts

    @property
    def num_image_tokens(self) -> int:
        """t*h*w / merge**2: the image placeholder tokens in input_ids."""
        t, h, w = (int(x) for x in self.image_grid_thw[0])
        return t * h * w // self.merge_size**2

    @property
    def collapsed_input_ids(self) -> list[int]:
        """input_ids with the run of image tokens collapsed to one (the un-expanded prompt form)."""
        out: list[int] = []
        for x in self.input_ids:
            if not (x == self.image_token_id and out and out[-1] == self.image_token_id):
                out.append(x)
        return out

    def model_inputs(self) -> dict[str, Tensor]:
        """Batch-of-one tensors for `Qwen3VLForConditionalGeneration.forward`."""
        return {
            "input_ids": torch.tensor([self.input_ids], dtype=torch.long),
            "mm_token_type_ids": torch.tensor([self.mm_token_type_ids], dtype=torch.int32),
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
        }


def synthetic_image(config: dict[str, Any], seed: int = 0) -> np.ndarray:
    """The seeded [H, W, 3] uint8 RGB image of `image_size(config)`: smooth gradients plus 4x4-block noise.

    Block noise keeps every patch distinct while the PNG data URL stays small (tens of KB).
    """
    h, w = image_size(config)
    rng = np.random.default_rng([seed, _IMAGE_SEED_SALT])
    yy, xx = np.meshgrid(np.linspace(0.0, 1.0, h), np.linspace(0.0, 1.0, w), indexing="ij")
    base = np.stack([yy, xx, 0.5 * (yy + 1.0 - xx)], axis=-1) * 160.0
    noise = rng.integers(0, 96, size=(-(-h // 4), -(-w // 4), 3)).repeat(4, axis=0).repeat(4, axis=1)[:h, :w]
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def image_prompt(config: dict[str, Any], seed: int = 0, text_before: int = 4, text_after: int = 6) -> ImagePrompt:
    """The fixed image prompt of a Qwen3-VL config.

    Raises:
        ValueError: not a Qwen3-VL config (no vision_config / image_token_id).
    """
    vc = _vision(config)
    image = synthetic_image(config, seed)
    pixel_values, grid = process_image(config, image)
    merge = int(vc["spatial_merge_size"])
    t, h, w = (int(x) for x in grid[0])
    n_img = t * h * w // merge**2
    text = _draw(config, np.random.default_rng([seed, _IMAGE_SEED_SALT, 1]), (text_before + text_after,))
    img_id = int(config["image_token_id"])
    ids = (
        [int(x) for x in text[:text_before]]
        + [int(config["vision_start_token_id"])]
        + [img_id] * n_img
        + [int(config["vision_end_token_id"])]
        + [int(x) for x in text[text_before:]]
    )
    return ImagePrompt(
        input_ids=ids,
        mm_token_type_ids=[int(x == img_id) for x in ids],
        image=image,
        image_url=encode_image_url(image),
        pixel_values=pixel_values,
        image_grid_thw=grid,
        image_token_id=img_id,
        merge_size=merge,
        text_before=tuple(int(x) for x in text[:text_before]),
        text_after=tuple(int(x) for x in text[text_before:]),
    )


PROBE_TOKENS = 40  # two full prefix-cache blocks of 16 and 8 more: a cached prefix is reused, one part is not
_PROBE_SEED_SALT = 0x9B0E


def probe_prompt(config: dict[str, Any], seed: int = 0) -> list[int]:
    """A fixed text prompt of `PROBE_TOKENS` ordinary token ids (no special ids), long enough that an engine
    with a prefix cache serves most of it from the cache when it sees it twice."""
    special = special_token_ids(config)
    rng = np.random.default_rng(seed ^ _PROBE_SEED_SALT)
    usable = [t for t in range(vocab_size(config)) if t not in special]
    return [int(usable[i]) for i in rng.integers(0, len(usable), PROBE_TOKENS)]

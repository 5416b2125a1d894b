"""The tokenizer, chat template and image/video processor files of a scaled-down Qwen3-VL checkpoint.

vLLM's image route is its chat route (`/v1/chat/completions` with an `image_url` part): the server
renders the messages with the checkpoint's chat template, tokenizes the text with its tokenizer and runs
transformers' `Qwen3VLProcessor` (image processor `preprocessor_config.json`, video processor
`video_preprocessor_config.json`) to expand the image placeholder and make pixel values. The released
checkpoints ship these files; a scaled-down one (remapped special ids, a vocabulary of about a thousand
ids) gets its own, written by `write_processor_files` so that the ids vLLM makes from a chat message are
exactly the fixed prompt's ids (`forward.prompts.image_prompt`):

- the vocabulary: every id of `[0, vocab_size)` is one token. The config's special ids carry the
  released tokenizer's special tokens (`special_tokens`: `<|image_pad|>` at `image_token_id`,
  `<|video_pad|>`, `<|vision_start|>`, `<|vision_end|>`, `<|endoftext|>` at the text bos id and
  `<|im_end|>` at the text eos id, as in the released Qwen3-VL tokenizer, whose eos is `<|im_end|>`),
  `<|im_start|>` the first free id above them; every other id is the ordinary token `ordinary_token(id)`
  (`t<id>`), and ordinary tokens are split on whitespace (a `WordLevel` model, `WhitespaceSplit`), so
  `" ".join(ordinary_token(i) for i in ids)` tokenizes back to `ids`;
- the chat template (`CHAT_TEMPLATE`): the messages' content in order, text parts as they are and
  `<|vision_start|><|image_pad|><|vision_end|>` where an image part is (`<|video_pad|>` for a video),
  with no role markers and no generation prompt, so the rendered prompt is the fixed prompt itself;
- the processors: `Qwen2VLImageProcessorFast` and `Qwen3VLVideoProcessor` with the vision config's
  patch, temporal patch and merge sizes and the released mean/std and min/max pixels
  (`image_processor_kwargs`, the values the fixed prompts' own image processing uses).

This module is a pure function of the config dict (the `ModelSpec.config`, HF config.json form) and
imports nothing else of `reference_impl`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The released Qwen3-VL preprocessor_config.json values that the model config does not hold
# (Qwen/Qwen3-VL-4B-Instruct preprocessor_config.json: "size": {"shortest_edge": 65536,
# "longest_edge": 16777216}, image_mean / image_std 0.5).
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
MIN_PIXELS = 65536
MAX_PIXELS = 16777216
# The released video_preprocessor_config.json (Qwen/Qwen3-VL-4B-Instruct): its own pixel bounds.
VIDEO_MIN_PIXELS = 4096
VIDEO_MAX_PIXELS = 25165824

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END  # what the chat template writes for an image part

# The messages' content in order; an image (video) part becomes the vision triple. vLLM hands the template
# OpenAI content parts with the image part as {"type": "image"} (vLLM chat_utils, "openai" content format,
# detected because the template loops over message['content']).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') or 'image' in part or 'image_url' in part -%}"
    f"{IMAGE_PLACEHOLDER}"
    "{%- elif part['type'] in ('video', 'video_url') or 'video' in part -%}"
    f"{VISION_START}{VIDEO_PAD}{VISION_END}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
)


def ordinary_token(token_id: int) -> str:
    """The text of ordinary token `token_id` in a scaled-down VL checkpoint's vocabulary: `t<id>`."""
    return f"t{token_id}"


def ordinary_text(ids: list[int]) -> str:
    """`ids` (ordinary ids) as text that the checkpoint's tokenizer splits back into exactly `ids`."""
    return " ".join(ordinary_token(i) for i in ids)


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def special_tokens(config: dict[str, Any]) -> dict[int, str]:
    """id -> special token of a Qwen3-VL config's tokenizer (see the module doc for the assignment).

    Raises:
        ValueError: not a Qwen3-VL config (no image/video/vision token ids), two tokens on one id, or an id
            outside the vocabulary.
    """
    text = _text_config(config)
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    if not all(isinstance(config.get(k), int) for k in keys):
        raise ValueError(f"a Qwen3-VL tokenizer needs the config's {', '.join(keys)}")
    named = [
        (config["image_token_id"], IMAGE_PAD),
        (config["video_token_id"], VIDEO_PAD),
        (config["vision_start_token_id"], VISION_START),
        (config["vision_end_token_id"], VISION_END),
        (text.get("bos_token_id"), ENDOFTEXT),
        (text.get("eos_token_id"), IM_END),
    ]
    out: dict[int, str] = {}
    for token_id, token in named:
        if token_id is None:
            continue
        if token_id in out:
            raise ValueError(f"token id {token_id} is both {out[token_id]} and {token}")
        out[int(token_id)] = token
    out[max(out) + 1] = IM_START
    vocab = int(text["vocab_size"])
    if max(out) >= vocab:
        raise ValueError(f"special token ids {sorted(out)} do not fit the vocabulary of {vocab}")
    return out


def image_processor_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """The Qwen2-VL image processor's settings for a Qwen3-VL config: patch, temporal patch and merge sizes
    from `vision_config`, the released mean/std and min/max pixels (constructor keywords of transformers'
    `Qwen2VLImageProcessorPil` / `Qwen2VLImageProcessorFast`).

    Raises:
        KeyError: no vision_config, or one without patch_size / temporal_patch_size / spatial_merge_size.
    """
    vc = config["vision_config"]
    return {
        "patch_size": int(vc["patch_size"]),
        "temporal_patch_size": int(vc["temporal_patch_size"]),
        "merge_size": int(vc["spatial_merge_size"]),
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "image_mean": list(IMAGE_MEAN),
        "image_std": list(IMAGE_STD),
    }


def _processor_file(config: dict[str, Any], processor_type_key: str, processor_type: str, pixels: tuple[int, int]):
    kw = image_processor_kwargs(config)
    return {
        "size": {"shortest_edge": pixels[0], "longest_edge": pixels[1]},
        "patch_size": kw["patch_size"],
        "temporal_patch_size": kw["temporal_patch_size"],
        "merge_size": kw["merge_size"],
        "image_mean": kw["image_mean"],
        "image_std": kw["image_std"],
        "processor_class": "Qwen3VLProcessor",
        processor_type_key: processor_type,
    }


def build_tokenizer(config: dict[str, Any]):  # -> transformers.PreTrainedTokenizerFast
    """The Qwen3-VL config's tokenizer (see the module doc) with `CHAT_TEMPLATE` as its chat template.

    Raises:
        ValueError: as `special_tokens`.
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = special_tokens(config)
    vocab_size = int(_text_config(config)["vocab_size"])
    vocab = {special.get(i, ordinary_token(i)): i for i in range(vocab_size)}
    # A word outside the vocabulary becomes <|endoftext|> (vLLM renders a "warmup" message at start); the
    # fixed prompts hold none, and the engine client checks the ids the engine made.
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special.get(_text_config(config).get("bos_token_id"))))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Already in the vocabulary at their ids: marked as special, matched whole before the whitespace split.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in sorted(special.items())])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END if IM_END in special.values() else None,
        pad_token=ENDOFTEXT if ENDOFTEXT in special.values() else None,
        model_max_length=int(_text_config(config).get("max_position_embeddings", 4096)),
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_processor_files(config: dict[str, Any], folder: Path) -> list[str]:
    """Write the tokenizer (with its chat template) and the image and video processor configs of a Qwen3-VL
    config into checkpoint `folder`; returns the file names written.

    Raises:
        ValueError: as `special_tokens`.
        KeyError: as `image_processor_kwargs`.
    """
    before = {p.name for p in folder.iterdir()}
    build_tokenizer(config).save_pretrained(str(folder))
    files = {
        "preprocessor_config.json": _processor_file(
            config, "image_processor_type", "Qwen2VLImageProcessorFast", (MIN_PIXELS, MAX_PIXELS)
        ),
        "video_preprocessor_config.json": _processor_file(
            config, "video_processor_type", "Qwen3VLVideoProcessor", (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
        ),
    }
    for name, body in files.items():
        (folder / name).write_text(json.dumps(body, indent=2) + "\n")
    return sorted({p.name for p in folder.iterdir()} - before)

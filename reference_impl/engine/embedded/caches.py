"""The embedded engine's caches, keyed as vLLM keys its own, and cleared only by the routes that clear vLLM's.

A cache that outlives a weight update serves the old weights: RL trainers reset vLLM's caches after every
update (`POST /reset_prefix_cache`, `POST /reset_encoder_cache`, vLLM `entrypoints/serve/dev/cache/
api_router.py`); vLLM 0.32's `finish_weight_update` resets neither (`v1/worker/gpu_worker.py`), and the
stale vision-encoder cache is a public bug (vllm-project/vllm#44910, huggingface/trl#7198). So that the
harness can see a missing reset, this engine caches the same way:

- **prefix cache** (`PrefixCache`): the attention keys/values of a prompt's leading full blocks of
  `BLOCK` tokens (vLLM's block hashing at its default block size), reused by a later request with the
  same leading tokens. As in vLLM, a request that asks for prompt log-probs neither reads nor fills it
  (they need every prompt position computed). Text prompts of text models only: the mRoPE position
  bookkeeping of Qwen3-VL is not replayed from a cache here.
- **encoder cache** (`EncoderCache`): a vision-language model's image features (the vision tower's
  output and its deepstack features) keyed by the image's hash (vLLM's `mm_hash`), reused by every later
  request with the same image, prompt log-probs or not.

Neither is cleared by `/finish_weight_update`; each only by its reset route.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from typing import Any

BLOCK = 16  # tokens per prefix block (vLLM's default block size)


class PrefixCache:
    """Keys/values (a transformers `Cache`) of block-aligned prompt prefixes, by their token ids."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], Any] = {}

    @staticmethod
    def cacheable_length(n_tokens: int) -> int:
        """The longest block-aligned prefix of an `n_tokens` prompt that may come from the cache: at least
        one token must still be computed (its logits are the answer)."""
        return ((n_tokens - 1) // BLOCK) * BLOCK

    def lookup(self, prompt: list[int]) -> tuple[int, Any]:
        """(length L, a copy of its keys/values) of the longest cached block-aligned prefix of `prompt`,
        (0, None) when none is."""
        for length in range(self.cacheable_length(len(prompt)), 0, -BLOCK):
            entry = self.entries.get(tuple(prompt[:length]))
            if entry is not None:
                return length, copy.deepcopy(entry)
        return 0, None

    def store(self, prompt: list[int], kv: Any) -> None:
        """Keep the keys/values of `prompt`'s longest cacheable prefix (`kv` holds at least that many
        positions; it is cropped on a copy)."""
        length = self.cacheable_length(len(prompt))
        if length <= 0 or tuple(prompt[:length]) in self.entries:
            return
        kept = copy.deepcopy(kv)
        kept.crop(length)
        self.entries[tuple(prompt[:length])] = kept

    def reset(self) -> int:
        """Drop every entry (`POST /reset_prefix_cache`); returns how many there were."""
        n = len(self.entries)
        self.entries.clear()
        return n


class EncoderCache:
    """Image features by image hash, served in place of the vision tower (see the module doc).

    `install(inner_model)` wraps the transformers VL model's `get_image_features` (the call its forward
    makes for `pixel_values`); `key` is the hash of the image the next forward is about (None: do not
    cache).
    """

    def __init__(self) -> None:
        self.entries: dict[str, Any] = {}
        self.key: str | None = None

    @staticmethod
    def image_key(image_url: str) -> str:
        """The cache key of an image: sha256 of its data URL (the same image, the same key)."""
        return hashlib.sha256(image_url.encode()).hexdigest()

    def install(self, inner_model: Any) -> None:
        """Route `inner_model.get_image_features` through this cache."""
        compute: Callable[..., Any] = inner_model.get_image_features

        def get_image_features(*args: Any, **kwargs: Any) -> Any:
            if self.key is None:
                return compute(*args, **kwargs)
            if self.key not in self.entries:
                self.entries[self.key] = compute(*args, **kwargs)
            return self.entries[self.key]

        inner_model.get_image_features = get_image_features

    def reset(self) -> int:
        """Drop every entry (`POST /reset_encoder_cache`); returns how many there were."""
        n = len(self.entries)
        self.entries.clear()
        return n

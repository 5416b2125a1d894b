"""The model families, one file each (`<model_type>.py` defines `FAMILY`, a `ModelFamily`), and their
registry keyed by transformers `config.model_type` (also the `model_type:` of a model entry).

Adding a family: add its file and one line to `FAMILIES` below (README, "Adding a model family").
"""

from __future__ import annotations

from reference_impl.models.families import qwen3, qwen3_moe, qwen3_vl, qwen3_vl_moe
from reference_impl.models.family import ModelFamily

FAMILIES: dict[str, ModelFamily] = {
    "qwen3": qwen3.FAMILY,
    "qwen3_vl": qwen3_vl.FAMILY,
    "qwen3_moe": qwen3_moe.FAMILY,
    "qwen3_vl_moe": qwen3_vl_moe.FAMILY,
}


def model_family(model_type: str) -> ModelFamily:
    """The family registered under `model_type` (read from `FAMILIES` at call time).

    Raises:
        KeyError: an unknown model_type (the message lists the known ones).
    """
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise KeyError(f"no model family for model_type {model_type!r}; known: {sorted(FAMILIES)}") from None

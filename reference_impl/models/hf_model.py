"""A transformers model of a checkpoint folder's architecture, filled with seeded weights.

Both the embedded engine (its dummy weights) and the trainer-side transformers forward (no fill; the sync
fills it) build their model here, from the folder's `config.json`, with the checkpoint maker's own
fill rule (`checkpoint.build_hf_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from reference_impl.models.checkpoint import build_hf_model
from reference_impl.models.families import FAMILIES
from reference_impl.models.registry import ModelSpec


def checkpoint_dtype(config: dict) -> str:
    """The dtype name a checkpoint's `config.json` declares ("dtype" or legacy "torch_dtype"; float32)."""
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def build_engine_model(checkpoint: Path, seed: int | None) -> tuple[torch.nn.Module, str]:
    """The transformers model of checkpoint folder `checkpoint`, filled by seed `seed`; and its family.

    Uses the checkpoint maker's own fill rule (`build_hf_model`) on the folder's `config.json`, in the
    checkpoint's dtype. The family is the config's `model_type` (a key of `models.families.FAMILIES`).

    Raises:
        FileNotFoundError: no config.json in `checkpoint`.
        ValueError: a model_type without a model family, or `seed` equal to the seed the checkpoint
            was made with (the engine would start with the checkpoint's weights).
    """
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    model_type = config.get("model_type", "")
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {config.get('model_type')!r} has no model family; known: {sorted(FAMILIES)}")
    source = Path(checkpoint) / "wsh_source.json"
    if source.exists() and json.loads(source.read_text()).get("seed") == seed:
        raise ValueError(
            f"engine seed {seed} equals the checkpoint's seed: pick another so the engine starts from "
            "different (dummy) weights"
        )
    spec = ModelSpec(
        name=Path(checkpoint).name,
        model_type=model_type,
        hf_architecture=config["architectures"][0],
        source_config=config,
        config=config,
        scaled=False,
    )
    return build_hf_model(spec, checkpoint_dtype(config), seed), model_type

"""What a fresh engine holds before its first update: the dummy weights of its seed, in checkpoint names.

The engine's starting model is the checkpoint maker's seeded fill of the checkpoint's architecture
(`models.hf_model.build_engine_model`). This oracle builds that model again in the harness's own
process and reads every checkpoint tensor's checksum through the family's checkpoint views, so an
engine that did not start fresh (a process reused from an earlier scenario that kept that scenario's
weights, or warm-started from them) differs from it. It shares the fill rule and the views with the
engine, not the engine's start or restart path, which is what it judges (`check_engine_fresh`).
"""

from __future__ import annotations

import functools
from pathlib import Path

from harness.oracles.digest import tensor_digest
from reference_impl.models.checkpoint_views import checkpoint_tensors
from reference_impl.models.families import model_family
from reference_impl.models.hf_model import build_engine_model


@functools.lru_cache(maxsize=4)
def fresh_engine_checksums(checkpoint: Path, seed: int) -> dict[str, str]:
    """Checkpoint name -> `tensor_digest` of that tensor in a fresh engine of `checkpoint` and `seed` (kept
    for the last 4 pairs: a matrix starts every engine of one model with the same seed; a 0.6B model takes
    about 14 s to build and hash on a 2-core host).

    Raises:
        ValueError / FileNotFoundError: as `build_engine_model` (no family, no config.json, the checkpoint's
            own seed).
    """
    model, model_type = build_engine_model(checkpoint, seed)
    params = dict(model.named_parameters())
    views = checkpoint_tensors(model_family(model_type).views, params)
    return {name: tensor_digest(ct.view(params[ct.param])) for name, ct in views.items()}

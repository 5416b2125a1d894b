"""Rollout engines, each kind one adapter (`base.EngineKind`): `embedded` (ours, the strict default)
and `vllm` (real vLLM). `engine_kind(name)` is the one place that maps a scenario's `engine:` to its
adapter; everything else reads the adapter's capabilities."""

from __future__ import annotations

from reference_impl.engine.base import Capabilities, EngineKind, EngineRequest, Transfer
from reference_impl.engine.embedded.adapter import EmbeddedEngine
from reference_impl.engine.vllm.adapter import VllmEngine

ENGINES: dict[str, EngineKind] = {kind.name: kind for kind in (EmbeddedEngine(), VllmEngine())}
DEFAULT_ENGINE = EmbeddedEngine.name

__all__ = ["DEFAULT_ENGINE", "ENGINES", "Capabilities", "EngineKind", "EngineRequest", "Transfer", "engine_kind"]


def engine_kind(name: str) -> EngineKind:
    """The adapter of engine kind `name`.

    Raises:
        ValueError: an unknown kind (the message lists the known ones).
    """
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"engine {name!r} is unknown: use one of {', '.join(ENGINES)}") from None

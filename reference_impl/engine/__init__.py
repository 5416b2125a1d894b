"""Rollout engines the trainer updates: the embedded FastAPI engine (`embedded/`) and real vLLM (`vllm/`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reference_impl.transport.client import RejectionParser


def rejection_parser(engine: str) -> RejectionParser:
    """The parser of engine kind `engine`'s error answers ("embedded" | "vllm"), for `UpdateClient`.

    Raises:
        ValueError: an unknown engine kind.
    """
    if engine == "embedded":
        from reference_impl.engine.embedded.answers import parse_rejections
    elif engine == "vllm":
        from reference_impl.engine.vllm.answers import parse_rejections
    else:
        raise ValueError(f"unknown engine {engine!r}; known: embedded, vllm")
    return parse_rejections

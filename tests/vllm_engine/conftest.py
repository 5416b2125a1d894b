"""The engine pairs of the vLLM engine's tests, vLLM and the embedded engine on one checkpoint, each
started once per test module that asks for it and stopped at its end: `engines` (tiny Qwen3) and
`vl_engines` (tiny Qwen3-VL)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .engines import Connected, both_engines


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Connected]]:
    """vLLM and the embedded engine on the tiny Qwen3 checkpoint."""
    yield from both_engines("qwen3", tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="module")
def vl_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Connected]]:
    """vLLM and the embedded engine on the tiny Qwen3-VL checkpoint (vLLM with its tokenizer and processors:
    the image prompt goes through its chat route)."""
    yield from both_engines("qwen3-vl", tmp_path_factory.mktemp("vl-engines"))

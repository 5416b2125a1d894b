"""The engine pairs of the vLLM engine's tests, vLLM and the embedded engine on one checkpoint, fresh for
each test module that asks for it: `engines` (tiny Qwen3) and `vl_engines` (tiny Qwen3-VL). The embedded
engine is started (forked from the session's fork server) and stopped with the module; the vLLM server is
taken from the session's shared ones (`shared_vllm`: restarted in place when one is idle) and given back at
the module's end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from shared_vllm import SharedVllm

from reference_impl.fork_client import ForkServerAddress

from .engines import Connected, both_engines


@pytest.fixture(scope="module")
def engines(
    tmp_path_factory: pytest.TempPathFactory, shared_vllm: SharedVllm, fork_server: ForkServerAddress
) -> Iterator[dict[str, Connected]]:
    """vLLM and the embedded engine on the tiny Qwen3 checkpoint."""
    yield from both_engines("qwen3", tmp_path_factory.mktemp("engines"), shared_vllm, fork_server)


@pytest.fixture(scope="module")
def vl_engines(
    tmp_path_factory: pytest.TempPathFactory, shared_vllm: SharedVllm, fork_server: ForkServerAddress
) -> Iterator[dict[str, Connected]]:
    """vLLM and the embedded engine on the tiny Qwen3-VL checkpoint (vLLM with its tokenizer and processors:
    the image prompt goes through its chat route)."""
    yield from both_engines("qwen3-vl", tmp_path_factory.mktemp("vl-engines"), shared_vllm, fork_server)

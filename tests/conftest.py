"""Shared fixtures: one Ray session and one scenario runner for all end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A `harness.runner.Runner` on a local Ray instance; trainer processes are shared between tests (with one
    idle pool of another world size kept, `Runner.idle_pools`), and spares are started ahead of need: a warm pool
    of 1 and one of 2 ranks and an embedded engine (`Runner.spare_pools`, `Runner.spare_engine`), since many of
    the tests' scenarios end their processes on purpose (faults, hard kills)."""
    import ray

    from harness.placement import ensure_ray
    from harness.runner import Runner
    from harness.soak import sample_resources

    ensure_ray()
    out: Path = tmp_path_factory.mktemp("e2e")
    # as `python -m harness` samples; the tests alternate world sizes, so one idle pool is kept beside the one in use
    r = Runner(
        out_dir=out,
        run_id="tests",
        after_sync=sample_resources,
        idle_pools=1,
        spare_pools=(1, 2),
        spare_engine="embedded",
    )
    yield r
    r.close()
    ray.shutdown()


@pytest.fixture(scope="session")
def shared_vllm() -> Iterator[object]:
    """vLLM servers shared by the test modules that start their own, restarted in place as fresh engines for
    each module (`tests/shared_vllm.py`); every one is stopped at the session's end."""
    from shared_vllm import SharedVllm

    shared = SharedVllm()
    yield shared
    shared.close()

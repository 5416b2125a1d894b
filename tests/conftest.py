"""Shared fixtures: one Ray session and one scenario runner for all end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A `harness.runner.Runner` on a local Ray instance; trainer processes are shared between tests."""
    import ray

    from harness.placement import ensure_ray
    from harness.runner import Runner
    from harness.soak import sample_resources

    ensure_ray()
    out: Path = tmp_path_factory.mktemp("e2e")
    r = Runner(out_dir=out, run_id="tests", after_sync=sample_resources)  # as `python -m harness` samples
    yield r
    r.close()
    ray.shutdown()

"""Shared fixtures: one Ray session and one scenario runner for all end-to-end tests, one fork server for the
embedded engine servers of the session, and the vLLM servers test modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reference_impl.fork_server import ForkServerAddress


@pytest.fixture(scope="session")
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServerAddress]:
    """One fork server for the session's embedded engine servers (`reference_impl.fork_server`):
    the tests that start such servers themselves and the runner's engine actors fork them from it instead of
    starting new interpreters. Stopped by pid at the session's end."""
    from reference_impl.engine.embedded.forked import ROLE
    from reference_impl.fork_server import ForkServer

    server = ForkServer.start(ROLE, tmp_path_factory.mktemp("fork-server") / "fork-server.log")
    yield server.address
    server.stop()


@pytest.fixture(scope="session")
def runner(tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServerAddress) -> Iterator[object]:
    """A `harness.runner.Runner` on a local Ray instance; trainer processes are shared between tests (with one
    idle pool of another world size kept, `Runner.idle_pools`), and spares are started ahead of need: a warm pool
    of 1 and one of 2 ranks and an embedded engine (`Runner.spare_pools`, `Runner.spare_engine`), since many of
    the tests' scenarios end their processes on purpose (faults, hard kills). Its embedded engine servers fork from
    the session's `fork_server`."""
    import dataclasses

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
        fork_server=dataclasses.replace(fork_server, node_id=ray.get_runtime_context().get_node_id()),
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

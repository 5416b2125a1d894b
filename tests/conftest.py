"""Shared fixtures: one Ray session and one scenario runner for all end-to-end tests, one fork server for the
embedded engine servers of the session, and the vLLM servers test modules share.

The suite runs in two pytest-xdist workers (`nox -s tests`: `-n 2 --dist loadgroup`), each a session of its own
with these fixtures. Every test belongs to a group that one worker runs from start to end (`group_of`, the
scheduler `pytest_xdist_make_scheduler` makes for `--dist loadgroup`): its file, so a module's fixtures are made
once, or, for the tests that start vLLM servers (`VLLM_GROUP`: one worker at a time runs vLLM) and those of
tests/embedded (`EMBEDDED_GROUP`, so one worker alone starts its servers per model), one group each; the longest
groups go first (`SLOWEST_FIRST`, with `--no-loadscope-reorder`). Each worker has a temp folder of its own
(`TMPDIR`). Without xdist the groups do nothing.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from reference_impl.fork_client import ForkServerAddress

if TYPE_CHECKING:
    from shared_vllm import SharedVllm

TESTS = Path(__file__).resolve().parent


def _worker_temp_folder() -> None:
    """In an xdist worker: a temp folder of its own (`TMPDIR`, `<temp>/wsh-tests-<worker>`) for it and every
    process it starts, Ray's session folder included, so that tests which compare the temp folder before and after
    (the servers' own temp folders) see only their worker's. Nothing without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or os.environ.get("TMPDIR", "").endswith(f"wsh-tests-{worker}"):
        return
    folder = Path(tempfile.gettempdir()) / f"wsh-tests-{worker}"
    folder.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # read TMPDIR again


_worker_temp_folder()

# Tests that start vLLM servers (or take the session's shared ones) form one xdist group: one worker at a time
# runs vLLM, as a run without xdist does (an idle vLLM server holds about 2.2 GB, its engine core and API server;
# several at once in two workers filled the 24 GB host), and one worker's shared servers serve every such module.
VLLM_GROUP = "vllm"
VLLM_PATHS = ("vllm_engine/", "hostile/test_vllm.py")
# tests/embedded: one group, so one worker alone starts its conftest's servers (`engines`: one per model)
EMBEDDED_GROUP = "embedded"
EMBEDDED_PATHS = ("embedded/",)

# The longest groups, longest first (seconds in one worker on a 2-core host, the whole suite in two): an xdist
# worker takes the next group when it is almost done, so these go first and the short ones fill in at the end. A
# group left out only costs time: it runs in collection order after these.
SLOWEST_FIRST = (
    VLLM_GROUP,  # 400
    "test_faults.py",  # 350
    "test_hard_kills.py",  # 170
    EMBEDDED_GROUP,  # 100
    "test_two_nodes.py",  # 100
    "test_soak.py",  # 90
    "test_cli_signals.py",  # 80
    "test_megatron_forward.py",  # 75
    "test_e2e.py",  # 60
    "hostile/test_embedded.py",  # 40
)


def group_of(path: str) -> str:
    """The xdist group of a test by its file's path relative to tests/: `VLLM_GROUP`, `EMBEDDED_GROUP` or the
    path itself."""
    if path.startswith(VLLM_PATHS):
        return VLLM_GROUP
    if path.startswith(EMBEDDED_PATHS):
        return EMBEDDED_GROUP
    return path


def _group(item: pytest.Item) -> str | None:
    return group_of(str(item.path.relative_to(TESTS))) if TESTS in item.path.parents else None


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: nothing without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """With `--dist loadgroup`: xdist's scope scheduling with `group_of` as the scope (a group runs in one worker
    from start to end). xdist's own loadgroup reads `xdist_group` marks into node ids, which pytest 9 no longer
    lets a plugin change, so it would send every test alone."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    prefix = f"{TESTS.relative_to(config.rootpath)}/"

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return group_of(path.removeprefix(prefix)) if path.startswith(prefix) else path

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In an xdist worker, put the `SLOWEST_FIRST` groups first (the scheduler takes the groups in the order of
    the workers' collection, `--no-loadscope-reorder`); a run without xdist keeps pytest's order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {group: i for i, group in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(_group(item) or "", len(rank)))


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

    from harness.driver_ray import ensure_ray
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


@pytest.fixture(autouse=True)
def _server_temp_root_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test that removed the folder where this session's engine servers keep their temp folders and exit
    statuses (`harness.driver_ray.server_temp_root`), e.g. by closing a `MatrixRun` in this process: every later
    stop of a live server of the session's runner then waited 16 s for a status that was never written (the
    runner's teardown took 50 s)."""
    driver_ray = sys.modules.get("harness.driver_ray")  # not imported: no server of this process made the folder
    root = getattr(driver_ray, "_server_temp_root", None)
    kept = root is not None and root.exists()
    yield
    if kept and not root.exists():
        pytest.fail(f"{request.node.nodeid} removed {root}, this session's engine servers' temp root", pytrace=False)


@pytest.fixture(scope="session")
def fault_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder the session's xdist workers share (the parent of each worker's base temp folder; without xdist,
    the session's own), where `fault_runs.run_once` keeps the fault scenarios' records."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "fault-records"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def shared_vllm() -> Iterator[object]:
    """vLLM servers shared by the test modules that start their own, restarted in place as fresh engines for
    each module (`tests/shared_vllm.py`); every one is stopped at the session's end."""
    from shared_vllm import SharedVllm

    shared = SharedVllm()
    _SHARED_VLLM.append(shared)
    yield shared
    _SHARED_VLLM.clear()
    shared.close()


_SHARED_VLLM: list[SharedVllm] = []  # the session's `shared_vllm`, once a test asked for it


@pytest.hookimpl(trylast=True)  # after pytest's own teardown, in which a module gives its server back
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """In an xdist worker, once the `VLLM_GROUP` ends (its tests run one after another there), stop the idle
    shared vLLM servers: about 2.2 GB each, which the rest of the worker's tests do not use. A run without xdist
    keeps them to the session's end (its vLLM tests are not contiguous)."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not _SHARED_VLLM:
        return
    if _group(item) == VLLM_GROUP and (nextitem is None or _group(nextitem) != VLLM_GROUP):
        _SHARED_VLLM[0].close()

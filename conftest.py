"""Scenarios as pytest tests: `pytest scenarios --matrix cpu -k "qwen3-vl and tp2"`.

`scenarios/test_matrix.py` has one test, `test_scenario`, parametrised here with every scenario of
the matrix named by `--matrix` (a name under scenarios/ or a YAML path; `--scenario-filter` takes a
`python -m harness` filter expression first); each test's id is the scenario id
(`test_scenario[qwen3/tp1-pp1/noncolocate/raw]`), its tags are keywords too (`-k "not full-size"`).
All selected scenarios share one run (`harness.matrix_run.MatrixRun`: Ray and the trainer pools, started
on the first scenario that validates), which writes the same `results/<run-id>/` as `python -m harness
run` (records, summary, plots, env.json); scenarios run grouped by trainer world size, as there. A test
fails with the first failing check's message when the verdict is not the expected one. Every process
the run started is stopped at the end of the session, Ctrl-C and SIGTERM included. With `--baseline
DIR` the regression report (`harness.report`) is written at the end and a regression makes the
session fail.

Only tests that take the `matrix_scenario` argument are touched: `pytest tests` collects and runs as it
always did (nothing here imports the harness until a scenario test is collected).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent
SCENARIO_ARG = "matrix_scenario"
MATRIX_ORDER = pytest.StashKey[list[str]]()
REPORT_STATUS = pytest.StashKey[int]()
RUN_FOLDER = pytest.StashKey[Path]()
RUN_ID = pytest.StashKey[str]()  # the run id the run writes under, once checked (`harness.run_args.results_folder`)


def pytest_addoption(parser: pytest.Parser) -> None:
    """The scenario options (harmless to `pytest tests`, which never reads them)."""
    group = parser.getgroup("scenarios", "scenario matrix (pytest scenarios --matrix NAME)")
    group.addoption("--matrix", default="cpu", help="matrix name under scenarios/ (cpu) or a YAML path")
    group.addoption(
        "--scenario-filter",
        default=None,
        help="a `python -m harness` filter applied before -k: key=value, tag:NAME, !tag:NAME, or an id regex",
    )
    group.addoption("--results-dir", default=str(ROOT / "results"), help="where the run's folder goes (results/)")
    group.addoption("--run-id", default=None, help="the run's folder name under --results-dir (default: a timestamp)")
    group.addoption("--baseline", default=None, help="a results folder to compare with at the end (report.md)")
    group.addoption("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One parameter per scenario of `--matrix` (after `--scenario-filter`), id = scenario id."""
    if SCENARIO_ARG not in metafunc.fixturenames:
        return
    from harness.run_args import ray_address_problem, results_folder
    from harness.scenario import load_matrix, select

    config = metafunc.config
    address = config.getoption("--ray-address")
    try:
        try:
            matrix = load_matrix(config.getoption("--matrix"))
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"--matrix: {e}") from None
        scenarios = select(matrix, config.getoption("--scenario-filter"))
        # as `python -m harness run` checks them, before anything starts: nothing recorded is overwritten
        config.stash[RUN_ID] = results_folder(Path(config.getoption("--results-dir")), config.getoption("--run-id"))
        problem = ray_address_problem(address) if address else None
        if config.getoption("--baseline"):  # read now, not after every scenario ran
            from harness.report import load_baseline

            load_baseline(Path(config.getoption("--baseline")))
    except (FileNotFoundError, ValueError) as e:
        problem = str(e)
    if problem:  # a collection error that says only this
        pytest.fail(problem, pytrace=False)
    config.stash[MATRIX_ORDER] = [sc.id for sc in matrix]
    metafunc.parametrize(SCENARIO_ARG, scenarios, ids=[sc.id for sc in scenarios])


def _scenario(item: pytest.Item) -> Any:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(SCENARIO_ARG) if callspec is not None else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scenario tests: tags as keywords; run grouped by trainer world size (`order_for_reuse`), each
    group where its first scenario was, so a pool of rank processes is made once per size."""
    positions = [i for i, item in enumerate(items) if _scenario(item) is not None]
    if not positions:
        return
    from harness.placement import order_for_reuse

    scenario_items = [items[i] for i in positions]
    for item in scenario_items:
        item.extra_keyword_matches.update(_scenario(item).tags)
    by_id = {_scenario(item).id: item for item in scenario_items}
    ordered = [by_id[sc.id] for sc in order_for_reuse([_scenario(item) for item in scenario_items])]
    for i, item in zip(positions, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="session")
def matrix_run(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The session's `harness.matrix_run.MatrixRun` over the selected scenarios (in matrix order); closed
    (every process it started stopped, env.json's end written) when the session ends, then compared
    with `--baseline` when given."""
    from harness.matrix_run import MatrixRun

    config = request.config
    rank = {sid: i for i, sid in enumerate(config.stash.get(MATRIX_ORDER, []))}
    selected = [sc for sc in map(_scenario, request.session.items) if sc is not None]
    selected.sort(key=lambda sc: rank.get(sc.id, len(rank)))
    run = MatrixRun(
        selected,
        Path(config.getoption("--results-dir")),
        config.stash.get(RUN_ID, None) or config.getoption("--run-id"),
        config.getoption("--ray-address"),
    )
    config.stash[RUN_FOLDER] = run.out
    from harness.interrupts import on_signal

    # SIGTERM ends the session like Ctrl-C, so the run's processes are stopped on the way out; one whose
    # KeyboardInterrupt Python dropped is raised again at the scenario's next wait (`harness.interrupts`)
    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        yield run
    finally:
        try:
            run.close()
        finally:
            signal.signal(signal.SIGTERM, previous)
        baseline = config.getoption("--baseline")
        if baseline:
            config.stash[REPORT_STATUS], _ = run.report(Path(baseline))


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> Any:
    """After the session's fixtures are torn down: a regression found by the report fails the session."""
    result = yield
    if session.config.stash.get(REPORT_STATUS, 0) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    return result


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Where the scenario run's folder is, and the report's outcome when there was one."""
    out = config.stash.get(RUN_FOLDER, None)
    if out is None:
        return
    terminalreporter.write_line(f"scenario results: {out} (summary.md, records/, plots/, env.json)")
    if REPORT_STATUS in config.stash:
        status = "regressions found" if config.stash[REPORT_STATUS] else "no regression"
        terminalreporter.write_line(f"regression report: {out / 'report.md'} ({status})")

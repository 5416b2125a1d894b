"""Each scenario of a matrix as one pytest test: `pytest scenarios --matrix cpu -k "qwen3 and tp1-pp1"`.

The parameters, the shared run and the options (`--matrix`, `--scenario-filter`, `--run-id`,
`--results-dir`, `--baseline`, `--ray-address`) come from the repository's conftest.py.
"""

from __future__ import annotations

import pytest

from harness.matrix_run import MatrixRun, failure_message
from harness.scenario import Scenario


def test_scenario(matrix_scenario: Scenario, matrix_run: MatrixRun) -> None:
    """The scenario runs and its verdict is the expected one (else: the first failing check's message)."""
    record = matrix_run.run(matrix_scenario)
    group = matrix_run.finished_groups.get(matrix_scenario.group_key, []) if matrix_scenario.group_key else []
    message = failure_message(record, group)
    if message:
        pytest.fail(message, pytrace=False)

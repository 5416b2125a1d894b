"""The command line of a harness run in a process of its own, as a user types it (`python -m harness run`)."""

from __future__ import annotations

import sys
from pathlib import Path


def harness_run(matrix: str | Path, results_dir: Path, *extra: str) -> list[str]:
    """argv of `python -m harness run --matrix MATRIX --results-dir RESULTS_DIR EXTRA...` with this interpreter;
    `matrix` is a matrix name under scenarios/ or a YAML path."""
    return [sys.executable, "-m", "harness", "run", "--matrix", str(matrix), "--results-dir", str(results_dir), *extra]

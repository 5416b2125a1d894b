"""The command line of a harness run in a process of its own, as a user types it (`python -m harness run`), and
the signal disposition it starts with."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path


def harness_run(matrix: str | Path, results_dir: Path, *extra: str) -> list[str]:
    """argv of `python -m harness run --matrix MATRIX --results-dir RESULTS_DIR EXTRA...` with this interpreter;
    `matrix` is a matrix name under scenarios/ or a YAML path."""
    return [sys.executable, "-m", "harness", "run", "--matrix", str(matrix), "--results-dir", str(results_dir), *extra]


@contextlib.contextmanager
def sigint_not_ignored() -> Iterator[None]:
    """Start a harness inside this block so that SIGINT reaches it as Ctrl-C does from a terminal. A shell
    starts its background jobs with SIGINT ignored (as some CI runners start their steps), an ignored signal
    stays ignored across exec, and Python then never installs its KeyboardInterrupt handler: a harness
    started from such a pytest ignores the SIGINT a test sends it and runs to its end. Inside the block this
    process handles SIGINT (as pytest does in a terminal), so a child starts with the default disposition."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous == signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

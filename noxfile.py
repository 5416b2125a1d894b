"""Sessions: `tests` (pytest, CI) and `cpu_matrix` (the CPU scenario matrix).

Both run on Python 3.12 (megatron-core 0.19.2 and Megatron-Bridge 0.6.2 require it). Where Python 3.12
is installed through pyenv but not active, it is found under `$(pyenv root)/versions/3.12.*`.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import nox

PYTHON = "3.12"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]


def _runs(exe: str | None) -> bool:
    # A pyenv shim is on PATH even when that version is not active; it then fails when run.
    return bool(exe) and subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0


def _make_python312_findable() -> None:
    if _runs(shutil.which(f"python{PYTHON}")):
        return
    roots = [os.environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv")]
    if shutil.which("pyenv"):
        roots.insert(0, subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip())
    for root in filter(None, roots):
        for bindir in sorted(glob.glob(f"{root}/versions/{PYTHON}*/bin"), reverse=True):
            if os.path.exists(f"{bindir}/python{PYTHON}"):
                os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
                return


_make_python312_findable()


def _install(session: nox.Session) -> None:
    session.install("-r", "requirements/trainer.txt")
    # Megatron-Bridge's declared dependencies do not install on CPU hosts (fast-hadamard-transform,
    # flashinfer, ...): install it alone; what it needs is pinned in requirements/trainer.txt.
    session.install("--no-deps", "-r", "requirements/trainer-nodeps.txt")
    session.install("--no-deps", "-e", ".")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Lint, then the test suite (unit, integration, one end-to-end scenario per mode)."""
    _install(session)
    session.run("ruff", "check", ".")
    session.run("pytest", *(session.posargs or ["-q", "tests"]))


@nox.session(python=PYTHON)
def cpu_matrix(session: nox.Session) -> None:
    """The CPU scenario matrix (`scenarios/cpu.yaml`); extra args go to `python -m harness run`."""
    _install(session)
    session.run("python", "-m", "harness", "run", "--matrix", "cpu", *session.posargs)

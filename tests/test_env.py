"""env.json names the run (commit, command line, start, end, wall time) and carries the host calibration."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

import pytest

from harness.calibrate import calibrate, gloo_broadcast_gbps, memcpy_gbps
from harness.env import REPO_ROOT, command_line, finish_env, git_state, write_env


def test_env_names_the_run_and_its_end(tmp_path: Path) -> None:
    argv = [str(REPO_ROOT / "harness" / "__main__.py"), "run", "--filter", "tag:full-size tp=2"]
    env = write_env(tmp_path, argv=argv)
    assert env["command"] == "python -m harness run --filter 'tag:full-size tp=2'"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert env["git"]["commit"] == head.stdout.strip() and isinstance(env["git"]["dirty"], bool)
    started = datetime.datetime.fromisoformat(env["started_at"])
    assert started.tzinfo is not None and "ended_at" not in env and "calibration" not in env

    ended = finish_env(tmp_path)
    saved = json.loads((tmp_path / "env.json").read_text())
    assert saved == ended and saved["started_at"] == env["started_at"]
    wall = (datetime.datetime.fromisoformat(saved["ended_at"]) - started).total_seconds()
    assert 0 <= saved["wall_s"] <= wall + 1


def test_finish_env_without_a_start_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        finish_env(tmp_path)


def test_git_state_outside_a_checkout(tmp_path: Path) -> None:
    assert git_state(tmp_path) == {"commit": None, "dirty": None}


def test_git_state_sees_an_untracked_file(tmp_path: Path) -> None:
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, capture_output=True, text=True, check=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "a.txt").write_text("a")
    run("add", "a.txt")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    sha = run("rev-parse", "HEAD").stdout.strip()
    assert git_state(tmp_path) == {"commit": sha, "dirty": False}
    (tmp_path / "b.py").write_text("b")
    assert git_state(tmp_path) == {"commit": sha, "dirty": True}


def test_command_line_of_a_script() -> None:
    assert (
        command_line(["/venv/bin/pytest", "scenarios", "-k", "qwen3 and tp1"]) == "pytest scenarios -k 'qwen3 and tp1'"
    )


def test_calibration_measures_both_paths() -> None:
    assert memcpy_gbps(1 << 20, 2) > 0
    assert gloo_broadcast_gbps(1 << 20, 2) > 0  # rank 1 checks it received rank 0's bytes
    cal = calibrate(1 << 22, 3)
    assert cal["bytes"] == 1 << 22 and cal["repeats"] == 3 and "error" not in cal
    assert cal["memcpy_gbps"] > 0 and cal["gloo_broadcast_gbps"] > 0 and 0 < cal["seconds"] < 30


def test_calibrated_env(tmp_path: Path) -> None:
    env = write_env(tmp_path, calibrate=True)
    cal = json.loads((tmp_path / "env.json").read_text())["calibration"]
    assert cal == env["calibration"] and cal["memcpy_gbps"] > 0 and cal["gloo_broadcast_gbps"] > 0
    assert cal["seconds"] < 10  # a few seconds at most at the start of every run

"""The embedded engine's in-place restart (`POST /wsh/restart`): what the runner reuses an engine process with.

The oracle is a fresh engine process started with the same checkpoint and seed: after a restart, an engine
that held another model, another seed's weights, a committed weight version, a paused flag and a filled
prefix cache must answer exactly as that fresh process does (checksums, shards, version, pause state,
log-probs of a prompt it served before), also when the old engine had a fault hook (the restart undoes
it). A restart can apply a hook, as a start with `--fault` does. Restarts are refused while an update
session is open, for a body that names no checkpoint or a hook that does not load, and when a hook's change
outlives its undo.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reference_impl.engine.embedded.launcher import EngineProcess, EngineStartError
from reference_impl.fork_client import ForkServerAddress
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model

CKPT_SEED = 1234
ENGINE_SEED = 4321
PROMPT = [3, 17, 42, 5, 99, 7]


def _post(url: str, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(url + route, json=body if body is not None else {}, timeout=120)


def _state(url: str) -> dict[str, Any]:
    """What a fresh engine and a restarted one must agree on, read through the engine's own routes."""
    completion = _post(
        url,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "logprobs": 0},
    )
    assert completion.status_code == 200, completion.text
    choice = completion.json()["choices"][0]
    return {
        "checksums": _post(url, "/weight_checker", {"action": "checksum"}).json()["checksums"],
        "shards": _post(url, "/weight_checker", {"action": "shards"}).json()["shards"],
        "weight_version": httpx.get(url + "/weight_info").json()["weight_version"],
        "is_paused": httpx.get(url + "/is_paused").json()["is_paused"],
        "prompt_logprobs": choice["prompt_logprobs"],
        "logprobs": choice["logprobs"],
    }


@contextlib.contextmanager
def _running(
    checkpoint: Path, seed: int, log: Path, fault: str | None = None, fork_server: ForkServerAddress | None = None
) -> Iterator[EngineProcess]:
    """An embedded engine process of `checkpoint` (dummy weights of `seed`, fault hook `fault`), forked from
    `fork_server` when given, else a new interpreter; started, and stopped by pid at the end of the block."""
    with EngineProcess(str(checkpoint), seed, str(log), fault=fault, fork_server=fork_server) as proc:
        proc.start(timeout_s=300)
        yield proc


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, Path]:
    return {m: make_checkpoint(load_model(m), CKPT_SEED, "float32") for m in ("qwen3", "qwen3-moe")}


@pytest.fixture(scope="module")
def fresh(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The oracle: a fresh engine process of qwen3 with the engine seed, its state read once; a new interpreter,
    while the engines it judges are forked from the session's fork server."""
    with _running(checkpoints["qwen3"], ENGINE_SEED, tmp_path_factory.mktemp("fresh") / "engine.log") as proc:
        yield _state(proc.url)


@pytest.fixture
def other(checkpoints: dict[str, Path], tmp_path: Path, fork_server: ForkServerAddress) -> Iterator[EngineProcess]:
    """An engine process of another model and seed."""
    with _running(checkpoints["qwen3-moe"], 7, tmp_path / "first.log", fork_server=fork_server) as proc:
        yield proc


@pytest.fixture(scope="module")
def refusing(
    checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServerAddress
) -> Iterator[EngineProcess]:
    """One engine process of another model and seed for every unreadable restart body: a 400 leaves the
    engine serving as it was (each case asserts it), so the cases need no process of their own."""
    log = tmp_path_factory.mktemp("refusing") / "engine.log"
    with _running(checkpoints["qwen3-moe"], 7, log, fork_server=fork_server) as proc:
        yield proc


def test_restarted_engine_answers_as_a_fresh_one(
    fresh: dict[str, Any], other: EngineProcess, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    url, pid = other.url, other.pid()
    # Leave state behind: a committed version, zeroed weights, a paused engine, a served prompt in its caches.
    assert _post(url, "/start_weight_update").status_code == 200
    assert _post(url, "/finish_weight_update", {"weight_version": 7}).json()["weight_version"] == 7
    assert _post(url, "/weight_checker", {"action": "reset"}).status_code == 200
    assert _post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "logprobs": 0}).status_code == 200
    assert _post(url, "/pause").status_code == 200

    log = tmp_path / "second.log"
    assert other.restart(str(checkpoints["qwen3"]), ENGINE_SEED, str(log)) == url
    assert other.pid() == pid  # the same process
    assert _state(url) == fresh
    assert "restarted in place" in log.read_text()
    assert other.log_path == log  # log tails of later failures come from the new log


def test_restart_is_refused_inside_an_update_session(other: EngineProcess, checkpoints: dict[str, Path]) -> None:
    before = _post(other.url, "/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert _post(other.url, "/start_weight_update").status_code == 200
    with pytest.raises(EngineStartError, match=r"409.*an update session is open"):
        other.restart(str(checkpoints["qwen3"]), ENGINE_SEED, str(other.log_path))
    # Nothing changed: the session is still open, the weights are the first model's.
    assert _post(other.url, "/finish_weight_update", {"weight_version": 1}).status_code == 200
    assert _post(other.url, "/weight_checker", {"action": "checksum"}).json()["checksums"] == before


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"seed": 1}, "checkpoint must name a checkpoint folder"),
        ({"checkpoint": "/nonexistent", "seed": 1}, "checkpoint must name a checkpoint folder"),
        ({"checkpoint": "CKPT", "seed": "1"}, "seed must be an integer"),
        ({"checkpoint": "CKPT", "seed": 1, "tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
        ({"checkpoint": "CKPT", "seed": 1, "threads": 2}, "unknown field(s) ['threads']"),
        ({"checkpoint": "CKPT", "seed": 1, "fault": 3}, "fault must be a MODULE:FUNCTION string"),
        ({"checkpoint": "CKPT", "seed": 1, "fault": "harness.faults.engine"}, "is not MODULE:FUNCTION"),
        ({"checkpoint": "CKPT", "seed": 1, "fault": "harness.faults.engine:nothing"}, "has no function 'nothing'"),
    ],
)
def test_a_body_it_cannot_read_is_a_400_naming_the_field(
    refusing: EngineProcess, checkpoints: dict[str, Path], body: dict[str, Any], says: str
) -> None:
    body = {k: (str(checkpoints["qwen3"]) if v == "CKPT" else v) for k, v in body.items()}
    before = _post(refusing.url, "/weight_checker", {"action": "checksum"}).json()["checksums"]
    resp = _post(refusing.url, "/wsh/restart", body)
    assert resp.status_code == 400, resp.text
    assert says in resp.json()["detail"]["error"]
    assert httpx.get(refusing.url + "/health").status_code == 200
    # still the first model's weights: nothing of the refused restart was applied
    assert _post(refusing.url, "/weight_checker", {"action": "checksum"}).json()["checksums"] == before


# A hook that changes an engine seam without `seams.replace`: `restore_all` cannot undo it.
LASTING_HOOK = """
from reference_impl.engine.embedded import server


def commit_nothing() -> None:
    \"\"\"/finish_weight_update never commits the version (set on the class, not through seams.replace).\"\"\"
    server.EngineState.commit_version = lambda self, version: None
"""


def _commits(url: str, version: int) -> Any:
    """The weight version the engine reports after a whole (empty) update session that finishes `version`."""
    assert _post(url, "/start_weight_update").status_code == 200
    assert _post(url, "/finish_weight_update", {"weight_version": version}).status_code == 200
    return httpx.get(url + "/weight_info").json()["weight_version"]


def test_a_restart_undoes_the_hook_the_engine_started_with(
    fresh: dict[str, Any], checkpoints: dict[str, Path], tmp_path: Path, fork_server: ForkServerAddress
) -> None:
    hook = "harness.faults.engine:weight_version_not_committed"
    with _running(checkpoints["qwen3"], ENGINE_SEED, tmp_path / "e.log", hook, fork_server) as proc:
        url = proc.url
        assert _commits(url, 1) == "0"  # the hook runs
        log = tmp_path / "e2.log"
        proc.restart(str(checkpoints["qwen3"]), ENGINE_SEED, str(log))
        assert _state(url) == fresh
        assert _commits(url, 1) == "1"
        assert f"fault hook {hook} undone" in log.read_text()


def test_a_hook_that_outlives_its_undo_keeps_the_engine_from_restarting(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fork_server: ForkServerAddress
) -> None:
    (tmp_path / "lasting_hook.py").write_text(LASTING_HOOK)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    hook = "lasting_hook:commit_nothing"  # found through PYTHONPATH, also by a forked server
    with _running(checkpoints["qwen3"], ENGINE_SEED, tmp_path / "e.log", hook, fork_server) as proc:
        url = proc.url
        assert _commits(url, 1) == "0"  # the hook runs
        for _ in range(2):  # and again: the process stays refused
            with pytest.raises(EngineStartError, match=r"409.*is not undone: engine_commit_version still run its code"):
                proc.restart(str(checkpoints["qwen3"]), ENGINE_SEED, str(tmp_path / "e2.log"))
        # the old app, partly undone, serves nothing more
        resp = _post(url, "/start_weight_update")
        assert resp.status_code == 503 and "is not undone" in resp.text, resp.text


def test_a_restart_applies_a_fault_hook_as_a_start_does(other: EngineProcess, checkpoints: dict[str, Path]) -> None:
    """`weight_version_not_committed` at a restart: the engine then reports version 0 after finishing version 1,
    as `tests/test_faults.py` shows for an engine started with the hook, and says so in its log."""
    hook = "harness.faults.engine:weight_version_not_committed"
    pid = other.pid()
    log = Path(str(other.log_path) + ".faulted")
    assert other.restart(str(checkpoints["qwen3"]), ENGINE_SEED, str(log), fault=hook) == other.url
    assert other.pid() == pid
    assert _commits(other.url, 1) == "0"
    assert f"FAULT ACTIVE: {hook}" in log.read_text()

"""The engine servers of the embedded engine's tests, started once per session: `engines` (one per model
entry, over gloo) and `shm_engines` (three qwen3 servers over shared-memory handles: no fault and each
engine fault)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.fork_client import ForkServerAddress
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.handles import SharedMemoryBuffer

from .engines import (
    CKPT_SEED,
    CLEAN,
    ENGINE_SEED,
    FINALIZE_PER_CHUNK,
    MODELS,
    OK_WITHOUT_TRANSFER,
    Engine,
    link,
    post,
    start_engine,
    wait_port,
)


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    """One engine per model entry of MODELS (keyed by entry name), started in parallel, linked, and
    stopped by pid at the end."""
    tmp = tmp_path_factory.mktemp("engines")
    started = {model: start_engine(model, tmp) for model in MODELS}
    out: dict[str, Engine] = {}
    try:
        for model, (proc, ckpt, port_file) in started.items():
            port = wait_port(proc, port_file, tmp / f"{model}.log")
            out[model] = Engine(load_model(model).model_type, ckpt, proc, f"http://127.0.0.1:{port}")
        for eng in out.values():
            link(eng)
        yield out
    finally:
        for proc, _, _ in started.values():
            if proc.poll() is None:
                os.kill(proc.pid, 15)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, 9)
                    proc.wait()


@pytest.fixture(scope="session")
def shm_engines(
    tmp_path_factory: pytest.TempPathFactory, fork_server: ForkServerAddress
) -> Iterator[dict[str, EngineProcess]]:
    """Three qwen3 engines started through EngineProcess (no fault, and each fault), in parallel, forked from the
    session's fork server, all initialised with backend shm; stopped by pid at the end. (`engines` starts its
    servers as new interpreters, with `python -m`.)"""
    tmp = tmp_path_factory.mktemp("shm-engines")
    ckpt = str(make_checkpoint(load_model("qwen3"), seed=CKPT_SEED))
    procs = {
        name: EngineProcess(ckpt, ENGINE_SEED, log_path=str(tmp / f"{name}.log"), fault=fault, fork_server=fork_server)
        for name, fault in ((CLEAN, None), (FINALIZE_PER_CHUNK, FINALIZE_PER_CHUNK), (OK_WITHOUT_TRANSFER,) * 2)
    }
    try:
        with ThreadPoolExecutor(len(procs)) as ex:
            list(ex.map(lambda p: p.start(timeout_s=120), procs.values()))
        for proc in procs.values():
            r = post(proc.url, "/init_weight_transfer_engine", {"init_info": {"backend": "shm"}})
            assert r.status_code == 200, r.text
            assert r.json() == {"ok": True, "backend": "shm"}
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture
def shm_buffer() -> Iterator[SharedMemoryBuffer]:
    with SharedMemoryBuffer(1) as buf:
        yield buf

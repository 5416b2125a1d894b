"""vLLM servers a test starts on its own: one that cannot start (EngineStartError naming why, its temp
folder removed) and one with two TP workers and a bearer token (every route refused without it, both
workers take every chunk, the right log-probs after, vLLM's temp files in the server's own folder, nothing it
made in /dev/shm left once stopped)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import httpx
import psutil
import pytest
from vllm_env import require_vllm as _require_vllm

from reference_impl.engine import engine_kind
from reference_impl.engine.process import EngineStartError
from reference_impl.engine.vllm.launcher import VllmEngineProcess
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient
from reference_impl.transport.vllm_packed import connect_packed_gloo

from .engines import ENGINE_SEED, PACKED_BUFFER, SEED, Connected, full, measure_logprobs, verdict_of

SHM = Path("/dev/shm")


def test_vllm_that_cannot_start_is_a_start_error_naming_why(tmp_path: Path) -> None:
    """A vLLM server that exits at start (here: an argument it does not know) ends `start()` with
    EngineStartError carrying the log's tail, which the runner records as the scenario's CRASH."""
    _require_vllm()
    ckpt = make_checkpoint(load_model("qwen3"), SEED)
    servers_before = set(Path(tempfile.gettempdir()).glob("wsh-server-*"))
    proc = VllmEngineProcess(str(ckpt), ENGINE_SEED, str(tmp_path / "vllm.log"), extra_args=["--no-such-flag"])
    try:
        with pytest.raises(EngineStartError) as err:
            proc.start(timeout_s=300)
    finally:
        proc.stop()
    assert "vLLM exited with" in str(err.value) and "--no-such-flag" in str(err.value)
    assert proc.proc is not None and proc.proc.returncode not in (0, None)
    # the stop a failed start makes removes the server's temp folder too
    assert set(Path(tempfile.gettempdir()).glob("wsh-server-*")) <= servers_before


def test_vllm_with_two_tp_workers_takes_every_chunk_and_asks_for_the_token(tmp_path: Path) -> None:
    """vLLM with `--tensor-parallel-size 2` on CPU (each worker its own CPU group) and the run's bearer token:
    every route without the token is a 401 (the in-place restart's too, which a TP 2 server refuses with a 409);
    both workers join the transfer group (ranks 1 and 2 of 3) and take
    every chunk of a sync in many chunks; its log-probs then equal a transformers forward over the checkpoint."""
    _require_vllm()
    token = "token-of-this-test"
    ckpt = make_checkpoint(load_model("qwen3"), SEED)
    log = tmp_path / "vllm-tp2.log"
    proc = VllmEngineProcess(str(ckpt), ENGINE_SEED, str(log), tp=2, token=token)
    url = proc.start(engine_kind("vllm").start_timeout_s)
    try:
        for method, route in (
            ("GET", "/health"),
            ("POST", "/update_weights"),
            ("POST", "/v1/completions"),
            ("POST", "/init_weight_transfer_engine"),
            ("GET", "/weight_info"),
            ("POST", "/wsh/restart"),  # the restart's middleware runs inside the token check
        ):
            assert httpx.request(method, url + route, json={}, timeout=30).status_code == 401, route
        # with the token: refused, its workers being processes of their own (wsh_vllm_plugin/restart.py)
        body = {"checkpoint": str(ckpt), "seed": 1, "tensor_parallel_size": 2, "log_path": None, "fault": None}
        r = httpx.post(url + "/wsh/restart", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 409 and "process of its own" in r.text, r.text
        client = EngineClient(
            url,
            timeout_s=300,
            session_ends_on_error=True,
            parse_rejections=engine_kind("vllm").parse_rejections,
            token=token,
        )
        channel = connect_packed_gloo(client, engine_ranks=[2], buffer_size_bytes=PACKED_BUFFER)
        conn = Connected("vllm", proc, client, channel, ckpt)
        rec = conn.sync(full(ckpt), 0, chunk_bytes=20_000)
        measure_logprobs(conn, rec)
        verdict, message = verdict_of(rec)
        assert verdict == "PASS", message
        assert rec.syncs[0].chunks_planned > 10 and rec.syncs[0].logprobs["max_abs"] < 1e-4
        joined = re.findall(r"gloo weight transfer: joined \S+ as rank (\d+) of (\d+)", log.read_text())
        assert sorted(joined) == [("1", "3"), ("2", "3")], joined
        conn.channel.close()
        client.close()
        # vLLM's temp files (torch's `vllm_dist_*` init file, its ZMQ sockets) lie in the server's own TMPDIR,
        # which stop removes; before, each vLLM start left them in /tmp
        assert proc.proc is not None
        temp = Path(psutil.Process(proc.proc.pid).environ()["TMPDIR"])
        assert any(temp.glob("vllm_dist_*")), sorted(p.name for p in temp.iterdir())
        # what vLLM made in /dev/shm while it started: its workers' CPU communicator segments (and its message
        # queue); killed by a signal, its processes never unlinked them, and each start left them behind
        made = set(proc.started_segments)
        assert any(name.endswith("-cpushm_0") for name in made), sorted(made)
        assert all((SHM / name).exists() for name in made)
    finally:
        proc.stop()
    assert not temp.exists()
    assert [name for name in made if (SHM / name).exists()] == []

"""vLLM's in-place restart (`wsh_vllm_plugin/restart.py`, `VllmEngineProcess.restart`) on one real server:
what was synced before is gone afterwards, the weights depend on the restart's seed and on nothing before
it, a new transfer group forms and carries the next sync, the output goes to the new log, and what it
cannot do is refused before anything changes.

The oracles: a transformers forward over the checkpoint (the sync landed), and the dummy range itself:
weights uniform in [-1e-3, 1e-3) give logits within about 1e-3 of zero, so every prompt log-prob is
within 1e-3 of -ln(vocab size), which the trainer's weights are nowhere near. What else a fresh server is
comes from vLLM itself: its prefix-cache counters (`/metrics`) and its initial weight version."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from shared_vllm import SharedVllm
from vllm_env import require_vllm
from wsh_vllm_plugin.restart import checkpoint_tensors, dummy_weights

from harness.checks import judge
from reference_impl.engine import engine_kind
from reference_impl.engine.process import EngineStartError
from reference_impl.engine.vllm.launcher import VllmEngineProcess, worker_in_engine_core
from reference_impl.forward.prompts import probe_prompt
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient
from reference_impl.transport.vllm_packed import connect_packed_gloo

from .engines import ENGINE_SEED, PACKED_BUFFER, SEED, Connected, full, measure_logprobs

PROMPT = [3, 17, 42, 99, 7, 250, 11, 5]
FRESH_WEIGHT_VERSION = "default"  # a new engine core's (vllm/v1/engine/core.py, EngineCore.__init__)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, shared_vllm: SharedVllm
) -> Iterator[tuple[VllmEngineProcess, Path]]:
    """One vLLM server on the tiny Qwen3 checkpoint, as the runner starts it (one of the session's shared
    servers, fresh: a new start, or one restarted in place), given back at the end; the logs folder beside
    it. Its token check in front of the restart is `test_servers.py`'s."""
    require_vllm()
    logs = tmp_path_factory.mktemp("vllm-restart")
    proc = shared_vllm.take(make_checkpoint(load_model("qwen3"), SEED), ENGINE_SEED, logs / "start.log")
    try:
        yield proc, logs
    finally:
        shared_vllm.give_back(proc)


def _client(url: str) -> EngineClient:
    caps = engine_kind("vllm").capabilities
    return EngineClient(
        url,
        timeout_s=300,
        session_ends_on_error=caps.session_ends_on_error,
        parse_rejections=engine_kind("vllm").parse_rejections,
    )


def _synced(proc: VllmEngineProcess, index: int) -> list[float]:
    """Join a new transfer group, sync the whole checkpoint as sync `index`, and assert it landed (PASS
    against a transformers forward over the checkpoint); returns the prompt's log-probs afterwards."""
    client = _client(proc.url)
    channel = connect_packed_gloo(client, buffer_size_bytes=PACKED_BUFFER)
    try:
        conn = Connected("vllm", proc, client, channel, Path(proc.checkpoint))
        rec = conn.sync(full(conn.checkpoint), index)
        measure_logprobs(conn, rec)
        assert judge(rec)[0] == "PASS", [r for r in judge(rec)[1] if r.failed]
        return client.prompt_logprobs(PROMPT, 1.0)
    finally:
        channel.close()
        client.close()


def _logprobs(proc: VllmEngineProcess) -> list[float]:
    client = _client(proc.url)
    try:
        return client.prompt_logprobs(PROMPT, 1.0)
    finally:
        client.close()


def _prefix_cache_counters(url: str) -> tuple[float, float]:
    """vLLM's own prefix-cache counters from `GET /metrics` (Prometheus text): (tokens queried, tokens hit),
    summed over engines (vllm/v1/metrics/loggers.py, `vllm:prefix_cache_queries` / `_hits`)."""
    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]


def _probe_hits(proc: VllmEngineProcess, probe: list[int]) -> float:
    """Serve `probe` once (a generated token, no prompt log-probs: vLLM may serve the prompt from its prefix
    cache) and return how many of its tokens vLLM counted as prefix-cache hits, once its stats for the
    request are in (the queried count moved)."""
    queried, hits = _prefix_cache_counters(proc.url)
    client = _client(proc.url)
    try:
        client.generate(probe, 1.0)
    finally:
        client.close()
    deadline = time.monotonic() + 30
    while True:
        now_queried, now_hits = _prefix_cache_counters(proc.url)
        if now_queried > queried or time.monotonic() > deadline:
            assert now_queried > queried, "vLLM counted no prefix-cache query for the probe"
            return now_hits - hits
        time.sleep(0.1)


def _near_uniform(logprobs: list[float], ckpt: Path) -> float:
    """The largest distance of a prompt log-prob from -ln(vocab size)."""
    import json

    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    return max(abs(lp + math.log(vocab)) for lp in logprobs)


def test_checkpoint_tensors_are_the_checkpoints_names_and_shapes() -> None:
    """The restart's own header reader against safetensors' (names, shapes), and its dummy draw: the range,
    the engine's dtype, and a seed that decides every value."""
    ckpt = make_checkpoint(load_model("qwen3"), SEED)
    expected: dict[str, list[int]] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            expected |= {n: list(fh.get_slice(n).get_shape()) for n in fh.keys()}  # noqa: SIM118
    assert checkpoint_tensors(str(ckpt)) == sorted(expected.items())
    a = dict(dummy_weights(str(ckpt), 7, torch.bfloat16))
    b = dict(dummy_weights(str(ckpt), 7, torch.bfloat16))
    c = dict(dummy_weights(str(ckpt), 8, torch.bfloat16))
    assert {n: list(t.shape) for n, t in a.items()} == expected
    assert all(t.dtype == torch.bfloat16 and t.min() >= -1e-3 and t.max() < 1e-3 for t in a.values())
    assert all(torch.equal(a[n], b[n]) for n in a) and not any(torch.equal(a[n], c[n]) for n in a)


def test_only_a_server_with_its_worker_in_the_engine_core_restarts() -> None:
    """Which servers `launch` starts with the worker inside the engine core (the restart's condition), and a
    TP 2 server's restart refused before any request (it never started)."""
    assert worker_in_engine_core("gloo", 1, {})
    assert not worker_in_engine_core("gloo", 2, {})
    assert not worker_in_engine_core("nccl", 1, {})  # GPU: vLLM's own executor layout
    assert not worker_in_engine_core("gloo", 1, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert not worker_in_engine_core("gloo", 1, {"VLLM_CPU_OMP_THREADS_BIND": "0"})
    proc = VllmEngineProcess("/nonexistent", 1, tp=2)
    with pytest.raises(EngineStartError, match="cannot restart in place"):
        proc.restart("/nonexistent", 2, "/nonexistent/log")
    assert proc.proc is None


def test_a_restart_forgets_what_was_synced_and_takes_the_next_sync(
    server: tuple[VllmEngineProcess, Path],
) -> None:
    proc, logs = server
    ckpt = Path(proc.checkpoint)
    assert _near_uniform(_logprobs(proc), ckpt) < 1e-3  # fresh: vLLM's dummy weights, or a restart's
    synced = _synced(proc, 0)
    assert _near_uniform(synced, ckpt) > 0.1  # the checkpoint's weights are far from uniform
    probe = probe_prompt(json.loads((ckpt / "config.json").read_text()))
    _probe_hits(proc, probe)
    assert _probe_hits(proc, probe) > 0  # seen again: served from the prefix cache, under the synced weights

    other = make_checkpoint(load_model("qwen3"), SEED + 1)  # the same model, other weights
    url = proc.url
    assert proc.restart(str(other), 7, str(logs / "seed7.log")) == url
    seed7 = _logprobs(proc)
    assert _near_uniform(seed7, ckpt) < 1e-3, (seed7, synced)
    assert _probe_hits(proc, probe) == 0  # nothing cached before the restart serves after it

    client = _client(proc.url)
    try:
        assert client.weight_version() == FRESH_WEIGHT_VERSION  # not sync 0's
    finally:
        client.close()

    # a new group forms and carries a sync again; then the same seed gives the same weights, whatever came before
    proc.restart(str(ckpt), 7, str(logs / "again.log"))
    _synced(proc, 1)
    proc.restart(str(other), 7, str(logs / "seed7-again.log"))
    assert _logprobs(proc) == seed7
    proc.restart(str(other), 8, str(logs / "seed8.log"))
    seed8 = _logprobs(proc)
    assert seed8 != seed7 and _near_uniform(seed8, ckpt) < 1e-3

    # each restart's output went to its own log, from the engine core too
    assert "(seed 7)" not in (logs / "start.log").read_text()
    seed7_log = (logs / "seed7.log").read_text()
    assert f"fresh engine from {other} (seed 7)" in seed7_log
    assert "EngineCore" in seed7_log and "gloo weight transfer: finish" in seed7_log
    again = (logs / "again.log").read_text()
    assert "gloo weight transfer: joined" in again and "joined" not in seed7_log


def test_what_a_restart_cannot_do_is_refused_and_changes_nothing(server: tuple[VllmEngineProcess, Path]) -> None:
    proc, logs = server
    before = _logprobs(proc)
    vl = make_checkpoint(load_model("qwen3-vl"), SEED)
    body = {"checkpoint": proc.checkpoint, "seed": 3, "tensor_parallel_size": 1, "log_path": None, "fault": None}
    cases = [
        ({**body, "fault": "tests.faults:hook"}, 400, "no fault hooks"),
        ({**body, "checkpoint": str(vl)}, 400, "another model"),
        ({**body, "tensor_parallel_size": 2}, 400, "runs at TP 1"),
        ({**body, "seed": "3"}, 400, "(an integer)"),
        ("not an object", 400, "a JSON object"),
    ]
    for sent, status, why in cases:
        r = httpx.post(proc.url + "/wsh/restart", json=sent, timeout=60)
        assert (r.status_code, why in r.text) == (status, True), (sent, r.status_code, r.text)

    client = _client(proc.url)  # inside an update session: refused by the worker before it changes anything
    try:
        client.start(0)
        with pytest.raises(EngineStartError, match=r"409.*update session is open"):
            proc.restart(proc.checkpoint, 3, str(logs / "refused.log"))
        client.finish(0, 1)
    finally:
        client.close()
    assert _logprobs(proc) == before
    assert not (logs / "refused.log").exists()  # the API server redirects only after the worker's part

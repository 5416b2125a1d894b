"""`ReplicaClient` over two real embedded engine apps, in-process (FastAPI's test client; chunks by shared
memory handle, so no transfer group is needed): every route reaches both engines, each engine's answer goes
into its own account and its calls carry its index, a refusal names the engine, and an engine left in an
open session by the other's refusal is finished there and then."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest
from fastapi.testclient import TestClient
from wsh_vllm_plugin.protocol import InitInfo, UpdateInfo, dtype_name, pack

from reference_impl.checksum import tensor_checksum
from reference_impl.engine import engine_kind
from reference_impl.engine.embedded.loader import EngineLoader
from reference_impl.engine.embedded.server import create_app
from reference_impl.models.checkpoint import make_checkpoint, read_checkpoint
from reference_impl.models.registry import load_model
from reference_impl.transport.client import EngineClient
from reference_impl.transport.handles import SharedMemoryBuffer
from reference_impl.transport.replicas import ReplicaClient, ReplicasRejected


class AppClient(EngineClient):
    """An `EngineClient` whose HTTP goes to an app in this process (what `EngineClient` does over TCP)."""

    def __init__(self, app, engine: int) -> None:  # type: ignore[no-untyped-def]
        self.app = app
        super().__init__("http://testserver", parse_rejections=engine_kind("embedded").parse_rejections, engine=engine)

    def _new_http(self) -> httpx.Client:
        return TestClient(self.app, base_url=self.base_url, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def setup() -> tuple[ReplicaClient, dict, dict]:
    """Engine 0 serves qwen3-untied (it has an lm_head), engine 1 qwen3 (tied: lm_head is not a parameter)."""
    apps, tensors = [], {}
    for i, model in enumerate(("qwen3-untied", "qwen3")):
        ckpt = make_checkpoint(load_model(model), 1234, "float32")
        config = json.loads((ckpt / "config.json").read_text())
        apps.append(create_app(EngineLoader.from_checkpoint(ckpt, 4321 + i), config))
        tensors[model] = read_checkpoint(ckpt)
    client = ReplicaClient([AppClient(app, i) for i, app in enumerate(apps)])
    for c in client.clients:
        c.init_transfer(InitInfo(backend="shm"))
    return client, tensors, {"apps": apps}


def _update(client: ReplicaClient, buf: SharedMemoryBuffer, named: dict, sync: int, chunk: int) -> None:
    tensors = list(named.values())
    payload = pack(tensors)
    buf.grow(payload.numel())
    buf.tensor(payload.numel()).copy_(payload)
    info = UpdateInfo(
        names=list(named),
        dtype_names=[dtype_name(t.dtype) for t in tensors],
        shapes=[list(t.shape) for t in tensors],
        chunk_index=chunk,
    )
    client.update(replace(info, handle=buf.handle(payload.numel())), sync, chunk)


def test_every_engine_takes_the_chunk_and_a_refusal_names_its_engine(setup) -> None:
    client, tensors, _ = setup
    shared = {n: t for n, t in tensors["qwen3"].items()}  # names both checkpoints have (all of the tied model's)
    with SharedMemoryBuffer(1) as buf:
        client.calls = []
        client.start(0, 1)
        assert client.session_open
        _update(client, buf, shared, 0, 0)
        with pytest.raises(ReplicasRejected) as refused:
            _update(client, buf, {"lm_head.weight": tensors["qwen3-untied"]["lm_head.weight"]}, 0, 1)
        client.finish(0, 1)
    assert list(refused.value.failures) == [1] and "engine 1:" in str(refused.value)
    assert [r.name for r in refused.value.rejections] == ["lm_head.weight"]
    a0, a1 = client.accounts(0)
    assert (a0.chunks_received, a1.chunks_received) == ([0, 1], [0])
    assert "lm_head.weight" in a0.names_accepted and set(a1.names_rejected) == {"lm_head.weight"}
    assert a0.finished and a1.finished and set(a1.engine_update_counts.values()) == {1}
    calls = client.calls
    assert {(c.engine, c.route) for c in calls if c.status != 200} == {(1, "/update_weights")}
    assert sorted(c.engine for c in calls if c.route == "/update_weights") == [0, 0, 1, 1]
    sums = [c.checksums() for c in client.clients]
    assert all(sums[1][n] == tensor_checksum(t) for n, t in shared.items())
    assert sums[0]["lm_head.weight"] == tensor_checksum(tensors["qwen3-untied"]["lm_head.weight"])


def test_an_engine_left_open_by_the_others_refused_start_is_finished(setup) -> None:
    client = setup[0]
    engine1 = client.clients[1]
    engine1.start(7, 7)  # engine 1 already holds a session: its next start is refused
    client.calls = []
    with pytest.raises(ReplicasRejected, match="engine 1: /start_weight_update -> 400"):
        client.start(8, 8)
    assert not client.session_open  # nothing may be broadcast in sync 8
    assert client.accounts(8)[0].finished and not client.accounts(8)[1].finished
    routes = [(c.engine, c.route, c.status) for c in client.calls]
    assert (0, "/finish_weight_update", 200) in routes
    assert engine1.finish(7, 7)["weight_version"] == 7  # engine 1's own session was left as it was
    assert client.clients[0].weight_version() == "8" and client.clients[0].prompt_logprobs([1, 2, 3], 1.0)

"""The run's bearer token: every route of the embedded engine asks for it once the guard is on, the guard
refuses to run without a token, and no engine server binds beyond 127.0.0.1 without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from wsh_vllm_plugin.auth import TOKEN_ENV, BearerTokenMiddleware, bearer_header

from reference_impl.engine.embedded.launcher import EngineProcess
from reference_impl.engine.embedded.loader import EngineLoader
from reference_impl.engine.embedded.server import create_app
from reference_impl.engine.vllm.launcher import AUTH_MIDDLEWARE, RESTART_MIDDLEWARE, VllmEngineProcess
from reference_impl.models.checkpoint import make_checkpoint
from reference_impl.models.registry import load_model

TOKEN = "s3cret-token-of-this-run"


@pytest.fixture(scope="module")
def guarded() -> tuple[TestClient, list[APIRoute]]:
    ckpt = make_checkpoint(load_model("qwen3"), 1234, "float32")
    app = create_app(EngineLoader.from_checkpoint(ckpt, 4321), json.loads((ckpt / "config.json").read_text()))
    app.add_middleware(BearerTokenMiddleware, token=TOKEN)
    docs = ("/docs", "/openapi", "/redoc")
    routes = [r for r in app.routes if isinstance(r, APIRoute) and not r.path.startswith(docs)]
    return TestClient(app), routes


@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer "])
def test_every_route_refuses_a_request_without_the_token(guarded, auth: str | None) -> None:
    client, routes = guarded
    headers = {"Authorization": auth} if auth is not None else {}
    assert {r.path for r in routes} >= {"/health", "/init_weight_transfer_engine", "/update_weights", "/v1/completions"}
    for route in routes:
        for method in route.methods:
            answer = client.request(method, route.path, headers=headers, json={})
            assert answer.status_code == 401, (method, route.path, answer.status_code)
            assert answer.json()["detail"]["kinds"] == {"Authorization": "request"}


def test_the_token_opens_every_route(guarded) -> None:
    client, _ = guarded
    assert client.get("/health", headers=bearer_header(TOKEN)).status_code == 200
    assert client.get("/weight_info", headers=bearer_header(TOKEN)).json() == {"weight_version": "0"}
    # past the guard, the route's own validation answers (not a 401)
    assert client.post("/update_weights", headers=bearer_header(TOKEN), json={}).status_code == 400


def test_the_guard_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=TOKEN_ENV):
        BearerTokenMiddleware(app=lambda *a: None)  # type: ignore[arg-type,return-value]
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert BearerTokenMiddleware(app=lambda *a: None).allows(f"Bearer {TOKEN}")  # type: ignore[arg-type,return-value]


def test_servers_bind_beyond_loopback_only_with_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the argv alone: vLLM's python is named, never run (this test needs no vLLM environment)
    monkeypatch.setattr("reference_impl.engine.vllm.launcher.vllm_python", lambda: Path("/opt/vllm/bin/python"))
    with pytest.raises(ValueError, match="needs a bearer token"):
        EngineProcess("ckpt", 1, str(tmp_path / "log"), host="192.0.2.2")
    with pytest.raises(ValueError, match="needs a bearer token"):
        VllmEngineProcess("ckpt", 1, str(tmp_path / "log"), host="192.0.2.2")
    embedded = EngineProcess("ckpt", 1, str(tmp_path / "log"), host="192.0.2.2", token=TOKEN, tp=2)
    argv, env, _, _ = embedded.launch()
    embedded.stop()  # never started: removes the temp folder `launch` made for its port file
    assert argv[argv.index("--host") + 1] == "192.0.2.2" and env[TOKEN_ENV] == TOKEN
    assert TOKEN not in " ".join(argv)  # never on the command line
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    vllm = VllmEngineProcess("ckpt", 1, str(tmp_path / "log"), host="192.0.2.2", token=TOKEN, tp=2)
    argv = vllm.command(8000)
    # vLLM adds middlewares in order and the last added runs first: the token check last, so that it guards
    # every route, the restart's included
    assert middlewares(argv) == [RESTART_MIDDLEWARE, AUTH_MIDDLEWARE] and TOKEN not in " ".join(argv)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--host") + 1] == "192.0.2.2"
    plain = VllmEngineProcess("ckpt", 1, str(tmp_path / "log")).command(8000)
    assert middlewares(plain) == [RESTART_MIDDLEWARE] and "--tensor-parallel-size" not in plain


def middlewares(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--middleware"]

"""The embedded engine's process: `python -m reference_impl.engine.embedded --checkpoint DIR --seed N
[--host H] [--port P] [--port-file FILE] [--threads T] [--tensor-parallel-size TP] [--fault MODULE:FUNCTION]
[--exit-with-parent PID]` builds the app (`reference_impl.engine.embedded.server.create_app`) and serves it
with uvicorn on one socket bound here (TCP_NODELAY), writing the port to FILE once it accepts requests.
The app is served behind `restart.RestartableApp`: `POST /wsh/restart` replaces it with a fresh one
(`build_app`, the same path as this start) without a new process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import threading
import time
from pathlib import Path

import torch
from fastapi import FastAPI
from starlette.types import ASGIApp
from wsh_vllm_plugin.auth import TOKEN_ENV, BearerTokenMiddleware

from reference_impl import fork_server, seams
from reference_impl.engine.embedded.hooks import apply_hook, load_hook
from reference_impl.engine.embedded.loader import EngineLoader
from reference_impl.engine.embedded.restart import RestartableApp, RestartRequest
from reference_impl.engine.embedded.server import EngineState, create_app
from reference_impl.fork_client import start_time


def _write_port_file(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, path)


def build_app(req: RestartRequest) -> FastAPI:
    """A fresh engine app: a model of `req.checkpoint`'s architecture with the dummy weights of `req.seed`
    (`EngineLoader.from_checkpoint`) and `req.tensor_parallel_size` TP ranks: what the server starts with,
    and what `POST /wsh/restart` replaces it with (`restart.RestartableApp`)."""
    loader = EngineLoader.from_checkpoint(req.checkpoint, req.seed)
    config = json.loads((req.checkpoint / "config.json").read_text())
    return create_app(loader, config=config, served_name=str(req.checkpoint), tp=req.tensor_parallel_size)


def _state(app: ASGIApp) -> EngineState:
    assert isinstance(app, FastAPI)
    return app.state.engine  # type: ignore[no-any-return]


def engine_busy(app: ASGIApp) -> str | None:
    """Why the engine app must not be replaced now (an update session open, a chunk or forward under its
    lock), or None."""
    st = _state(app)
    if st.session_open:
        return "an update session is open"
    if st.lock.locked():
        return "a chunk or a forward is in progress"
    return None


async def _serve(app: ASGIApp, host: str, port: int, port_file: Path | None) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: without it a response written in two parts (head, body)
    # waits for the client's delayed ACK, ~40 ms per call.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started and port_file is not None:
        _write_port_file(port_file, sock.getsockname()[1])
    await task


def _exit_with_parent(pid: int, period_s: float = 1.0) -> None:
    """Watch the launcher `pid` from a daemon thread; once it has ended, exit at once. A server started by its
    launcher watches its parent (re-parented once the launcher is gone, also before this runs); a server forked by
    a fork server (`fork_server.forked_for`; the fork server is its parent) watches the launcher's start time (a
    pid reused by another process has another)."""
    if fork_server.forked_for is None:

        def ended() -> bool:
            return os.getppid() != pid
    else:
        started = start_time(pid)

        def ended() -> bool:
            return started is None or start_time(pid) != started

    def watch() -> None:
        while not ended():
            time.sleep(period_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description="the embedded rollout engine: vLLM's RLHF weight-update routes")
    ap.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder (config.json)")
    ap.add_argument("--seed", type=int, required=True, help="seed of the engine's dummy weights")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 binds a free port")
    ap.add_argument("--port-file", type=Path, default=None, help="written with the port once serving")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="TP ranks in the transfer group (as vLLM's)")
    ap.add_argument(
        "--fault",
        default=None,
        metavar="MODULE:FUNCTION",
        help="load a fault hook at start (mutation tests only), e.g. harness.faults.engine:ok_without_transfer",
    )
    ap.add_argument(
        "--exit-with-parent",
        type=int,
        default=None,
        metavar="PID",
        help="exit when process PID (the launcher) is gone, so a killed launcher never leaves a server behind",
    )
    args = ap.parse_args(argv)
    if args.exit_with_parent is not None:
        _exit_with_parent(args.exit_with_parent)
    unfaulted = seams.snapshot(seams.ENGINE_SEAMS)  # what runs at the engine's seams before any hook
    if args.fault is not None:
        try:
            hook = load_hook(args.fault)
        except ValueError as e:
            ap.exit(2, f"{ap.prog}: error: --fault: {e}\n")
        apply_hook(args.fault, hook)
    torch.set_num_threads(args.threads)
    first = build_app(RestartRequest(args.checkpoint, args.seed, args.tensor_parallel_size))
    app: ASGIApp = RestartableApp(build_app, first, engine_busy, lambda old: _state(old).close(), unfaulted, args.fault)
    if os.environ.get(TOKEN_ENV):  # every route asks for the run's bearer token (`wsh_vllm_plugin.auth`)
        app = BearerTokenMiddleware(app)
    asyncio.run(_serve(app, args.host, args.port, args.port_file))

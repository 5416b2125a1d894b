"""The embedded rollout engine: vLLM's RLHF weight-update routes over a transformers model.

Run: `python -m reference_impl.engine.embedded --checkpoint DIR --seed N --host 127.0.0.1
--port 0 --port-file FILE [--fault MODULE:FUNCTION]`. With port 0 it binds a free port and writes the port
it serves on to FILE (atomically) once it accepts requests. `--fault MODULE:FUNCTION` loads a fault hook
at start (the harness's mutation tests: `harness.faults.engine`): the function is called once, before
the app is built, and may replace what runs at the engine's seams (`reference_impl.seams`); a hook
that cannot be loaded exits at startup.

Request bodies are the protocol's (`wsh_vllm_plugin.protocol`: `InitInfo`, `UpdateInfo`, the handle
layouts), validated by pydantic from those dataclasses.

Routes and bodies follow vLLM's (`vllm/entrypoints/rl/online/api_router.py`; older releases
`vllm/entrypoints/serve/dev/rlhf/api_router.py`), with plain-data answers the harness records:

- POST /init_weight_transfer_engine `{"init_info": {"backend": "gloo", "master_address", "master_port",
  "rank_offset", "world_size", "timeout_s"}}` -> joins the transfer group as rank `rank_offset` (blocks until the
  trainer joins) -> `{"ok": true, "backend": "gloo", "rank": r, "world_size": w}`. Colocate:
  `{"init_info": {"backend": "shm"}}` (CPU) or `{"init_info": {"backend": "cuda_ipc"}}` (GPU; a 400 where
  the engine has no CUDA) -> nothing to join (vLLM's IPC init info is empty too) -> `{"ok": true,
  "backend": b}`. A later init replaces the backend; a failed gloo join keeps the previous one.
- POST /start_weight_update `{}` or `{"weight_version": v}` -> opens a session, zeroes the update
  counts -> `{"ok": true}`; 400 when one is open.
- POST /update_weights `{"update_info": {"names", "dtype_names", "shapes", "packed": true, "src": 0,
  "chunk_index", "handle"}}` -> with no open session, a 400 (kind "session") before anything is received, as
  vLLM's worker refuses it before its transfer backend runs (a sender must not broadcast then);
  otherwise receives the chunk from the group FIRST (so a bad body never leaves the trainer's broadcast
  hanging), then checks, unpacks and loads it -> `{"ok": true, "chunk_index", "received_bytes",
  "load_s", "loaded"}`. With backend shm / cuda_ipc, update_info's `"handle"` is `{"kind": "shm",
  "name", "nbytes"}` / `{"kind": "cuda_ipc", "ipc", "nbytes", "device_uuid"}`
  (opened by `reference_impl.transport.handles`) and the engine reads the chunk from it (no broadcast; views over
  the shared buffer, copied by the load, dropped before the handle is closed). A missing, malformed or
  unopenable handle is a 400 naming the chunk (kind "bytes"); so is a handle under backend gloo (nothing
  is broadcast-received then: a sender that passes handles does not broadcast).
- POST /finish_weight_update `{"weight_version": v}` -> `{"weight_version", "update_counts": {shard:
  n for every shard}, "load_s"}`. A shard is one checkpoint tensor, keyed by its vLLM target string
  (`vllm_name` or `vllm_name[shard]`, e.g. `model.layers.0.mlp.experts.routed_experts.w13_weight[3:w1]`); a full sync
  counts every shard exactly once.
- POST /weight_checker `{"action": "checksum" | "shards" | "reset" | "compare", "baseline"?}`: "checksum"
  -> `{"checksums": {checkpoint_name: checksum}}` over each shard's view of the engine's parameters in the
  checkpoint's layout (equal to the safetensors tensors' after a full sync); "shards" -> the shard strings;
  "compare" compares the checksums with `baseline` (checkpoint names).
- POST /v1/completions `{"prompt": [token ids], "max_tokens": 0|1, "temperature", "prompt_logprobs",
  "logprobs", "multi_modal_data": {"image": data URL}}` -> vLLM's `CompletionResponse` with
  `choices[0].prompt_logprobs` (`completions`, which documents the shapes and where we differ from
  vLLM: temperature applied to prompt log-probs). The forward runs under the same lock as chunk loads
  (never over a half-applied chunk) and is refused with a 409 (kind "session") while an update session
  is open or the engine is paused.
- GET /weight_info -> `{"weight_version": "<v>"}` (vLLM's route): the version committed by the last finish.
- POST /reset_prefix_cache -> `{"success": true}`, POST /reset_encoder_cache -> `{"success": true}`
  (vLLM's routes): clear the prefix cache and the vision-encoder cache (`caches`); nothing else clears
  them, a weight update included, as in vLLM 0.32.
- GET /health, GET /get_world_size, GET /is_paused, POST /pause, POST /resume.

Every 4xx body is `{"detail": {"error": sentence, "rejected": {hf_name: reason}, "kinds": {hf_name:
kind}}}` with kind "name" | "shape" | "dtype" | "bytes" | "session" ("request" for malformed bodies,
keyed by field). Any other exception is a 500 whose body carries the traceback; the server keeps serving.

Differences from vLLM, on purpose: a rejected chunk leaves the session open (nothing of it was
loaded; the finish counts show the gap) where vLLM's worker drops the session on any exception; a
tied `lm_head.weight` and a dtype mismatch are errors where vLLM skips / casts silently (the harness's
vLLM plugin refuses a dtype mismatch too); errors are 4xx with `{"detail": {"rejected", "kinds"}}`
where vLLM answers 500 with the worker's exception text ("Call to collective_rpc method failed ...");
answers carry counts and load times where vLLM's carry only `{"message"}`. Each engine kind's adapter
parses its own answers into `Rejection`s (`answers.py` here, `engine/vllm/answers.py` for vLLM), so the
checks read the same data from both (tests/test_vllm_engine.py sends the same bad inputs to both
engines and asserts the same verdicts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from wsh_vllm_plugin.protocol import (
    CUDA_IPC,
    GLOO,
    HANDLE_KINDS,
    InitInfo,
    ProtocolError,
    TransferGroup,
    UpdateInfo,
    join_transfer_group,
)

from reference_impl.engine.embedded import receive
from reference_impl.engine.embedded.completions import CompletionEngine, CompletionError, CompletionRequest
from reference_impl.engine.embedded.loader import EngineLoader


class InitRequest(BaseModel):
    init_info: InitInfo


class StartRequest(BaseModel):
    weight_version: int | None = None  # vLLM declares `str | None`; numeric strings are accepted (pydantic)


class UpdateRequest(BaseModel):
    update_info: UpdateInfo


class FinishRequest(BaseModel):
    weight_version: int | None = None  # vLLM declares `str | None`; numeric strings are accepted (pydantic)


class CheckerRequest(BaseModel):
    action: Literal["checksum", "shards", "reset", "compare"]
    baseline: dict[str, str] | None = None


def _http_error(
    status: int, error: str, rejected: dict[str, str] | None = None, kinds: dict[str, str] | None = None
) -> HTTPException:
    return HTTPException(status, detail={"error": error, "rejected": rejected or {}, "kinds": kinds or {}})


class EngineState:
    """Mutable state of one engine: transfer backend and group, update session, version, paused flag."""

    def __init__(self, loader: EngineLoader) -> None:
        self.loader = loader
        self.applier = receive.ChunkApplier(loader)
        self.backend: str | None = None  # set by a successful /init_weight_transfer_engine
        self.group: TransferGroup | None = None
        self.session_open = False
        self.weight_version = 0
        self.session_load_s = 0.0
        self.paused = False
        self.lock = threading.Lock()  # one chunk received + loaded at a time, in arrival order

    def commit_version(self, version: int) -> None:
        """The weights now in place are `version` (what /finish_weight_update commits, and what
        /weight_info and completions report). A seam (`reference_impl.seams`)."""
        self.weight_version = version


def _request_error(route: str, field: str, msg: str) -> HTTPException:
    """A 400 shaped like the request-validation ones (keyed by the field, kind "request")."""
    return _http_error(400, f"bad request body for {route}: {field}: {msg}", {field: msg}, {field: "request"})


def create_app(
    loader: EngineLoader,
    config: dict[str, Any] | None = None,
    served_name: str = "wsh-embedded",
) -> FastAPI:
    """The FastAPI app over `loader`. Handlers are sync so FastAPI runs them in its threadpool.

    `config`: the checkpoint's config.json dict (image processing of VL models; default: the model's
    config as a dict). `served_name`: the model name /v1/completions answers.
    """
    app = FastAPI(title="wsh embedded engine")
    st = EngineState(loader)
    app.state.engine = st
    completer = CompletionEngine(
        loader.model, config if config is not None else loader.model.config.to_dict(), served_name
    )

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = {".".join(str(x) for x in e.get("loc", ())): str(e.get("msg", "")) for e in exc.errors()}
        first = next(iter(fields.items()), ("body", "invalid"))
        return JSONResponse(
            status_code=400,
            content={
                "detail": {
                    "error": f"bad request body for {request.url.path}: {first[0]}: {first[1]}",
                    "rejected": fields,
                    "kinds": dict.fromkeys(fields, "request"),
                }
            },
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            status_code=500,
            content={
                "detail": {
                    "error": f"{type(exc).__name__} in {request.url.path}: {exc}",
                    "rejected": {},
                    "kinds": {},
                    "traceback": "".join(traceback.format_exception(exc)),
                }
            },
        )

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/weight_info")
    def weight_info() -> dict[str, str]:
        """vLLM's `GET /weight_info`: the committed weight version, as a string."""
        return {"weight_version": str(st.weight_version)}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> dict[str, bool]:
        """vLLM's `POST /reset_prefix_cache`: drop every cached prompt prefix (`caches.PrefixCache`)."""
        with st.lock:
            completer.prefix_cache.reset()
        return {"success": True}

    @app.post("/reset_encoder_cache")
    def reset_encoder_cache() -> dict[str, bool]:
        """vLLM's `POST /reset_encoder_cache`: drop every cached image's features (`caches.EncoderCache`)."""
        with st.lock:
            completer.encoder_cache.reset()
        return {"success": True}

    @app.get("/get_world_size")
    def get_world_size() -> dict[str, int]:
        return {"world_size": 1}

    @app.post("/pause")
    def pause() -> dict[str, str]:
        st.paused = True
        return {"status": "paused"}

    @app.post("/resume")
    def resume() -> dict[str, str]:
        st.paused = False
        return {"status": "resumed"}

    @app.get("/is_paused")
    def is_paused() -> dict[str, bool]:
        return {"is_paused": st.paused}

    @app.post("/init_weight_transfer_engine")
    def init_weight_transfer_engine(req: InitRequest) -> dict[str, Any]:
        info = req.init_info
        route = "/init_weight_transfer_engine"
        if info.backend in HANDLE_KINDS:
            if info.backend == CUDA_IPC and not torch.cuda.is_available():
                raise _request_error(
                    route,
                    "body.init_info.backend",
                    "backend 'cuda_ipc' needs CUDA in the engine process (torch.cuda.is_available() is False); "
                    "use backend 'shm' on CPU",
                )
            with st.lock:
                st.backend = info.backend
            return {"ok": True, "backend": info.backend}
        try:
            info.check()
        except ProtocolError as e:
            if e.required:
                raise _request_error(route, f"body.init_info.{e.field}", e.reason) from None
            raise _http_error(400, str(e)) from None
        assert info.master_address is not None and info.master_port is not None
        with st.lock:
            st.group = join_transfer_group(
                info.master_address,
                info.master_port,
                rank=info.rank_offset,
                world_size=info.world_size,
                timeout_s=info.timeout_s,
            )
            st.backend = GLOO
        return {"ok": True, "backend": GLOO, "rank": info.rank_offset, "world_size": info.world_size}

    @app.post("/start_weight_update")
    def start_weight_update(req: StartRequest | None = None) -> dict[str, Any]:
        with st.lock:
            if st.session_open:
                why = "start_weight_update called while an update session is open; POST /finish_weight_update first"
                raise _http_error(400, why, {"/start_weight_update": why}, {"/start_weight_update": "session"})
            st.session_open = True
            st.session_load_s = 0.0
            st.loader.reset_counts()  # a start's weight_version is read but, as in vLLM, only a finish commits one
        return {"ok": True}

    @app.post("/update_weights")
    def update_weights(req: UpdateRequest) -> dict[str, Any]:
        info = req.update_info
        chunk = f"chunk {info.chunk_index}" if info.chunk_index is not None else "this chunk"
        with st.lock:
            if st.backend is None or (st.backend == GLOO and st.group is None):
                raise _http_error(
                    400,
                    f"{chunk}: no transfer group or handle backend; POST /init_weight_transfer_engine before "
                    "/update_weights",
                    dict.fromkeys(info.names, "no transfer group"),
                    dict.fromkeys(info.names, "session"),
                )
            if not info.packed:
                raise _http_error(
                    400,
                    f"{chunk}: packed=false is not supported by the embedded engine; send packed chunks",
                    dict.fromkeys(info.names, "unpacked transfer"),
                    dict.fromkeys(info.names, "bytes"),
                )
            try:
                if st.backend == GLOO:
                    received, load_s = _receive_broadcast(info, chunk)
                else:
                    received, load_s = _receive_handle(info, chunk)
            except receive.ChunkRejected as e:
                raise _http_error(400, e.error, e.rejected, e.kinds) from None
            st.session_load_s += load_s
        return {
            "ok": True,
            "chunk_index": info.chunk_index,
            "received_bytes": received,
            "load_s": load_s,
            "loaded": len(info.names),
        }

    def _require_session(info: UpdateInfo, chunk: str, what: str) -> None:
        if not st.session_open:
            raise receive.ChunkRejected(
                f"{chunk} ({what}): no update session is open; POST /start_weight_update first",
                dict.fromkeys(info.names, "no update session open"),
                dict.fromkeys(info.names, "session"),
            )

    def _apply(info: UpdateInfo, chunk: str, payload: torch.Tensor) -> float:
        t0 = time.perf_counter()
        st.applier.apply(chunk, info.names, info.dtype_names, info.shapes, payload)
        return time.perf_counter() - t0

    def _receive_broadcast(info: UpdateInfo, chunk: str) -> tuple[int, float]:
        if info.handle is not None:
            raise receive.ChunkRejected(
                f"{chunk}: update_info carries a {info.handle.get('kind', '?')!r} handle but the transfer backend "
                "is gloo (nothing was received); init with the colocate backend or send by broadcast",
                dict.fromkeys(info.names, "handle under backend gloo"),
                dict.fromkeys(info.names, "bytes"),
            )
        assert st.group is not None
        # As vLLM's worker: no session, no receive (the sender must not broadcast then; see client.py).
        _require_session(info, chunk, "nothing received")
        payload = st.group.receive_chunk(info.src)  # with a session: receive first, check after
        return int(payload.numel()), _apply(info, chunk, payload)

    def _receive_handle(info: UpdateInfo, chunk: str) -> tuple[int, float]:
        assert st.backend is not None
        nbytes = receive.check_handle(info.handle, st.backend, chunk, info.names)
        _require_session(info, chunk, f"its {nbytes}-byte handle was not opened")
        assert info.handle is not None
        with contextlib.ExitStack() as stack:
            payload = receive.open_handle(stack, info.handle, chunk, info.names)
            try:
                return int(payload.numel()), _apply(info, chunk, payload)
            finally:
                del payload  # every view of the shared buffer is gone before the handle closes

    @app.post("/finish_weight_update")
    def finish_weight_update(req: FinishRequest | None = None) -> dict[str, Any]:
        with st.lock:
            if not st.session_open:
                why = "finish_weight_update called without an open session; POST /start_weight_update first"
                raise _http_error(400, why, {"/finish_weight_update": why}, {"/finish_weight_update": "session"})
            st.session_open = False
            if req is not None and req.weight_version is not None:
                st.commit_version(req.weight_version)
            return {
                "weight_version": st.weight_version,
                "update_counts": dict(st.loader.counts),
                "load_s": st.session_load_s,
            }

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict[str, Any]:
        try:
            inputs = completer.prepare(req)  # reads no weights: outside the lock
            with st.lock:
                if st.session_open or st.paused:
                    why = "an update session is open" if st.session_open else "the engine is paused"
                    fix = "POST /finish_weight_update" if st.session_open else "POST /resume"
                    raise CompletionError(
                        409,
                        f"/v1/completions refused: {why} (weights may be half-updated); {fix} first",
                        {"/v1/completions": why},
                        kind="session",
                    )
                return completer.complete(req, inputs, st.weight_version)
        except CompletionError as e:
            raise _http_error(e.status, e.error, e.rejected, e.kinds) from None

    @app.post("/weight_checker")
    def weight_checker(req: CheckerRequest) -> dict[str, Any]:
        with st.lock:
            if req.action == "shards":
                return {"shards": st.loader.shard_ids()}
            if req.action == "reset":
                st.loader.reset_weights()
                return {"status": "reset"}
            sums = st.loader.checksums()
        if req.action == "checksum":
            return {"checksums": sums, "weight_version": st.weight_version}
        if req.baseline is None:
            raise _http_error(400, "action 'compare' requires a 'baseline' object {hf_name: checksum}")
        keys = set(sums) | set(req.baseline)
        mismatches = sorted(k for k in keys if sums.get(k) != req.baseline.get(k))
        return {"match": not mismatches, "mismatches": mismatches, "weight_version": st.weight_version}

    return app


def _write_port_file(path: Path, port: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, path)


async def _serve(app: FastAPI, host: str, port: int, port_file: Path | None) -> None:
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
    """Watch `pid` from a daemon thread; when it is gone (this process was re-parented), exit at once."""

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(period_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def load_hook(spec: str) -> Callable[[], None]:
    """The function named by `MODULE:FUNCTION` (imported, not called).

    Raises:
        ValueError: `spec` is not MODULE:FUNCTION, the module does not import, or it has no such function.
    """
    module_name, sep, func = spec.partition(":")
    if not sep or not module_name or not func:
        raise ValueError(f"{spec!r} is not MODULE:FUNCTION (e.g. harness.faults.engine:ok_without_transfer)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r}: {e}") from None
    hook = getattr(module, func, None)
    if not callable(hook):
        raise ValueError(f"{module_name} has no function {func!r}")
    return hook


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder (config.json)")
    ap.add_argument("--seed", type=int, required=True, help="seed of the engine's dummy weights")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 binds a free port")
    ap.add_argument("--port-file", type=Path, default=None, help="written with the port once serving")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
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
    if args.fault is not None:
        try:
            hook = load_hook(args.fault)
        except ValueError as e:
            ap.exit(2, f"{ap.prog}: error: --fault: {e}\n")
        hook()
        doc = (hook.__doc__ or "").strip().splitlines()
        print(f"wsh engine: FAULT ACTIVE: {args.fault}: {doc[0] if doc else ''}", file=sys.stderr, flush=True)
    torch.set_num_threads(args.threads)
    loader = EngineLoader.from_checkpoint(args.checkpoint, args.seed)
    config = json.loads((args.checkpoint / "config.json").read_text())
    app = create_app(loader, config=config, served_name=str(args.checkpoint))
    asyncio.run(_serve(app, args.host, args.port, args.port_file))


if __name__ == "__main__":
    sys.exit(
        "run the engine as `python -m reference_impl.engine.embedded` (this module must be imported under its "
        "own name, so that fault hooks replace what the app calls)"
    )

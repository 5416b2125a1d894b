"""The embedded rollout engine: vLLM's RLHF weight-update routes over a transformers model.

Run: `python -m reference_impl.engine.embedded.server --checkpoint DIR --seed N --host 127.0.0.1
--port 0 --port-file FILE`. With port 0 it binds a free port and writes the port it serves on to
FILE (atomically) once it accepts requests.

Routes and bodies follow vLLM's (`vllm/entrypoints/rl/online/api_router.py`; older releases
`vllm/entrypoints/serve/dev/rlhf/api_router.py`), with plain-data answers the harness records:

- POST /init_weight_transfer_engine `{"init_info": {"backend": "gloo", "master_address", "master_port",
  "rank_offset", "world_size"}}` -> joins the transfer group as rank `rank_offset` (blocks until the
  trainer joins) -> `{"ok": true, "rank": r, "world_size": w}`.
- POST /start_weight_update `{}` or `{"weight_version": v}` -> opens a session, zeroes the update
  counts -> `{"ok": true}`; 400 when one is open.
- POST /update_weights `{"update_info": {"names", "dtype_names", "shapes", "packed": true, "src": 0,
  "chunk_index"}}` -> receives the chunk from the group FIRST (always, so the trainer's broadcast never
  hangs), then checks, unpacks and loads it -> `{"ok": true, "chunk_index", "received_bytes",
  "load_s", "loaded"}`.
- POST /finish_weight_update `{"weight_version": v}` -> `{"weight_version", "update_counts": {slot:
  n for every slot}, "load_s"}`. A slot is one checkpoint tensor, keyed by its vLLM target string
  (`vllm_name` or `vllm_name[shard]`, e.g. `model.layers.0.mlp.experts.routed_experts.w13_weight[3:w1]`); a full sync
  counts every slot exactly once.
- POST /weight_checker `{"action": "checksum" | "slots" | "reset" | "compare", "baseline"?}`: "checksum"
  -> `{"checksums": {checkpoint_name: checksum}}` over each slot's view of the engine's parameters in the
  checkpoint's layout (equal to the safetensors tensors' after a full sync); "slots" -> the slot strings;
  "compare" compares the checksums with `baseline` (checkpoint names).
- GET /health, GET /get_world_size, GET /is_paused, POST /pause, POST /resume.

Every 4xx body is `{"detail": {"error": sentence, "rejected": {hf_name: reason}, "kinds": {hf_name:
kind}}}` with kind "name" | "shape" | "dtype" | "bytes" | "session" ("request" for malformed bodies,
keyed by field). Any other exception is a 500 whose body carries the traceback; the server keeps serving.

Differences from vLLM, on purpose: a rejected chunk leaves the session open (nothing of it was
loaded; the finish counts show the gap) where vLLM's worker drops the session on any exception; a
tied `lm_head.weight` and a dtype mismatch are errors where vLLM skips / casts silently.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from reference_impl.engine.embedded.loader import EngineLoader, LoadRejected
from reference_impl.transport import wire


class InitInfo(BaseModel):
    """`init_info` of /init_weight_transfer_engine (vLLM `NCCLWeightTransferInitInfo`, gloo backend)."""

    backend: Literal["gloo"] = "gloo"
    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int = 2
    timeout_s: float = 120.0


class InitRequest(BaseModel):
    init_info: InitInfo


class StartRequest(BaseModel):
    weight_version: int | None = None


class UpdateInfo(BaseModel):
    """`update_info` of /update_weights (vLLM `NCCLWeightTransferUpdateInfo` plus our chunk index)."""

    names: list[str] = Field(default_factory=list)
    dtype_names: list[str] = Field(default_factory=list)
    shapes: list[list[int]] = Field(default_factory=list)
    packed: bool = True
    src: int = 0
    chunk_index: int | None = None


class UpdateRequest(BaseModel):
    update_info: UpdateInfo


class FinishRequest(BaseModel):
    weight_version: int | None = None


class CheckerRequest(BaseModel):
    action: Literal["checksum", "slots", "reset", "compare"]
    baseline: dict[str, str] | None = None


def _http_error(
    status: int, error: str, rejected: dict[str, str] | None = None, kinds: dict[str, str] | None = None
) -> HTTPException:
    return HTTPException(status, detail={"error": error, "rejected": rejected or {}, "kinds": kinds or {}})


class EngineState:
    """Mutable state of one engine: transfer group, update session, version, paused flag."""

    def __init__(self, loader: EngineLoader) -> None:
        self.loader = loader
        self.group: wire.TransferGroup | None = None
        self.session_open = False
        self.weight_version = 0
        self.session_load_s = 0.0
        self.paused = False
        self.lock = threading.Lock()  # one chunk received + loaded at a time, in arrival order


def create_app(loader: EngineLoader) -> FastAPI:
    """The FastAPI app over `loader`. Handlers are sync so FastAPI runs them in its threadpool."""
    app = FastAPI(title="wsh embedded engine")
    st = EngineState(loader)
    app.state.engine = st

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
        if not 0 < info.rank_offset < info.world_size:
            raise _http_error(
                400,
                f"init_info rank_offset {info.rank_offset} must lie in 1..world_size-1 "
                f"(world_size {info.world_size}); the trainer's sender is rank 0",
            )
        with st.lock:
            st.group = wire.join_transfer_group(
                info.master_address,
                info.master_port,
                rank=info.rank_offset,
                world_size=info.world_size,
                timeout_s=info.timeout_s,
            )
        return {"ok": True, "rank": info.rank_offset, "world_size": info.world_size}

    @app.post("/start_weight_update")
    def start_weight_update(req: StartRequest | None = None) -> dict[str, Any]:
        with st.lock:
            if st.session_open:
                raise _http_error(
                    400,
                    "start_weight_update called while an update session is open; POST /finish_weight_update first",
                )
            st.session_open = True
            st.session_load_s = 0.0
            st.loader.reset_counts()
            if req is not None and req.weight_version is not None:
                st.weight_version = req.weight_version
        return {"ok": True}

    @app.post("/update_weights")
    def update_weights(req: UpdateRequest) -> dict[str, Any]:
        info = req.update_info
        chunk = f"chunk {info.chunk_index}" if info.chunk_index is not None else "this chunk"
        with st.lock:
            if st.group is None:
                raise _http_error(
                    400,
                    f"{chunk}: no transfer group; POST /init_weight_transfer_engine before /update_weights",
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
            payload = st.group.broadcast_chunk(None, src=info.src)  # always receive first
            received = int(payload.numel())
            if not st.session_open:
                raise _http_error(
                    400,
                    f"{chunk} ({received} bytes received and dropped): no update session is open; "
                    "POST /start_weight_update first",
                    dict.fromkeys(info.names, "no update session open"),
                    dict.fromkeys(info.names, "session"),
                )
            t0 = time.perf_counter()
            try:
                rejected, kinds = st.loader.validate(info.names, info.dtype_names, info.shapes)
            except ValueError as e:
                raise _http_error(400, f"{chunk}: {e}") from e
            if rejected:
                raise _http_error(400, str(LoadRejected(rejected, kinds)), rejected, kinds)
            dtypes = [wire.dtype_from_name(d) for d in info.dtype_names]
            try:
                tensors = wire.unpack(payload, dtypes, info.shapes)
            except ValueError as e:
                reason = f"{chunk} holds {received} bytes, which does not match its declared dtypes/shapes"
                raise _http_error(
                    400,
                    f"{e} ({chunk}: {', '.join(info.names[:3])}{' ...' if len(info.names) > 3 else ''}); "
                    "make the packed bytes match dtype_names and shapes",
                    dict.fromkeys(info.names, reason),
                    dict.fromkeys(info.names, "bytes"),
                ) from e
            try:
                st.loader.load(info.names, info.dtype_names, info.shapes, tensors)
            except LoadRejected as e:
                raise _http_error(400, str(e), e.rejected, e.kinds) from e
            load_s = time.perf_counter() - t0
            st.session_load_s += load_s
        return {
            "ok": True,
            "chunk_index": info.chunk_index,
            "received_bytes": received,
            "load_s": load_s,
            "loaded": len(info.names),
        }

    @app.post("/finish_weight_update")
    def finish_weight_update(req: FinishRequest | None = None) -> dict[str, Any]:
        with st.lock:
            if not st.session_open:
                raise _http_error(
                    400,
                    "finish_weight_update called without an open session; POST /start_weight_update first",
                )
            st.session_open = False
            if req is not None and req.weight_version is not None:
                st.weight_version = req.weight_version
            return {
                "weight_version": st.weight_version,
                "update_counts": dict(st.loader.counts),
                "load_s": st.session_load_s,
            }

    @app.post("/weight_checker")
    def weight_checker(req: CheckerRequest) -> dict[str, Any]:
        with st.lock:
            if req.action == "slots":
                return {"slots": st.loader.slot_strings()}
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


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="checkpoint folder (config.json)")
    ap.add_argument("--seed", type=int, required=True, help="seed of the engine's dummy weights")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 binds a free port")
    ap.add_argument("--port-file", type=Path, default=None, help="written with the port once serving")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loader = EngineLoader.from_checkpoint(args.checkpoint, args.seed)
    asyncio.run(_serve(create_app(loader), args.host, args.port, args.port_file))


if __name__ == "__main__":
    main()

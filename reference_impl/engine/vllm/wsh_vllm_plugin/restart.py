"""In-place restart of a vLLM server: a fresh engine of the same model in the same processes.

`POST /wsh/restart {"checkpoint": DIR, "seed": N, "tensor_parallel_size": TP, "log_path": FILE, "fault": null}`
(the harness's own route, served by `RestartMiddleware`, which vLLM loads with `--middleware`) makes a running
server what a new start on DIR would be, without the 15-20 s of a new start on a 2-core host (two interpreters
importing torch and vLLM, one after the other):

1. refused (409, nothing changed) while requests run (vLLM's prefix-cache reset fails while blocks are held),
   while an update session is open, or where a restart cannot reach every process (below);
2. the engine core's standard output and error go to `log_path` from now on (the API server's once the
   worker is done);
3. the worker drops its weight-transfer group (vLLM's `shutdown_weight_transfer_engine`) and loads new dummy
   weights through vLLM's own reload path (`WorkerRestart.wsh_restart`): every tensor of DIR's checkpoint, by
   its Hugging Face name and shape, drawn uniform in [-1e-3, 1e-3) (vLLM's dummy range,
   `initialize_single_dummy_weight`) from a generator seeded with N, in the engine's dtype, loaded between
   the worker's own `start_weight_update` and `finish_weight_update` (layerwise reload, CPU repacks), so no
   tensor keeps what an earlier scenario sent;
4. the prefix, multi-modal and encoder caches are emptied, and the weight version is vLLM's initial one
   ("default", vllm/v1/engine/core.py).

A fresh start's dummy weights (vLLM's loader seeds every tensor with 1234, whatever `--seed`) are not
reproduced bit for bit; what a restart keeps of a fresh start is what a sync test needs: small random
weights that hold nothing of the trainer's.

What it cannot change is the model: DIR's `config.json` must equal the served checkpoint's (the seed's
weights differ, the architecture not), `tensor_parallel_size` the server's, and `fault` must be null (vLLM
loads no fault hooks); each is a 400 naming what to change. It needs the worker inside the engine-core
process (TP 1 with `VLLM_ENABLE_V1_MULTIPROCESSING=0`, how the harness starts a CPU server): a worker process
of its own, or several, would keep writing the engine core's output to the old log; that is a 409.

Answers `{"ok": true, "pid": p, "restart_s": s, "tensors": n}`; a reload that fails is a 500 (the layerwise
reload is aborted, the old weights partly replaced: start a new server).
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wsh_vllm_plugin.auth import Receive, Scope, Send

RESTART_ROUTE = "/wsh/restart"
DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3  # vLLM's `initialize_single_dummy_weight` range
INITIAL_WEIGHT_VERSION = "default"  # what a new vLLM engine core reports (vllm/v1/engine/core.py)
MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


def redirect_output(log_path: str) -> None:
    """Point this process's file descriptors 1 and 2 (what Python, vLLM's log handler and faulthandler write
    to) at `log_path`, appended to; Python's own buffers are flushed to the old file first.

    Raises:
        OSError: the file cannot be opened.
    """
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for std in (1, 2):
            os.dup2(fd, std)
    finally:
        os.close(fd)


def checkpoint_tensors(checkpoint: str) -> list[tuple[str, list[int]]]:
    """(Hugging Face name, shape) of every tensor in the `*.safetensors` files of `checkpoint`, sorted by
    name, read from the files' headers (8-byte little-endian header length, then a JSON object of name ->
    {"dtype", "shape", "data_offsets"}; the safetensors format).

    Raises:
        FileNotFoundError: no `*.safetensors` file in `checkpoint`.
        ValueError: a header that is not JSON.
    """
    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {checkpoint}")
    out: dict[str, list[int]] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out |= {name: list(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}
    return sorted(out.items())


def dummy_weights(checkpoint: str, seed: int, dtype: Any) -> Iterator[tuple[str, Any]]:
    """One tensor per checkpoint tensor (`checkpoint_tensors`), in that order: shape as in the checkpoint,
    dtype `dtype` (a torch floating-point dtype), values uniform in [DUMMY_LOW, DUMMY_HIGH) from one CPU
    generator seeded with `seed`. Each is made when asked for, so the whole model never exists twice."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, shape in checkpoint_tensors(checkpoint):
        yield name, torch.empty(shape, dtype=dtype).uniform_(DUMMY_LOW, DUMMY_HIGH, generator=generator)


class WorkerRestart:
    """vLLM worker extension (`--worker-extension-cls wsh_vllm_plugin.restart.WorkerRestart`): vLLM mixes it
    into its worker class, and `collective_rpc("wsh_restart", ...)` runs it on every worker."""

    def wsh_restart(self, checkpoint: str, seed: int, log_path: str | None = None) -> dict[str, Any]:
        """This worker's part of a restart (see the module doc): output to `log_path`, the transfer group
        dropped, every checkpoint tensor reloaded with `dummy_weights(checkpoint, seed)` through the worker's
        own weight-update session. Returns {"pid", "tensors"}.

        Raises:
            RuntimeError: an update session is open (nothing changed), or the worker has no weight-transfer
                engine.
            whatever the reload raised (the layerwise reload is then aborted).
        """
        worker: Any = self
        if worker._weight_update_active:
            raise RuntimeError("an update session is open: finish it before a restart")
        engine = worker.weight_transfer_engine
        if engine is None:
            raise RuntimeError("the server has no weight-transfer engine: start it with --weight-transfer-config")
        if log_path:
            redirect_output(log_path)
        worker.shutdown_weight_transfer_engine()
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        n = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal n
            for item in dummy_weights(checkpoint, seed, worker.model_config.dtype):
                n += 1
                yield item

        worker.start_weight_update()
        try:
            with set_current_vllm_config(worker.vllm_config), disable_mtp_completeness_check():
                engine.model.load_weights(counted())
        except BaseException:
            worker._weight_update_active = False
            abort = getattr(engine, "_abort_layerwise_reload", None)
            if abort is not None:
                abort()
            raise
        worker.finish_weight_update()
        worker.model_runner.reset_encoder_cache()
        worker.model_runner.reset_mm_cache()
        if hasattr(engine, "bytes_received"):
            engine.bytes_received = 0
        return {"pid": os.getpid(), "tensors": n}


def _config(checkpoint: str) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / "config.json").read_text())


def restart_problem(body: Any, served: str, tp: int) -> str | None:
    """Why `body` (a parsed `/wsh/restart` body) cannot restart a server of checkpoint `served` at TP `tp`
    (one sentence saying what to change), None when it can."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    checkpoint, seed = body.get("checkpoint"), body.get("seed")
    if not isinstance(checkpoint, str) or not isinstance(seed, int) or isinstance(seed, bool):
        return 'send "checkpoint" (a folder) and "seed" (an integer)'
    if body.get("fault") is not None:
        return "vLLM loads no fault hooks: send fault null, or start a new server"
    if body.get("tensor_parallel_size", 1) != tp:
        return f"this server runs at TP {tp}: a restart keeps it; start a new server for another TP"
    try:
        same = _config(checkpoint) == _config(served)
    except (OSError, ValueError) as e:
        return f"cannot read {checkpoint}/config.json: {e}"
    if not same:
        return f"{checkpoint} is another model than the served {served}: a restart keeps the model; start a new server"
    log_path = body.get("log_path")
    if log_path is not None and not isinstance(log_path, str):
        return '"log_path" must be a file path or null'
    return None


class RestartMiddleware:
    """Serves `POST /wsh/restart` (the module doc) in front of vLLM's app; every other request passes.
    Load it before the token check (`--middleware wsh_vllm_plugin.restart.RestartMiddleware --middleware
    wsh_vllm_plugin.auth.BearerTokenMiddleware`): vLLM adds middlewares in order and the last added runs
    first, so the check guards this route too."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._lock = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("path") != RESTART_ROUTE:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        if scope.get("method") != "POST":
            status, answer = 405, _refusal(405, f"{RESTART_ROUTE} takes POST")
        else:
            async with self._lock:
                status, answer = await self._restart(scope["app"].state, b"".join(chunks))
        body = json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _restart(self, state: Any, raw: bytes) -> tuple[int, dict[str, Any]]:
        t0 = time.perf_counter()
        try:
            body = json.loads(raw or b"null")
        except ValueError as e:
            return 400, _refusal(400, f"{RESTART_ROUTE}: the body is not JSON: {e}")
        config, client = state.vllm_config, state.engine_client
        why = restart_problem(body, config.model_config.model, config.parallel_config.tensor_parallel_size)
        if why:
            return 400, _refusal(400, f"{RESTART_ROUTE}: {why}")
        if config.parallel_config.world_size != 1 or os.environ.get(MULTIPROCESSING) != "0":
            why = (
                "the worker runs in a process of its own (TP > 1, or VLLM_ENABLE_V1_MULTIPROCESSING is not 0), so "
                "the engine core's output would stay in the old log; start a new server"
            )
            return 409, _refusal(409, f"{RESTART_ROUTE} refused: {why}")
        if not await client.reset_prefix_cache():
            return 409, _refusal(409, f"{RESTART_ROUTE} refused: requests are running; restart once they ended")
        try:
            answers = await client.collective_rpc(
                "wsh_restart",
                kwargs={"checkpoint": body["checkpoint"], "seed": body["seed"], "log_path": body.get("log_path")},
            )
        except Exception as e:
            text = f"{type(e).__name__}: {e}"
            if "update session is open" in text:
                return 409, _refusal(409, f"{RESTART_ROUTE} refused: {text}; finish the update first")
            return 500, {"detail": {"error": f"{RESTART_ROUTE}: the reload failed ({text}); start a new server"}}
        if body.get("log_path"):  # the engine core's went there as the worker began
            redirect_output(body["log_path"])
        await client.reset_prefix_cache()
        await client.reset_mm_cache()
        await client.reset_encoder_cache()
        await client.update_weight_version(INITIAL_WEIGHT_VERSION)
        print(f"wsh restart: fresh engine from {body['checkpoint']} (seed {body['seed']})", flush=True)
        return 200, {
            "ok": True,
            "pid": os.getpid(),
            "restart_s": time.perf_counter() - t0,
            "tensors": answers[0]["tensors"],
        }


def _refusal(status: int, why: str) -> dict[str, Any]:
    """A refusal body in the shape the harness parses (`transport.rejections`): the route as the rejected
    field, "request" for a 4xx the body caused, "session" for a state that forbids it now."""
    kind = "session" if status == 409 else "request"
    return {"detail": {"error": why, "rejected": {RESTART_ROUTE: why}, "kinds": {RESTART_ROUTE: kind}}}

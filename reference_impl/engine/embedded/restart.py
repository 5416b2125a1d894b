"""In-place restart of the embedded engine: a fresh engine in the same server process.

`POST /wsh/restart {"checkpoint": DIR, "seed": N, "tensor_parallel_size": TP, "log_path": FILE, "fault": HOOK}`
(the harness's own route, not vLLM's) undoes the fault hook the process has (if any), builds a new app
exactly as the server's start does (`cli.build_app`: a model of DIR's architecture filled with the dummy
weights of seed N, a new engine state, empty caches, no transfer backend, weight version 0), swaps it in
for every later request and drops the old one (its transfer group, session, caches and weights). With
`log_path` the server's standard output and error go to that file from then on (each scenario has its
own log). With `fault` (`MODULE:FUNCTION`) the hook is applied before the new app is built, exactly as at
a start with `--fault`. A hook the process already has (from its start or an earlier restart) is undone
first (`seams.restore_all`) and shown undone: every engine seam must run what it ran before any hook
(`seams.replaced_since` a snapshot the server took at its start), else the restart is refused. Answers
`{"ok": true, "pid": p, "restart_s": s}` once the new app serves.

What it saves is a process start (interpreter, torch and FastAPI imports: about 4 s of a 6 s engine
start on a 2-core host), so a harness may run many scenarios on one engine process; what it must not
lose is the fresh start's state, which is why nothing of the old app is kept. It is refused with a 409
while the old engine is inside an update session or loading a chunk (nothing changes), and when a hook's
change outlives its undo (the old app, now partly undone, is dropped: every route answers 503 and every
later restart is refused; start a fresh engine), and with a 400 for a body it cannot read or a hook that
does not load (what to change is named). The old app is dropped before the new one is built (never two
models in memory); a checkpoint that does not build, or a hook that raises when applied, is a 500, after
which every route answers 503 until a restart succeeds (undoing such a hook first).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from reference_impl import seams
from reference_impl.engine.embedded.hooks import apply_hook, load_hook
from reference_impl.memory import release_memory

RESTART_ROUTE = "/wsh/restart"


@dataclass(frozen=True)
class RestartRequest:
    """The body of `POST /wsh/restart`: what a fresh start would be given on its command line."""

    checkpoint: Path
    seed: int
    tensor_parallel_size: int = 1
    log_path: Path | None = None
    fault: str | None = None  # a fault hook MODULE:FUNCTION to apply before the build (mutation tests only)

    @classmethod
    def from_json(cls, body: Any) -> RestartRequest:
        """Read the JSON body.

        Raises:
            ValueError: not an object, an unknown field, `checkpoint` not a folder with a config.json, `seed`
                not an int, `tensor_parallel_size` not an int >= 1, `log_path` or `fault` not a string (the
                message says which field and what it must be).
        """
        if not isinstance(body, dict):
            raise ValueError(
                "the body must be a JSON object {checkpoint, seed, tensor_parallel_size?, log_path?, fault?}"
            )
        fields = ("checkpoint", "seed", "tensor_parallel_size", "log_path", "fault")
        unknown = set(body) - set(fields)
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}; allowed: {', '.join(fields)}")
        ckpt, seed, log, fault = body.get("checkpoint"), body.get("seed"), body.get("log_path"), body.get("fault")
        tp = body.get("tensor_parallel_size", 1)
        if not isinstance(ckpt, str) or not (Path(ckpt) / "config.json").is_file():
            raise ValueError(f"checkpoint must name a checkpoint folder with a config.json (got {ckpt!r})")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer (got {seed!r})")
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1 (got {tp!r})")
        if log is not None and not isinstance(log, str):
            raise ValueError(f"log_path must be a file path string or null (got {log!r})")
        if fault is not None and not isinstance(fault, str):
            raise ValueError(f"fault must be a MODULE:FUNCTION string or null (got {fault!r})")
        return cls(Path(ckpt), seed, tp, Path(log) if log else None, fault)


def redirect_output(log_path: Path) -> None:
    """Point this process's standard output and error (file descriptors 1 and 2, so also what Python,
    uvicorn and faulthandler write there) at `log_path`, appended to. Raises OSError when it cannot be
    opened."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for std in (1, 2):
            os.dup2(fd, std)
    finally:
        os.close(fd)


class RestartableApp:
    """The ASGI app the server serves: `/wsh/restart` here, every other request to the current engine app.

    Args:
        build: makes a fresh engine app from a `RestartRequest` (the server's own start path).
        first: the app the process started with.
        busy: whether the current app must not be replaced now (an update session open, a chunk loading);
            called with the current app, returns a sentence saying why, or None.
        close: releases what a replaced app holds beyond its memory (threads), called once it is replaced.
        unfaulted: what ran at every engine seam before any hook was applied (`seams.snapshot`).
        fault: the fault hook the process loaded at start (`--fault`), None for none; a restart undoes it
            and may apply another.
    """

    def __init__(
        self,
        build: Callable[[RestartRequest], ASGIApp],
        first: ASGIApp,
        busy: Callable[[ASGIApp], str | None],
        close: Callable[[ASGIApp], None],
        unfaulted: dict[str, Callable[..., Any]],
        fault: str | None = None,
    ) -> None:
        self.build, self.busy, self.close, self.unfaulted, self.fault = build, busy, close, unfaulted, fault
        self.app: ASGIApp | None = first
        self.broken = ""  # why there is no app (a restart in progress, or one that failed)
        self._lock = asyncio.Lock()  # one restart at a time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == RESTART_ROUTE:
            response = await self._restart(Request(scope, receive))
            await response(scope, receive, send)
            return
        if self.app is None:
            if scope["type"] == "http":
                why = f"the engine has no app: {self.broken}"
                body = {"detail": {"error": why, "rejected": {scope["path"]: why}, "kinds": {scope["path"]: "session"}}}
                await JSONResponse(body, status_code=503)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _restart(self, request: Request) -> JSONResponse:
        def refused(status: int, why: str) -> JSONResponse:
            kind = "request" if status == 400 else "session"
            return JSONResponse(
                {"detail": {"error": why, "rejected": {RESTART_ROUTE: why}, "kinds": {RESTART_ROUTE: kind}}},
                status_code=status,
            )

        if request.method != "POST":
            return refused(405, f"{RESTART_ROUTE} takes POST")
        try:
            req = RestartRequest.from_json(await request.json())
            hook = load_hook(req.fault) if req.fault is not None else None
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            return refused(400, f"{RESTART_ROUTE}: {e}")
        async with self._lock:
            why = self.busy(self.app) if self.app is not None else None
            if why:
                return refused(409, f"{RESTART_ROUTE} refused: {why}; finish the update first")
            if self.fault is not None:
                seams.restore_all()
                still = seams.replaced_since(self.unfaulted)
                if still:  # the old app now runs part faulted, part not: it serves nothing more
                    why = f"fault hook {self.fault} is not undone: {', '.join(still)} still run its code"
                    if self.app is not None:
                        self.close(self.app)
                    self.app, self.broken = None, f"{why}; start a fresh engine"
                    return refused(409, f"{why}; start a fresh engine instead")
            undone, self.fault = self.fault, None
            t0 = time.perf_counter()
            if req.log_path is not None:
                redirect_output(req.log_path)
            if undone is not None:
                print(f"wsh engine: fault hook {undone} undone", flush=True)
            # The old app goes first, so a restart never holds two models: its state's close drops the
            # weights, a collection frees the app's cycles, and the freed pages go back to the system.
            old, self.app, self.broken = self.app, None, "a restart is in progress"
            if old is not None:
                self.close(old)
            del old
            await asyncio.to_thread(release_memory)
            try:
                if hook is not None:
                    self.fault = req.fault
                    apply_hook(req.fault, hook)
                self.app = await asyncio.to_thread(self.build, req)
            except Exception as e:  # no app now: every route answers 503 until a restart builds one
                self.broken = f"its restart failed: {type(e).__name__}: {e}; restart it again or start a new engine"
                return JSONResponse(
                    {"detail": {"error": f"{RESTART_ROUTE}: the new engine did not build: {type(e).__name__}: {e}"}},
                    status_code=500,
                )
            self.broken = ""
            print(f"wsh engine: restarted in place from {req.checkpoint} (seed {req.seed})", flush=True)
            return JSONResponse({"ok": True, "pid": os.getpid(), "restart_s": time.perf_counter() - t0})

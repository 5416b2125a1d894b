"""A bearer-token check on every route of an engine server, as a pure ASGI middleware.

An engine server that must be reachable from another node (the trainer's) binds to its node's address,
and then anybody who can reach that address could push weights into it: so every request must carry
`Authorization: Bearer <token>`, the run's token, which the harness generates per run and hands to the
engine in the environment variable `WSH_ENGINE_TOKEN` (never on the command line, where `ps` shows it).
Every route is checked (`/health` and the weight-update routes included); only the ASGI lifespan
messages pass. A request without the right token gets 401 and never reaches the app.

Both engine servers load it: the embedded engine adds it when `WSH_ENGINE_TOKEN` is set, vLLM through
its `--middleware wsh_vllm_plugin.auth.BearerTokenMiddleware` option (vLLM's own `--api-key` guards only
paths under `/v1`, `/v2`, `/inference` and `/cohere`, `vllm/entrypoints/serve/middleware/authenticate.py`
`GUARDED_PREFIX`, not the RLHF routes). Stdlib only, so it installs into both environments.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

TOKEN_ENV = "WSH_ENGINE_TOKEN"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def bearer_header(token: str) -> dict[str, str]:
    """The request header that carries `token`: {"Authorization": "Bearer <token>"}."""
    return {"Authorization": f"Bearer {token}"}


class BearerTokenMiddleware:
    """Refuse (401) every HTTP or websocket request whose `Authorization` is not `Bearer <token>`.

    Args:
        app: the ASGI app it guards.
        token: the expected token; None reads `WSH_ENGINE_TOKEN` (how vLLM's `--middleware` builds it).

    Raises:
        RuntimeError: no token given and `WSH_ENGINE_TOKEN` unset or empty (a guard without a token would
            refuse everything, or worse, nothing).
    """

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"BearerTokenMiddleware needs a token: set {TOKEN_ENV}")
        self.app = app
        self._digest = hashlib.sha256(token.encode()).digest()

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries the token (compared in constant time)."""
        if not authorization:
            return False
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(value.strip().encode()).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.allows(headers.get("authorization")):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        why = "missing or wrong bearer token: send Authorization: Bearer <the run's token>"
        body = json.dumps(
            {"detail": {"error": why, "rejected": {"Authorization": why}, "kinds": {"Authorization": "request"}}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

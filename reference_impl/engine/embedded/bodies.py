"""The embedded engine's request bodies and the shape of its error answers.

Bodies: pydantic models that refuse unknown fields; `init_info` and `update_info` stay JSON objects here
and are read by the protocol's `from_json` (`read`), which names the field that breaks a rule. Every
4xx is `{"detail": {"error": sentence, "rejected": {key: reason}, "kinds": {key: kind}}}` (`http_error`;
keys are fields as "body.<field>..." with kind "request", HF names, or routes); a 500 carries the
exception's text and traceback in the same shape with empty maps.
"""

from __future__ import annotations

import traceback
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from wsh_vllm_plugin.protocol import MAX_INT64, InitInfo, ProtocolError, UpdateInfo


class _Body(BaseModel):
    """A request body: an unknown field is a 400 naming it (vLLM ignores some; a typo must not pass)."""

    model_config = ConfigDict(extra="forbid")


class InitRequest(_Body):
    init_info: dict[str, Any]  # read by `InitInfo.from_json` (types, ranges, unknown fields)


def _weight_version(value: Any) -> Any:
    """An int, or its decimal string (vLLM declares `str | None`; the update client sends strings)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    raise ValueError(f"weight_version must be an integer >= 0 or its decimal string, got {type(value).__name__}")


WeightVersion = Annotated[int | None, BeforeValidator(_weight_version), Field(ge=0, le=MAX_INT64)]


class StartRequest(_Body):
    weight_version: WeightVersion = None


class UpdateRequest(_Body):
    update_info: dict[str, Any]  # read by `UpdateInfo.from_json` (types, names, shapes, unknown fields)


class FinishRequest(_Body):
    weight_version: WeightVersion = None


class ProbeRequest(_Body):
    sizes: list[Annotated[int, Field(ge=1, le=MAX_INT64)]] = Field(max_length=1 << 20)


class CheckerRequest(_Body):
    action: Literal["checksum", "shards", "reset", "compare"]
    baseline: dict[str, str] | None = None


def http_error(
    status: int, error: str, rejected: dict[str, str] | None = None, kinds: dict[str, str] | None = None
) -> HTTPException:
    """An error answer: `error` sentence, `rejected` {key: reason}, `kinds` {key: kind}."""
    return HTTPException(status, detail={"error": error, "rejected": rejected or {}, "kinds": kinds or {}})


def request_error(route: str, field: str, msg: str) -> HTTPException:
    """A 400 shaped like the request-validation ones (keyed by the field, kind "request")."""
    return http_error(400, f"bad request body for {route}: {field}: {msg}", {field: msg}, {field: "request"})


def read[T: (InitInfo, UpdateInfo)](cls: type[T], body: dict[str, Any], route: str, key: str) -> T:
    """`cls.from_json(body)`; a broken rule is a 400 keyed by the field (`body.<key>.<field>`, kind "request")."""
    try:
        return cls.from_json(body)
    except ProtocolError as e:
        raise request_error(route, ".".join(filter(None, ("body", key, e.field))), str(e)) from None


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in the engine's shape: a body that fails validation is a 400 keyed by
    its fields (kind "request"); the framework's own errors (404, 405, a body that cannot be parsed at all)
    keep their status, keyed by the route; any other exception is a 500 carrying its traceback."""

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

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Ours carry the detail dict already; the framework's own (404, 405, a body that cannot be parsed at
        # all) carry a sentence: answer those in the same shape, keyed by the route.
        detail = exc.detail
        if not (isinstance(detail, dict) and {"error", "rejected", "kinds"} <= set(detail)):
            why = f"{request.method} {request.url.path}: {detail}"
            detail = {"error": why, "rejected": {request.url.path: why}, "kinds": {request.url.path: "request"}}
        return JSONResponse(status_code=exc.status_code, content={"detail": detail}, headers=exc.headers)

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

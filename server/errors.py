"""One handler maps every error to one status and one JSON body (``kvstore.wire.errors``).

Typed store errors use ``STATUS``, and their body carries the error's ``field`` when the request
part at fault is known (``field_error`` names it); FastAPI's own validation errors become 422
naming the first failing field; unknown routes and methods 404/405; anything else is a 500
whose body says only that (the traceback goes to the log).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvstore.errors import RouteNotFound, Unauthorized
from kvstore.wire.errors import error_body, status_for
from kvstore.errors import InvalidInput, KVStoreError

__all__ = ["install_error_handlers", "field_error", "raise_named", "error_response", "store_error", "unexpected_error",
           "send_error"]

log = logging.getLogger("kvstore.server")


def error_response(exc: BaseException, *, field: str | None = None, status: int | None = None) -> JSONResponse:
    status = status or status_for(exc)
    headers = {"WWW-Authenticate": 'Bearer realm="kvstore"'} if isinstance(exc, Unauthorized) else None
    return JSONResponse(error_body(exc, field=field), status_code=status, headers=headers)


async def send_error(send: Any, exc: BaseException) -> None:
    """Answer ``exc`` from an ASGI middleware, before any route runs, and close the connection
    (the body is left unread)."""
    body = json.dumps(error_body(exc)).encode()
    await send({"type": "http.response.start", "status": status_for(exc),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def raise_named(exc: InvalidInput, field: str) -> None:
    """Raise ``exc`` with ``field`` set when the engine's message starts with it (the engine's
    errors name the argument they are about that way); return when it does not."""
    if exc.field is None and str(exc).startswith(f"{field}:"):
        raise field_error(exc, field) from exc


def field_error(exc: InvalidInput, field: str) -> InvalidInput:
    """The same error class with the field named in front of the message and as its ``field``."""
    message = str(exc)
    named = message.startswith((f"{field}:", f"{field}."))
    return type(exc)(message if named else f"{field}: {message}", field=field)


async def store_error(request: Request, exc: Exception) -> JSONResponse:
    svc = getattr(request.app.state, "svc", None)
    if svc is not None and status_for(exc) in (401, 403):
        svc.metrics.auth_failures.labels(str(status_for(exc))).inc()
    if status_for(exc) >= 500:
        log.warning("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems: list[str] = []
    first_field: str | None = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header")]
        where = ".".join(loc) or "body"
        first_field = first_field or where
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    wrapped = InvalidInput("; ".join(problems) or "invalid request")
    return error_response(wrapped, field=first_field)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code in (404, 405):
        return error_response(RouteNotFound(f"{request.method} {request.url.path}: {exc.detail}"),
                              status=exc.status_code)
    body: dict[str, Any] = {"error": {"type": "ServiceError", "message": str(exc.detail)}}
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("%s %s: unexpected error", request.method, request.url.path)
    return JSONResponse({"error": {"type": "ServiceError", "message": "internal server error"}}, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(KVStoreError, store_error)
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected_error)

"""How errors cross the wire: one status per class, one JSON body, and back.

Every error answer is JSON ``{"error": {"type": T, "message": M, "field": F}}``.
``T`` is the name of a class in ``ERRORS`` and ``STATUS[T]`` its one status;
the server answers with ``error_body`` and the SDK raises ``error_from``'s class.
``F`` (the error's ``field``: the part of the request at fault) is there only when one
is known; a few classes add their own figures (``stored_tokens``, ``tier``, ``limit``...).
Nothing here does I/O.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from kvstore import errors as _e
from kvstore.errors import (Forbidden, InvalidInput, MalformedRequest, PayloadTooLarge, QuotaExceeded, RouteNotFound,
                            ServiceError, TierFull, Unauthorized)

__all__ = ["ERRORS", "STATUS", "status_for", "error_type", "error_body", "error_from"]

ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        *(getattr(_e, name) for name in _e.__all__),
    )
}
"""Every error class that crosses the wire, by name."""

STATUS: dict[str, int] = {
    "KVStoreError": 500,
    "ServiceError": 500,
    "InvalidInput": 422, "InvalidSpec": 422, "InvalidKV": 422, "InvalidTokens": 422, "InvalidKey": 422,
    "FrameError": 422, "CorruptFrame": 422, "UnsupportedFrame": 422,
    "MalformedRequest": 400, "BodyTimeout": 408, "ServerBusy": 503,
    "PayloadTooLarge": 413, "TooManyTokens": 413,
    "Unauthorized": 401,
    "Forbidden": 403,
    "BlockNotFound": 404,
    "RouteNotFound": 404,
    "TierError": 503, "TierUnavailable": 503, "TierIOError": 500, "StoreClosed": 503,
    "TierFull": 507, "QuotaExceeded": 507, "RetainQuotaExceeded": 507,
    "ConnectionFailed": 503, "RequestTimeout": 504,
}
"""One status per error class; a class not listed takes its nearest listed base's."""


def error_type(exc: BaseException) -> str:
    """The name of the nearest class of ``exc`` that the wire knows (``KVStoreError`` at worst)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in STATUS and ERRORS.get(cls.__name__) is cls:
            return cls.__name__
    return "KVStoreError"


def status_for(exc: BaseException) -> int:
    return STATUS[error_type(exc)]


def error_body(exc: BaseException, *, field: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": error_type(exc), "message": str(exc)}
    field = field or getattr(exc, "field", None)
    if field:
        body["field"] = field
    if isinstance(exc, TierFull) and exc.stored_tokens is not None:
        body["stored_tokens"] = exc.stored_tokens
    if isinstance(exc, _e.TierError) and exc.tier:
        body["tier"] = exc.tier
    if isinstance(exc, _e.RetainQuotaExceeded):
        body["retained_bytes"], body["quota_bytes"] = exc.retained_bytes, exc.quota_bytes
    if isinstance(exc, _e.TooManyTokens) and exc.limit is not None:
        body["limit"] = exc.limit
    return {"error": body}


def error_from(status: int, body: bytes | Mapping[str, Any] | None) -> Exception:
    """The exception an error answer stands for (the SDK raises it)."""
    info: Mapping[str, Any] = {}
    if isinstance(body, (bytes, bytearray, memoryview)):
        try:
            parsed = json.loads(bytes(body) or b"{}")
            info = parsed.get("error") or {} if isinstance(parsed, dict) else {}
            if not info and isinstance(parsed, dict) and "detail" in parsed:
                info = {"message": str(parsed["detail"])}
        except ValueError:
            info = {"message": bytes(body[:200]).decode("utf-8", "replace")}
    elif isinstance(body, Mapping):
        info = body.get("error") or {}
    name = str(info.get("type") or "")
    message = str(info.get("message") or f"HTTP {status}")
    cls = ERRORS.get(name)
    if cls is None:
        cls = {400: MalformedRequest, 401: Unauthorized, 403: Forbidden, 404: RouteNotFound, 405: RouteNotFound,
               413: PayloadTooLarge, 422: InvalidInput, 507: QuotaExceeded}.get(status, ServiceError)
    if issubclass(cls, _e.RetainQuotaExceeded):
        exc: Exception = cls(message, status=status, retained_bytes=_int(info.get("retained_bytes")),
                             quota_bytes=_int(info.get("quota_bytes")))
    elif issubclass(cls, ServiceError):
        exc = cls(message, status=status)
    elif issubclass(cls, TierFull):
        exc = cls(message, tier=info.get("tier"), stored_tokens=info.get("stored_tokens"))
    elif issubclass(cls, _e.TierError):
        exc = cls(message, tier=info.get("tier"))
    elif issubclass(cls, _e.TooManyTokens):
        exc = cls(message, limit=_int(info.get("limit")) or None)
    else:
        exc = cls(message)
    field = info.get("field")
    if isinstance(field, str) and field:
        exc.field = field
    return exc


def _int(value: Any) -> int:
    """A byte count from an error body; 0 when absent or not a whole number (an older server)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0

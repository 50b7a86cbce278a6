"""The wire contract between ``server`` and ``client_sdk``: body layouts, headers, errors.

Both sides import this one module, so a layout or a status code is defined once.
Nothing here does I/O.

**KV body** (``application/x-kvstore-kv``), the request of ``POST /v1/kv/put``,
``/v1/kv/get`` and ``/v1/kv/handles``; little-endian, regions 64-byte aligned
so the server can view tokens and KV in place::

    0        4s   magic b"KVW1"
    4        u32  header length H
    8        H    header JSON {"spec": {...}, "n_tokens": N, "kv_tokens": T}
             pad  zeros to a multiple of 64
    tok_at   N*4  token ids, uint32
             pad  zeros to a multiple of 64
    kv_at    ...  KV bytes [num_layers, 2, num_kv_heads, T, head_dim] in spec.dtype,
                  C order; T = 0 (no KV) for get and handles

A get's answer is the KV bytes alone, ``[L, 2, H, n, D]`` of the hit prefix,
with ``X-KV-Tokens: n``, ``X-KV-Shape``, ``X-KV-Dtype`` and a Content-Length, so
a client can receive it straight into the tensor it returns.

**Batch body** (``application/x-kvstore-batch``), the request of
``POST /v1/blocks/put`` and the answer of ``POST /v1/blocks/get``::

    0        4s   magic b"KVB1"
    4        u32  header length H
    8        H    header JSON {"blocks": [{"key": hex, "offset": o, "length": n}, ...]}
                  (offset and length null for a block that is absent)
             pad  zeros to a multiple of 64
    data_at  ...  frames; each at data_at + offset, 64-byte aligned

**Errors**: every error answer is JSON ``{"error": {"type": T, "message": M,
"field": F}}``. ``T`` is the name of a class in ``ERRORS`` and ``STATUS[T]``
its one status; the SDK raises the class of that name.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Iterable, Mapping

from kvstore import errors as _e
from kvstore.errors import InvalidInput, KVStoreError, TierFull

__all__ = [
    "KV_MEDIA", "BATCH_MEDIA", "FRAME_MEDIA", "JSON_MEDIA",
    "H_NAMESPACE", "H_TOKENS", "H_SHAPE", "H_DTYPE", "H_MEDIUM", "H_TIER", "H_CODEC",
    "ServiceError", "Unauthorized", "Forbidden", "MalformedRequest", "BodyTimeout", "PayloadTooLarge",
    "QuotaExceeded", "RouteNotFound", "ConnectionFailed", "RequestTimeout",
    "ERRORS", "STATUS", "status_for", "error_type", "error_body", "error_from",
    "KVHeader", "encode_kv_head", "parse_kv_head", "kv_nbytes",
    "encode_batch_head", "parse_batch_head", "pad64", "host_id", "MAX_TOUCH_KEYS",
]

KV_MEDIA = "application/x-kvstore-kv"
BATCH_MEDIA = "application/x-kvstore-batch"
FRAME_MEDIA = "application/x-kvstore-frame"
JSON_MEDIA = "application/json"

H_NAMESPACE = "x-kv-namespace"
H_TOKENS = "x-kv-tokens"
H_SHAPE = "x-kv-shape"
H_DTYPE = "x-kv-dtype"
H_MEDIUM = "x-kv-medium"
"""Which medium carried the KV: ``http`` or ``shm``; the SDK counts it in ``stats()``."""
H_TIER = "x-kv-tier"
H_CODEC = "x-kv-codec"

_KV_MAGIC = b"KVW1"
_BATCH_MAGIC = b"KVB1"
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 1 << 20
MAX_TOUCH_KEYS = 65_536
"""Keys one access report (``POST /v1/kv/touch``) may carry; a client sends more in further reports."""
_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


# -- errors of the service layer ----------------------------------------------------------


class ServiceError(KVStoreError):
    """The server answered with an error the SDK has no finer class for."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Unauthorized(ServiceError, PermissionError):
    """No bearer token, or one the server does not know (401)."""


class Forbidden(ServiceError, PermissionError):
    """A known token asked for what it may not: another tenant's namespace, or /admin (403)."""


class MalformedRequest(InvalidInput):
    """The body cannot be parsed at all: bad JSON, a bad magic, a length that does not add up (400)."""


class PayloadTooLarge(InvalidInput):
    """The body is over the server's limit (413)."""


class BodyTimeout(ServiceError, TimeoutError):
    """The request body stalled or trickled past the server's ``body_timeout_s`` (408)."""


class QuotaExceeded(ServiceError):
    """The tenant's byte quota would be exceeded (507); nothing was stored."""


class RouteNotFound(ServiceError):
    """No such route, or a method the route does not take (404/405)."""


class ConnectionFailed(ServiceError, ConnectionError):
    """The SDK could not reach the server, after its retries."""


class RequestTimeout(ServiceError, TimeoutError):
    """The server did not answer within the client's timeout (not retried: the request may be running)."""


ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        *(getattr(_e, name) for name in _e.__all__),
        ServiceError, Unauthorized, Forbidden, MalformedRequest, BodyTimeout, PayloadTooLarge, QuotaExceeded,
        RouteNotFound, ConnectionFailed, RequestTimeout,
    )
}
"""Every error class that crosses the wire, by name."""

STATUS: dict[str, int] = {
    "KVStoreError": 500,
    "ServiceError": 500,
    "InvalidInput": 422, "InvalidSpec": 422, "InvalidKV": 422, "InvalidTokens": 422, "InvalidKey": 422,
    "FrameError": 422, "CorruptFrame": 422, "UnsupportedFrame": 422,
    "MalformedRequest": 400, "BodyTimeout": 408,
    "PayloadTooLarge": 413,
    "Unauthorized": 401,
    "Forbidden": 403,
    "BlockNotFound": 404,
    "RouteNotFound": 404,
    "TierError": 503, "TierUnavailable": 503, "TierIOError": 500, "StoreClosed": 503,
    "TierFull": 507, "QuotaExceeded": 507,
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
    if issubclass(cls, ServiceError):
        exc: Exception = cls(message, status=status)
    elif issubclass(cls, TierFull):
        exc = cls(message, tier=info.get("tier"), stored_tokens=info.get("stored_tokens"))
    elif issubclass(cls, _e.TierError):
        exc = cls(message, tier=info.get("tier"))
    else:
        exc = cls(message)
    if info.get("field"):
        exc.field = info["field"]  # type: ignore[attr-defined]
    return exc


# -- KV bodies ----------------------------------------------------------------------------


def pad64(n: int) -> int:
    return -(-n // 64) * 64


def kv_nbytes(spec: Mapping[str, Any], kv_tokens: int) -> int:
    """Bytes of a ``[L, 2, H, kv_tokens, D]`` KV of the wire spec ``spec``."""
    size = _ELEMENT_BYTES.get(str(spec.get("dtype", "float16")))
    if size is None:
        raise InvalidInput(f"spec.dtype must be one of {sorted(_ELEMENT_BYTES)}, got {spec.get('dtype')!r}")
    return int(spec["num_layers"]) * 2 * int(spec["num_kv_heads"]) * kv_tokens * int(spec["head_dim"]) * size


class KVHeader:
    """A parsed KV body head: where tokens and KV start, and how long the body must be."""

    __slots__ = ("spec", "n_tokens", "kv_tokens", "tokens_at", "kv_at", "total")

    def __init__(self, spec: dict, n_tokens: int, kv_tokens: int, tokens_at: int, kv_at: int, total: int) -> None:
        self.spec, self.n_tokens, self.kv_tokens = spec, n_tokens, kv_tokens
        self.tokens_at, self.kv_at, self.total = tokens_at, kv_at, total


def encode_kv_head(spec: Mapping[str, Any], n_tokens: int, kv_tokens: int) -> tuple[bytes, int]:
    """The bytes before the token ids (padding included) and the token region's padded size."""
    head = json.dumps({"spec": dict(spec), "n_tokens": n_tokens, "kv_tokens": kv_tokens},
                      separators=(",", ":")).encode()
    raw = _PREFIX.pack(_KV_MAGIC, len(head)) + head
    return raw + bytes(pad64(len(raw)) - len(raw)), pad64(n_tokens * 4)


def parse_kv_head(data: bytes | memoryview) -> KVHeader:
    """Parse the head of a KV body (at least its first ``8 + H`` bytes).

    Raises:
        MalformedRequest: naming what is wrong (magic, header length, JSON, a field).
    """
    head, hlen = _json_head(data, _KV_MAGIC, "KV")
    spec, n_tokens, kv_tokens = head.get("spec"), head.get("n_tokens"), head.get("kv_tokens", 0)
    if not isinstance(spec, dict):
        raise MalformedRequest("header.spec: required, a JSON object")
    for name, value in (("n_tokens", n_tokens), ("kv_tokens", kv_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**40:
            raise MalformedRequest(f"header.{name}: must be a non-negative integer, got {value!r}")
    tokens_at = pad64(_PREFIX.size + hlen)
    kv_at = tokens_at + pad64(n_tokens * 4)
    try:
        total = kv_at + (kv_nbytes(spec, kv_tokens) if kv_tokens else 0)
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedRequest(f"header.spec: cannot size the KV from it: {exc!r}") from exc
    return KVHeader(spec, n_tokens, kv_tokens, tokens_at, kv_at, total)


def _json_head(data: bytes | memoryview, magic: bytes, what: str) -> tuple[dict, int]:
    """The JSON object after a body's 8-byte prefix (magic, header length), and that length.

    Raises:
        MalformedRequest: naming what is wrong (magic, header length, JSON).
    """
    data = memoryview(data).cast("B")
    if len(data) < _PREFIX.size:
        raise MalformedRequest(f"body: a {what} body starts with {_PREFIX.size} bytes (magic, header length); "
                               f"got {len(data)}")
    got, hlen = _PREFIX.unpack(data[:_PREFIX.size])
    if got != magic:
        raise MalformedRequest(f"body: magic must be {magic!r}, got {bytes(got)!r}")
    if hlen > MAX_HEADER_BYTES or len(data) < _PREFIX.size + hlen:
        raise MalformedRequest(f"body: header length {hlen} runs past the body ({len(data)} bytes) or over 1 MiB")
    try:
        head = json.loads(bytes(data[_PREFIX.size:_PREFIX.size + hlen]))
    except ValueError as exc:
        raise MalformedRequest(f"header: not JSON: {exc}") from exc
    if not isinstance(head, dict):
        raise MalformedRequest("header: must be a JSON object")
    return head, hlen


# -- batch bodies -------------------------------------------------------------------------


def encode_batch_head(blocks: Iterable[Mapping[str, Any]]) -> tuple[bytes, int]:
    """The head of a batch body and where its data region starts."""
    head = json.dumps({"blocks": list(blocks)}, separators=(",", ":")).encode()
    raw = _PREFIX.pack(_BATCH_MAGIC, len(head)) + head
    return raw + bytes(pad64(len(raw)) - len(raw)), pad64(len(raw))


def parse_batch_head(data: bytes | memoryview) -> tuple[list[dict], int]:
    """(blocks, data_at) of a batch body.

    Raises:
        MalformedRequest: naming what is wrong.
    """
    head, hlen = _json_head(data, _BATCH_MAGIC, "batch")
    blocks = head.get("blocks")
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise MalformedRequest("header.blocks: required, a list of objects")
    return blocks, pad64(_PREFIX.size + hlen)


# -- co-location --------------------------------------------------------------------------


def host_id() -> str:
    """Who this kernel is: the boot id and machine id, hashed.

    Equal ids mean the same running kernel; the client still has to open the
    server's shm segment (a container may share the kernel, not ``/dev/shm``).
    """
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path, "rb") as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append(b"")
    return hashlib.sha256(b"kvstore-host\x00" + b"\x00".join(parts)).hexdigest()[:32]

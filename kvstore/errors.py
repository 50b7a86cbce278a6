"""The one error tree of kvstore.

Every error the engine raises on purpose is a ``KVStoreError``. Leaves also
inherit the builtin that a caller would reach for first, so ``except
ValueError`` or ``except KeyError`` keeps working for code that does not know
kvstore. The server maps each class to one HTTP status in one handler and the
SDK maps the status back to the same class (``kvstore.wire.errors``).

    KVStoreError
    ├── InvalidInput (ValueError)            the caller sent something wrong
    │   ├── InvalidSpec                      a KVSpec field is missing or out of range
    │   ├── InvalidKV                        KV shape/dtype off, or NaN/Inf for int8
    │   ├── InvalidTokens                    token ids not a 1-D list of uint32
    │   └── InvalidKey                       a block key that is not 64 hex digits
    ├── FrameError (ValueError)              a stored frame cannot be decoded
    │   ├── CorruptFrame                     magic, length or checksum mismatch
    │   └── UnsupportedFrame                 a version, codec or dtype we do not know
    ├── BlockNotFound (KeyError)             a block asked for by key is not stored
    ├── TierError                            a tier failed to do its job
    │   ├── TierUnavailable (ConnectionError)  its backing is down or unreachable
    │   ├── TierFull                         the frame does not fit
    │   └── TierIOError (OSError)            the backing reported an I/O error
    ├── StoreClosed (RuntimeError)           the store was used after close()
    ├── NotDurable                           a put asked to be durable sits (partly) on volatile tiers
    ├── PutFailed                            a put_kv(wait=False) failed (its error is the cause);
    │                                        the client's next put_kv or flush() says so
    └── ServiceError                         the server answered with an error (status kept)
        ├── Unauthorized (PermissionError)   no bearer token, or an unknown one (401)
        ├── Forbidden (PermissionError)      another tenant's namespace, or /admin (403)
        ├── BodyTimeout (TimeoutError)       a request body stalled (408)
        ├── ServerBusy                       bodies in flight hold the server's memory cap (503)
        ├── QuotaExceeded                    the tenant's byte quota (507)
        │   └── RetainQuotaExceeded          its retained-bytes quota, on retain (507)
        ├── RouteNotFound                    no such route or method (404/405)
        ├── ConnectionFailed (ConnectionError)  the SDK could not reach the server
        └── RequestTimeout (TimeoutError)    no answer within the client's timeout

    InvalidInput also has three service leaves: MalformedRequest (400, a body
    that cannot be parsed), PayloadTooLarge (413) and its TooManyTokens (413,
    more token ids in one request than the server's KVSTORE_MAX_TOKENS_PER_REQUEST).

Every error has ``field``: the part of the request at fault (``spec``, ``tokens``, ``ttl_s``, a
header, ``body``...) when one is, else None; the server's error bodies carry it.

``KVStoreWarning`` (a ``UserWarning``, so outside the tree: nothing failed) is what the store and
the SDK warn with, e.g. a get that found nothing for a spec while the same tokens are stored
under another spec of the same model.

A miss is never an error: tiers return ``None`` and the store returns fewer
tokens. Lower-layer exceptions are translated at the boundary with
``raise ... from exc`` so the cause stays visible.
"""

from __future__ import annotations

__all__ = [
    "KVStoreError",
    "InvalidInput",
    "InvalidSpec",
    "InvalidKV",
    "InvalidTokens",
    "InvalidKey",
    "FrameError",
    "CorruptFrame",
    "UnsupportedFrame",
    "BlockNotFound",
    "TierError",
    "TierUnavailable",
    "TierFull",
    "TierIOError",
    "StoreClosed",
    "NotDurable",
]

SERVICE_ERRORS = [
    "ServiceError", "Unauthorized", "Forbidden", "MalformedRequest", "BodyTimeout", "ServerBusy", "PayloadTooLarge",
    "QuotaExceeded", "RetainQuotaExceeded", "RouteNotFound", "ConnectionFailed", "RequestTimeout", "PutFailed",
    "TooManyTokens",
]
"""The errors of the service layer (the server's answers, the SDK's transport and its queued puts); they are in
``__all__`` too, after the engine's, but ``kvstore`` itself re-exports the engine's alone."""
__all__ += SERVICE_ERRORS


class KVStoreWarning(UserWarning):
    """Something a caller likely wants to know that is not an error: a get that found nothing for
    its spec while the same tokens are stored under another spec of the model (``hint``)."""


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""

    field: str | None = None
    """The request field at fault (``spec``, ``tokens``, ``ttl_s``, a header...), when one is:
    error bodies carry it, and the SDK sets it again on the error it raises."""


class InvalidInput(KVStoreError, ValueError):
    """The caller sent something the store cannot accept; nothing was changed.

    ``field`` names the part of the request at fault, when one is.
    """

    def __init__(self, *args: object, field: str | None = None) -> None:
        super().__init__(*args)
        if field is not None:
            self.field = field


class InvalidSpec(InvalidInput):
    """A KVSpec field is missing, of the wrong type or out of range."""


class InvalidKV(InvalidInput):
    """A KV tensor does not match its spec, or holds values the codec rejects."""


class InvalidTokens(InvalidInput):
    """Token ids are not a 1-D sequence of integers in [0, 2**32)."""


class InvalidKey(InvalidInput):
    """A block key is not 32 bytes (64 hex digits)."""


class FrameError(KVStoreError, ValueError):
    """A frame cannot be decoded. The store treats it as a miss, never as data."""


class CorruptFrame(FrameError):
    """Magic, lengths or a checksum do not match: the bytes were damaged or cut."""


class UnsupportedFrame(FrameError):
    """The frame names a version, codec, dtype or layout this build does not know."""


class BlockNotFound(KVStoreError, KeyError):
    """A block asked for by its key is not stored."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "block not found"


class TierError(KVStoreError):
    """A tier could not do what was asked. ``tier`` names it when known."""

    def __init__(self, message: str, *, tier: str | None = None) -> None:
        super().__init__(message)
        self.tier = tier


class TierUnavailable(TierError, ConnectionError):
    """The tier's backing (a server, a device, a mount) is down or unreachable."""


class TierFull(TierError):
    """The frame does not fit in the tier's capacity.

    ``stored_tokens`` is set when the store raises it from ``put_kv``: the
    tokens that were stored before space ran out.
    """

    def __init__(
        self, message: str, *, tier: str | None = None, stored_tokens: int | None = None
    ) -> None:
        super().__init__(message, tier=tier)
        self.stored_tokens = stored_tokens


class TierIOError(TierError, OSError):
    """The tier's backing reported an I/O error (EIO, a short write, ...)."""


class NotDurable(KVStoreError):
    """A put asked to be durable was stored, but not all of it on a durable tier.

    ``stored_tokens`` were stored (and stay stored); only ``durable_tokens`` of them, a
    prefix, sat on a tier that survives a crash (nvme; Redis with an AOF) when checked.
    """

    def __init__(self, message: str, *, stored_tokens: int, durable_tokens: int) -> None:
        super().__init__(message)
        self.stored_tokens = stored_tokens
        self.durable_tokens = durable_tokens


class StoreClosed(KVStoreError, RuntimeError):
    """The store (or a tier) was used after ``close()``."""


class PutFailed(KVStoreError):
    """A ``put_kv(..., wait=False)`` failed; the SDK raises this once, on the client's next
    ``put_kv`` or ``flush()``, for a caller that never looks at the put's handle.

    The put's own error (``TierFull``, ``QuotaExceeded``, ``NotDurable``...) is ``__cause__``.
    ``tokens`` and ``namespace`` name that put; ``failed`` counts the failures this one error
    reports (the first is the cause; later ones are reported with it, not raised again).
    """

    def __init__(self, message: str, *, tokens: int | None = None, namespace: str | None = None,
                 failed: int = 1) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.namespace = namespace
        self.failed = failed


# -- errors of the service layer (raised by the server's routes and the SDK's transports) ----------------------------------------------------------


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


class TooManyTokens(PayloadTooLarge):
    """A request carries more token ids than the server takes in one request (413,
    ``KVSTORE_MAX_TOKENS_PER_REQUEST``; field ``tokens``); ``limit`` is that cap. Nothing was
    stored or looked up: split the sequence, or raise the server's setting."""

    def __init__(self, message: str, *, limit: int | None = None, field: str | None = "tokens") -> None:
        super().__init__(message, field=field)
        self.limit = limit


class BodyTimeout(ServiceError, TimeoutError):
    """The request body stalled or trickled past the server's ``body_timeout_s`` (408)."""


class ServerBusy(ServiceError):
    """The server is at a cap (503): request bodies in flight hold its memory cap
    (``max_inflight_bytes``; nothing was stored), or it has as many event subscribers as it
    takes (``max_event_subscribers``). The answer's ``Retry-After`` says when to try again."""

    retry_after_s: float = 1.0


class QuotaExceeded(ServiceError):
    """The tenant's byte quota would be exceeded (507); nothing was stored."""


class RetainQuotaExceeded(QuotaExceeded):
    """A ``retain`` would take the tenant's retained bytes over its retention quota
    (``KVSTORE_RETAIN_QUOTA_BYTES``, or the token's ``retain_quota_bytes``) (507); nothing
    new was retained. ``retained_bytes`` and ``quota_bytes`` say where the tenant stands."""

    def __init__(self, message: str, *, retained_bytes: int = 0, quota_bytes: int = 0,
                 status: int | None = 507) -> None:
        super().__init__(message, status=status)
        self.retained_bytes = retained_bytes
        self.quota_bytes = quota_bytes


class RouteNotFound(ServiceError):
    """No such route, or a method the route does not take (404/405)."""


class ConnectionFailed(ServiceError, ConnectionError):
    """The SDK could not reach the server, after its retries."""


class RequestTimeout(ServiceError, TimeoutError):
    """The server did not answer within the client's timeout (not retried: the request may be running)."""

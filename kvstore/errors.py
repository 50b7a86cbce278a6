"""The one error tree of kvstore.

Every error the engine raises on purpose is a ``KVStoreError``. Leaves also
inherit the builtin that a caller would reach for first, so ``except
ValueError`` or ``except KeyError`` keeps working for code that does not know
kvstore. The server maps each class to one HTTP status in one handler and the
SDK maps the status back to the same class.

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
    └── NotDurable                           a put asked to be durable sits (partly) on volatile tiers

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


class KVStoreError(Exception):
    """Base of every error kvstore raises on purpose."""


class InvalidInput(KVStoreError, ValueError):
    """The caller sent something the store cannot accept; nothing was changed."""


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

"""LMCache's ``lm://`` wire format, as LMCache 0.5.6 speaks it (``lmcache/v1/protocol.py``).

Read from that file for the format only; this is our own code. Everything is
little-endian int32 with no padding:

    client meta  186 bytes  command, length, fmt, dtype, location, shape[4], key (150 bytes, space-padded)
    server meta   36 bytes  code, length, fmt, dtype, shape[4], location

A PUT is followed by ``length`` payload bytes and gets no answer. A GET gets a
meta (200 and the stored length, fmt, dtype and shape, or 400 and zeros) and,
on a hit, the payload. EXIST and HEALTH get a meta alone. LMCache's connector
reads the 36-byte meta with one ``recv``, so a meta must go out in one send.

LIST: no LMCache 0.5.6 client sends it (its connector's ``list()`` returns None)
and LMCache's server does not answer it. We answer it as LMCache's server code
sketches: a 200 meta whose length is that of a payload of the stored key strings,
one per line.

Keys are ``model@world_size@worker_id@chunk_hash_hex@dtype[@layer_id][@tag%value...]``.
LMCache compares the hash as an integer, so ``0abc`` and ``ABC`` name one chunk:
``LMKey.canonical`` writes each key one way before it becomes a kvstore key.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from enum import IntEnum

from kvstore.errors import MalformedRequest

__all__ = ["BadRequest", "CLIENT_META", "SERVER_META", "Command", "SUCCESS", "FAIL", "MAX_KEY_BYTES", "Request",
           "LMKey", "parse_request", "parse_key", "server_meta", "payload_length", "FORMATS", "DTYPES"]

CLIENT_META = struct.Struct("<9i150s")
SERVER_META = struct.Struct("<9i")
MAX_KEY_BYTES = 150
SUCCESS, FAIL = 200, 400


class BadRequest(MalformedRequest):
    """An lm:// request the listener will not serve; it closes the connection.

    ``reason`` is a short fixed label (for a metric); the message says what was wrong.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Command(IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5


FORMATS = {0: "UNDEFINED", 1: "KV_2LTD", 2: "KV_T2D", 3: "KV_2TD", 4: "BINARY", 5: "BINARY_BUFFER",
           6: "KV_MLA_FMT", 7: "EC_TD", 8: "HS_TD"}
"""LMCache's MemoryFormat values."""
_BINARY_FORMATS = frozenset({4, 5})
"""Formats whose shape does not describe the payload (compressed bytes)."""

DTYPES = {0: (None, 0), 1: ("float16", 2), 2: ("float16", 2), 3: ("bfloat16", 2), 4: ("float32", 4),
          5: ("float64", 8), 6: ("uint8", 1), 7: ("float8_e4m3fn", 1), 8: ("float8_e5m2", 1)}
"""LMCache's dtype codes: (name, bytes per element). Codes 1 and 2 are both float16."""

_KEY_DTYPES = frozenset({"half", "bfloat16", "float", "double", "int8", "uint8", "int16", "int32", "int64",
                         "bool", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "fp8_e5m2fnuz"})
"""The dtype names LMCache writes into key strings."""
_HASH = re.compile(r"-?[0-9a-fA-F]+")
_INT = re.compile(r"-?[0-9]+")
_LAYER = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() takes "²", which int() refuses
_MAX_HASH_DIGITS = 64


@dataclass(frozen=True, slots=True)
class Request:
    """One client meta, checked field by field."""

    command: Command
    length: int
    """Payload bytes that follow (PUT); 0 otherwise."""
    fmt: int
    dtype: int
    shape: tuple[int, int, int, int]
    key: str
    """The key string with its padding stripped (not yet parsed: LIST and HEALTH ignore it)."""


@dataclass(frozen=True, slots=True)
class LMKey:
    """A parsed LMCache cache-engine key."""

    model: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    layer_id: int | None = None
    tags: tuple[tuple[str, str], ...] = ()

    def canonical(self) -> str:
        """One spelling per key (lowercase hex, no leading zeros), as LMCache writes it."""
        h = f"-{-self.chunk_hash:x}" if self.chunk_hash < 0 else f"{self.chunk_hash:x}"
        parts = [self.model, str(self.world_size), str(self.worker_id), h, self.dtype]
        if self.layer_id is not None:
            parts.append(str(self.layer_id))
        parts += [f"{k}%{v}" for k, v in self.tags]
        return "@".join(parts)

    def model_part(self) -> str:
        """What identifies the model and the worker's shard: entries of one share a fingerprint."""
        return "@".join([self.model, str(self.world_size), str(self.worker_id), self.dtype])


def parse_request(buf: bytes | memoryview) -> Request:
    """A client meta from its 186 bytes.

    Raises:
        BadRequest: an unknown command, format or dtype code, a negative length or
            shape, or a key that is not UTF-8.
    """
    cmd, length, fmt, dtype, _location, s0, s1, s2, s3, raw_key = CLIENT_META.unpack(buf)
    try:
        command = Command(cmd)
    except ValueError:
        raise BadRequest("unknown command", f"unknown command {cmd} (known: {[c.value for c in Command]})") from None
    if fmt not in FORMATS:
        raise BadRequest("unknown format", f"unknown memory format {fmt} (known: 0-{max(FORMATS)})")
    if dtype not in DTYPES:
        raise BadRequest("unknown dtype", f"unknown dtype code {dtype} (known: 0-{max(DTYPES)})")
    if length < 0 or min(s0, s1, s2, s3) < 0:
        raise BadRequest("negative field", f"negative length or shape: length {length}, shape {[s0, s1, s2, s3]}")
    try:
        key = raw_key.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest("malformed key", f"the key is not UTF-8: {exc}") from None
    # LMCache pads with spaces and strips whitespace; NUL padding (a C client's habit) goes too.
    return Request(command, length, fmt, dtype, (s0, s1, s2, s3), key.strip().strip("\x00").strip())


def parse_key(text: str) -> LMKey:
    """An ``LMKey`` from its string form.

    Raises:
        BadRequest: the string is not a cache-engine key.
    """
    parts = text.split("@")
    if len(parts) < 5 or not parts[0]:
        raise BadRequest("malformed key", f"key {text[:80]!r}: need model@world_size@worker_id@chunk_hash@dtype")
    model, ws, worker, chunk, dtype, *rest = parts
    if not (_INT.fullmatch(ws) and _INT.fullmatch(worker)):
        raise BadRequest("malformed key", f"key {text[:80]!r}: world_size and worker_id must be integers")
    if not _HASH.fullmatch(chunk) or len(chunk) > _MAX_HASH_DIGITS:
        raise BadRequest("malformed key",
                         f"key {text[:80]!r}: the chunk hash must be hex (at most {_MAX_HASH_DIGITS} digits)")
    if dtype not in _KEY_DTYPES:
        raise BadRequest("malformed key", f"key {text[:80]!r}: unknown dtype {dtype!r}")
    layer_id = None
    if rest and _LAYER.fullmatch(rest[0]):  # a layer-wise key (LMCache's LayerCacheEngineKey)
        layer_id, rest = int(rest[0]), rest[1:]
    tags = []
    for tag in rest:
        name, sep, value = tag.partition("%")
        if not sep or not name:
            raise BadRequest("malformed key", f"key {text[:80]!r}: a tag must be name%value, got {tag!r}")
        tags.append((name, value))
    return LMKey(model, int(ws), int(worker), int(chunk, 16), dtype, layer_id, tuple(tags))


def payload_length(fmt: int, dtype: int, shape: tuple[int, ...]) -> int | None:
    """The payload bytes a chunk of this format, dtype and shape takes; None where the
    shape does not say (binary formats, no dtype).

    LMCache strips trailing zero dims from a shape (keeping one) before it sizes a buffer.
    """
    size = DTYPES[dtype][1]
    if fmt in _BINARY_FORMATS or not size:
        return None
    dims = list(shape)
    while len(dims) > 1 and dims[-1] == 0:
        dims.pop()
    return math.prod(dims) * size


def server_meta(code: int, length: int = 0, fmt: int = 1, dtype: int = 2,
                shape: tuple[int, int, int, int] = (0, 0, 0, 0)) -> bytes:
    """A 36-byte server meta. The defaults are LMCache's filler for answers without a payload."""
    return SERVER_META.pack(code, length, fmt, dtype, *shape, 0)

"""The REST wire contract between ``server`` and ``client_sdk``: body layouts and headers.

Both sides import this one module, so a layout is defined once. Nothing here does
I/O. Error answers are ``kvstore.wire.errors``.

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
a client can receive it straight into the tensor it returns; ``X-KV-Hint`` when
nothing was found but the tokens are stored under another spec of the model.

**Batch body** (``application/x-kvstore-batch``), the request of
``POST /v1/blocks/put`` and the answer of ``POST /v1/blocks/get``::

    0        4s   magic b"KVB1"
    4        u32  header length H
    8        H    header JSON {"blocks": [{"key": hex, "offset": o, "length": n}, ...]}
                  (offset and length null for a block that is absent)
             pad  zeros to a multiple of 64
    data_at  ...  frames; each at data_at + offset, 64-byte aligned

**Block-major KV body** (``application/x-kvstore-kv-blocks.v2``), a request of ``POST /v1/kv/put``
only: the KV body's head and tokens as above, ``kv_tokens`` = the tokens of the full blocks
(``n_tokens`` rounded down to ``block_tokens``), then each full block one after another, block 0
first, each as a 48-byte label and its KV::

    0        4s   magic b"KVBL"
    4        u32  depth (the block's index in the chain: 0, 1, ...)
    8        u64  KV bytes that follow (``spec.block_nbytes``)
    16       32s  the block's key (``kvstore.keys.block_hashes`` under the request's namespace)
    48       ...  KV ``[num_layers, 2, num_kv_heads, block_tokens, head_dim]`` in C order:
                  exactly the payload of that block's raw frame

The KV is the token-major body's, in another order, so the server receives each block straight
into its frame. The label lets it refuse, before anything is stored, a body whose blocks came out
of order or were cut, or whose KV was keyed for other tokens, another model or another namespace
(its bytes alone cannot tell). The first block-major body (``...kv-blocks``, no labels) is no
longer taken: a client that sends it gets 400 ``content-type`` and falls back to ``KV_MEDIA``.
``/v1/info`` lists the put bodies a server takes in ``put_media`` (absent: ``KV_MEDIA`` only).

"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Iterable, Mapping

from kvstore.errors import InvalidInput, MalformedRequest

__all__ = [
    "KV_MEDIA", "BATCH_MEDIA", "FRAME_MEDIA", "JSON_MEDIA",
    "H_NAMESPACE", "H_TOKENS", "H_SHAPE", "H_DTYPE", "H_MEDIUM", "H_TIER", "H_CODEC", "H_HINT",
    "KVHeader", "encode_kv_head", "encode_kv_head_json", "parse_kv_head", "kv_nbytes",
    "encode_batch_head", "parse_batch_head", "pad64", "host_id", "MAX_TOUCH_KEYS", "MAX_HEADER_BYTES",
    "RESERVE_NO_ROOM", "RESERVE_OFF",
    "KV_BLOCKS_MEDIA", "PUT_MEDIA", "KV_PREFIX_BYTES", "kv_tokens_at", "check_block_head",
    "BLOCK_LABEL_BYTES", "encode_block_labels", "check_block_label",
]

KV_MEDIA = "application/x-kvstore-kv"
BATCH_MEDIA = "application/x-kvstore-batch"
FRAME_MEDIA = "application/x-kvstore-frame"
JSON_MEDIA = "application/json"

H_NAMESPACE = "x-kv-namespace"
H_AGENT = "x-kv-agent"
"""Who is calling (the SDK's agent id, one per client unless named): the server learns hand-offs
from which agent writes a chain and which one reads it next (``kvstore.engine.prefetch``)."""
H_TOKENS = "x-kv-tokens"
H_SHAPE = "x-kv-shape"
H_DTYPE = "x-kv-dtype"
H_MEDIUM = "x-kv-medium"
"""Which medium carried the KV: ``http`` or ``shm``; the SDK counts it in ``stats()``."""
H_TIER = "x-kv-tier"
H_CODEC = "x-kv-codec"
H_HINT = "x-kv-hint"
"""On a get that found nothing: the same tokens' first block is stored under another spec of the
model, and how that spec differs (``kvstore.engine.hints``); the JSON answers carry it as ``hint``."""

_KV_MAGIC = b"KVW1"
_BATCH_MAGIC = b"KVB1"
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 1 << 20
MAX_TOUCH_KEYS = 65_536
"""Keys one access report (``POST /v1/kv/touch``) may carry; a client sends more in further reports."""
_ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


# -- KV bodies ----------------------------------------------------------------------------


def pad64(n: int) -> int:
    return -(-n // 64) * 64


def kv_nbytes(spec: Mapping[str, Any], kv_tokens: int) -> int:
    """Bytes of a ``[L, 2, H, kv_tokens, D]`` KV of the wire spec ``spec``."""
    size = _ELEMENT_BYTES.get(str(spec.get("dtype", "float16")))
    if size is None:
        raise InvalidInput(f"spec.dtype must be one of {sorted(_ELEMENT_BYTES)}, got {spec.get('dtype')!r}",
                           field="spec.dtype")
    return int(spec["num_layers"]) * 2 * int(spec["num_kv_heads"]) * kv_tokens * int(spec["head_dim"]) * size


class KVHeader:
    """A parsed KV body head: where tokens and KV start, and how long the body must be."""

    __slots__ = ("spec", "n_tokens", "kv_tokens", "tokens_at", "kv_at", "total", "fields")

    def __init__(self, spec: dict, n_tokens: int, kv_tokens: int, tokens_at: int, kv_at: int, total: int,
                 fields: dict | None = None) -> None:
        self.spec, self.n_tokens, self.kv_tokens = spec, n_tokens, kv_tokens
        self.tokens_at, self.kv_at, self.total = tokens_at, kv_at, total
        self.fields = fields or {}
        """The whole JSON head: a route's own fields ride beside spec and counts (a pooled put's writes)."""


def encode_kv_head(spec: Mapping[str, Any], n_tokens: int, kv_tokens: int) -> tuple[bytes, int]:
    """The bytes before the token ids (padding included) and the token region's padded size."""
    return encode_kv_head_json(json.dumps(dict(spec), separators=(",", ":")), n_tokens, kv_tokens)


def encode_kv_head_json(spec_json: str, n_tokens: int, kv_tokens: int, extra: str = "") -> tuple[bytes, int]:
    """``encode_kv_head`` from the spec's JSON, encoded once by the caller (a client sends the
    same spec with every call: no JSON encoder on its hot path). ``extra``: more members of the
    head object, as JSON text starting with a comma (``KVHeader.fields`` has them)."""
    head = f'{{"spec":{spec_json},"n_tokens":{int(n_tokens)},"kv_tokens":{int(kv_tokens)}{extra}}}'.encode()
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
        raise MalformedRequest("header.spec: required, a JSON object", field="header.spec")
    for name, value in (("n_tokens", n_tokens), ("kv_tokens", kv_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**40:
            raise MalformedRequest(f"header.{name}: must be a non-negative integer, got {value!r}",
                                   field=f"header.{name}")
    tokens_at = pad64(_PREFIX.size + hlen)
    kv_at = tokens_at + pad64(n_tokens * 4)
    try:
        total = kv_at + (kv_nbytes(spec, kv_tokens) if kv_tokens else 0)
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedRequest(f"header.spec: cannot size the KV from it: {exc!r}", field="header.spec") from exc
    return KVHeader(spec, n_tokens, kv_tokens, tokens_at, kv_at, total, head)


def _json_head(data: bytes | memoryview, magic: bytes, what: str) -> tuple[dict, int]:
    """The JSON object after a body's 8-byte prefix (magic, header length), and that length.

    Raises:
        MalformedRequest: naming what is wrong (magic, header length, JSON).
    """
    data = memoryview(data).cast("B")
    if len(data) < _PREFIX.size:
        raise MalformedRequest(f"body: a {what} body starts with {_PREFIX.size} bytes (magic, header length); "
                               f"got {len(data)}", field="body")
    got, hlen = _PREFIX.unpack(data[:_PREFIX.size])
    if got != magic:
        raise MalformedRequest(f"body: magic must be {magic!r}, got {bytes(got)!r}", field="body")
    if hlen > MAX_HEADER_BYTES or len(data) < _PREFIX.size + hlen:
        raise MalformedRequest(f"body: header length {hlen} runs past the body ({len(data)} bytes) or over 1 MiB",
                               field="body")
    try:
        head = json.loads(bytes(data[_PREFIX.size:_PREFIX.size + hlen]))
    except ValueError as exc:
        raise MalformedRequest(f"header: not JSON: {exc}", field="header") from exc
    if not isinstance(head, dict):
        raise MalformedRequest("header: must be a JSON object", field="header")
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
        raise MalformedRequest("header.blocks: required, a list of objects", field="header.blocks")
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


RESERVE_NO_ROOM = "no_room"
"""``reason`` of a reservation or pool answer with no slots: the top tier has no room now (try later)."""
RESERVE_OFF = "reserved_puts_off"
"""``reason`` of a reservation or pool answer with no slots: this server takes no reserved puts (stop asking)."""


# -- block-major KV bodies (``POST /v1/kv/put``) ---------------------------------------------

KV_BLOCKS_MEDIA = "application/x-kvstore-kv-blocks.v2"
"""A put whose KV comes block after block, each labelled and then its raw frame's payload (module
docstring)."""
PUT_MEDIA = (KV_MEDIA, KV_BLOCKS_MEDIA)
"""The KV bodies ``POST /v1/kv/put`` takes, as ``/v1/info`` lists them (``put_media``)."""
KV_PREFIX_BYTES = _PREFIX.size
"""A KV body's first bytes (magic, header length): what ``kv_tokens_at`` reads."""


def kv_tokens_at(prefix: bytes | memoryview) -> int:
    """Where a KV body's token ids start (its head, padded), from its first ``KV_PREFIX_BYTES``:
    how much a reader that receives a body part by part must take before ``parse_kv_head``.

    Raises:
        MalformedRequest: not a KV body's start (magic), or a header over ``MAX_HEADER_BYTES``.
    """
    data = memoryview(prefix).cast("B")
    if len(data) < _PREFIX.size:
        raise MalformedRequest(f"body: a KV body starts with {_PREFIX.size} bytes (magic, header length); "
                               f"got {len(data)}", field="body")
    magic, hlen = _PREFIX.unpack(data[:_PREFIX.size])
    if magic != _KV_MAGIC:
        raise MalformedRequest(f"body: magic must be {_KV_MAGIC!r}, got {bytes(magic)!r}", field="body")
    if hlen > MAX_HEADER_BYTES:
        raise MalformedRequest(f"body: header length {hlen} is over 1 MiB", field="body")
    return pad64(_PREFIX.size + hlen)


def check_block_head(head: KVHeader, block_tokens: int) -> int:
    """The full blocks a block-major body's head describes, once its ``kv_tokens`` is theirs.

    Raises:
        InvalidInput: (``header.kv_tokens``) not ``n_tokens`` rounded down to whole blocks.
    """
    blocks = head.n_tokens // block_tokens
    if head.kv_tokens != blocks * block_tokens:
        raise InvalidInput(f"header.kv_tokens: a block-major body carries the KV of its {blocks} full blocks "
                           f"({blocks * block_tokens} tokens of {head.n_tokens}, {block_tokens} a block), "
                           f"got {head.kv_tokens}", field="header.kv_tokens")
    return blocks


_BLOCK_MAGIC = b"KVBL"
_BLOCK_LABEL = struct.Struct("<4sIQ32s")
BLOCK_LABEL_BYTES = _BLOCK_LABEL.size
"""The label before each block of a block-major body (module docstring)."""


def encode_block_labels(keys: Iterable[bytes], nbytes: int) -> bytes:
    """The labels of a block-major body's blocks, one after another (a sender interleaves them
    with the blocks' KV): block ``i`` is labelled depth ``i``, ``nbytes`` and ``keys[i]``."""
    return b"".join(_BLOCK_LABEL.pack(_BLOCK_MAGIC, depth, nbytes, bytes(key)) for depth, key in enumerate(keys))


def check_block_label(label: bytes | memoryview, depth: int, key: bytes, nbytes: int) -> None:
    """Refuse the label of a block-major body's block ``depth`` unless it is the one a sender of
    that block writes: in order, of ``nbytes``, keyed ``key`` (the receiver's own key of it).

    Raises:
        MalformedRequest: (field ``body``) not a label, another depth (blocks out of order or one
            left out), another length.
        InvalidInput: (field ``body``) another key: KV keyed for other tokens, another model's
            spec or another namespace than the request's.
    """
    magic, got_depth, got_bytes, got_key = _BLOCK_LABEL.unpack(label)
    if magic != _BLOCK_MAGIC:
        raise MalformedRequest(f"body: block {depth} must start with its {BLOCK_LABEL_BYTES}-byte label "
                               f"(magic {_BLOCK_MAGIC!r}), got {bytes(magic)!r}", field="body")
    if got_depth != depth:
        raise MalformedRequest(f"body: block {depth} is labelled block {got_depth}: blocks come in chain order, "
                               f"block 0 first, none left out", field="body")
    if got_bytes != nbytes:
        raise MalformedRequest(f"body: block {depth} is labelled {got_bytes} bytes; a block of this spec is "
                               f"{nbytes}", field="body")
    if got_key != key:
        raise InvalidInput(f"body: block {depth} is keyed {got_key.hex()[:16]}..., not {bytes(key).hex()[:16]}..., "
                           f"its key under this request's namespace and spec: KV for other tokens, another "
                           f"model or another namespace", field="body")

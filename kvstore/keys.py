"""Chained block keys.

``h_i = blake3(h_{i-1} || token ids of block i)`` with
``h_{-1} = blake3(domain || namespace || spec fingerprint)``.

Token ids are fixed-width (uint32, little-endian), and the namespace is
length-prefixed, so two different inputs never encode to the same bytes; with
a cryptographic hash no choice of token values can make two blocks collide.
Python's ``hash()`` is never used: it is salted per process (keys would differ
between the writer and the reader) and it is not collision resistant.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Iterator, NewType

import blake3
import numpy as np
import torch

from kvstore.errors import InvalidKey, InvalidSpec, InvalidTokens
from kvstore.spec import KVSpec

__all__ = [
    "BlockHash",
    "meta_prefix",
    "surely_names",
    "HASH_BYTES",
    "root_hash",
    "block_hashes",
    "iter_block_hashes",
    "block_meta",
    "named_key",
    "name_fingerprint",
    "normalize_tokens",
    "validate_namespace",
    "to_hex",
    "from_hex",
    "check_key",
]

BlockHash = NewType("BlockHash", bytes)
"""32 bytes naming one block of one token sequence under one namespace and spec."""

HASH_BYTES = 32
_DOMAIN = b"kvstore/block-key/v1\x00"  # bump if the encoding ever changes
_NAMED = b"kvstore/named-key/v1\x00"
_NAMED_SPEC = b"kvstore/named-spec/v1\x00"
_NAMESPACE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
_TOKEN_DTYPE = np.dtype("<u4")
_MAX_TOKEN = 2**32 - 1


def validate_namespace(namespace: Any) -> str:
    """Return ``namespace`` if it is 1-128 characters of ``[A-Za-z0-9._-]``.

    The alphabet keeps namespaces safe in URLs, Redis keys and file names.

    Raises:
        InvalidSpec: otherwise.
    """
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise InvalidSpec(f"namespace must be 1-128 characters of [A-Za-z0-9._-], got {namespace!r}")
    return namespace


def normalize_tokens(tokens: Any) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array.

    Args:
        tokens: a list/tuple/range of ints, or a 1-D integer numpy array or torch tensor.

    Raises:
        InvalidTokens: for floats, bools, nested lists, or ids outside [0, 2**32).
    """
    if type(tokens) is np.ndarray and tokens.dtype == _TOKEN_DTYPE and tokens.ndim == 1 and tokens.flags.c_contiguous:
        return tokens  # already normalized (a caller's layer passing ids on): nothing to check or copy
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidTokens(f"token ids must be integers, got a tensor of {tokens.dtype}")
        try:
            arr = tokens.detach().to("cpu").numpy()
        except (RuntimeError, TypeError, NotImplementedError) as exc:  # meta, sparse, quantized
            raise InvalidTokens(f"token ids must be a dense integer tensor: {exc}") from exc
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, (list, tuple)) and set(map(type, tokens)) == {int}:
        # the common case, in one pass: numpy refuses (OverflowError) ids outside uint32
        try:
            return np.array(tokens, dtype=_TOKEN_DTYPE)
        except OverflowError:
            raise InvalidTokens(f"token ids must be in [0, 2**32), got min {min(tokens)} max {max(tokens)}") from None
    elif isinstance(tokens, (list, tuple, range)):
        if not isinstance(tokens, range) and bool in set(map(type, tokens)):
            raise InvalidTokens("token ids must be integers, got a bool")  # np.asarray would make it 0/1
        try:
            arr = np.asarray(tokens) if len(tokens) else np.zeros(0, dtype=np.int64)
        except (ValueError, OverflowError, TypeError) as exc:
            raise InvalidTokens(f"token ids must be a flat list of integers: {exc}") from exc
    else:
        raise InvalidTokens(f"tokens must be a list of ints or a 1-D integer tensor, got {type(tokens).__name__}")
    if arr.ndim != 1:
        raise InvalidTokens(f"tokens must be 1-D, got shape {list(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise InvalidTokens(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and not (arr.dtype.kind == "u" and arr.dtype.itemsize <= 4):  # narrow unsigned ids always fit
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _MAX_TOKEN:
            raise InvalidTokens(f"token ids must be in [0, 2**32), got min {lo} max {hi}")
    return np.ascontiguousarray(arr, dtype=_TOKEN_DTYPE)


def root_hash(spec: KVSpec, namespace: str) -> BlockHash:
    """``h_{-1}``: the seed every chain of ``spec`` under ``namespace`` starts from."""
    return _root(spec.fingerprint(), namespace)


@functools.lru_cache(maxsize=1024)  # a few specs and namespaces per process; a hit skips a regex and a hash
def _root(fingerprint: str, namespace: str) -> BlockHash:
    ns = validate_namespace(namespace).encode()
    h = blake3.blake3(_DOMAIN)
    h.update(len(ns).to_bytes(2, "little"))
    h.update(ns)
    h.update(bytes.fromhex(fingerprint))
    return BlockHash(h.digest())


def iter_block_hashes(spec: KVSpec, tokens: Any, namespace: str = "default") -> Iterator[BlockHash]:
    """Yield the key of each full block of ``tokens``, in order.

    Lazy, so a prefix walk that stops at the first miss hashes no further.

    Raises:
        InvalidTokens, InvalidSpec: before the first key is yielded.
    """
    data = memoryview(normalize_tokens(tokens)).cast("B")
    stride = spec.block_tokens * _TOKEN_DTYPE.itemsize
    prev = root_hash(spec, namespace)
    return _chain(prev, data, stride, len(data) // stride)


def _chain(prev: bytes, data: memoryview, stride: int, n_blocks: int) -> Iterator[BlockHash]:
    for i in range(n_blocks):
        h = blake3.blake3(prev)
        h.update(data[i * stride : (i + 1) * stride])
        prev = h.digest()
        yield BlockHash(prev)


def block_hashes(spec: KVSpec, tokens: Any, namespace: str = "default") -> list[BlockHash]:
    """The keys of every full block of ``tokens``; the tail gets none."""
    return list(iter_block_hashes(spec, tokens, namespace))


def block_meta(namespace: str, spec_fingerprint: str, depth: int, **extra: Any) -> bytes:
    """The metadata every stored frame carries: namespace, spec fingerprint and chain depth.

    Kept in the frame so a durable tier's contents can be re-indexed after a
    restart, and so a frame put by key is checked against the request's namespace.
    ``extra`` (JSON values) rides along for whoever wrote the frame, e.g. another
    protocol's description of its payload.
    """
    if not extra and type(depth) is int and type(spec_fingerprint) is str and type(namespace) is str:
        return _meta_head(namespace, spec_fingerprint) + str(depth).encode() + b"}"  # a put makes one a block
    return json.dumps({"v": 1, "ns": validate_namespace(namespace), "spec": spec_fingerprint, "depth": depth,
                       **extra}, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=1024)
def _meta_head(namespace: str, spec_fingerprint: str) -> bytes:
    """``block_meta``'s bytes before the depth: the same ``json.dumps`` writes."""
    return json.dumps({"v": 1, "ns": validate_namespace(namespace), "spec": spec_fingerprint, "depth": 0},
                      separators=(",", ":")).encode()[:-2]


def meta_prefix(namespace: str) -> bytes:
    """How every ``block_meta`` of ``namespace`` begins: a reader checks a frame's namespace by it."""
    return b'{"v":1,"ns":' + json.dumps(validate_namespace(namespace)).encode() + b","


def surely_names(meta: bytes, prefix: bytes) -> bool:
    """Whether block metadata ``meta`` names the namespace whose ``meta_prefix`` is ``prefix``,
    decided without parsing it: True only when sure; False means "parse it" (``json.loads``, whose
    answer a reader must then follow), not "another namespace".

    Sure when ``meta`` starts with the prefix, holds no escape and spells the key ``"ns"`` once: a
    later duplicate key, which ``json.loads`` would let win, needs a second spelling or an escape.
    """
    return meta.startswith(prefix) and b"\\" not in meta and meta.count(b'"ns"') == 1


def named_key(namespace: str, domain: str, name: str) -> BlockHash:
    """The key of an entry named by a string instead of a token chain (another system's key).

    ``blake3(named-domain || namespace || domain || name)``, every part length-prefixed, so
    it never equals a token-chain key, another namespace's or another domain's.
    """
    h = blake3.blake3(_NAMED)
    for part in (validate_namespace(namespace), domain, name):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return BlockHash(h.digest())


def name_fingerprint(domain: str, name: str) -> str:
    """A spec fingerprint (64 hex digits) for entries of another system's model, named by ``name``."""
    h = blake3.blake3(_NAMED_SPEC)
    h.update(f"{domain}\x00{name}".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def to_hex(key: bytes) -> str:
    """The 64-digit lowercase hex form used in URLs and logs."""
    return key.hex()


def from_hex(text: Any) -> BlockHash:
    """Parse a 64-digit hex key.

    Raises:
        InvalidKey: for anything else (wrong length, non-hex, not a string).
    """
    if not isinstance(text, str) or not _HEX.fullmatch(text):
        raise InvalidKey(f"a block key is 64 hex digits, got {str(text)[:80]!r}")
    return BlockHash(bytes.fromhex(text))


def check_key(key: Any) -> BlockHash:
    """Return ``key`` if it is 32 bytes; tiers and the index take only these.

    Raises:
        InvalidKey: otherwise.
    """
    if type(key) is not bytes or len(key) != HASH_BYTES:  # BlockHash is bytes at run time
        raise InvalidKey(f"a block key is {HASH_BYTES} bytes, got {type(key).__name__} of length {_len(key)}")
    return BlockHash(key)


def _len(value: Any) -> str:
    try:
        return str(len(value))
    except TypeError:
        return "?"

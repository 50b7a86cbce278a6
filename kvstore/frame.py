"""The frame format: a frame's header, written and read.

A frame is the unit every tier stores. Tiers see opaque bytes; only ``kvstore.codec`` (which
encodes and decodes the body) and this module look inside. Layout (little-endian, every region
64-byte aligned so payloads can be viewed in place)::

    header   magic "KVSF", version, codec, dtype, flags, scale layout,
             scale dtype, ndim, meta length, scales length, payload length,
             raw payload length, body checksum, shape (u64 each),
             zero padding, header checksum (xxh3-64 of all before it)
    meta     caller bytes (e.g. JSON), padded to 64
    scales   int8 only: K scales [L, H, 1, D] then V scales [L, H, T, 1], padded to 64
    payload  raw: the tensor's bytes; int8: int8 values, lz4-compressed if flagged

The body checksum (xxh3-64) covers meta, scales and payload, so a flipped bit anywhere in a
frame is a typed error, never wrong KV. Readers of many frames of one layout (an arena's
server-verified slots) compare layout bytes instead of parsing each header
(``layout_prefix``, ``header_like``, ``meta_span``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import xxhash

from kvstore.errors import CorruptFrame, InvalidInput, InvalidKV, UnsupportedFrame
from kvstore.spec import DTYPES

__all__ = [
    "MAGIC", "VERSION", "ALIGN", "MAX_NDIM", "MAX_META_BYTES", "MAX_ELEMENTS", "LZ4_MAX_BYTES", "FLAG_LZ4",
    "FRAME_DTYPES", "SCALE_ID", "LAYOUT_NONE", "LAYOUT_KIVI", "HEAD_BYTES",
    "Codec", "FrameHeader", "pad", "header_size", "scale_counts", "kv_shape", "seal", "read_header", "trusted_meta", "meta_span",
    "layout_of", "layout_prefix", "layout_matches", "header_like", "bytes_view",
]

MAGIC = b"KVSF"
VERSION = 1
ALIGN = 64
MAX_NDIM = 8
MAX_META_BYTES = 1 << 20
MAX_ELEMENTS = 1 << 40  # guards shape fields of a damaged or hostile frame

_FIXED = struct.Struct("<4sBBBBBBBBIQQQQ")  # 48 bytes, then ndim u64 dims, pad, u64 checksum
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
FLAG_LZ4 = 0x01

# lz4 cannot expand more than ~255x; a header claiming more is a decompression bomb.
_LZ4_MAX_RATIO = 256
# python-lz4's block API takes at most this many bytes in or out.
LZ4_MAX_BYTES = 0x7E000000


class Codec(str, Enum):
    """How a frame's payload is encoded."""

    RAW = "raw"
    INT8 = "int8"
    INT8_LZ4 = "int8+lz4"

    @classmethod
    def parse(cls, value: "str | Codec") -> "Codec":
        try:
            return cls(value)
        except ValueError:
            raise InvalidInput(f"unknown codec {value!r}; known: {[c.value for c in cls]}") from None


_CODEC_ID = {Codec.RAW: 1, Codec.INT8: 2, Codec.INT8_LZ4: 3}
_CODEC_BY_ID = {v: k for k, v in _CODEC_ID.items()}
FRAME_DTYPES = {**DTYPES, "uint8": torch.uint8}
"""KV dtypes, and uint8 for frames of opaque bytes (another system's payload, kept exactly): raw only."""
_DTYPE_ID = {"float16": 1, "bfloat16": 2, "float32": 3, "uint8": 4}
_DTYPE_BY_ID = {v: k for k, v in _DTYPE_ID.items()}
LAYOUT_NONE, LAYOUT_KIVI = 0, 1  # KIVI: K per channel, V per token
SCALE_ID = {"float16": 1, "float32": 2}
_SCALE_BY_ID = {v: k for k, v in SCALE_ID.items()}


def pad(n: int) -> int:
    """``n`` rounded up to the next multiple of ``ALIGN``: every region of a frame starts so."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def header_size(ndim: int) -> int:
    """The length of the header of a frame of ``ndim`` dims."""
    return pad(_FIXED.size + 8 * ndim + 8)


def scale_counts(shape: tuple[int, ...]) -> tuple[int, int]:
    """How many K scales and V scales a KV of ``shape`` (``[L, 2, H, T, D]``) has."""
    layers, _, heads, tokens, dim = shape
    return layers * heads * dim, layers * heads * tokens


def kv_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` when int8 can hold a KV of it (a non-empty ``[L, 2, H, T, D]``).

    Raises:
        InvalidKV: any other shape.
    """
    if len(shape) != 5 or shape[1] != 2 or 0 in shape:
        raise InvalidKV(
            f"int8 codec needs a non-empty KV tensor [num_layers, 2, num_kv_heads, num_tokens, head_dim], got {list(shape)}"
        )
    return shape


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """What a frame says about itself, after its header checksum passed."""

    version: int
    codec: Codec
    dtype: str
    shape: tuple[int, ...]
    lz4: bool
    """Whether lz4 was applied to the payload (only when it shrank it)."""
    scale_dtype: str | None
    meta_len: int
    scales_len: int
    payload_len: int
    """Stored payload bytes (after lz4 when applied)."""
    raw_payload_len: int
    """Payload bytes before lz4."""
    body_checksum: int
    header_len: int

    @property
    def meta_offset(self) -> int:
        return self.header_len

    @property
    def scales_offset(self) -> int:
        return self.header_len + pad(self.meta_len)

    @property
    def payload_offset(self) -> int:
        return self.scales_offset + pad(self.scales_len)

    @property
    def frame_len(self) -> int:
        return self.payload_offset + self.payload_len

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the decoded tensor."""
        return self.numel * FRAME_DTYPES[self.dtype].itemsize


def seal(mv: memoryview, codec: Codec, dname: str, shape: tuple[int, ...], meta_len: int, flags: int,
          layout: int, sid: int, scales_len: int, payload_len: int, raw_len: int, *,
          body_sum: int | None = None) -> int:
    """Checksum the body already in ``mv`` (unless its ``body_sum`` is known) and write the header
    in front of it; the frame's length."""
    header_len = header_size(len(shape))
    frame_len = header_len + pad(meta_len) + pad(scales_len) + payload_len
    if body_sum is None:
        body_sum = xxhash.xxh3_64_intdigest(mv[header_len:frame_len])
    fixed = _FIXED.pack(
        MAGIC, VERSION, _CODEC_ID[codec], _DTYPE_ID[dname], flags, layout, sid, len(shape), 0,
        meta_len, scales_len, payload_len, raw_len, body_sum,
    )
    dims = struct.pack(f"<{len(shape)}Q", *shape)
    end = len(fixed) + len(dims)
    mv[: len(fixed)] = fixed
    mv[len(fixed) : end] = dims
    mv[end : header_len - 8] = bytes(header_len - 8 - end)
    mv[header_len - 8 : header_len] = _U64.pack(xxhash.xxh3_64_intdigest(mv[: header_len - 8]))
    return frame_len


def read_header(frame: Any, *, prefix: bool = False) -> FrameHeader:
    """Parse and check a frame's header without hashing its body.

    Args:
        prefix: ``frame`` holds only the frame's first bytes (at least the
            header); its length is then not checked against the header.

    Raises:
        CorruptFrame: bad magic, truncated, trailing bytes, inconsistent lengths
            or a header checksum mismatch.
        UnsupportedFrame: an unknown version, codec, dtype, layout or flag.
    """
    mv = bytes_view(frame)
    if len(mv) < _FIXED.size:
        raise CorruptFrame(f"truncated frame: {len(mv)} bytes, a header needs at least {_FIXED.size}")
    (magic, version, codec_id, dtype_id, flags, layout, sid, ndim, reserved,
     meta_len, scales_len, payload_len, raw_len, body_sum) = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptFrame(f"not a kvstore frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise UnsupportedFrame(f"frame version {version} is not supported (this build reads {VERSION})")
    if not 1 <= ndim <= MAX_NDIM:
        raise CorruptFrame(f"frame header names {ndim} dims (1..{MAX_NDIM} allowed)")
    header_len = header_size(ndim)
    if len(mv) < header_len:
        raise CorruptFrame(f"truncated frame: {len(mv)} bytes, its header alone needs {header_len}")
    (stored_sum,) = _U64.unpack_from(mv, header_len - 8)
    if xxhash.xxh3_64_intdigest(mv[: header_len - 8]) != stored_sum:
        raise CorruptFrame("frame header checksum mismatch")
    # The header is intact from here on: what remains is a writer we do not know.
    codec = _CODEC_BY_ID.get(codec_id)
    dtype = _DTYPE_BY_ID.get(dtype_id)
    if codec is None or dtype is None or reserved or flags & ~FLAG_LZ4:
        raise UnsupportedFrame(f"unknown codec {codec_id}, dtype {dtype_id} or flags {flags:#x}")
    shape = struct.unpack_from(f"<{ndim}Q", mv, _FIXED.size)
    numel = math.prod(shape)
    # a zero dim makes numel 0 whatever the others claim; bound the others too
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS or meta_len > MAX_META_BYTES:
        raise CorruptFrame(f"frame claims shape {list(shape)} and {meta_len} meta bytes")
    lz4 = bool(flags & FLAG_LZ4)
    if codec is Codec.RAW:
        ok = (layout == LAYOUT_NONE and sid == 0 and scales_len == 0 and not lz4
              and payload_len == raw_len == numel * FRAME_DTYPES[dtype].itemsize)
        scale_dtype = None
    else:
        scale_dtype = _SCALE_BY_ID.get(sid)
        if layout != LAYOUT_KIVI or scale_dtype is None or (lz4 and codec is Codec.INT8) or dtype not in DTYPES:
            raise UnsupportedFrame(f"unknown int8 scale layout {layout} / scale dtype {sid} / flags {flags:#x}")
        try:
            n_k, n_v = scale_counts(kv_shape(shape))
        except InvalidKV as exc:
            raise CorruptFrame(f"int8 frame with a non-KV shape {list(shape)}") from exc
        ok = (scales_len == (n_k + n_v) * DTYPES[scale_dtype].itemsize and raw_len == numel
              and (payload_len < raw_len <= min(payload_len * _LZ4_MAX_RATIO, LZ4_MAX_BYTES)
                   if lz4 else payload_len == raw_len))
    if not ok:
        raise CorruptFrame(f"frame lengths do not match its shape {list(shape)} and codec {codec.value}")
    header = FrameHeader(
        version=version, codec=codec, dtype=dtype, shape=tuple(shape), lz4=lz4, scale_dtype=scale_dtype,
        meta_len=meta_len, scales_len=scales_len, payload_len=payload_len, raw_payload_len=raw_len,
        body_checksum=body_sum, header_len=header_len,
    )
    if header.frame_len != len(mv) and not (prefix and header.frame_len >= len(mv)):
        raise CorruptFrame(f"frame is {len(mv)} bytes but its header says {header.frame_len}")
    return header


def trusted_meta(frame: Any) -> bytes:
    """A frame's metadata bytes, read without parsing or checking its header: for a frame whose
    metadata someone trusted parsed (an arena slot the server indexed, read under its seqlock by a
    reader who checks the slot did not change meanwhile). Cut short where the bytes end."""
    mv = bytes_view(frame)
    if len(mv) < _FIXED.size:
        return b""
    start = header_size(mv[10])  # the fixed part's ndim byte
    (meta_len,) = _U32.unpack_from(mv, 12)
    return bytes(mv[start:start + min(meta_len, MAX_META_BYTES)])


HEAD_BYTES = _FIXED.size + 8 * MAX_NDIM
"""A frame's first bytes that hold its layout and say where its metadata lies, whatever its ndim
(``layout_of``, ``meta_span``): a reader of many frames reads these in one go."""


_HEADER_LENS = tuple(header_size(ndim) for ndim in range(256))


def meta_span(head: bytes) -> tuple[int, int]:
    """Where a frame's metadata starts and how long it is (at most ``MAX_META_BYTES``), from its
    first bytes (``head``: at least 16), read as ``trusted_meta`` reads them: not parsed or checked."""
    (meta_len,) = _U32.unpack_from(head, 12)
    return _HEADER_LENS[head[10]], min(meta_len, MAX_META_BYTES)  # by the fixed part's ndim byte


def layout_of(head: bytes) -> bytes:
    """``layout_prefix`` of a frame whose first ``HEAD_BYTES`` are ``head``, its ndim read from them
    (unchecked: a wrong one makes bytes no parsed header's layout equals)."""
    return head[:_FIXED.size - 8] + head[_FIXED.size:_FIXED.size + 8 * head[10]]


def layout_prefix(frame: Any, ndim: int) -> bytes:
    """The header bytes that fix a frame's layout: every field but the body checksum, and the
    dims; not the header's own checksum. Two frames whose prefixes are equal have the same
    codec, dtype, shape and lengths, so a reader of many frames of one spec, each verified whole
    by someone it trusts, parses the first header and compares the rest (no parse, no hash)."""
    mv = bytes_view(frame)
    return bytes(mv[:_FIXED.size - 8]) + bytes(mv[_FIXED.size:_FIXED.size + 8 * ndim])


def layout_matches(frame: memoryview, ref: FrameHeader, ref_layout: bytes) -> bool:
    """Whether ``frame`` (a byte view) is as long as ``ref``'s frame and its layout bytes equal
    ``ref_layout`` (``ref``'s ``layout_prefix``), compared in place: ``header_like`` for a reader
    that needs only where the payload lies and its shape, not a header of its own."""
    fixed = _FIXED.size - 8
    return (len(frame) == ref.frame_len and frame[:fixed] == ref_layout[:fixed]
            and frame[_FIXED.size:_FIXED.size + len(ref_layout) - fixed] == ref_layout[fixed:])


def header_like(frame: Any, ref: FrameHeader, ref_layout: bytes) -> FrameHeader | None:
    """``frame``'s header when its layout bytes equal ``ref_layout`` (``ref``'s ``layout_prefix``),
    read with no parse and no hash: ``ref`` with the frame's own body checksum. None otherwise.

    Only for a frame someone trusted verified whole (a server-verified arena slot, read under its
    seqlock): the header's own checksum is not checked. A reader of many frames of one layout
    parses the first with ``read_header`` and takes the rest through this.
    """
    mv = bytes_view(frame)
    if not layout_matches(mv, ref, ref_layout):
        return None
    (body_sum,) = _U64.unpack_from(mv, _FIXED.size - 8)
    if body_sum == ref.body_checksum:
        return ref
    r = ref  # built field by field: dataclasses.replace took 3x as long, per page of a batch
    return FrameHeader(version=r.version, codec=r.codec, dtype=r.dtype, shape=r.shape, lz4=r.lz4,
                       scale_dtype=r.scale_dtype, meta_len=r.meta_len, scales_len=r.scales_len,
                       payload_len=r.payload_len, raw_payload_len=r.raw_payload_len, body_checksum=body_sum,
                       header_len=r.header_len)


def bytes_view(frame: Any) -> memoryview:
    """``frame`` as a flat byte view (no copy).

    Raises:
        CorruptFrame: ``frame`` is not a contiguous bytes-like object (or a released view).
    """
    try:
        mv = memoryview(frame)
        if not mv.c_contiguous:
            raise TypeError("not C-contiguous")
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except (TypeError, ValueError) as exc:  # ValueError: a released memoryview
        raise CorruptFrame(f"a frame is a contiguous bytes-like object, got {type(frame).__name__}: {exc}") from exc

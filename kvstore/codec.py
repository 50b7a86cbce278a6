"""KV frames encoded and decoded: raw, int8, int8+lz4.

A frame is the unit every tier stores (its layout and header: ``kvstore.frame``). This module
writes a tensor into a frame and reads it back: raw frames copy and hash in one cache-sized pass,
int8 frames quantize through ``kvstore.int8`` (KIVI: K per channel, V per token), and lz4 is kept
only where it pays. Every read checks the body checksum (xxh3-64 over meta, scales and payload)
unless the caller vouches for the bytes, so a flipped bit anywhere in a frame is a typed error,
never wrong KV (``tests/kvstore/test_codec.py`` round-trips and damages every codec).

The format's names (``Codec``, ``FrameHeader``, ``read_header`` and the layout readers) are
``kvstore.frame``'s, exported here too: callers import one module for frames.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Sequence

import lz4.block
import numpy as np
import torch
import xxhash

from kvstore.errors import CorruptFrame, InvalidInput, InvalidKV
from kvstore.frame import (FLAG_LZ4, FRAME_DTYPES, HEAD_BYTES, LAYOUT_KIVI, LAYOUT_NONE, LZ4_MAX_BYTES, MAGIC,
                           MAX_META_BYTES, MAX_NDIM, SCALE_ID, VERSION, Codec, FrameHeader, bytes_view, header_like,
                           header_size, kv_shape, layout_matches, layout_of, layout_prefix, meta_span, pad, read_header,
                           scale_counts, seal, trusted_meta)
from kvstore.int8 import dequantize, native_takes, quantize, quantize_into, quantize_many, scales_sound
from kvstore.spec import DTYPES

__all__ = [
    "encode_many",
    "MANY_PAYS_BELOW",
    "transcode",
    "layout_prefix",
    "layout_matches",
    "header_like",
    "trusted_meta",
    "meta_span",
    "layout_of",
    "HEAD_BYTES",
    "SAME_SIZE_INTS",
    "int_view",
    "Codec",
    "FrameHeader",
    "MAGIC",
    "VERSION",
    "frame_size",
    "encode",
    "encode_into",
    "decode",
    "read_header",
    "verify",
    "frame_meta",
    "raw_payload_offset",
    "seal_raw",
    "raw_frame_into",
]

# torch.frombuffer warns on read-only buffers; decode only ever reads from them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)

# lz4 must save at least this fraction to be kept: KV and int8 KV do not shrink
# (measured ratio 1.00), and a token gain is not worth a decompress on every read.
LZ4_MIN_SAVING_FRAC = 0.03
_LZ4_SAMPLE_BYTES = 64 * 1024


# -- sizes ----------------------------------------------------------------------


def frame_size(
    shape: tuple[int, ...] | torch.Size,
    dtype: str | torch.dtype,
    codec: str | Codec = Codec.RAW,
    *,
    meta_len: int = 0,
    scale_dtype: str = "float32",
) -> int:
    """Bytes a frame of this tensor needs: exact for raw and int8, an upper bound for int8+lz4."""
    codec = Codec.parse(codec)
    shape = tuple(int(s) for s in shape)
    dname = _dtype_name(dtype)
    _check_scale_dtype(scale_dtype)
    numel = math.prod(shape)
    head = header_size(len(shape)) + pad(meta_len)
    if codec is Codec.RAW:
        return head + numel * FRAME_DTYPES[dname].itemsize
    _check_lossy_dtype(dname)
    n_k, n_v = scale_counts(kv_shape(shape))
    return head + pad((n_k + n_v) * DTYPES[scale_dtype].itemsize) + numel


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        for name, value in FRAME_DTYPES.items():
            if value == dtype:
                return name
    elif dtype in FRAME_DTYPES:
        return dtype
    raise InvalidKV(f"codec supports dtypes {sorted(FRAME_DTYPES)}, got {dtype!r}")


def _check_lossy_dtype(dname: str) -> None:
    if dname not in DTYPES:  # uint8: bytes that are not ours to quantize
        raise InvalidKV(f"the int8 codecs hold KV of {sorted(DTYPES)}; a {dname} frame is kept raw")


def _check_scale_dtype(scale_dtype: Any) -> str:
    if scale_dtype not in SCALE_ID:
        raise InvalidKV(f"scale_dtype must be one of {sorted(SCALE_ID)}, got {scale_dtype!r}")
    return scale_dtype


def _check_meta(meta: Any) -> bytes:
    if not isinstance(meta, (bytes, bytearray, memoryview)):
        raise InvalidInput(f"frame meta must be bytes, got {type(meta).__name__}")
    meta = bytes(meta)
    if len(meta) > MAX_META_BYTES:
        raise InvalidInput(f"frame meta is limited to {MAX_META_BYTES} bytes, got {len(meta)}")
    return meta


# -- encode ---------------------------------------------------------------------


def encode(
    kv: torch.Tensor,
    codec: str | Codec = Codec.RAW,
    *,
    meta: bytes = b"",
    scale_dtype: str = "float32",
) -> bytearray:
    """Encode ``kv`` into a new frame. Hot paths use ``encode_into`` with a reused buffer."""
    if not isinstance(kv, torch.Tensor):
        raise InvalidKV(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    meta = _check_meta(meta)
    out = bytearray(frame_size(kv.shape, kv.dtype, codec, meta_len=len(meta), scale_dtype=scale_dtype))
    n = encode_into(kv, out, codec, meta=meta, scale_dtype=scale_dtype)
    del out[n:]
    return out


def encode_into(
    kv: torch.Tensor,
    out: Any,
    codec: str | Codec = Codec.RAW,
    *,
    meta: bytes = b"",
    scale_dtype: str = "float32",
) -> int:
    """Encode ``kv`` into the writable buffer ``out``.

    Args:
        kv: any-shape tensor for raw; ``[L, 2, H, T, D]`` for the int8 codecs.
            It may be a strided view (a block slice of a longer KV).
        out: a writable bytes-like object of at least ``frame_size(...)`` bytes.
        codec: ``raw``, ``int8`` or ``int8+lz4``.
        meta: opaque caller bytes kept in the frame and covered by its checksum.
        scale_dtype: ``float32`` (default) or ``float16`` for int8 scales.

    Returns:
        The frame's length in bytes; the frame is ``out[:n]``.

    Raises:
        InvalidKV: for an unsupported dtype, shape or device, a too small ``out``,
            or values an int8 codec cannot represent (NaN/Inf, beyond float16 scales).
        InvalidInput: for an unknown codec or bad ``meta``.
    """
    codec = Codec.parse(codec)
    if not isinstance(kv, torch.Tensor):
        raise InvalidKV(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    dname = _dtype_name(kv.dtype)
    shape = tuple(kv.shape)
    if not 1 <= len(shape) <= MAX_NDIM:
        raise InvalidKV(f"frames hold tensors of 1 to {MAX_NDIM} dims, got {len(shape)}")
    meta = _check_meta(meta)
    _check_scale_dtype(scale_dtype)
    if codec is not Codec.RAW:
        _check_lossy_dtype(dname)
    kv = kv.detach()  # a tensor with autograd history must not drag it into the scratch
    if kv.device.type != "cpu":
        try:
            kv = kv.to("cpu")  # frames live in host memory
        except (RuntimeError, NotImplementedError) as exc:
            raise InvalidKV(f"kv on device {kv.device} cannot be copied to host memory: {exc}") from exc
    if kv.layout is not torch.strided or kv.is_quantized:
        raise InvalidKV(f"kv must be a dense tensor, got layout {kv.layout}")
    need = frame_size(shape, dname, codec, meta_len=len(meta), scale_dtype=scale_dtype)
    mv = bytes_view(out)
    if mv.readonly or len(mv) < need:
        raise InvalidKV(f"output buffer must be writable and hold {need} bytes, got {len(mv)}")

    header_len = header_size(len(shape))
    meta_off = header_len
    scales_off = meta_off + pad(len(meta))
    mv[meta_off : meta_off + len(meta)] = meta
    mv[meta_off + len(meta) : scales_off] = bytes(scales_off - meta_off - len(meta))
    flags = 0
    numel = math.prod(shape)
    if codec is Codec.RAW:
        scales_len, payload_off = 0, scales_off
        payload_len = raw_len = numel * kv.element_size()
        body_sum = _encode_raw(mv, int_view(kv), header_len, payload_off, payload_len)
        layout, sid = LAYOUT_NONE, 0
        return seal(mv, codec, dname, shape, len(meta), flags, layout, sid, scales_len, payload_len, raw_len,
                    body_sum=body_sum)
    else:
        n_k, n_v = scale_counts(kv_shape(shape))
        sdt = DTYPES[scale_dtype]
        scales_len = (n_k + n_v) * sdt.itemsize
        payload_off = scales_off + pad(scales_len)
        mv[scales_off + scales_len : payload_off] = bytes(payload_off - scales_off - scales_len)
        scales = _view(mv, sdt, scales_off, n_k + n_v)
        q = _view(mv, torch.int8, payload_off, numel).view(shape)
        quantize(kv, q, scales, n_k)
        payload_len = raw_len = numel
        if codec is Codec.INT8_LZ4:
            payload_len = _maybe_lz4(mv, payload_off, raw_len)
            if payload_len != raw_len:
                flags |= FLAG_LZ4
        layout, sid = LAYOUT_KIVI, SCALE_ID[scale_dtype]

    return seal(mv, codec, dname, shape, len(meta), flags, layout, sid, scales_len, payload_len, raw_len)


MANY_PAYS_BELOW = 256 << 10
"""Blocks of at most this many KV bytes encode to int8 faster together (``encode_many``) than one
at a time: 32 blocks of 64 KiB at 1.8-1.9 GB/s against 0.37, 256 KiB blocks about even (0.84-1.10
against 0.92-0.99; AMD VM, stop 48); at 2 MiB a block, batching is slower (0.55 GB/s against 1.8).
Those are the torch path's figures; with the native kernel (``kvstore.int8.NATIVE``) a batch saves
only the calls: 16 blocks of 64 KiB at 6.1 GB/s against 3.7 one by one, 2 MiB blocks alike."""


def encode_many(kvs: Sequence[torch.Tensor], metas: Sequence[bytes]) -> list[bytearray]:
    """int8 frames of blocks of one shape and dtype, quantized in one batched pass: the very
    frames ``encode(kv, Codec.INT8, meta=meta)`` makes, one per block (float32 scales).

    Why: a small block is all per-op overhead one at a time (a 64 KiB block encodes at 0.37
    GB/s alone against 1.8 for a 2 MiB block, stop 48's AMD VM); the re-encoder
    (``kvstore.engine.recode``) batches the blocks puts spilled raw.

    Raises:
        InvalidKV: shapes or dtypes differ, a shape int8 cannot hold, or a block holds values
            int8 cannot represent (NaN, Inf, too large): nothing is returned; encode them one
            by one to learn which.
        InvalidInput: ``metas`` does not match ``kvs``, or a bad meta.
    """
    if len(kvs) != len(metas):
        raise InvalidInput(f"{len(kvs)} blocks but {len(metas)} metas")
    if not kvs:
        return []
    first = kvs[0]
    if not all(isinstance(k, torch.Tensor) and k.shape == first.shape and k.dtype == first.dtype for k in kvs):
        raise InvalidKV("encode_many takes tensors of one shape and dtype")
    shape = kv_shape(tuple(first.shape))
    dname = _dtype_name(first.dtype)
    _check_lossy_dtype(dname)
    metas = [_check_meta(m) for m in metas]
    n_k, n_v = scale_counts(shape)
    scales_len = (n_k + n_v) * 4
    numel = math.prod(shape)
    hlen, sid = header_size(len(shape)), SCALE_ID["float32"]
    kvs = [k.detach() for k in kvs]
    if all(native_takes(k) for k in kvs):  # each block straight into its frame: no stack, no float32 copy
        frames = []
        for kv, meta in zip(kvs, metas):
            scales_off = hlen + pad(len(meta))
            payload_off = scales_off + pad(scales_len)
            out = bytearray(payload_off + numel)  # the frame's exact length, zeroed: its pads too
            out[hlen:hlen + len(meta)] = meta
            with memoryview(out) as mv:
                quantize_into(kv, mv[payload_off:], mv[scales_off:scales_off + scales_len])
                seal(mv, Codec.INT8, dname, shape, len(meta), 0, LAYOUT_KIVI, sid, scales_len, numel, numel)
            frames.append(out)
        return frames
    x = torch.stack([k.to("cpu") for k in kvs]).float()  # [N, L, 2, H, T, D]
    k_s, v_s, q = quantize_many(x)
    # Each block's scales and values are copied in with numpy: torch's per-call cost (a view, a
    # reshape, a copy for each) was about a quarter of the batch's time at 64 KiB a block
    ks, vs, qs = (t.reshape(len(metas), -1).numpy() for t in (k_s, v_s, q))
    frames = []
    for i, meta in enumerate(metas):
        scales_off = hlen + pad(len(meta))
        payload_off = scales_off + pad(scales_len)
        out = bytearray(payload_off + numel)  # the frame's exact length, zeroed: its pads too
        out[hlen:hlen + len(meta)] = meta
        scales = np.frombuffer(out, np.float32, n_k + n_v, scales_off)
        scales[:n_k] = ks[i]
        scales[n_k:] = vs[i]
        np.frombuffer(out, np.int8, numel, payload_off)[:] = qs[i]
        del scales  # no view of ``out`` outlives its fill
        mv = memoryview(out)
        n = seal(mv, Codec.INT8, dname, shape, len(meta), 0, LAYOUT_KIVI, sid, scales_len, numel, numel)
        mv.release()
        del out[n:]  # nothing, as the parts add up to the frame: kept so that a longer buffer stays safe
        frames.append(out)
    return frames


def raw_payload_offset(ndim: int, meta_len: int) -> int:
    """Where the payload of a raw frame of ``ndim`` dims and ``meta_len`` meta bytes starts."""
    return header_size(ndim) + pad(meta_len)


def seal_raw(out: Any, dtype: str | torch.dtype, shape: tuple[int, ...], meta: bytes = b"") -> int:
    """Finish a raw frame whose payload the caller already wrote into ``out``.

    The payload sits at ``raw_payload_offset(len(shape), len(meta))``: bytes received
    from a socket go straight there, with no tensor and no copy. This writes the meta
    and the header around them.

    Returns:
        The frame's length; the frame is ``out[:n]``.

    Raises:
        InvalidKV: an unsupported dtype or shape, or ``out`` too small or read-only.
        InvalidInput: bad ``meta``.
    """
    dname = _dtype_name(dtype)
    shape = tuple(int(d) for d in shape)
    if not 1 <= len(shape) <= MAX_NDIM or min(shape) < 0:
        raise InvalidKV(f"frames hold tensors of 1 to {MAX_NDIM} dims, got shape {list(shape)}")
    meta = _check_meta(meta)
    mv = bytes_view(out)
    meta_off = header_size(len(shape))
    payload_off = meta_off + pad(len(meta))
    raw_len = math.prod(shape) * FRAME_DTYPES[dname].itemsize
    if mv.readonly or len(mv) < payload_off + raw_len:
        raise InvalidKV(f"output buffer must be writable and hold {payload_off + raw_len} bytes, got {len(mv)}")
    mv[meta_off : meta_off + len(meta)] = meta
    mv[meta_off + len(meta) : payload_off] = bytes(payload_off - meta_off - len(meta))
    return seal(mv, Codec.RAW, dname, shape, len(meta), 0, LAYOUT_NONE, 0, 0, raw_len, raw_len)


def _view(mv: memoryview, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    return torch.frombuffer(mv, dtype=dtype, count=count, offset=offset)


def _maybe_lz4(mv: memoryview, off: int, n: int) -> int:
    """Compress the payload in place if lz4 pays; return the stored length."""
    if n > LZ4_MAX_BYTES:
        return n  # beyond the lz4 block API; KV does not compress anyway
    payload = mv[off : off + n]
    sample = payload[: min(n, _LZ4_SAMPLE_BYTES)]
    limit = 1.0 - LZ4_MIN_SAVING_FRAC
    # A sample first: incompressible KV (the usual case) costs one small call.
    if len(lz4.block.compress(sample, store_size=False)) > len(sample) * limit:
        return n
    packed = lz4.block.compress(payload, store_size=False)
    if len(packed) > n * limit:
        return n
    mv[off : off + len(packed)] = packed
    return len(packed)


# -- decode ---------------------------------------------------------------------


def verify(frame: Any) -> FrameHeader:
    """``read_header`` plus the body checksum.

    Raises:
        CorruptFrame, UnsupportedFrame: as ``read_header``, or a body checksum mismatch.
    """
    header = read_header(frame)
    mv = bytes_view(frame)
    if xxhash.xxh3_64_intdigest(mv[header.header_len : header.frame_len]) != header.body_checksum:
        raise CorruptFrame("frame body checksum mismatch")
    return header


def transcode(frame: Any, codec: "str | Codec") -> Any:
    """``frame`` re-encoded in ``codec``, with its metadata; the frame itself when already so.

    Used to send a block over a slow link in fewer bytes (int8 halves fp16).

    Raises:
        CorruptFrame, UnsupportedFrame: ``frame`` does not verify.
        InvalidInput: unknown codec.
        InvalidKV: the block holds NaN/Inf, which int8 cannot carry.
    """
    want = Codec.parse(codec)
    header = read_header(frame)
    if header.codec is want:
        return frame
    return encode(decode(frame), want, meta=frame_meta(frame))


def frame_meta(frame: Any) -> bytes:
    """The caller bytes stored with ``encode(meta=...)``, after a full verify."""
    header = verify(frame)
    off = header.meta_offset
    return bytes(bytes_view(frame)[off : off + header.meta_len])


def decode(frame: Any, *, out: torch.Tensor | None = None, expect_checksum: int | None = None,
           verified: bool = False) -> torch.Tensor:
    """Verify a frame and decode it into a tensor of its original dtype.

    Without ``out`` it allocates the decoded tensor: up to 4x the frame for
    int8 and 256x more for lz4. Callers decoding untrusted frames should check
    ``read_header(frame).raw_nbytes`` first or pass ``out``.

    Args:
        frame: a bytes-like object holding exactly one frame.
        out: optional destination (may be a strided view) with the frame's
            shape and dtype; avoids allocating on hot paths.
        expect_checksum: the body checksum the caller recorded when it stored
            the frame; a different (even if sound) frame is refused.
        verified: the caller vouches for the body (it verified these very bytes before:
            ``docs/design.md``, "Verified once"); only the header's checksum is checked.

    Returns:
        ``out``, or a new tensor when ``out`` is None. It never aliases ``frame``.

    Raises:
        CorruptFrame, UnsupportedFrame: the frame cannot be trusted; nothing is returned.
        InvalidKV: ``out`` has the wrong shape or dtype, or cannot be written.
    """
    header = read_header(frame)
    raw = header.codec is Codec.RAW
    if not raw and not verified:
        verify(frame)  # int8 reads the whole payload several times anyway; raw hashes as it copies
    if expect_checksum is not None and header.body_checksum != expect_checksum:
        raise CorruptFrame("frame is sound but is not the one recorded for this key")
    dtype = FRAME_DTYPES[header.dtype]
    if out is None:
        out = torch.empty(header.shape, dtype=dtype)
    elif (not isinstance(out, torch.Tensor) or tuple(out.shape) != header.shape or out.dtype != dtype
          or out.requires_grad or out.device.type != "cpu"):
        got = (list(out.shape), out.dtype, out.device) if isinstance(out, torch.Tensor) else type(out).__name__
        raise InvalidKV(f"out must be a CPU {dtype} tensor of shape {list(header.shape)} without grad, got {got}")
    if header.numel == 0:
        if raw and not verified:
            verify(frame)
        return out
    try:
        with torch.no_grad():
            if raw and verified:
                dst = int_view(out)
                np.copyto(dst, np.frombuffer(bytes_view(frame), dtype=dst.dtype, count=header.numel,
                                             offset=header.payload_offset).reshape(header.shape))
                return out
            if raw:
                return _decode_raw(bytes_view(frame), header, out)
            return _decode_body(frame, header, out)
    except RuntimeError as exc:  # e.g. an expanded out= view torch refuses to write
        raise InvalidKV(f"out cannot be written: {exc}") from exc


SAME_SIZE_INTS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}
"""Integer types by element size: numpy has no bfloat16, so KV bytes are copied as these."""


def int_view(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as same-size integers in numpy (2- and 4-byte dtypes), for copies."""
    return t.view(SAME_SIZE_INTS[t.element_size()][0]).numpy()


_FUSED_CHUNK_BYTES = 1 << 20  # hashed and copied while it sits in L2


def raw_frame_into(src: np.ndarray, dtype: str, out: Any, meta: bytes = b"") -> tuple[int, int]:
    """Write the raw frame of a ``dtype`` tensor whose bits ``src`` holds (same-size ints, as
    ``int_view`` gives: numpy has no bfloat16; any strides) into ``out``; its length and body
    checksum.

    Why beside ``encode_into``: a put of many blocks of one shape repeats encode_into's checks
    and its tensor-to-numpy step for each, and then read the header back for the checksum; at
    64 KiB a block that cost more than the block's copy. The caller views its KV as ints once.

    Raises:
        InvalidKV: an unsupported dtype, ``src`` not the same-size ints of ``dtype``, or
            ``out`` too small or read-only. InvalidInput: bad ``meta``.
    """
    dname = _dtype_name(dtype)
    if src.dtype != SAME_SIZE_INTS[FRAME_DTYPES[dname].itemsize][1] or not 1 <= src.ndim <= MAX_NDIM:
        raise InvalidKV(f"a {dname} frame's bits come as {FRAME_DTYPES[dname].itemsize}-byte ints of 1 to "
                        f"{MAX_NDIM} dims, got {src.dtype} of {src.ndim}")
    meta = _check_meta(meta)
    mv = bytes_view(out)
    header_len = header_size(src.ndim)
    payload_off = header_len + pad(len(meta))
    if mv.readonly or len(mv) < payload_off + src.nbytes:
        raise InvalidKV(f"output buffer must be writable and hold {payload_off + src.nbytes} bytes, got {len(mv)}")
    mv[header_len:header_len + len(meta)] = meta
    mv[header_len + len(meta):payload_off] = bytes(payload_off - header_len - len(meta))
    body_sum = _encode_raw(mv, src, header_len, payload_off, src.nbytes)
    n = seal(mv, Codec.RAW, dname, src.shape, len(meta), 0, LAYOUT_NONE, 0, 0, src.nbytes, src.nbytes,
             body_sum=body_sum)
    return n, body_sum


def _encode_raw(mv: memoryview, src: np.ndarray, header_len: int, payload_off: int, payload_len: int) -> int:
    """Copy ``src`` (a tensor's bits) into the payload and hash the body, one cache-sized run of
    its outer rows at a time.

    The mirror of ``_decode_raw``: copying all of it and then hashing the frame reads
    a large payload from memory twice; this hashes each run while it is still cached.
    ``src`` may be a strided view (one block of a token-major KV). The body checksum.
    """
    digest = xxhash.xxh3_64()
    digest.update(mv[header_len:payload_off])  # the meta and its padding
    if not payload_len:
        return digest.intdigest()
    dst = np.frombuffer(mv, dtype=src.dtype, count=src.size, offset=payload_off).reshape(src.shape)
    rows = src.shape[0] if src.ndim > 1 else 1
    row_bytes = payload_len // rows
    if rows == 1 or payload_len <= 2 * _FUSED_CHUNK_BYTES:
        np.copyto(dst, src)
        digest.update(mv[payload_off:payload_off + payload_len])
        return digest.intdigest()
    step = max(1, _FUSED_CHUNK_BYTES // max(1, row_bytes))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        np.copyto(dst[r0:r1], src[r0:r1])
        digest.update(mv[payload_off + r0 * row_bytes:payload_off + r1 * row_bytes])
    return digest.intdigest()


def _decode_raw(mv: memoryview, header: FrameHeader, out: torch.Tensor) -> torch.Tensor:
    """Hash and copy the payload one cache-sized run of layers at a time.

    Verifying first and copying after reads a large frame from memory twice;
    this reads it once. The copy goes through numpy: torch's threaded CPU
    ``copy_`` stalls on a busy small machine. Measured here for 32 MiB into a
    strided ``out``: 2.37 ms before, 1.93 after (hash alone 0.94, memcpy 1.25). On a checksum mismatch ``out`` holds
    garbage and CorruptFrame is raised, as the contract allows.
    """
    dst = int_view(out)  # numpy has no bfloat16: copy the bits
    src = np.frombuffer(mv, dtype=dst.dtype, count=header.numel, offset=header.payload_offset).reshape(header.shape)
    if header.payload_len <= 2 * _FUSED_CHUNK_BYTES:  # small: it stays cached between the two passes
        if xxhash.xxh3_64_intdigest(mv[header.header_len : header.frame_len]) != header.body_checksum:
            raise CorruptFrame("frame body checksum mismatch")
        np.copyto(dst, src)
        return out
    digest = xxhash.xxh3_64()
    digest.update(mv[header.header_len : header.payload_offset])
    layers = header.shape[0]
    layer_bytes = header.payload_len // layers
    step = max(1, _FUSED_CHUNK_BYTES // max(1, layer_bytes))
    for l0 in range(0, layers, step):
        l1 = min(layers, l0 + step)
        digest.update(mv[header.payload_offset + l0 * layer_bytes : header.payload_offset + l1 * layer_bytes])
        np.copyto(dst[l0:l1], src[l0:l1])
    if digest.intdigest() != header.body_checksum:
        raise CorruptFrame("frame body checksum mismatch")
    return out


def _decode_body(frame: Any, header: FrameHeader, out: torch.Tensor) -> torch.Tensor:
    dtype = FRAME_DTYPES[header.dtype]
    mv = bytes_view(frame)
    if header.codec is Codec.RAW:
        out.copy_(_view(mv, dtype, header.payload_offset, header.numel).view(header.shape))
        return out
    n_k, n_v = scale_counts(header.shape)
    scales = _view(mv, DTYPES[header.scale_dtype], header.scales_offset, n_k + n_v)
    if not scales_sound(scales):  # no encoder writes these: a hostile or buggy writer
        raise CorruptFrame("int8 frame has negative, NaN, Inf or overflowing scales")
    if header.lz4:
        stored = mv[header.payload_offset : header.frame_len]
        try:
            raw = lz4.block.decompress(stored, uncompressed_size=header.raw_payload_len)
        except lz4.block.LZ4BlockError as exc:
            raise CorruptFrame(f"lz4 payload does not decompress: {exc}") from exc
        if len(raw) != header.raw_payload_len:
            raise CorruptFrame("lz4 payload decompressed to the wrong length")
        q = _view(memoryview(raw), torch.int8, 0, header.numel)
    else:
        q = _view(mv, torch.int8, header.payload_offset, header.numel)
    dequantize(q.view(header.shape), scales, n_k, out)
    return out

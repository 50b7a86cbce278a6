"""The int8 codecs' quantizer (KIVI): the math, not the frame.

K is quantized per channel (absmax over the block's tokens) and V per token (absmax over
head_dim), symmetric, scale = absmax/127. Quantization runs in chunks through a per-thread
float32 scratch buffer that is reused across calls: whole-tensor torch ops allocate temporaries
and run ~10x slower on this machine (0.2 GB/s against ~2 GB/s).

``kvstore.codec`` owns the frame: it lays the scales (K's ``[L, H, 1, D]`` then V's
``[L, H, T, 1]``) and the int8 values into it and reads them back through here.

Where the package's one compiled module (``kvstore._int8``, built by ``pip install`` where a C
compiler is) imports, both directions run there instead: the same bytes in one pass over each
(layer, head), with the GIL let go. The torch code below stays for the blocks it does not take
(a strided last dim) and for installs without it.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstore.errors import InvalidKV
from kvstore.memory.buffers import Scratch

try:
    from kvstore import _int8 as _native
except ImportError:  # built where a C compiler was (setup.py); torch does the same work slower
    _native = None

__all__ = [
    "MAX_SCALE", "MIN_SCALE", "NATIVE", "native_takes", "quantize", "quantize_into", "quantize_many",
    "dequantize", "scales_sound", "raise_bad_scales",
]

NATIVE = _native is not None
"""True where ``kvstore._int8`` was built and imports: quantize and dequantize run there."""
_NATIVE_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}

# float32 scratch elements per chunk (1 MiB): the K or V of one layer of a 32 MiB
# block. It fits a core's L2 across the passes over it, and keeps the Python
# per-op overhead small; 512 KiB and 2 MiB chunks both measured slower.
_CHUNK_ELEMS = 1 << 18
# Scales are clamped into [smallest normal float32, largest that 127 * scale keeps
# finite]: the reciprocal used to quantize stays finite and decode cannot overflow.
MIN_SCALE = torch.finfo(torch.float32).tiny
MAX_SCALE = torch.finfo(torch.float32).max / 128
_MIN_SCALE_F16 = torch.finfo(torch.float16).tiny  # float16 scales below this lose precision


def _float32(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float32)


# Per-thread float32 work areas, grown on demand and reused across calls.
_WORK = Scratch(_float32, torch.Tensor.numel)
_SMALL = Scratch(_float32, torch.Tensor.numel)


def _scratch(pool: Scratch, n: int) -> torch.Tensor:
    return pool.get(n)[:n]


def _chunks(layers: int, heads: int, per_head: int):
    """Yield (l0, l1, h0, h1) slices of K (or V) of about ``_CHUNK_ELEMS`` float32 each.

    Small layers are grouped (fewer op calls); a large layer is split by heads.
    """
    per_layer = heads * per_head
    if per_layer <= _CHUNK_ELEMS:
        group = max(1, _CHUNK_ELEMS // per_layer)
        for l0 in range(0, layers, group):
            yield l0, min(layers, l0 + group), 0, heads
    else:
        group = max(1, _CHUNK_ELEMS // per_head)
        for l0 in range(layers):
            for h0 in range(0, heads, group):
                yield l0, l0 + 1, h0, min(heads, h0 + group)


def quantize(kv: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, n_k: int) -> None:
    """Fill ``q`` (int8) and ``scales`` (K then V) from ``kv``, chunk by chunk.

    K and V go through the scratch separately: a 1 MiB float32 chunk stays in a
    core's L2 across the seven passes over it (measured ~30% faster than 2 MiB
    chunks here). The NaN/Inf check runs once, on the scales, at the end.
    """
    layers, _, heads, tokens, dim = kv.shape
    exact = scales.dtype == torch.float32
    if native_takes(kv) and q.is_contiguous():
        quantize_into(kv, q.numpy(), scales.numpy(), not exact)
        return
    for part, scale, reduce_dim in _parts(scales, n_k, layers, heads, tokens, dim):
        for l0, l1, h0, h1 in _chunks(layers, heads, tokens * dim):
            buf = _scratch(_WORK, (l1 - l0) * (h1 - h0) * tokens * dim).view(l1 - l0, h1 - h0, tokens, dim)
            dest = scale[l0:l1, h0:h1]
            small = _scratch(_SMALL, 2 * dest.numel())
            hi, lo = small[: dest.numel()].view(dest.shape), small[dest.numel() :].view(dest.shape)
            buf.copy_(kv[l0:l1, part, h0:h1])
            torch.amax(buf, dim=reduce_dim, keepdim=True, out=hi)
            torch.amin(buf, dim=reduce_dim, keepdim=True, out=lo)
            torch.maximum(hi, lo.neg_(), out=hi)  # absmax without an abs() pass
            # The floor keeps an all-zero channel at q = 0 (not 0 * inf = NaN); the stored scale
            # is the clamped one, so the decoder multiplies by exactly what was divided by.
            torch.div(hi, 127.0, out=lo).clamp_min_(MIN_SCALE)
            dest.copy_(lo)
            if not exact:  # quantize with the rounded float16 scale the decoder will see
                if bool((lo < _MIN_SCALE_F16).logical_and_(hi > 0).any()):
                    raise InvalidKV("int8 codec: values too small for float16 scales; use scale_dtype='float32'")
                lo.copy_(dest)
            buf.mul_(lo.reciprocal_()).round_()
            if not exact:  # the rounded float16 scale can sit just under absmax/127
                buf.clamp_(-127.0, 127.0)
            q[l0:l1, part, h0:h1].copy_(buf)
    if not scales_sound(scales):
        raise_bad_scales(kv, exact)


def quantize_many(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize`` of many blocks in one batched pass: ``x`` is their KV stacked as float32
    ``[N, L, 2, H, T, D]`` (overwritten). Returns K's scales ``[N, L, H, 1, D]``, V's
    ``[N, L, H, T, 1]`` and the int8 values ``[N, L, 2, H, T, D]``: per block, the very values
    ``quantize`` makes (float32 scales).

    Raises:
        InvalidKV: a block holds NaN, Inf or values too large.
    """
    k, v = x[:, :, 0], x[:, :, 1]  # [N, L, H, T, D]
    # As quantize, per block: K per channel over tokens, V per token over head_dim; absmax / 127
    # with the same floor; x * (1 / scale), rounded. The same float32 ops give the same bytes.
    k_s = torch.maximum(k.amax(dim=3, keepdim=True), k.amin(dim=3, keepdim=True).neg_())
    v_s = torch.maximum(v.amax(dim=4, keepdim=True), v.amin(dim=4, keepdim=True).neg_())
    k_s.div_(127.0).clamp_min_(MIN_SCALE)
    v_s.div_(127.0).clamp_min_(MIN_SCALE)
    for s in (k_s, v_s):
        lo, hi = torch.aminmax(s)
        if not (bool(lo >= 0) and bool(hi <= MAX_SCALE)):  # NaN fails both
            raise InvalidKV("int8 codec: a block of the batch holds NaN, Inf or values too large")
    k.mul_(k_s.reciprocal())
    v.mul_(v_s.reciprocal())
    return k_s, v_s, x.round_().to(torch.int8)


def native_takes(kv: torch.Tensor) -> bool:
    """Whether ``quantize_into`` (the native kernel) takes this block: ``kvstore._int8`` built,
    and a non-empty CPU tensor of fp16, bf16 or fp32 whose last dim is dense."""
    return (
        NATIVE and kv.dtype in _NATIVE_DTYPES and kv.device.type == "cpu" and kv.numel() > 0
        and kv.stride(-1) == 1
    )


def quantize_into(kv: torch.Tensor, q: Any, scales: Any, scales_f16: bool = False) -> None:
    """``quantize`` by the native kernel into writable buffers: ``q`` the block's int8 values
    (``kv.numel()`` bytes, dense), ``scales`` K's then V's (float16 when ``scales_f16``), e.g. the
    two parts of a frame. Only for a block ``native_takes``; the same bytes as ``quantize``.

    Raises:
        InvalidKV: values int8 cannot represent (NaN, Inf, too large; too small for float16 scales).
    """
    layers, _, heads, tokens, dim = kv.shape
    rc = _native.quantize(kv.data_ptr(), _NATIVE_DTYPES[kv.dtype], layers, heads, tokens, dim,
                          *kv.stride()[:4], q, scales, scales_f16)
    if rc == 2:
        raise InvalidKV("int8 codec: values too small for float16 scales; use scale_dtype='float32'")
    if rc:  # 1: NaN; 3: Inf or too large, the scales scales_sound refuses
        raise_bad_scales(kv, not scales_f16)


def _parts(scales: torch.Tensor, n_k: int, layers: int, heads: int, tokens: int, dim: int):
    """(part, its scales, the dim its absmax reduces): K per channel over tokens, V per token."""
    return (
        (0, scales[:n_k].view(layers, heads, 1, dim), 2),
        (1, scales[n_k:].view(layers, heads, tokens, 1), 3),
    )


def scales_sound(scales: torch.Tensor) -> bool:
    """Every scale in [0, MAX_SCALE]: no NaN (comparisons fail), no Inf, no overflow on decode."""
    lo, hi = torch.aminmax(scales if scales.dtype == torch.float32 else scales.float())
    return bool(lo >= 0) and bool(hi <= MAX_SCALE)  # NaN propagates and fails both


def raise_bad_scales(kv: torch.Tensor, exact: bool) -> None:
    """Say why scales came out unsound; an error path, so it may rescan the input."""
    for part in (0, 1):
        finite = torch.isfinite(kv[:, part])
        if not bool(finite.all()):
            layer = int((~finite).nonzero()[0, 0])
            raise InvalidKV(
                f"int8 codec: {'KV'[part]} of layer {layer} holds NaN or Inf; "
                "int8 cannot represent them (store with codec='raw' or fix the producer)"
            )
    limit = "the float32 range" if exact else "float16 scales; use scale_dtype='float32'"
    raise InvalidKV(f"int8 codec: values too large for {limit}")


def dequantize(q: torch.Tensor, scales: torch.Tensor, n_k: int, out: torch.Tensor) -> None:
    layers, _, heads, tokens, dim = q.shape
    if scales.dtype != torch.float32:
        scales = scales.float()  # small: one scale per channel or token
    if native_takes(out) and q.is_contiguous() and out.shape == q.shape:  # the kernel writes by q's shape
        _native.dequantize(out.data_ptr(), _NATIVE_DTYPES[out.dtype], layers, heads, tokens, dim,
                           *out.stride()[:4], q.numpy(), scales.contiguous().numpy())
        return
    for part, scale, _ in _parts(scales, n_k, layers, heads, tokens, dim):
        for l0, l1, h0, h1 in _chunks(layers, heads, tokens * dim):
            buf = _scratch(_WORK, (l1 - l0) * (h1 - h0) * tokens * dim).view(l1 - l0, h1 - h0, tokens, dim)
            buf.copy_(q[l0:l1, part, h0:h1])
            buf.mul_(scale[l0:l1, h0:h1])
            out[l0:l1, part, h0:h1].copy_(buf)

"""The native int8 kernel (kvstore/_int8.c) against the torch code it replaces, byte for byte.

The torch path in kvstore/int8.py is the reference: every frame int8 makes must be the same
whichever one ran, so that stores written by one install read back alike in another and the
codec's error bounds stay the ones test_codec.py checks.
"""

from __future__ import annotations

import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore.int8 as int8
from kvstore import codec
from kvstore.codec import Codec
from kvstore.errors import InvalidKV

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def test_the_kernel_is_built_where_the_install_can_build_it():
    # pip install -e . compiles it on every x86_64 machine with a C compiler (ours, CI's);
    # a quiet fall back to torch there would cost a full store about half its put speed.
    if platform.machine() != "x86_64":
        pytest.skip("kvstore._int8 is x86_64 (AVX2) only; elsewhere torch quantizes")
    assert int8.NATIVE


def _both(fn, monkeypatch):
    """fn() with the native kernel, then with torch; both results."""
    native = fn()
    with monkeypatch.context() as m:
        m.setattr(int8, "NATIVE", False)
        ref = fn()
    return native, ref


def _quantize(kv, scale_dtype):
    layers, _, heads, tokens, dim = kv.shape
    n_k = layers * heads * dim
    q = torch.empty(kv.shape, dtype=torch.int8)
    scales = torch.empty(n_k + layers * heads * tokens, dtype=scale_dtype)
    try:
        int8.quantize(kv, q, scales, n_k)
    except InvalidKV as exc:
        return (str(exc),)
    out = torch.empty(kv.shape, dtype=kv.dtype)
    int8.dequantize(q, scales, n_k, out)
    return q, scales, out


shapes = st.tuples(
    st.integers(1, 3), st.integers(1, 3), st.integers(1, 19), st.sampled_from([1, 7, 8, 31, 32, 33, 64, 70, 128])
)


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    scale_dtype=st.sampled_from([torch.float32, torch.float16]),
    magnitude=st.sampled_from([1e-3, 1.0, 30.0, 1000.0]),
    zero_rows=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_quantize_and_dequantize_make_the_bytes_torch_makes(
    shape, dtype, scale_dtype, magnitude, zero_rows, strided, seed
):
    layers, heads, tokens, dim = shape
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(layers, 2, heads, tokens + 3, dim, generator=g) * magnitude
    if zero_rows:  # all-zero channels and tokens take the scale floor
        full[..., 0, :] = 0
        full[..., 0] = 0
    # a block sliced out of a longer KV: strided over tokens, last dim dense
    kv = (full[:, :, :, 1 : tokens + 1] if strided else full[:, :, :, :tokens].contiguous()).to(dtype)
    with pytest.MonkeyPatch.context() as mp:
        native, ref = _both(lambda: _quantize(kv, scale_dtype), mp)
    assert len(native) == len(ref)  # both refused (float16 scales under their range), or neither
    for a, b in zip(native, ref):
        if isinstance(a, str):
            assert a == b
        else:
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_64_kib_and_a_2_mib_block_match_and_take_the_native_path(dtype, monkeypatch):
    for shape in [(8, 2, 2, 16, 64), (32, 2, 8, 16, 128)]:
        kv = torch.randn(shape).to(dtype)
        assert int8.native_takes(kv)
        native, ref = _both(lambda: _quantize(kv, torch.float32), monkeypatch)
        for a, b in zip(native, ref):
            assert torch.equal(a, b)


def test_a_last_dim_that_is_not_dense_goes_to_torch_and_still_round_trips():
    kv = torch.randn(2, 2, 2, 16, 8).transpose(3, 4)  # [L, 2, H, T=8, D=16], D strided
    assert not int8.native_takes(kv)
    frame = codec.encode(kv, Codec.INT8)
    assert torch.allclose(codec.decode(frame), kv, atol=kv.abs().max().item() / 100)


def test_decode_into_a_strided_out_matches_torch(monkeypatch):
    kv = torch.randn(2, 2, 3, 16, 64).half()
    frame = codec.encode(kv, Codec.INT8)

    def into_view():
        big = torch.zeros(2, 2, 3, 20, 64, dtype=torch.float16)
        codec.decode(frame, out=big[:, :, :, 2:18])
        return big

    native, ref = _both(into_view, monkeypatch)
    assert torch.equal(native, ref) and not bool(native[:, :, :, :2].any())


POISONS = [
    (float("nan"), "float32"), (float("inf"), "float32"), (-float("inf"), "float16"),
    (3.4e38, "float32"), (1e7, "float16"), (1e-5, "float16"),
]


@pytest.mark.parametrize(
    "dtype, poison, scale_dtype",
    # float16 KV holds neither large poison (they are Inf there: the Inf rows cover it)
    [(d, p, s) for d in DTYPES for p, s in POISONS if not (d == torch.float16 and p in (3.4e38, 1e7))],
)
@pytest.mark.parametrize("part", [0, 1])
def test_unrepresentable_values_raise_the_error_torch_raises(dtype, poison, scale_dtype, part, monkeypatch):
    kv = torch.randn(2, 2, 2, 16, 40, dtype=torch.float32)
    if poison == 1e-5:
        kv[:, part] = 1e-5  # a whole part under float16 scales' smallest normal times 127
    else:
        kv[1, part, 1, 5, 37] = poison  # in the scalar tail (40 is not a multiple of 32)
    kv = kv.to(dtype)

    def err():
        with pytest.raises(InvalidKV) as exc:
            codec.encode(kv, Codec.INT8, scale_dtype=scale_dtype)
        return str(exc.value)

    native, ref = _both(err, monkeypatch)
    assert native == ref


def test_encode_many_is_encode_byte_for_byte_on_the_native_path():
    kvs = [torch.randn(4, 2, 2, 16, 64).half() for _ in range(5)]
    metas = [b"", b"a", b"meta" * 7, b"x" * 9, b""]
    many = codec.encode_many(kvs, metas)
    assert [bytes(f) for f in many] == [bytes(codec.encode(k, Codec.INT8, meta=m)) for k, m in zip(kvs, metas)]
    bad = kvs[2].clone()
    bad[0, 1, 0, 0, 0] = float("nan")
    with pytest.raises(InvalidKV):
        codec.encode_many([kvs[0], bad], [b"", b""])


def test_the_kernel_checks_its_buffers_sizes():
    if not int8.NATIVE:
        pytest.skip("no native kernel here")
    kv = torch.randn(1, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="too small"):
        int8._native.quantize(kv.data_ptr(), 2, 1, 1, 4, 8, *kv.stride()[:4], bytearray(63), bytearray(48), False)
    with pytest.raises(ValueError, match="too small"):
        int8._native.quantize(kv.data_ptr(), 2, 1, 1, 4, 8, *kv.stride()[:4], bytearray(64), bytearray(47), False)
    with pytest.raises(TypeError):  # a read-only buffer is refused, not written
        int8._native.quantize(kv.data_ptr(), 2, 1, 1, 4, 8, *kv.stride()[:4], bytes(64), bytearray(48), False)
    with pytest.raises(ValueError, match="bad dtype or shape"):
        int8._native.quantize(kv.data_ptr(), 7, 1, 1, 4, 8, *kv.stride()[:4], bytearray(64), bytearray(48), False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_halves_round_to_even_in_the_vector_lanes_and_the_tail(dtype, monkeypatch):
    # V per token: absmax 127 makes the scale 1, so each value is its own x * (1 / scale);
    # halves sit in the 32-lane part (d < 32) and in the scalar tail (d >= 32 of 40)
    kv = torch.zeros(1, 2, 1, 1, 40)
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5])
    kv[0, 1, 0, 0, 0] = 127.0
    kv[0, 1, 0, 0, 8:16] = halves
    kv[0, 1, 0, 0, 32:40] = halves
    kv = kv.to(dtype)
    native, ref = _both(lambda: _quantize(kv, torch.float32), monkeypatch)
    assert torch.equal(native[0], ref[0])
    want = torch.tensor([0, 2, 2, 0, -2, -2, 4, 126], dtype=torch.int8)  # every half is exact in each dtype
    assert torch.equal(native[0][0, 1, 0, 0, 8:16], want) and torch.equal(native[0][0, 1, 0, 0, 32:40], want)


def test_dequantize_into_an_out_of_another_shape_raises_and_writes_nothing_past_it():
    kv = torch.randn(2, 2, 2, 16, 64)
    q, scales, _ = _quantize(kv, torch.float32)
    big = torch.zeros(4, 2, 2, 16, 64)
    small = big[:1]  # one layer where q has two: the kernel must not write the second
    with pytest.raises(RuntimeError):
        int8.dequantize(q, scales, 2 * 2 * 64, small)
    assert not bool(big[1:].any())


def test_a_head_dim_past_the_kernels_stack_work_area_matches(monkeypatch):
    kv = torch.randn(1, 2, 2, 3, 1100).half()  # 1100 channels: the kernel's work area comes from the heap
    native, ref = _both(lambda: _quantize(kv, torch.float32), monkeypatch)
    for a, b in zip(native, ref):
        assert torch.equal(a, b)

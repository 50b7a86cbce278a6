import struct

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvstore import codec, frame, int8
from kvstore.codec import Codec, decode, encode, encode_into, frame_meta, frame_size, read_header, verify
from kvstore.errors import CorruptFrame, FrameError, InvalidInput, InvalidKV, UnsupportedFrame

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()  # float32 norms underflow for tiny magnitudes
    return float((a - b).norm() / b.norm())


def kv(shape=(4, 2, 3, 16, 32), dtype=torch.float16, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", list(Codec))
@pytest.mark.parametrize("scale_dtype", ["float32", "float16"])
def test_round_trip_every_codec_and_dtype(c, dtype, scale_dtype):
    x = kv(dtype=dtype)
    frame = encode(x, c, scale_dtype=scale_dtype)
    assert len(frame) <= frame_size(x.shape, dtype, c)
    header = verify(frame)
    assert (header.codec, header.dtype, header.shape) == (c, str(dtype).removeprefix("torch."), tuple(x.shape))
    y = decode(bytes(frame))
    assert y.dtype == dtype and y.shape == x.shape
    if c is Codec.RAW:
        assert torch.equal(y, x)
    else:
        assert rel_err(y, x) <= 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_error_on_random_normal_at_store_block_sizes(dtype):
    for shape in [(32, 2, 8, 256, 128), (8, 2, 2, 16, 64)]:
        x = kv(shape, dtype, seed=3)
        assert rel_err(decode(encode(x, "int8")), x) <= 0.01


def test_int8_error_on_real_model_kv():
    realkv = pytest.importorskip("bench.realkv")
    assert realkv.unavailable() is None, realkv.unavailable()  # it is a dev dependency: must be here
    x = realkv.minilm_kv()  # trained MiniLM K/V over real text, fp16
    assert x.shape[0] == 6 and x.shape[3] > 400
    y = decode(encode(x, "int8"))
    assert rel_err(y, x) <= 0.01
    assert rel_err(y[:, 0], x[:, 0]) <= 0.01 and rel_err(y[:, 1], x[:, 1]) <= 0.01
    for t0 in range(0, x.shape[3] - 16, 16):  # and block by block, as the store cuts it
        block = x[:, :, :, t0 : t0 + 16]
        assert rel_err(decode(encode(block, "int8+lz4")), block) <= 0.01


def test_raw_is_bit_exact_and_keeps_nan():
    x = kv()
    x[0, 0, 0, 0, 0] = float("nan")
    x[1, 1, 1, 1, 1] = float("inf")
    y = decode(encode(x, "raw"))
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("c", [Codec.INT8, Codec.INT8_LZ4])
@pytest.mark.parametrize("part", [0, 1])
def test_int8_rejects_non_finite(c, bad, part):
    x = kv()
    x[2, part, 1, 5, 7] = bad
    with pytest.raises(InvalidKV, match=rf"{'KV'[part]} of layer 2 holds NaN or Inf"):
        encode(x, c)


def test_int8_float16_scales_overflow_is_clear():
    x = kv(dtype=torch.float32) * 1e8
    with pytest.raises(InvalidKV, match="float16 scales"):
        encode(x, "int8", scale_dtype="float16")


def test_zero_channels_decode_to_zero():
    x = kv()
    x[:, 0, :, :, 3] = 0  # a K channel that is zero across the block
    x[:, 1, :, 4, :] = 0  # a V token that is zero
    y = decode(encode(x, "int8"))
    assert torch.all(y[:, 0, :, :, 3] == 0) and torch.all(y[:, 1, :, 4, :] == 0)
    assert rel_err(y, x) <= 0.01


def test_lz4_only_when_it_shrinks():
    noise = kv(shape=(4, 2, 4, 64, 64))
    frame = encode(noise, "int8+lz4")
    assert read_header(frame).lz4 is False
    assert len(frame) == len(encode(noise, "int8"))
    steps = torch.zeros(4, 2, 4, 64, 64, dtype=torch.float16)
    steps[..., ::8] = 1.0  # highly regular: lz4 pays
    packed = encode(steps, "int8+lz4")
    assert read_header(packed).lz4 is True
    assert len(packed) < len(encode(steps, "int8")) * 0.5
    assert torch.equal(decode(packed), steps)


def test_meta_is_kept_and_checked():
    frame = encode(kv(), "int8", meta=b'{"ns":"a"}')
    assert frame_meta(frame) == b'{"ns":"a"}'
    header = read_header(frame)
    frame[header.meta_offset] ^= 1
    with pytest.raises(CorruptFrame):
        frame_meta(frame)


def test_decode_into_strided_view():
    long = kv(shape=(4, 2, 3, 64, 32))
    out = torch.zeros_like(long)
    for c in Codec:
        for t0 in range(0, 64, 16):
            decode(encode(long[:, :, :, t0 : t0 + 16], c), out=out[:, :, :, t0 : t0 + 16])
        tol = 0 if c is Codec.RAW else 0.01
        assert rel_err(out, long) <= tol


def test_decode_out_must_match():
    frame = encode(kv(), "raw")
    with pytest.raises(InvalidKV, match="shape"):
        decode(frame, out=torch.empty(4, 2, 3, 15, 32, dtype=torch.float16))
    with pytest.raises(InvalidKV):
        decode(frame, out=torch.empty(4, 2, 3, 16, 32, dtype=torch.float32))


def test_encode_input_errors():
    with pytest.raises(InvalidKV, match="output buffer"):
        encode_into(kv(), bytearray(100), "raw")
    with pytest.raises(InvalidKV, match="writable"):
        encode_into(kv(), bytes(frame_size((4, 2, 3, 16, 32), torch.float16)), "raw")
    with pytest.raises(InvalidKV, match="int8 codec needs"):
        encode(torch.zeros(4, 3, 2, 2, 2, dtype=torch.float16), "int8")
    with pytest.raises(InvalidKV, match="dtypes"):
        encode(torch.zeros(2, 2, dtype=torch.int32), "raw")
    with pytest.raises(InvalidInput, match="unknown codec"):
        encode(kv(), "zstd")
    with pytest.raises(InvalidKV):
        encode([1, 2, 3], "raw")


def test_scratch_buffers_are_reused():
    x = kv(shape=(8, 2, 4, 64, 64))
    buf = bytearray(frame_size(x.shape, x.dtype, "int8"))
    out = torch.empty_like(x)
    n = encode_into(x, buf, "int8")
    decode(memoryview(buf)[:n], out=out)
    ptr = int8._WORK.get(0).data_ptr()
    for _ in range(3):
        n = encode_into(x, buf, "int8")
        decode(memoryview(buf)[:n], out=out)
    assert int8._WORK.get(0).data_ptr() == ptr  # no fresh scratch per call


# -- damaged frames: always a typed error, never data ------------------------------

FRAMES = {c: bytes(encode(kv(shape=(2, 2, 2, 16, 8)), c, meta=b"m")) for c in Codec}


@given(c=st.sampled_from(list(Codec)), data=st.data())
def test_bit_flips_are_detected(c, data):
    frame = bytearray(FRAMES[c])
    pos = data.draw(st.integers(0, len(frame) * 8 - 1), label="bit")
    frame[pos // 8] ^= 1 << (pos % 8)
    with pytest.raises(FrameError):
        decode(frame)


@given(c=st.sampled_from(list(Codec)), data=st.data())
def test_truncation_and_extension_are_detected(c, data):
    frame = FRAMES[c]
    cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
    with pytest.raises(CorruptFrame):
        decode(frame[:cut])
    extra = data.draw(st.binary(min_size=1, max_size=64), label="extra")
    with pytest.raises(CorruptFrame):
        decode(frame + extra)


@given(c=st.sampled_from(list(Codec)), data=st.data())
def test_overwritten_ranges_are_detected(c, data):
    frame = bytearray(FRAMES[c])
    start = data.draw(st.integers(0, len(frame) - 1), label="start")
    junk = data.draw(st.binary(min_size=1, max_size=128), label="junk")
    end = min(len(frame), start + len(junk))
    if bytes(frame[start:end]) == junk[: end - start]:
        return  # the same bytes: nothing was damaged
    frame[start:end] = junk[: end - start]
    with pytest.raises(FrameError):
        decode(frame)


@given(st.binary(max_size=4096))
def test_random_bytes_are_never_a_frame(blob):
    with pytest.raises(FrameError):
        decode(blob)


def _reseal(frame: bytearray, **fields) -> bytearray:
    """Rewrite header fields and fix the header checksum, as a future writer would."""
    offsets = {"version": 4, "codec": 5, "dtype": 6, "flags": 7}
    for name, value in fields.items():
        frame[offsets[name]] = value
    header_len = read_header(FRAMES[Codec.RAW]).header_len
    frame[header_len - 8 : header_len] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(frame[: header_len - 8])))
    return frame


@pytest.mark.parametrize("fields", [{"codec": 9}, {"dtype": 9}, {"flags": 0x80}])
def test_unknown_ids_with_a_sound_header_are_unsupported(fields):
    with pytest.raises(UnsupportedFrame):
        decode(_reseal(bytearray(FRAMES[Codec.RAW]), **fields))


def test_unknown_version_is_unsupported():
    frame = bytearray(FRAMES[Codec.RAW])
    frame[4] = 2
    with pytest.raises(UnsupportedFrame, match="version 2"):
        decode(frame)


def test_not_a_frame_is_corrupt():
    with pytest.raises(CorruptFrame, match="magic"):
        decode(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CorruptFrame, match="bytes-like"):
        decode(12345)


def test_lz4_decompression_bomb_is_refused():
    """A header (with a checksum anyone can recompute) claiming far more than lz4 can expand to."""
    frame = bytearray(encode(torch.zeros(2, 2, 2, 64, 64, dtype=torch.float16), "int8+lz4"))
    header = read_header(frame)
    assert header.lz4 and header.payload_len < 512
    # same scale count (L*H*(T+D) = 512) so only the lz4 ratio is off: 131072 from < 512 bytes
    frame[48:88] = struct.pack("<5Q", 1, 2, 1, 256, 256)
    frame[32:40] = struct.pack("<Q", 2 * 256 * 256)
    frame[header.header_len - 8 : header.header_len] = struct.pack(
        "<Q", xxhash.xxh3_64_intdigest(bytes(frame[: header.header_len - 8])))
    with pytest.raises(CorruptFrame, match="lengths"):
        read_header(frame)  # refused from the header alone, before anything is allocated


# -- hostile frames: sound checksums, impossible contents --------------------------


def forge(codec_id, dtype_id, shape, *, flags=0, layout=0, sid=0, scales=b"", payload=b"", raw_len=None):
    """A frame built by hand with valid checksums, as a hostile client could."""
    ndim = len(shape)
    header_len = frame.header_size(ndim)
    body = scales + bytes(frame.pad(len(scales)) - len(scales)) + payload
    fixed = frame._FIXED.pack(codec.MAGIC, 1, codec_id, dtype_id, flags, layout, sid, ndim, 0, 0,
                              len(scales), len(payload), len(payload) if raw_len is None else raw_len,
                              xxhash.xxh3_64_intdigest(body))
    head = fixed + struct.pack(f"<{ndim}Q", *shape)
    head += bytes(header_len - 8 - len(head))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + body


def test_forge_matches_the_encoder():
    x = kv(shape=(1, 2, 1, 2, 2), dtype=torch.float32)
    real = encode(x, "int8")
    h = read_header(real)
    scales = bytes(real[h.scales_offset : h.scales_offset + h.scales_len])
    assert forge(2, 3, h.shape, layout=1, sid=2, scales=scales, payload=bytes(real[h.payload_offset :])) == bytes(real)


@pytest.mark.parametrize("shape", [(0, 2**64 - 1), (0, 2**62, 2**62), (0,) + (2**40,) * 7, (2**41,)])
def test_absurd_shapes_are_refused(shape):
    with pytest.raises(CorruptFrame, match="claims shape"):
        decode(forge(1, 1, shape))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 3e38])
def test_impossible_int8_scales_are_refused(bad):
    scales = struct.pack("<4f", 0.1, bad, 0.1, 0.1)  # shape (1,2,1,2,2): 2 K + 2 V scales
    with pytest.raises(CorruptFrame, match="scales"):
        decode(forge(2, 1, (1, 2, 1, 2, 2), layout=1, sid=2, scales=scales, payload=bytes([127]) * 8))


def test_lz4_beyond_the_block_api_is_refused_from_the_header():
    tokens, dim = 32768, 32769  # 2 * T * D int8 values > 2**31: more than lz4's block API takes
    numel = 2 * tokens * dim
    frame = forge(3, 1, (1, 2, 1, tokens, dim), flags=1, layout=1, sid=2,
                  scales=bytes(4 * (tokens + dim)), payload=bytes(-(-numel // 256)), raw_len=numel)
    with pytest.raises(CorruptFrame, match="lengths"):
        read_header(frame)


def test_non_contiguous_or_released_buffers_are_not_frames():
    frame = bytes(encode(kv(), "raw"))
    doubled = bytearray(len(frame) * 2)
    doubled[::2] = frame
    with pytest.raises(CorruptFrame, match="contiguous"):
        decode(memoryview(doubled)[::2])
    view = memoryview(frame)
    view.release()
    with pytest.raises(CorruptFrame):
        decode(view)


# -- encoder edge cases ---------------------------------------------------------------


def test_kv_with_autograd_history_does_not_poison_the_scratch():
    weight = torch.randn(4, 2, 3, 16, 32, requires_grad=True)
    x = weight * 2  # has a grad_fn, as a forward pass outside no_grad would give
    for c in Codec:
        y = decode(encode(x, c))
        assert not y.requires_grad and rel_err(y, x.detach()) <= 0.01
    assert not int8._WORK.get(0).requires_grad
    assert rel_err(decode(encode(kv(), "int8")), kv()) <= 0.01  # the next plain call still works


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-20, 1e-29, 1e-33])
def test_tiny_magnitudes_keep_the_error_bound(dtype, magnitude):
    x = (kv(dtype=torch.float32) * magnitude).to(dtype)
    assert rel_err(decode(encode(x, "int8")), x) <= 0.01


def test_values_near_float32_max_are_refused_not_overflowed():
    x = kv(dtype=torch.float32).sign() * torch.finfo(torch.float32).max
    with pytest.raises(InvalidKV, match="too large"):
        encode(x, "int8")


def test_float16_scales_refuse_underflow():
    with pytest.raises(InvalidKV, match="too small for float16 scales"):
        encode(kv(dtype=torch.float32) * 1e-6, "int8", scale_dtype="float16")
    x = kv()
    assert rel_err(decode(encode(x, "int8", scale_dtype="float16")), x) <= 0.01


@pytest.mark.parametrize("call", [
    lambda: encode(kv(), "int8", scale_dtype="float64"),
    lambda: encode(kv(), "int8", scale_dtype=None),
    lambda: frame_size((4, 2, 3, 16, 32), torch.float16, "int8", scale_dtype="bfloat16"),
    lambda: encode(kv(), "raw", meta="text"),
    lambda: encode(kv().to("meta"), "raw"),
    lambda: encode(kv().to_sparse(), "raw"),
])
def test_bad_encode_arguments_are_typed(call):
    with pytest.raises(InvalidInput):
        call()


def test_decode_refuses_unwritable_out():
    frame = encode(kv(), "int8")
    with pytest.raises(InvalidKV):
        decode(frame, out=torch.zeros(4, 2, 3, 16, 32, dtype=torch.float16, requires_grad=False).requires_grad_())
    with pytest.raises(InvalidKV, match="cannot be written"):
        decode(frame, out=torch.zeros(1, 1, 1, 1, 1, dtype=torch.float16).expand(4, 2, 3, 16, 32))


def test_expect_checksum_refuses_a_sound_but_different_frame():
    a, b = encode(kv(seed=1), "raw"), encode(kv(seed=2), "raw")
    assert torch.equal(decode(a, expect_checksum=read_header(a).body_checksum), kv(seed=1))
    with pytest.raises(CorruptFrame, match="not the one recorded"):
        decode(b, expect_checksum=read_header(a).body_checksum)


def test_large_raw_frame_is_hashed_while_copied_and_still_refused_when_damaged():
    kv = torch.randn(8, 2, 8, 64, 128).to(torch.bfloat16)  # 2 MiB+: the chunked path
    frame = codec.encode(kv, "raw")
    out = torch.empty(8, 2, 8, 96, 128, dtype=torch.bfloat16)[:, :, :, :64]  # strided destination
    assert torch.equal(codec.decode(frame, out=out), kv)
    frame[-3] ^= 0x40  # one bit in the last layer
    with pytest.raises(CorruptFrame, match="checksum"):
        codec.decode(frame, out=out)


def test_a_bytes_frame_is_raw_only_and_sealed_around_a_payload_in_place():
    meta = b'{"who":"lmcache"}'
    payload = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and an odd tail
    at = codec.raw_payload_offset(1, len(meta))
    buf = bytearray(at + len(payload) + 100)
    buf[at:at + len(payload)] = payload  # as a socket would have written it
    n = codec.seal_raw(buf, "uint8", (len(payload),), meta)
    frame = bytes(buf[:n])
    header = verify(frame)
    assert (header.dtype, header.shape, header.codec, header.raw_nbytes) == ("uint8", (len(payload),), Codec.RAW,
                                                                           len(payload))
    assert frame_meta(frame) == meta and bytes(decode(frame).numpy()) == payload
    with pytest.raises(InvalidKV, match="kept raw"):
        codec.transcode(frame, "int8")  # opaque bytes are never quantized
    with pytest.raises(InvalidKV, match="kept raw"):
        encode(torch.zeros(4, 2, 1, 16, 8, dtype=torch.uint8), "int8")
    with pytest.raises(InvalidKV):
        codec.seal_raw(bytearray(at + 10), "uint8", (len(payload),), meta)  # too small
    assert codec.seal_raw(bytearray(at), "uint8", (0,), b"") == codec.raw_payload_offset(1, 0)


def test_encode_many_makes_the_frames_encode_makes_byte_for_byte():
    from kvstore.codec import encode_many

    for shape, dtype in (((8, 2, 2, 16, 64), torch.float16), ((2, 2, 3, 5, 7), torch.bfloat16),
                         ((1, 2, 1, 1, 1), torch.float32)):
        gen = torch.Generator().manual_seed(len(shape) + shape[0])
        kvs = [torch.randn(shape, generator=gen).to(dtype) * (10.0 ** i) for i in range(-3, 4)]
        kvs.append(torch.zeros(shape, dtype=dtype))  # all-zero channels: the scale's floor
        kvs.append(torch.randn((shape[0], shape[1], shape[3], shape[2], shape[4]), generator=gen).to(dtype)
                   .transpose(2, 3))  # a strided view
        metas = [f"block {i}".encode() * i for i in range(len(kvs))]
        metas[1:4] = [b"m" * 64, b"m" * 65, b"m" * 129]  # on, past and two past the 64-byte padding
        many = encode_many(kvs, metas)
        assert [bytes(f) for f in many] == [bytes(encode(k, "int8", meta=m)) for k, m in zip(kvs, metas)]


def test_encode_many_refuses_what_encode_refuses():
    from kvstore.codec import encode_many

    good = torch.randn(2, 2, 2, 4, 8).half()
    bad = good.clone()
    bad[1, 0, 1, 2, 3] = float("inf")
    with pytest.raises(InvalidKV):
        encode_many([good, bad], [b"", b""])
    with pytest.raises(InvalidKV, match="one shape"):
        encode_many([good, torch.randn(2, 2, 2, 5, 8).half()], [b"", b""])
    with pytest.raises(InvalidKV):
        encode_many([torch.randn(4, 8).half()] * 2, [b"", b""])
    with pytest.raises(InvalidInput):
        encode_many([good], [])
    assert encode_many([], []) == []


@pytest.mark.parametrize("dtype", [*DTYPES, torch.uint8])
def test_raw_frame_into_writes_encode_intos_frame_and_returns_its_checksum(dtype):
    from kvstore.codec import int_view, raw_frame_into

    whole = (torch.randn(4, 2, 3, 48, 32, generator=torch.Generator().manual_seed(5)) * 50).to(dtype)
    bits = int_view(whole)
    name = str(dtype).removeprefix("torch.")
    for lo, hi, meta in ((0, 16, b""), (16, 32, b"m" * 64), (32, 48, b"m" * 65)):  # strided blocks; meta pads
        want = bytearray(frame_size((4, 2, 3, 16, 32), dtype, meta_len=len(meta)) + 40)
        n = encode_into(whole[:, :, :, lo:hi], want, meta=meta)
        got = bytearray(b"\xff" * len(want))  # stale bytes under the pads must not survive
        length, checksum = raw_frame_into(bits[:, :, :, lo:hi], name, got, meta)
        assert (length, bytes(got[:n])) == (n, bytes(want[:n]))
        assert checksum == read_header(got[:n]).body_checksum
        assert torch.equal(decode(bytes(got[:n])), whole[:, :, :, lo:hi])
    big = torch.randn(4, 2, 1, 1024, 256).half()  # 4 MiB: copied and hashed in cache-sized runs
    out = bytearray(frame_size(big.shape, big.dtype))
    assert raw_frame_into(int_view(big), "float16", out)[1] == verify(out).body_checksum


def test_raw_frame_into_refuses_bits_of_another_size_and_a_bad_buffer_or_meta():
    from kvstore.codec import int_view, raw_frame_into

    x = torch.randn(2, 2, 1, 4, 8).half()
    room = bytearray(frame_size(x.shape, x.dtype, meta_len=8))
    with pytest.raises(InvalidKV, match="2-byte ints"):
        raw_frame_into(int_view(x.float()), "float16", room)  # float32 bits as a float16 frame
    with pytest.raises(InvalidKV, match="dtypes"):
        raw_frame_into(int_view(x), "float8", room)
    with pytest.raises(InvalidKV, match="hold"):
        raw_frame_into(int_view(x), "float16", room[:-1], b"m" * 8)
    with pytest.raises(InvalidKV, match="hold"):
        raw_frame_into(int_view(x), "float16", bytes(room))  # read-only
    with pytest.raises(InvalidInput):
        raw_frame_into(int_view(x), "float16", room, "meta")

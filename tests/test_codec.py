import struct

import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvstore import codec
from kvstore.codec import Codec, decode, encode, encode_into, frame_meta, frame_size, read_header, verify
from kvstore.errors import CorruptFrame, FrameError, InvalidInput, InvalidKV, UnsupportedFrame

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
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
    ptr = codec._SCRATCH.work.data_ptr()
    for _ in range(3):
        n = encode_into(x, buf, "int8")
        decode(memoryview(buf)[:n], out=out)
    assert codec._SCRATCH.work.data_ptr() == ptr  # no fresh scratch per call


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

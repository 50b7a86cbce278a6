"""LMCache's lm:// message layouts and key strings (kvstore/wire/lmcache.py)."""

from __future__ import annotations

import pytest

from kvstore.wire.lmcache import (CLIENT_META, SERVER_META, BadRequest, Command, LMKey, parse_key, parse_request,
                                     payload_length, server_meta)
from tests.server import lmwire as lm


def test_sizes_and_a_request_from_the_wire():
    assert CLIENT_META.size == 186 and SERVER_META.size == 36
    req = parse_request(lm.meta(lm.PUT, "m@1@0@ab@bfloat16", 512, lm.KV_2LTD, lm.BF16, (2, 1, 16, 8)))
    assert (req.command, req.length, req.fmt, req.dtype, req.shape, req.key) == \
        (Command.PUT, 512, 1, 3, (2, 1, 16, 8), "m@1@0@ab@bfloat16")
    # A C client's NUL padding is accepted as well as LMCache's spaces.
    raw = bytearray(lm.meta(lm.EXIST, "m@1@0@ab@half"))
    raw[36 + len("m@1@0@ab@half"):] = bytes(150 - len("m@1@0@ab@half"))
    assert parse_request(bytes(raw)).key == "m@1@0@ab@half"


@pytest.mark.parametrize("text,canonical", [
    ("llama@1@0@abc@bfloat16", "llama@1@0@abc@bfloat16"),
    ("llama@1@0@0ABC@bfloat16", "llama@1@0@abc@bfloat16"),  # LMCache compares the hash as a number
    ("llama@4@2@-1f@half", "llama@4@2@-1f@half"),  # Python's hash() may be negative
    ("llama@1@0@ff@half@3", "llama@1@0@ff@half@3"),  # a layer-wise key
    ("llama@1@0@ff@half@lmcache.tag.user%alice%x", "llama@1@0@ff@half@lmcache.tag.user%alice%x"),
    ("org/model-7B@8@7@1@fp8_e4m3fn", "org/model-7B@8@7@1@fp8_e4m3fn"),
])
def test_keys_parse_to_one_spelling(text, canonical):
    key = parse_key(text)
    assert key.canonical() == canonical and parse_key(canonical) == key


def test_the_model_part_names_one_shard():
    key = parse_key("m@4@2@ff@half@3@lmcache.tag.user%a")
    assert key == LMKey("m", 4, 2, 0xFF, "half", 3, (("lmcache.tag.user", "a"),))
    assert key.model_part() == "m@4@2@half"


@pytest.mark.parametrize("text", ["", "m@1@0@1", "@1@0@1@half", "m@x@0@1@half", "m@1@0@g@half", "m@1@0@1@bf16",
                                  "m@1@0@1@half@tag-without-value", "m@1@0@" + "f" * 65 + "@half"])
def test_malformed_keys(text):
    with pytest.raises(BadRequest) as err:
        parse_key(text)
    assert err.value.reason == "malformed key"


def test_payload_lengths_and_answers():
    assert payload_length(1, 3, (2, 32, 256, 1024)) == 32 << 20
    assert payload_length(1, 2, (2, 1, 16, 0)) == 2 * 16 * 2  # trailing zero dims are padding
    assert payload_length(4, 6, (999, 0, 0, 0)) is None  # binary: the shape does not say
    assert payload_length(1, 0, (1, 2, 3, 4)) is None  # no dtype
    assert SERVER_META.unpack(server_meta(400)) == (400, 0, 1, 2, 0, 0, 0, 0, 0)
    assert SERVER_META.unpack(server_meta(200, 8, 1, 3, (1, 2, 2, 1))) == (200, 8, 1, 3, 1, 2, 2, 1, 0)

"""Spec-mismatch hints (``kvstore.engine.hints``): a get that finds nothing says so when the same
tokens are stored under another spec of the model, and costs nothing otherwise."""

from __future__ import annotations

import warnings

import pytest

from kvstore import KVStore
from kvstore.engine.hints import SPECS_PER_MODEL, describe
from kvstore.errors import KVStoreWarning
from tests.conftest import make_kv, make_spec
from tiers.memory import MemoryTier

TOKENS = list(range(700, 764))  # 4 blocks of 16


@pytest.fixture
def store():
    with KVStore([MemoryTier(64 << 20)], background=False) as s:
        yield s


def _get(store, spec, tokens=TOKENS, namespace="default", **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kv, n = store.get_kv(spec, tokens, namespace, **kw)
    return n, [w for w in caught if issubclass(w.category, KVStoreWarning)]


def test_a_get_under_another_dtype_is_empty_and_warned_once_per_pair(store):
    f16, f32 = make_spec(dtype="float16"), make_spec(dtype="float32")
    store.put_kv(f16, TOKENS, make_kv(f16, 64))
    n, warned = _get(store, f32)
    assert n == 0 and len(warned) == 1
    text = str(warned[0].message)
    assert "stored as dtype=float16, asked dtype=float32" in text and "'llama-tiny'" in text
    assert warned[0].filename == __file__  # points at the caller of get_kv
    assert _get(store, f32) == (0, [])  # once per pair of specs
    assert _get(store, f16)[0] == 64  # the writer's spec still reads


def test_hints_go_to_a_list_when_given_and_name_every_differing_field(store):
    stored = make_spec(block_tokens=16, fingerprint="rev-2")
    store.put_kv(stored, TOKENS, make_kv(stored, 64))
    asked = make_spec(block_tokens=32, fingerprint="rev-1")
    hints: list[str] = []
    n, warned = _get(store, asked, hints=hints)
    assert n == 0 and warned == [] and hints == [describe(stored, asked)]
    assert "stored as block_tokens=16 fingerprint=rev-2, asked block_tokens=32 fingerprint=rev-1" in hints[0]
    blocks_hints: list[str] = []
    assert store.prefix_blocks(asked, TOKENS, "default", hints=blocks_hints) == [] and blocks_hints == hints


@pytest.mark.parametrize("case", ["other namespace", "other model", "other tokens", "too short", "partial hit"])
def test_no_hint_where_there_is_nothing_to_say(store, case):
    f16, f32 = make_spec(dtype="float16"), make_spec(dtype="float32")
    store.put_kv(f16, TOKENS, make_kv(f16, 64), "ns-a")
    asked, tokens, ns = f32, TOKENS, "ns-a"
    if case == "other namespace":
        ns = "ns-b"
    elif case == "other model":
        asked = make_spec(dtype="float32", model_id="another-model")
    elif case == "other tokens":
        tokens = list(range(64))
    elif case == "too short":
        tokens = TOKENS[:10]  # not one full block: nothing was asked
    else:  # the asked spec hits its first block itself: no miss at block 0
        store.put_kv(f32, TOKENS[:16], make_kv(f32, 16), "ns-a")
    hints: list[str] = []
    store.get_kv(asked, tokens, ns, hints=hints)
    assert hints == []


def test_remembered_specs_are_bounded_per_model(store):
    f16 = make_spec(dtype="float16")
    store.put_kv(f16, TOKENS, make_kv(f16, 64))
    for i in range(SPECS_PER_MODEL):  # newer specs of the model push the float16 one out
        store.hints.saw(make_spec(fingerprint=f"rev-{i}"), "default")
    hints: list[str] = []
    store.get_kv(make_spec(dtype="float32"), TOKENS, hints=hints)
    assert hints == []
    store.put_kv(f16, TOKENS, make_kv(f16, 64))  # a put remembers it again
    store.get_kv(make_spec(dtype="float32"), TOKENS, hints=hints)
    assert len(hints) == 1

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import InvalidKey, InvalidSpec, InvalidTokens
from kvstore.keys import HASH_BYTES, block_hashes, from_hex, iter_block_hashes, root_hash, to_hex
from tests.conftest import make_spec

TOKENS = list(range(1000, 1050))  # 3 full blocks of 16 and a tail of 2


def test_only_full_blocks_get_keys(spec):
    keys = block_hashes(spec, TOKENS)
    assert len(keys) == 3
    assert all(isinstance(k, bytes) and len(k) == HASH_BYTES for k in keys)
    assert block_hashes(spec, TOKENS[:15]) == []


def test_keys_are_chained(spec):
    base = block_hashes(spec, TOKENS)
    changed = list(TOKENS)
    changed[3] += 1  # inside block 0: every later key changes
    assert all(a != b for a, b in zip(base, block_hashes(spec, changed)))
    changed = list(TOKENS)
    changed[40] += 1  # inside block 2: blocks 0 and 1 keep their keys
    assert block_hashes(spec, changed)[:2] == base[:2]
    assert block_hashes(spec, changed)[2] != base[2]
    assert block_hashes(spec, TOKENS + [7] * 14)[:3] == base  # the tail does not matter


def test_input_forms_agree(spec):
    expected = block_hashes(spec, TOKENS)
    for form in (tuple(TOKENS), np.array(TOKENS, dtype=np.int64), np.array(TOKENS, dtype=np.uint32),
                 torch.tensor(TOKENS), torch.tensor(TOKENS, dtype=torch.int32),
                 np.array(TOKENS, dtype=np.uint16), [np.int64(t) for t in TOKENS]):
        assert block_hashes(spec, form) == expected
    edge = [2**32 - 1] * 16  # the largest id, in the list fast path and as an array
    assert block_hashes(spec, edge) == block_hashes(spec, np.array(edge, dtype=np.uint64))


def test_separated_by_namespace_and_fingerprint(spec):
    base = block_hashes(spec, TOKENS, "default")
    assert set(base).isdisjoint(block_hashes(spec, TOKENS, "tenant-b"))
    assert set(base).isdisjoint(block_hashes(make_spec(fingerprint="weights-rev-2"), TOKENS, "default"))
    assert set(base).isdisjoint(block_hashes(make_spec(model_id="other"), TOKENS, "default"))
    assert set(base).isdisjoint(block_hashes(make_spec(dtype="bfloat16"), TOKENS, "default"))
    # length-prefixed namespace: "ab" + fingerprint cannot pose as "a" + "b..."
    assert root_hash(spec, "ab") != root_hash(spec, "a")


def test_lazy_iterator_matches_list(spec):
    it = iter_block_hashes(spec, TOKENS)
    assert next(it) == block_hashes(spec, TOKENS)[0]


def test_stable_across_processes(spec):
    """Python's hash() is salted per process; our keys must not be."""
    code = (
        "from tests.conftest import make_spec; from kvstore.keys import block_hashes;"
        f"print(','.join(k.hex() for k in block_hashes(make_spec(), {TOKENS!r}, 'ns-1')))"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             cwd=str(pathlib.Path(__file__).resolve().parents[2]), check=True)
        outs.add(res.stdout.strip())
    assert outs == {",".join(k.hex() for k in block_hashes(spec, TOKENS, "ns-1"))}


@given(a=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=16),
       b=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=16))
def test_different_blocks_never_collide(a, b):
    spec = make_spec()
    if a != b:
        assert block_hashes(spec, a) != block_hashes(spec, b)


def test_fixed_width_encoding_has_no_ambiguity():
    spec = make_spec(block_tokens=2)
    # with variable-width or concatenated decimal encodings these pairs would collide
    assert block_hashes(spec, [1, 23]) != block_hashes(spec, [12, 3])
    assert block_hashes(spec, [256, 0]) != block_hashes(spec, [1, 1 << 16])


@pytest.mark.parametrize("bad", [
    [1.5] * 16, [-1] * 16, [2**32] * 16, [[1, 2]] * 8, "abc", None, torch.ones(16),
    torch.ones(2, 16, dtype=torch.int64), np.ones(16, dtype=bool), [True] * 16,
    [1] * 15 + [2**70], [1] * 15 + [-1], (0,) * 15 + (2**32,), np.full(16, -1, np.int8),
    np.full(16, -1, np.int16), torch.full((16,), -1, dtype=torch.int8),
])
def test_bad_tokens(spec, bad):
    with pytest.raises(InvalidTokens):
        block_hashes(spec, bad)


@pytest.mark.parametrize("ns", ["", "a b", "a/b", "x" * 129, None, "ü"])
def test_bad_namespace(spec, ns):
    with pytest.raises(InvalidSpec, match="namespace"):
        block_hashes(spec, TOKENS, ns)


def test_hex_round_trip_and_errors(spec):
    key = block_hashes(spec, TOKENS)[0]
    assert from_hex(to_hex(key)) == key and len(to_hex(key)) == 64
    assert from_hex(to_hex(key).upper()) == key
    for bad in ["", "zz" * 32, "ab" * 31, "ab" * 33, "../" * 20, 42]:
        with pytest.raises(InvalidKey):
            from_hex(bad)


def test_trailing_newlines_are_not_accepted(spec):
    with pytest.raises(InvalidSpec):
        block_hashes(spec, TOKENS, "default\n")
    with pytest.raises(InvalidKey):
        from_hex("ab" * 32 + "\n")
    with pytest.raises(InvalidSpec):
        make_spec(model_id="llama\n")


@pytest.mark.parametrize("bad", [[1, True, 2, 3], (5, False), torch.ones(16, dtype=torch.int64).to("meta"),
                                 torch.ones(16, dtype=torch.int64).to_sparse()])
def test_bools_and_odd_tensors_are_refused(spec, bad):
    with pytest.raises(InvalidTokens):
        block_hashes(spec, bad)

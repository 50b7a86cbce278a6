import pytest
import torch

from kvstore import KVSpec
from kvstore.errors import InvalidKV, InvalidSpec
from tests.conftest import make_spec


def test_public_constructor_and_fields():
    spec = KVSpec(model_id="llama-tiny", num_layers=8, num_kv_heads=2, head_dim=64,
                  dtype="float16", block_tokens=16, fingerprint="weights-rev-1")
    assert spec.weights_fingerprint == "weights-rev-1"
    assert spec.torch_dtype is torch.float16
    assert spec.block_shape == (8, 2, 2, 16, 64)
    assert spec.bytes_per_token == 8 * 2 * 2 * 64 * 2
    assert spec.block_nbytes == spec.bytes_per_token * 16
    assert spec.full_blocks(47) == 2


def test_fingerprint_is_stable_hex():
    a, b = make_spec(), make_spec()
    assert a == b and hash(a) == hash(b)
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 64 and int(a.fingerprint(), 16) >= 0


@pytest.mark.parametrize("change", [
    {"model_id": "llama-other"}, {"fingerprint": "weights-rev-2"}, {"num_layers": 5},
    {"num_kv_heads": 4}, {"head_dim": 32}, {"dtype": "bfloat16"}, {"block_tokens": 32},
])
def test_fingerprint_covers_every_field(change):
    assert make_spec(**change).fingerprint() != make_spec().fingerprint()


@pytest.mark.parametrize("dtype, name", [
    ("float16", "float16"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16"), (torch.float32, "float32"),
])
def test_dtype_accepts_names_and_torch_dtypes(dtype, name):
    spec = make_spec(dtype=dtype)
    assert spec.dtype == name
    assert spec == make_spec(dtype=name)


@pytest.mark.parametrize("bad, match", [
    ({"fingerprint": None}, "fingerprint is required"),
    ({"fingerprint": ""}, "fingerprint"),
    ({"model_id": "has space"}, "model_id"),
    ({"num_layers": 0}, "num_layers"),
    ({"num_layers": 2.0}, "num_layers must be an int"),
    ({"num_kv_heads": True}, "num_kv_heads"),
    ({"head_dim": 10**6}, "head_dim"),
    ({"dtype": "int8"}, "dtype"),
    ({"dtype": torch.float64}, "dtype"),
    ({"block_tokens": -16}, "block_tokens"),
])
def test_bad_fields_are_named(bad, match):
    with pytest.raises(InvalidSpec, match=match):
        make_spec(**bad)


def test_frozen():
    with pytest.raises(AttributeError):
        make_spec().num_layers = 3


def test_validate_kv_names_expected_and_actual(spec):
    good = spec.empty_kv(40)
    assert spec.validate_kv(good, min_tokens=32) is good
    with pytest.raises(InvalidKV, match=r"kv shape \[4, 2, 3, 40, 16\].*expected \[4, 2, 2, >=32, 16\]"):
        spec.validate_kv(torch.empty(4, 2, 3, 40, 16, dtype=torch.float16), min_tokens=32)
    with pytest.raises(InvalidKV, match=r">=48"):
        spec.validate_kv(good, min_tokens=48)
    with pytest.raises(InvalidKV, match="dtype torch.float32 does not match spec dtype torch.float16"):
        spec.validate_kv(good.float(), min_tokens=32)
    with pytest.raises(InvalidKV, match="torch.Tensor"):
        spec.validate_kv(good.numpy(), min_tokens=32)


def test_dict_round_trip_and_errors(spec):
    assert KVSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(InvalidSpec, match="unknown spec field"):
        KVSpec.from_dict({**spec.to_dict(), "layers": 3})
    with pytest.raises(InvalidSpec, match="missing"):
        KVSpec.from_dict({"model_id": "x"})
    with pytest.raises(InvalidSpec, match="object"):
        KVSpec.from_dict(["x"])


def test_replace_and_dataclasses_replace(spec):
    import dataclasses

    other = spec.replace(num_layers=6)
    assert other.num_layers == 6 and other.fingerprint() != spec.fingerprint()
    assert dataclasses.replace(spec, dtype="bfloat16") == spec.replace(dtype="bfloat16")


def test_from_dict_with_non_string_keys(spec):
    with pytest.raises(InvalidSpec, match="unknown spec field"):
        KVSpec.from_dict({**spec.to_dict(), 1: 2})

import inspect

import pytest

import kvstore
from kvstore import errors


def _classes():
    return [getattr(errors, name) for name in errors.__all__]


def test_every_error_is_in_the_tree_and_drawn_in_the_docstring():
    doc = errors.__doc__
    for cls in _classes():
        assert issubclass(cls, errors.KVStoreError)
        assert cls.__name__ in doc, f"{cls.__name__} missing from the drawn tree"
        assert cls.__doc__, f"{cls.__name__} has no docstring"
    # KVStoreWarning is a Warning (so an Exception) but no error: it stays outside the tree
    defined = {n for n, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, Exception) and not issubclass(c, Warning)}
    assert defined == set(errors.__all__)
    assert issubclass(errors.KVStoreWarning, UserWarning) and "KVStoreWarning" in doc


@pytest.mark.parametrize("cls, builtin", [
    (errors.InvalidInput, ValueError), (errors.InvalidSpec, ValueError), (errors.InvalidKV, ValueError),
    (errors.InvalidTokens, ValueError), (errors.InvalidKey, ValueError), (errors.CorruptFrame, ValueError),
    (errors.UnsupportedFrame, ValueError), (errors.BlockNotFound, KeyError),
    (errors.TierUnavailable, ConnectionError), (errors.TierIOError, OSError), (errors.StoreClosed, RuntimeError),
])
def test_leaves_inherit_a_builtin(cls, builtin):
    assert issubclass(cls, builtin)


def test_tier_errors_carry_the_tier():
    exc = errors.TierUnavailable("redis is down", tier="redis")
    assert exc.tier == "redis" and str(exc) == "redis is down"
    full = errors.TierFull("full", tier="shm", stored_tokens=32)
    assert full.stored_tokens == 32 and isinstance(full, errors.TierError)
    assert str(errors.BlockNotFound("block ab is not stored")) == "block ab is not stored"


def test_package_reexports_the_tree():
    """The engine's errors from ``kvstore``, the service's from ``client_sdk``: one tree either way."""
    import client_sdk

    for name in errors.__all__:
        home = client_sdk if name in errors.SERVICE_ERRORS else kvstore
        assert getattr(home, name) is getattr(errors, name)
        assert issubclass(getattr(errors, name), errors.KVStoreError)

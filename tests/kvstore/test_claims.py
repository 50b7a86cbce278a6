"""Every change to the index runs under its key's claim: the index checks it, not a convention."""

import threading

import pytest

from kvstore import KVStore
from kvstore.keys import block_hashes
from tests.conftest import make_kv, make_spec
from tiers.memory import MemoryTier


@pytest.fixture()
def store():
    with KVStore([MemoryTier(8 << 20, name="memory")], background=False) as s:
        yield s


def test_publish_and_removal_without_the_claim_are_refused(store):
    spec = make_spec()
    tokens = list(range(32))
    store.put_kv(spec, tokens, make_kv(spec, 32))
    key = block_hashes(spec, tokens)[0]
    entry = store.entry(key)
    with pytest.raises(RuntimeError, match="without its claim"):
        store.core.publish(entry)
    with pytest.raises(RuntimeError, match="without its claim"):
        store.core.unpublish(key, expected=entry)
    with pytest.raises(RuntimeError, match="without its claim"):
        store.core.switch(entry, src="memory")
    assert store.entry(key) is entry  # nothing changed
    with store.core.claim(key):
        assert store.core.unpublish(key, expected=entry) is entry
    assert store.entry(key) is None


def test_another_threads_claim_does_not_count(store):
    """A claim belongs to the thread that took it: a second thread changing the key while the
    first holds the claim is refused, rather than racing it."""
    spec = make_spec()
    tokens = list(range(16))
    store.put_kv(spec, tokens, make_kv(spec, 16))
    key = block_hashes(spec, tokens)[0]
    entry = store.entry(key)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            store.core.unpublish(key, expected=entry)
        except RuntimeError as exc:
            errors.append(exc)

    with store.core.claim(key):
        t = threading.Thread(target=other)
        t.start()
        t.join(10)
    assert len(errors) == 1 and "without its claim" in str(errors[0])
    assert store.entry(key) is entry


def test_every_engine_path_holds_the_claim(store):
    """Puts, frame puts, moves, drops, deletes and reserved commits all pass the check (a path
    that forgot its claim would raise here)."""
    spec = make_spec()
    for i in range(4):
        store.put_kv(spec, list(range(i * 1000, i * 1000 + 64)), make_kv(spec, 64, seed=i))
    assert store.delete(spec, list(range(64))) == 4
    keys = block_hashes(spec, list(range(1000, 1064)))
    assert store.delete_blocks(keys[:2]) == 2
    assert store.lookup(spec, list(range(2000, 2064))) == 64

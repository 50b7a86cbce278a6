"""Every change to the index runs under its key's claim: the index checks it, not a convention."""

import threading
import time

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


def test_claim_all_waits_for_every_key_holding_none_meanwhile(store):
    """``claim_all`` takes its keys together: while another thread holds one of them it holds
    none of the others (a thread claiming those is not blocked), and it releases them together."""
    a, b, c = (bytes([i]) * 32 for i in range(3))
    index = store.core._index
    taken = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def holder() -> None:
        with index.claim(b):
            taken.set()
            release.wait(10)
            order.append("holder done")

    def batch() -> None:
        with index.claim_all([a, b, c]):
            order.append("batch in")

    t1 = threading.Thread(target=holder)
    t1.start()
    assert taken.wait(10)
    t2 = threading.Thread(target=batch)
    t2.start()
    deadline = time.monotonic() + 10
    while not index._cond._waiters and time.monotonic() < deadline:  # the batch waits for b
        time.sleep(0.001)
    assert index._cond._waiters

    def claim_a() -> None:
        with index.claim(a):  # not held by the waiting batch: it would block here
            order.append("a free")
    t3 = threading.Thread(target=claim_a, daemon=True)
    t3.start()
    t3.join(5)
    assert order == ["a free"]
    release.set()
    t1.join(10)
    t2.join(10)
    assert order == ["a free", "holder done", "batch in"]
    with index.claim_all([c, a]):  # all released
        pass
    with pytest.raises(ValueError, match="each key once"):
        with index.claim_all([a, a]):
            pass
    with index.claim(a):  # the refused claim_all took nothing
        pass

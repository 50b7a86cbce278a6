"""Arena slot stamps: a new one at every publish and move, and a vouch that lasts only as long as it.

The store hashes a frame's body once per stamp (``kvstore/frames.py``); these check the
tier's half of that rule on a real shm arena and on an arena that lends copies.
"""

import pytest

from tests.tiers.conformance import MiB, key, payload
from tests.tiers.test_arena import HeapArena
from tiers.shm import ShmTier


def seen(tier, k):
    """(stamp, vouched) of ``k``'s slot as a reader is told them; None when absent."""
    return tier.read_vouched(k, lambda _view, stamp, vouched: (stamp, vouched))


@pytest.fixture
def shm():
    tier = ShmTier(1 * MiB, max_entries=16)
    yield tier
    tier.close()


def test_a_vouch_lasts_until_the_slot_is_published_again(shm):
    shm.put(key(1), payload(4096, 1))
    stamp, vouched = seen(shm, key(1))
    assert stamp > 0 and not vouched
    shm.vouch(key(1), stamp)
    assert seen(shm, key(1)) == (stamp, True)
    shm.put(key(1), payload(4096, 2))  # rewritten: a new stamp, not vouched for
    again, vouched = seen(shm, key(1))
    assert again > stamp and not vouched
    shm.vouch(key(1), stamp)  # a stale stamp vouches for nothing
    assert seen(shm, key(1)) == (again, False)
    shm.delete(key(1))
    shm.vouch(key(1), again)
    assert seen(shm, key(1)) is None
    shm.put(key(1), payload(4096, 1))
    assert seen(shm, key(1))[0] > again and not seen(shm, key(1))[1]


def test_bytes_written_in_place_are_not_vouched_for(shm):
    """Bytes written into a slot are checked by their first read, never trusted for where they came from."""
    shm.put_with(key(1), 4096, lambda view: view.nbytes)
    assert seen(shm, key(1))[1] is False
    slot = shm.reserve(key(2), 4096)  # a co-located client's put fills a reserved slot
    shm.reserved_view(slot)[:] = payload(4096, 2)
    shm.commit_reserved(key(2), slot, 4096, 4096)
    stamp, vouched = seen(shm, key(2))
    assert stamp > seen(shm, key(1))[0] and not vouched


def test_compaction_restamps_what_it_moves_and_keeps_its_vouch(shm):
    """A move is a new publication (a new stamp), but of bytes copied in memory from ones that were
    checked: the vouch goes with them (the scrubber re-checks every slot in its cycle), and what
    was never vouched for is not after the move either."""
    for i in range(8):
        shm.put(key(i), payload(128 * 1024 - 64, i))
    before = {i: seen(shm, key(i))[0] for i in range(1, 8, 2)}
    for i in before:
        shm.vouch(key(i), before[i])
    for i in range(0, 8, 2):
        shm.delete(key(i))
    shm.put(key(100), payload(512 * 1024 - 64, 100))
    assert shm.stats().details["compactions"] == "1"
    for i, stamp in before.items():
        now, vouched = seen(shm, key(i))
        assert now != stamp and vouched
        assert bytes(shm.get(key(i))) == payload(128 * 1024 - 64, i)
    assert not seen(shm, key(100))[1]


def test_an_arena_that_lends_copies_never_says_vouched():
    """A copy (the device tier's way) is new bytes on every read: they are hashed every time."""
    tier = HeapArena(1 * MiB, max_entries=16)
    try:
        tier.put(key(1), payload(4096, 1))
        stamp, _ = seen(tier, key(1))
        tier.vouch(key(1), stamp)
        assert seen(tier, key(1)) == (stamp, False)
    finally:
        tier.close()

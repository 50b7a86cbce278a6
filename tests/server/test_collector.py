"""The server's collector policy (``server.collector``) against Python's real collector.

Process-wide state: each test unfreezes and uninstalls what it did, so the rest of the run is
as before."""

from __future__ import annotations

import gc
import weakref

import pytest

from server.collector import Collector


class Node:  # a cycle's member, watched through a weak reference
    def __init__(self) -> None:
        self.other: Node | None = None


def _cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


class Ticks:
    """A clock that says every collection took ``step`` seconds."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_start_and_slow_full_collections_freeze_what_is_alive_and_cycles_made_after_are_collected(unfrozen):
    collector = Collector(0.5, clock=Ticks(1.0))  # every full collection "took" 1 s: slow
    uninstall = collector.install()
    try:
        assert collector.freezes == 1 and gc.get_freeze_count() > 0  # at start
        kept = [Node() for _ in range(1000)]  # alive through the next full collection
        at_start = gc.get_freeze_count()
        gc.collect()
        assert collector.freezes == 2 and collector.last_full_s == 1.0
        assert gc.get_freeze_count() >= at_start + len(kept)
        dead = _cycle()  # garbage made after the freeze: the collector still walks it, and frees it
        gc.collect()
        assert dead() is None
    finally:
        uninstall()
    assert collector._on_collect not in gc.callbacks


def test_a_quick_full_collection_freezes_nothing_more(unfrozen):
    collector = Collector(5.0, clock=Ticks(1.0))
    uninstall = collector.install()
    try:
        frozen = gc.get_freeze_count()
        gc.collect(1)  # not a full collection: not timed
        gc.collect()
        # no freeze: the frozen count can only fall (frozen objects freed by their reference counts)
        assert collector.freezes == 1 and collector.last_full_s == 1.0 and gc.get_freeze_count() <= frozen
    finally:
        uninstall()


def test_zero_turns_the_policy_off(unfrozen):
    collector = Collector(0)
    uninstall = collector.install()
    assert gc.get_freeze_count() == 0 and collector._on_collect not in gc.callbacks
    uninstall()

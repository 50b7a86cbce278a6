"""The shm tier on real /dev/shm, with readers in real other processes."""

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import xxhash

from kvstore.errors import InvalidInput, TierFull, TierUnavailable
from tests.tiers.conformance import MiB, TierContract, key, payload, tier_state_machine
from tiers.shm import SHM_DIR, ShmReader, ShmTier, SlotHandle, cleanup_stale

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def make_tier():
    made = []

    def make(capacity_bytes, **kw):
        made.append(ShmTier(capacity_bytes, **kw))
        return made[-1]

    yield make
    for tier in made:
        tier.close()
        assert not os.path.exists(tier.path), "close must unlink the segment"


class TestShmTier(TierContract):
    def test_stats_name_segment_and_pinning(self, tier):
        details = tier.stats().details
        assert details["segment"] == tier.path and os.path.exists(tier.path)
        assert details["pinned"] == "false"  # no CUDA here
        assert tier.stats().shared is True


TestShmStateMachine = tier_state_machine(lambda cap: ShmTier(cap)).TestCase


def framed(seed: int, n: int) -> bytes:
    body = payload(n, seed)
    return xxhash.xxh3_64_digest(body) + body


def test_reader_copies_by_handle_and_misses_when_stale(make_tier):
    tier = make_tier(4 * MiB)
    tier.put(key(1), framed(1, 5000))
    handle = tier.handle(key(1))
    with ShmReader(tier.segment) as reader:
        assert reader.read(handle) == framed(1, 5000)
        assert reader.find(key(1)) == handle
        tier.put(key(1), framed(2, 5000))  # replaced: the old handle must not serve
        assert reader.read(handle) is None
        fresh = tier.handle(key(1))
        out = bytearray(8192)
        assert reader.read(fresh, out) == 5008 and bytes(out[:5008]) == framed(2, 5000)
        tier.delete(key(1))
        assert reader.read(fresh) is None and reader.find(key(1)) is None
    assert tier.handle(key(1)) is None


def test_lease_keeps_bytes_still_until_released(make_tier):
    tier = make_tier(1 * MiB, max_entries=8)
    tier.put(key(1), framed(1, 200_000))
    handle = tier.handle(key(1))
    with ShmReader(tier.segment) as reader:
        with reader.lease(handle) as view:
            tier.delete(key(1))
            for i in range(2, 6):  # fill the arena: the leased range must not be handed out
                try:
                    tier.put(key(i), framed(i, 200_000))
                except TierFull:
                    pass
            assert bytes(view) == framed(1, 200_000)
            assert tier.stats().details["retired"] == "1"
        tier.put(key(9), b"x")  # the next put reclaims what the lease held
        assert tier.stats().details["retired"] == "0"
        with reader.lease(handle) as view:
            assert view is None


def test_handles_from_outside_are_checked(make_tier):
    tier = make_tier(1 * MiB)
    with ShmReader(tier.segment) as reader:
        with pytest.raises(InvalidInput):
            reader.read(SlotHandle(tier.segment, 0, tier.arena_bytes, 10, 2))
        with pytest.raises(InvalidInput):
            reader.read(SlotHandle("other", 0, 0, 10, 2))
        with pytest.raises(InvalidInput):
            SlotHandle.from_dict({"segment": tier.segment, "index": -1, "offset": 0, "length": 1, "gen": 2})
    with pytest.raises(TierUnavailable):
        ShmReader("kvstore.nothing.1.00000000")
    with pytest.raises(InvalidInput):
        ShmReader("../etc/passwd")


def churn_against_reader(tier, seconds: float, max_frame: int = 200_000, how: str = "find") -> dict:
    """Overwrite four keys as fast as possible while another process reads them."""
    keys = [key(i) for i in range(4)]
    rng = np.random.default_rng(0)
    # Made up front so the loop is nothing but puts: ranges get reused within microseconds.
    frames = [framed(i, int(rng.integers(100, max_frame))) for i in range(24)]
    reader = subprocess.Popen(
        [sys.executable, "-m", "tests.tiers.shm_churn", tier.segment, str(seconds), ",".join(k.hex() for k in keys),
         how],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    writes = 0
    while reader.poll() is None:
        k = keys[writes % 4]
        if writes % 7 == 6:
            tier.delete(k)
        else:
            try:
                tier.put(k, frames[writes % len(frames)])
            except TierFull:  # leased ranges can hold the small arena apart for a moment
                tier.delete(keys[(writes + 1) % 4])
        writes += 1
    out, _ = reader.communicate(timeout=30)
    assert reader.returncode == 0
    counts = json.loads(out)
    counts["writes"] = writes
    return counts


def test_cross_process_reader_never_sees_a_torn_frame(make_tier):
    # A small arena forces constant reuse and compaction of the ranges being read.
    tier = make_tier(3 * MiB, max_entries=16)
    counts = churn_against_reader(tier, seconds=3, max_frame=1 * MiB)
    assert counts["torn"] == 0 and counts["torn_leased"] == 0, counts
    assert int(tier.stats().details["compactions"]) > 10, "the churn must move ranges under the reader"
    assert counts["ok"] > 100 and counts["leased"] > 10 and counts["stale"] > 0, counts


def test_reader_through_the_key_index_never_sees_a_torn_frame(make_tier):
    # The same churn, found through the shared key index: entries move and vanish under the reader.
    tier = make_tier(3 * MiB, max_entries=16)
    counts = churn_against_reader(tier, seconds=3, max_frame=1 * MiB, how="index")
    assert counts["torn"] == 0 and counts["torn_leased"] == 0, counts
    assert counts["ok"] > 100 and counts["stale"] > 0, counts


def test_key_index_matches_the_tier_after_random_churn(make_tier):
    # Few rows, so probe runs collide and removals shift entries; every step is checked whole.
    tier = make_tier(1 * MiB, max_entries=24)
    reader = ShmReader(tier.segment)
    try:
        assert reader.indexed
        rng = np.random.default_rng(7)
        keys = [rng.bytes(32) for _ in range(40)]  # hash-like: homes collide in the 64 buckets
        for step in range(3000):
            k = keys[int(rng.integers(len(keys)))]
            if rng.random() < 0.35:
                tier.delete(k)
            else:
                try:
                    tier.put(k, payload(int(rng.integers(1, 60_000)), int(step)))
                except TierFull:
                    tier.delete(keys[int(rng.integers(len(keys)))])
            if step % 50 == 0 or step > 2900:
                hits = reader.look_up(keys)  # a batch: numpy's gathers
                assert hits == [reader.look_up([k])[0] for k in keys]  # one key: scalar loads
                for k, hit in zip(keys, hits):
                    want = tier.handle(k)
                    assert (hit is None) == (want is None), (step, k.hex())
                    if hit is not None:
                        assert hit.handle == want and reader.read(hit.handle) == tier.get(k)
        assert int(tier.stats().details["compactions"]) > 0, "compaction must publish slots again"
    finally:
        reader.close()


def test_key_index_says_verified_only_for_the_vouched_publication(make_tier):
    tier = make_tier(1 * MiB)
    reader = ShmReader(tier.segment)
    try:
        tier.put(key(1), payload(1000, 1))
        hit = reader.look_up([key(1)])[0]
        assert hit is not None and not hit.verified
        stamp = tier.read_vouched(key(1), lambda view, stamp, vouched: stamp)
        tier.vouch(key(1), stamp)
        hit = reader.look_up([key(1)])[0]
        assert hit.verified and reader.verified(hit.handle)
        tier.put(key(1), payload(1000, 2))  # a new publication: no longer vouched for
        again = reader.look_up([key(1)])[0]
        assert again is not None and not again.verified and not reader.verified(hit.handle)
        assert reader.look_up([key(2)]) == [None]
    finally:
        reader.close()


@pytest.mark.slow
def test_cross_process_reader_long_churn(make_tier):
    counts = churn_against_reader(make_tier(3 * MiB, max_entries=16), seconds=30, max_frame=1 * MiB)
    assert counts["torn"] == 0 and counts["torn_leased"] == 0 and counts["ok"] > 1000, counts


def test_no_segment_outlives_kill_9(tmp_path):
    # A prefix of this test's own: the stale scan looks at (and unlinks) only its segments, never
    # the "kvstore" ones of other servers on the machine, some of which other tests kill on purpose.
    prefix = f"kvtest{os.getpid()}"
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from tiers.shm import ShmTier\n"
         f"t = ShmTier(1 << 20, name='victim', prefix={prefix!r}); print(t.path, flush=True); time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        path = child.stdout.readline().strip()
        assert os.path.exists(path)
        assert cleanup_stale(prefix) == []  # its owner is alive: keep it
        assert os.path.exists(path)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        assert os.path.exists(path)  # kill -9 runs no cleanup of its own
        tier = ShmTier(1 << 20, prefix=prefix)
        try:
            assert not os.path.exists(path)
            assert tier.stale_removed == [os.path.basename(path)]
        finally:
            tier.close()
    finally:
        child.kill()
        child.wait()


def test_interpreter_exit_without_close_unlinks():
    out = subprocess.run(
        [sys.executable, "-c", "from tiers.shm import ShmTier\nt = ShmTier(1 << 20); print(t.path)"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert out.startswith(SHM_DIR) and not os.path.exists(out)


def test_reader_survives_owner_close(make_tier):
    tier = make_tier(1 * MiB)
    tier.put(key(1), b"abc")
    handle = tier.handle(key(1))
    reader = ShmReader(tier.segment)
    tier.close()
    assert reader.read(handle) is None  # closing unpublishes every slot
    reader.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_arena_larger_than_shm_is_tierfull(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        with pytest.raises(TierFull):
            ShmTier(8 * MiB, shm_dir=str(mnt))
        assert os.listdir(mnt) == []  # the failed segment is gone too
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_concurrent_gets_during_compaction(make_tier):
    tier = make_tier(1 * MiB, max_entries=32)
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            for i in range(8):
                got = tier.get(key(i))
                if got is not None and bytes(got[:8]) != xxhash.xxh3_64_digest(bytes(got[8:])):
                    bad.append(i)

    th = threading.Thread(target=reader)
    th.start()
    try:
        for n in range(300):
            i = n % 8
            try:
                tier.put(key(i), framed(n, (n * 7919) % 150_000 + 10))
            except TierFull:
                tier.delete(key((i + 3) % 8))
    finally:
        stop.set()
        th.join()
    assert not bad
    assert int(tier.stats().details["compactions"]) > 0


def test_spaced_arrays_read_frames_either_way_and_refuse_the_arenas_outside(make_tier):
    """A run of equally spaced frames as one view: upwards, downwards (the first frame highest,
    as a pooled writer's slots lie) and a run of one; any part outside the arena is refused."""
    tier = make_tier(1 * MiB)
    reader = ShmReader(tier.segment)
    try:
        frames = [payload(256, i) for i in range(4)]
        for i, frame in enumerate(frames):
            tier.put(key(i), frame)
        offsets = [reader.look_up([key(i)])[0].offset for i in range(4)]
        stride = offsets[1] - offsets[0]
        assert stride > 0 and [b - a for a, b in zip(offsets, offsets[1:])] == [stride] * 3
        up = reader.spaced_arrays(offsets[0], stride, 4, np.uint8, (256,))
        down = reader.spaced_arrays(offsets[3], -stride, 4, np.uint8, (256,))
        assert [bytes(a) for a in up] == frames and [bytes(a) for a in down] == frames[::-1]
        assert bytes(reader.spaced_arrays(offsets[2], 0, 1, np.uint8, (16, 16))[0].reshape(-1)) == frames[2]
        assert not up.flags.writeable
        size = len(reader.mapping())
        for start, step, count in ((offsets[0], -stride, 2 + offsets[0] // stride), (size - 128, stride, 1),
                                   (-1, stride, 1), (offsets[0], stride, 0)):
            with pytest.raises(InvalidInput):
                reader.spaced_arrays(start, step, count, np.uint8, (256,))
        assert reader.heads(offsets[:2], 8) == [frames[0][:8], frames[1][:8]]
        assert len(reader.heads([size - 4], 8)[0]) == 4  # cut short where the arena ends
        for bad in ([-1], [size]):
            with pytest.raises(InvalidInput):
                reader.heads(bad, 8)
    finally:
        reader.close()

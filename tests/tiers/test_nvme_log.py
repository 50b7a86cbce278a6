"""The nvme tier's log-structured layout (``tiers.nvme_log``): the Tier contract, restarts,
torn appends, damaged segments, compaction and kill -9."""

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from kvstore.errors import InvalidInput, TierUnavailable
from tests.tiers.conformance import MiB, TierContract, key, payload, tier_state_machine
from tests.tiers.nvme_crash_child import crash_frame, crash_key, frame_number
from tiers.nvme_log import LogTier
from tiers.nvme_log_format import HEADER, record_size

ROOT = Path(__file__).resolve().parents[2]


def segments(data_dir) -> list[Path]:
    return sorted((Path(data_dir) / "segments").iterdir())


def details(tier) -> dict[str, str]:
    return tier.stats().details


@pytest.fixture
def open_tier(tmp_path):
    """open_tier(capacity_bytes, **kw) on tmp_path/data; every tier made is closed after the test.
    No compactor thread unless asked: tests call ``compact()`` when they mean it."""
    made = []

    def make(capacity_bytes: int = 64 * MiB, **kw) -> LogTier:
        kw.setdefault("compact_interval_s", 0)
        tier = LogTier(tmp_path / "data", capacity_bytes, **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


class TestLogTier(TierContract):
    kw: dict = {}

    @pytest.fixture
    def make_tier(self, tmp_path):
        made = []

        def make(capacity_bytes: int) -> LogTier:
            tier = LogTier(tmp_path / f"d{len(made)}", capacity_bytes, **self.kw)
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()

    def test_details_name_the_layout(self, tier):
        stats = tier.stats()
        assert stats.kind == "nvme" and stats.durable and not stats.shared
        assert stats.details["layout"] == "log" and stats.details["backing"].startswith("segments under ")


class TestLogTierGroupCommit(TestLogTier):
    kw = {"sync_interval_s": 0.05}


class TestLogTierSmallSegments(TestLogTier):
    """Rolls every few records and compacts often, under the whole contract."""

    kw = {"segment_bytes": 4096, "compact_interval_s": 0.01, "sync_interval_s": 0.05}


_STATE_ROOT = tempfile.TemporaryDirectory(prefix="kvstore-nvme-log-sm-")
TestLogTierStateMachine = tier_state_machine(
    lambda cap: LogTier(tempfile.mkdtemp(dir=_STATE_ROOT.name), cap, segment_bytes=16384, compact_interval_s=0.01)
).TestCase


def test_bad_settings_are_typed_errors(tmp_path):
    for kw in ({"capacity_bytes": 0}, {"capacity_bytes": MiB, "segment_bytes": 10},
               {"capacity_bytes": MiB, "compact_dead_fraction": 0}):
        with pytest.raises(InvalidInput):
            LogTier(tmp_path / "d", **kw)


def test_one_tier_per_directory(open_tier):
    open_tier()
    with pytest.raises(TierUnavailable):
        open_tier()


def test_a_restart_finds_every_put_overwrite_and_delete(open_tier):
    tier = open_tier(segment_bytes=8192)
    model = {}
    rng = random.Random(3)
    for i in range(300):
        k = key(rng.randrange(20))
        if rng.random() < 0.2:
            tier.delete(k)
            model.pop(k, None)
        else:
            model[k] = payload(rng.randrange(0, 3000), seed=i)
            tier.put(k, model[k])
    tier.close()
    again = open_tier(segment_bytes=8192)
    assert sorted(again.keys()) == sorted(model)
    assert all(bytes(again.get(k)) == v for k, v in model.items())
    assert again.stats().used_bytes == sum(map(len, model.values()))
    assert details(again)["torn_bytes_dropped"] == "0"


def test_a_torn_append_is_dropped_at_start_and_never_served(open_tier, tmp_path):
    tier = open_tier()
    tier.put(key(1), payload(5000, 1))
    tier.put(key(2), payload(5000, 2))
    tier.close()
    (active,) = segments(tmp_path / "data")
    assert active.suffix == ".open"
    size = active.stat().st_size
    with open(active, "r+b") as f:  # the second record's body cut short, as a crash mid-append leaves it
        f.truncate(size - 100)
    again = open_tier()
    assert bytes(again.get(key(1))) == payload(5000, 1)
    assert again.get(key(2)) is None and not again.contains(key(2))
    assert int(details(again)["torn_bytes_dropped"]) == size - 100 - record_size(5000)
    assert [p.suffix for p in segments(tmp_path / "data")].count(".seg") == 1  # cut and sealed
    again.put(key(3), b"after")  # appends go to a fresh segment, after the good records
    again.close()
    third = open_tier()
    assert bytes(third.get(key(1))) == payload(5000, 1) and bytes(third.get(key(3))) == b"after"


def test_a_torn_body_under_an_intact_header_is_dropped_at_start(open_tier, tmp_path):
    tier = open_tier()
    tier.put(key(1), payload(5000, 1))
    tier.put(key(2), payload(5000, 2))
    tier.close()
    (active,) = segments(tmp_path / "data")
    with open(active, "r+b") as f:  # zeros where a body should be: the page never reached the disk
        f.seek(record_size(5000) + HEADER + 100)
        f.write(bytes(4096))
    again = open_tier()
    assert bytes(again.get(key(1))) == payload(5000, 1) and again.get(key(2)) is None


def test_damage_in_a_sealed_segment_is_a_miss_and_stays_one_after_a_restart(open_tier, tmp_path):
    tier = open_tier(segment_bytes=8192)
    for i in range(6):
        tier.put(key(i), payload(5000, i))
    tier.compact()  # seals the full segments
    first = segments(tmp_path / "data")[0]
    assert first.suffix == ".seg"
    with open(first, "r+b") as f:
        f.seek(HEADER + 10)
        f.write(b"\xff" * 8)
    assert tier.get(key(0)) is None  # the first record's frame: damaged, never served
    assert details(tier)["corrupt_frames"] == "1" and not tier.contains(key(0))
    assert bytes(tier.get(key(1))) == payload(5000, 1)
    tier.close()
    again = open_tier(segment_bytes=8192)
    assert again.get(key(0)) is None and not again.contains(key(0))  # its tombstone holds
    assert all(bytes(again.get(key(i))) == payload(5000, i) for i in range(1, 6))


def test_compaction_reclaims_dead_space_and_keeps_every_live_frame(open_tier, tmp_path):
    tier = open_tier(segment_bytes=16384)
    model = {}
    for i in range(400):  # 8 keys overwritten 50 times each, a few deleted
        k = key(i % 8)
        model[k] = payload(3000 + i, seed=i)
        tier.put(k, model[k])
    for j in (1, 5):
        tier.delete(key(j))
        del model[key(j)]
    before = int(details(tier)["disk_bytes"])
    removed = tier.compact()
    after = int(details(tier)["disk_bytes"])
    assert removed >= 50 and after < before / 10
    assert int(details(tier)["dead_bytes"]) < 3 * 16384  # what is left: the active segments' dead records
    assert all(bytes(tier.get(k)) == v for k, v in model.items())
    tier.close()
    again = open_tier(segment_bytes=16384)
    assert sorted(again.keys()) == sorted(model)  # deleted keys stay deleted: tombstones survived
    assert all(bytes(again.get(k)) == v for k, v in model.items())


def test_tombstones_do_not_pile_up(open_tier, tmp_path):
    tier = open_tier(segment_bytes=4096)
    for i in range(500):
        tier.put(key(i), b"x" * 100)
        tier.delete(key(i))
        if i % 50 == 0:
            tier.compact()
    tier.compact()
    tier.put(key(9999), b"roll")  # everything before is now sealed and compactable
    for _ in range(3):
        tier.compact()
    assert int(details(tier)["disk_bytes"]) < 3 * 4096
    tier.close()
    again = open_tier(segment_bytes=4096)
    assert list(again.keys()) == [key(9999)]


def test_puts_and_reads_meanwhile_compaction_runs(open_tier):
    """Writers, readers and the compactor thread at once: every read is one of the frames put."""
    tier = open_tier(segment_bytes=32768, compact_interval_s=0.005, sync_interval_s=0.05)
    frames = {(k, v): payload(2000 + 7 * v, seed=100 * k + v) for k in range(6) for v in range(40)}
    stop = threading.Event()
    errors: list[BaseException] = []

    def write(k):
        try:
            for v in range(40):
                tier.put(key(k), frames[k, v])
        except BaseException as exc:
            errors.append(exc)

    def read():
        try:
            while not stop.is_set():
                for k in range(6):
                    got = tier.get(key(k))
                    assert got is None or any(bytes(got) == frames[k, v] for v in range(40))
        except BaseException as exc:
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    writers = [threading.Thread(target=write, args=(k,)) for k in range(6)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors
    assert all(bytes(tier.get(key(k))) == frames[k, 39] for k in range(6))
    assert int(details(tier)["compactions"]) > 0


def test_acknowledged_puts_survive_kill_9_during_group_commits_and_compaction(tmp_path):
    """A child puts 64 KiB frames over 12 keys (1 MiB segments, its compactor every 10 ms,
    a group commit): killed at random points, every acknowledged put is found, nothing torn."""
    data_dir, frame_bytes, n_keys = tmp_path / "crash", 64 * 1024, 12
    model: dict[int, int] = {}
    try:
        for r in range(5):
            start = (r + 1) * 1_000_000
            child = subprocess.Popen(
                [sys.executable, "-m", "tests.tiers.nvme_crash_child", str(data_dir), str(start), str(frame_bytes),
                 str(n_keys), "0", "0.05", "log"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            acked = b""
            try:
                for _ in range(200):  # several segments' worth before the kill
                    line = child.stdout.readline()
                    assert line, f"child died: {child.stderr.read().decode()[-2000:]}"
                    acked += line
                time.sleep(random.uniform(0, 0.05))
                os.kill(child.pid, signal.SIGKILL)
            finally:
                child.kill()
                rest = child.stdout.read()
                child.stderr.read()
                child.wait()
            numbers = [int(x) for x in (acked + rest).split(b"\n")[:-1]]
            for i in numbers:
                model[i % n_keys] = i
            in_flight = numbers[-1] + 1
            tier = LogTier(data_dir, 1 << 40, compact_interval_s=0)
            try:
                for k in range(n_keys):
                    allowed = {model.get(k)} | ({in_flight} if in_flight % n_keys == k else set())
                    got = tier.get(crash_key(k))
                    number = None if got is None else frame_number(got)
                    assert number in allowed, f"round {r} key {k}: found put {number}, expected one of {allowed}"
                    assert got is None or bytes(got) == crash_frame(number, frame_bytes)
                    model[k] = number
                assert details(tier)["corrupt_frames"] == "0"
                tier.compact()  # what the child's compactor had not reached yet
                assert all(tier.get(crash_key(k)) is None if model[k] is None
                           else bytes(tier.get(crash_key(k))) == crash_frame(model[k], frame_bytes)
                           for k in range(n_keys))
            finally:
                tier.close()
            # 12 live frames (under 1 MiB): two segments hold them, one less than half dead may stay, and
            # the open one: not the dozens the child's puts filled
            assert len(segments(data_dir)) <= 4
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_a_segment_damaged_mid_way_is_left_alone_by_compaction(open_tier, tmp_path):
    """A header damaged after start (bit rot) stops a compaction's scan short: the records past it
    stay readable through the index and the segment is not dropped under them."""
    tier = open_tier(segment_bytes=6 * record_size(3000))
    for i in range(6):
        tier.put(key(i), payload(3000, i))
    tier.put(key(99), b"roll")  # the first segment is full now
    for i in range(3):
        tier.delete(key(i))  # half of it dead: a compaction candidate
    tier.compact()  # seals it (and compacts it: copies 3..5, drops the dead)
    tier.close()
    tier = open_tier(segment_bytes=6 * record_size(3000))
    for i in range(6, 12):
        tier.put(key(i), payload(3000, i))
    tier.put(key(98), b"roll")
    target = [p for p in segments(tmp_path / "data") if p.suffix == ".open"][0].with_suffix(".seg")  # 6..11
    tier.compact()  # seals it
    assert target.exists()
    with open(target, "r+b") as f:
        f.seek(2 * record_size(3000))  # the third record's header
        f.write(b"\x00" * HEADER)
    for i in (6, 7):
        tier.delete(key(i))
    tier.delete(key(9))  # past the damage
    tier.compact()
    assert details(tier)["damaged_segments"] == "1" and target.exists()
    for i in (10, 11):  # past the damage, still served from the kept segment
        assert bytes(tier.get(key(i))) == payload(3000, i)
    assert tier.get(key(8)) is None  # its own header is the damaged one: a miss, never wrong bytes


# -- races and failures a review found (stop 41) ------------------------------------------------


def test_a_delete_racing_a_put_leaves_memory_and_segments_agreeing(tmp_path):
    """A put appended (seq N) but not yet published when a delete appends its tombstone (N+1): on
    disk the tombstone wins, so in memory the put must not come back either."""
    from tiers.nvme_log_format import FRAME

    written, go = threading.Event(), threading.Event()

    class Paused(LogTier):
        def _write(self, kind, key, body, checksum, seq):
            out = super()._write(kind, key, body, checksum, seq)
            if kind == FRAME and threading.current_thread().name == "putter":
                written.set()
                go.wait(10)
            return out

    tier = Paused(tmp_path / "d", MiB, compact_interval_s=0)
    tier.put(key(1), b"v1")
    putter = threading.Thread(target=tier.put, args=(key(1), b"v2"), name="putter")
    putter.start()
    assert written.wait(10)
    assert tier.delete(key(1)) is True
    go.set()
    putter.join()
    assert tier.get(key(1)) is None and tier.stats().used_bytes == 0
    tier.close()
    again = LogTier(tmp_path / "d", MiB, compact_interval_s=0)
    assert again.get(key(1)) is None
    again.close()


def test_under_a_group_commit_compaction_syncs_before_it_deletes_a_segment(open_tier):
    """The records that made a segment dead (a newer put) must be durable before the segment goes,
    or a host crash would bring back the older frame they replaced."""
    tier = open_tier(segment_bytes=8192, sync_interval_s=3600)  # the thread would not sync for an hour
    for i in range(7):
        tier.put(key(i), payload(1000, i))
    tier.sync()
    for i in range(7):  # all dead now: replaced by unsynced puts
        tier.put(key(i), payload(1000, 100 + i))
    assert tier._group.unsynced > 0
    assert tier.compact() >= 1
    assert tier._group.unsynced == 0


def test_a_put_whose_sync_fails_does_not_let_a_tombstone_go_too_soon(open_tier, tmp_path, monkeypatch):
    import errno

    from kvstore.errors import TierIOError

    tier = open_tier(segment_bytes=8192)  # each put synced
    tier.put(key(0), payload(1000, 0))
    for i in range(1, 8):
        tier.put(key(100 + i), payload(1000, i))  # the first segment stays live: never compacted
    assert tier.delete(key(0))
    real, fail = os.fdatasync, [True]

    def fdatasync(fd):
        if fail[0]:
            fail[0] = False
            raise OSError(errno.EIO, "injected")
        return real(fd)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    with pytest.raises(TierIOError):
        tier.put(key(0), payload(1000, 50))  # on disk, unpublished: dead, and counted as such
    for r in range(4):
        for i in range(1, 6):
            tier.put(key(200 + i), payload(1000, 10 * r + i))
        tier.compact()
    tier.close()
    again = open_tier(segment_bytes=8192)
    assert again.get(key(0)) in (None, payload(1000, 50))  # deleted, or the put that failed: never v1
    assert again.get(key(0)) != payload(1000, 0)


def test_compactions_called_at_once_do_not_trip_each_other(open_tier):
    tier = open_tier(segment_bytes=4096)
    for r in range(30):
        for i in range(4):
            tier.put(key(i), payload(900, 10 * r + i))
    errors: list[BaseException] = []

    def run():
        try:
            tier.compact()
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(bytes(tier.get(key(i))) == payload(900, 290 + i) for i in range(4))

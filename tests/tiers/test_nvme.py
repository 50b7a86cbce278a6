import errno
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.numpy import load_file

from kvstore import codec
from kvstore.errors import InvalidInput, TierFull, TierIOError, TierUnavailable
from tests.mounts import small_tmpfs
from tests.tiers.conformance import MiB, TierContract, key, payload, tier_state_machine
from tests.tiers.nvme_crash_child import crash_frame, crash_key, frame_number
from tiers import nvme as nvme_mod
from tiers.nvme import FORMAT, NVMeTier

ROOT = Path(__file__).resolve().parents[2]


def frame_files(data_dir) -> list[Path]:
    return sorted(Path(data_dir).glob("??/*.safetensors"))


def temp_files(data_dir) -> list[Path]:
    return sorted(Path(data_dir).glob("??/.*.tmp"))


def file_of(data_dir, k: bytes) -> Path:
    h = k.hex()
    return Path(data_dir) / h[:2] / f"{h}.safetensors"


def quarantined(tier: NVMeTier) -> tuple[int, int]:
    details = tier.stats().details
    return int(details["quarantined_temp_files"]), int(details["quarantined_corrupt_files"])


@pytest.fixture
def open_tier(tmp_path):
    """open_tier(capacity_bytes, **kw) on tmp_path/data; every tier made is closed after the test."""
    made = []

    def make(capacity_bytes: int = 64 * MiB, **kw) -> NVMeTier:
        tier = NVMeTier(tmp_path / "data", capacity_bytes, **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


class TestNVMeTier(TierContract):
    direct_io = True

    @pytest.fixture
    def make_tier(self, tmp_path):
        made = []

        def make(capacity_bytes: int) -> NVMeTier:
            tier = NVMeTier(tmp_path / f"d{len(made)}", capacity_bytes, direct_io=self.direct_io)
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()

    def test_details_name_the_backing(self, tier):
        stats = tier.stats()
        assert stats.kind == "nvme" and stats.durable and not stats.shared
        assert stats.details["backing"].startswith("files under ")
        assert stats.details["direct_io"] == ("on" if self.direct_io else "off")


class TestNVMeTierBuffered(TestNVMeTier):
    """The same contract through the page-cache write path."""

    direct_io = False


class TestNVMeTierGroupCommit(TestNVMeTier):
    """The same contract with a group commit: puts acknowledged unsynced, synced behind them."""

    direct_io = False  # the group commit writes through the page cache

    @pytest.fixture
    def make_tier(self, tmp_path):
        made = []

        def make(capacity_bytes: int) -> NVMeTier:
            tier = NVMeTier(tmp_path / f"d{len(made)}", capacity_bytes, sync_interval_s=0.05)
            made.append(tier)
            return tier

        yield make
        for tier in made:
            tier.close()


_STATE_ROOT = tempfile.TemporaryDirectory(prefix="kvstore-nvme-sm-")
TestNVMeTierStateMachine = tier_state_machine(
    lambda cap: NVMeTier(tempfile.mkdtemp(dir=_STATE_ROOT.name), cap)
).TestCase
TestNVMeTierGroupCommitStateMachine = tier_state_machine(
    lambda cap: NVMeTier(tempfile.mkdtemp(dir=_STATE_ROOT.name), cap, sync_interval_s=0.05)
).TestCase


def test_a_group_commit_acks_puts_unsynced_and_sync_covers_them(open_tier, monkeypatch):
    """No put syncs on its own path; ``sync()`` returns only after one syncfs covered every put
    before it; the thread syncs unasked within its interval; close syncs what is left."""
    from tiers import group_commit

    synced: list[int] = []
    real = group_commit.syncfs
    monkeypatch.setattr(group_commit, "syncfs", lambda fd: (real(fd), synced.append(1)))

    def no_sync(fd):
        raise AssertionError("a put synced on its own path")
    tier = open_tier(sync_interval_s=30.0)  # the thread would wait 30 s: only sync() makes it sync now
    monkeypatch.setattr(os, "fdatasync", no_sync)  # after the open, which syncs the directories it made
    monkeypatch.setattr(nvme_mod, "fsync_dir", no_sync)
    for i in range(20):
        tier.put(key(i), payload(4096 + i, seed=i))
    assert tier.stats().details["fsync"].startswith("group commit") and tier._group.unsynced == 20
    tier.sync()
    assert len(synced) == 1 and tier._group.unsynced == 0
    tier.sync()  # nothing new: no sync
    assert len(synced) == 1
    assert [tier.get(key(i)) == payload(4096 + i, seed=i) for i in range(20)] == [True] * 20
    tier.close()
    assert len(synced) == 1  # nothing left to sync at close
    fast = NVMeTier(tier.data_dir, 64 * MiB, sync_interval_s=0.01)
    fast.put(key(99), payload(4096))
    deadline = time.monotonic() + 5
    while fast._group.unsynced and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fast._group.unsynced == 0 and len(synced) == 2  # unasked, within its interval
    fast.close()


def test_a_failed_group_commit_is_a_typed_error_and_the_puts_stay(open_tier, monkeypatch):
    from tiers import group_commit

    tier = open_tier(sync_interval_s=30.0)
    tier.put(key(1), payload(4096))

    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(group_commit, "syncfs", eio)
    with pytest.raises(TierIOError, match="syncing its writes failed"):
        tier.sync()
    assert tier.stats().counters.errors >= 1 and tier.get(key(1)) == payload(4096)
    monkeypatch.undo()
    tier.sync()  # the disk is back: the same writes are synced by the next one
    assert tier._group.unsynced == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1GiB"])
def test_capacity_must_be_positive_int(tmp_path, bad):
    with pytest.raises(InvalidInput):
        NVMeTier(tmp_path, bad)


def test_without_fsync_it_says_it_is_not_durable(open_tier):
    tier = open_tier(fsync=False)
    tier.put(key(1), b"abc")
    assert bytes(tier.get(key(1))) == b"abc"
    assert tier.durable is False and tier.stats().details["fsync"].startswith("off")


def test_one_tier_per_directory(open_tier, tmp_path):
    open_tier()
    with pytest.raises(TierUnavailable):
        NVMeTier(tmp_path / "data", MiB)


# -- restart and quarantine ------------------------------------------------------


def test_restart_rebuilds_the_index(open_tier, tmp_path):
    tier = open_tier()
    frames = {key(i): payload(1000 * i + 7, i) for i in range(6)}
    for k, data in frames.items():
        tier.put(k, data)
    tier.put(key(0), payload(99, 42))  # overwritten: the newest must come back
    frames[key(0)] = payload(99, 42)
    tier.delete(key(5))
    del frames[key(5)]
    tier.close()

    again = open_tier()
    stats = again.stats()
    assert (stats.entries, stats.used_bytes) == (len(frames), sum(map(len, frames.values())))
    assert sorted(again.keys()) == sorted(frames)
    for k, data in frames.items():
        assert bytes(again.get(k)) == data
    assert again.get(key(5)) is None
    assert quarantined(again) == (0, 0)
    assert temp_files(tmp_path / "data") == []


def test_corrupt_and_truncated_files_are_quarantined(open_tier, tmp_path):
    data_dir = tmp_path / "data"
    tier = open_tier()
    for i in range(3):
        tier.put(key(i), payload(20_000, i))
    tier.close()
    flipped, cut = file_of(data_dir, key(0)), file_of(data_dir, key(1))
    raw = bytearray(flipped.read_bytes())
    raw[-5000] ^= 0x40  # one bit inside the frame bytes: only the checksum can see it
    flipped.write_bytes(raw)
    os.truncate(cut, cut.stat().st_size - 10)

    again = open_tier()
    # The start-up scan checks lengths, so the cut file is gone at once; the flipped
    # bit is caught by the checksum on the first read.
    assert quarantined(again) == (0, 1)
    assert sorted(again.keys()) == [key(0), key(2)]
    assert again.get(key(1)) is None
    assert again.get(key(0)) is None
    assert quarantined(again) == (0, 2)
    assert not flipped.exists() and not cut.exists()
    assert len(list((data_dir / "quarantine").iterdir())) == 2
    stats = again.stats()
    assert (stats.entries, stats.used_bytes) == (1, 20_000)
    assert stats.counters.misses == 2
    assert bytes(again.get(key(2))) == payload(20_000, 2)


def test_verify_on_start_hashes_every_file(open_tier, tmp_path):
    tier = open_tier()
    tier.put(key(1), payload(5000, 1))
    tier.put(key(2), payload(5000, 2))
    tier.close()
    path = file_of(tmp_path / "data", key(1))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(raw)

    again = open_tier(verify_on_start=True)
    assert quarantined(again) == (0, 1)
    assert list(again.keys()) == [key(2)]
    assert again.stats().details["startup_scan"] == "full checksums"


def test_start_quarantines_temp_and_misplaced_files(open_tier, tmp_path):
    data_dir = tmp_path / "data"
    tier = open_tier()
    tier.put(key(1), payload(3000, 1))
    tier.put(key(2), payload(3000, 2))
    tier.close()
    src = file_of(data_dir, key(1))
    (src.parent / f".{key(1).hex()}.123.0.tmp").write_bytes(b"half a frame")
    # key(2)'s file under key(3)'s name: its header names another key
    wrong = file_of(data_dir, key(3))
    shutil.copy(file_of(data_dir, key(2)), wrong)
    stray = data_dir / "ff" / src.name  # a sound file in another key's directory
    shutil.copy(src, stray)
    (src.parent / "notes.txt").write_text("not ours")

    again = open_tier()
    assert quarantined(again) == (1, 2)
    assert sorted(again.keys()) == [key(1), key(2)]
    assert again.get(key(3)) is None
    assert temp_files(data_dir) == [] and not wrong.exists() and not stray.exists()
    assert (src.parent / "notes.txt").exists()  # foreign files are left alone


def test_a_file_deleted_behind_its_back_is_a_miss(open_tier, tmp_path):
    tier = open_tier()
    tier.put(key(1), b"abc")
    file_of(tmp_path / "data", key(1)).unlink()
    assert tier.get(key(1)) is None
    stats = tier.stats()
    assert (stats.entries, stats.used_bytes, stats.details["missing_files"]) == (0, 0, "1")


# -- file format -------------------------------------------------------------------


def test_files_are_plain_safetensors(open_tier, tmp_path, spec):
    tier = open_tier()
    opaque = payload(3333, 1)
    tier.put(key(1), opaque)
    path = file_of(tmp_path / "data", key(1))
    assert np.array_equal(load_file(str(path))["frame"], np.frombuffer(opaque, np.uint8))
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    assert meta["format"] == FORMAT and meta["key"] == key(1).hex()
    assert meta["frame_len"] == "3333" and meta["codec"] == "opaque"
    assert int(meta["xxh3_64"], 16) == xxhash.xxh3_64_intdigest(opaque)
    head = path.read_bytes()[:8]
    assert int.from_bytes(head, "little") + 8 == 4096  # data starts on a 4 KiB boundary

    kv = torch.randn(spec.kv_shape(spec.block_tokens)).to(spec.torch_dtype)
    info = {"v": 1, "ns": "team-a", "spec": spec.fingerprint(), "depth": 3}
    frame = codec.encode(kv, "int8", meta=json.dumps(info).encode())
    tier.put_with(key(2), len(frame), lambda view: _fill(view, frame))
    with safe_open(str(file_of(tmp_path / "data", key(2))), "np") as f:
        meta = f.metadata()
        stored = f.get_tensor("frame").tobytes()
    assert stored == bytes(frame)
    assert meta["codec"] == "int8" and meta["dtype"] == spec.dtype
    assert meta["spec_fingerprint"] == spec.fingerprint()
    assert (meta["namespace"], meta["depth"], meta["frame_len"]) == ("team-a", "3", str(len(frame)))
    assert torch.equal(codec.decode(tier.get(key(2))), codec.decode(frame))


def _fill(view: memoryview, frame: bytes) -> int:
    view[: len(frame)] = frame
    return len(frame)


# -- faults ------------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted for the test (needs root)."""
    yield from small_tmpfs(tmp_path / "tiny", "1m")


@pytest.mark.parametrize("direct_io", [True, False])
def test_out_of_space_is_tier_full(tiny_tmpfs, direct_io):
    tier = NVMeTier(tiny_tmpfs, 64 * MiB, direct_io=direct_io)  # the budget is not the limit here
    try:
        tier.put(key(1), payload(600 * 1024, 1))
        with pytest.raises(TierFull) as info:
            tier.put(key(2), payload(600 * 1024, 2))
        assert info.value.tier == "nvme"
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
        assert temp_files(tiny_tmpfs) == []  # the half-written temp file is gone
        assert tier.get(key(2)) is None and bytes(tier.get(key(1))) == payload(600 * 1024, 1)
        stats = tier.stats()
        assert (stats.entries, stats.used_bytes, stats.counters.errors) == (1, 600 * 1024, 1)
        tier.put(key(3), payload(100 * 1024, 3))  # the space came back
    finally:
        tier.close()
    again = NVMeTier(tiny_tmpfs, 64 * MiB)
    try:
        assert sorted(again.keys()) == [key(1), key(3)] and quarantined(again) == (0, 0)
    finally:
        again.close()


def _eio(*args, **kwargs):
    raise OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("call", ["writev", "fdatasync", "replace"])
def test_io_error_on_put_is_typed_and_leaves_no_file(open_tier, tmp_path, monkeypatch, call, direct_io):
    tier = open_tier(direct_io=direct_io)
    tier.put(key(1), payload(5000, 1))
    with monkeypatch.context() as m:
        m.setattr(os, call, _eio)
        with pytest.raises(TierIOError) as info:
            tier.put(key(1), payload(7000, 2))
    assert info.value.__cause__.errno == errno.EIO and info.value.tier == "nvme"
    assert temp_files(tmp_path / "data") == []
    assert bytes(tier.get(key(1))) == payload(5000, 1)  # the old frame is untouched
    stats = tier.stats()
    assert (stats.entries, stats.used_bytes, stats.counters.errors) == (1, 5000, 1)
    tier.put(key(1), payload(7000, 2))
    assert bytes(tier.get(key(1))) == payload(7000, 2)


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_failed_rename_never_leaves_the_live_file_as_a_spare(open_tier, monkeypatch, direct_io):
    """An overwrite links the old file as a spare before the rename; if the rename fails that
    link is still the live file, and a later put rewriting the spare would overwrite it."""
    tier = open_tier(direct_io=direct_io)
    tier.put(key(1), payload(5000, 1))
    with monkeypatch.context() as m:
        m.setattr(os, "replace", _eio)
        with pytest.raises(TierIOError):
            tier.put(key(1), payload(5000, 2))  # same size: its old file would be the spare
    for i in range(2, 6):  # puts of that size take spares first
        tier.put(key(i), payload(5000, i + 10))
    assert bytes(tier.get(key(1))) == payload(5000, 1)
    assert all(bytes(tier.get(key(i))) == payload(5000, i + 10) for i in range(2, 6))


def test_threads_sharing_keys_keep_index_and_files_in_step(open_tier, tmp_path):
    tier = open_tier()
    sizes = [0, 700, 5000, 20_000]
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(60):
                k, size = key(i % 2), sizes[(t + i) % 4]
                if i % 7 == 3:
                    tier.delete(k)
                else:
                    tier.put(k, payload(size, size))
                got = tier.get(k)
                assert got is None or bytes(got) == payload(len(got), len(got))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    on_disk = {p.name: p.stat().st_size - 4096 for p in frame_files(tmp_path / "data")}
    stats = tier.stats()
    assert stats.entries == len(on_disk) and stats.used_bytes == sum(on_disk.values())
    assert temp_files(tmp_path / "data") == []


def test_io_error_on_read_is_typed_not_a_miss(open_tier, monkeypatch):
    tier = open_tier()
    tier.put(key(1), payload(5000, 1))
    with monkeypatch.context() as m:
        m.setattr(os, "preadv", _eio)
        with pytest.raises(TierIOError):
            tier.get(key(1))
    assert quarantined(tier) == (0, 0)  # a failing disk is not a corrupt file
    assert bytes(tier.get(key(1))) == payload(5000, 1)


def test_refused_o_direct_falls_back_to_buffered_writes(open_tier, monkeypatch):
    tier = open_tier()
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    tier.put(key(1), payload(10_000, 1))
    assert bytes(tier.get(key(1))) == payload(10_000, 1)
    assert tier.stats().details["direct_io"].startswith("off (refused")


# -- kill -9 -------------------------------------------------------------------------


def _crash_rounds(data_dir: Path, rounds: int, frame_bytes: int, n_keys: int = 6, spares: int = 0,
                  sync_interval_s: float = 0.0) -> int:
    """Kill a writing child ``rounds`` times; check every acknowledged put after each.

    Even rounds kill as soon as a temp file appears (mid-write); odd rounds
    after a random delay (anywhere in the put cycle). Returns the temp files
    quarantined over all rounds.
    """
    model: dict[int, int] = {}  # key number -> put number of the frame it must hold
    temps = 0
    for r in range(rounds):
        start = (r + 1) * 1_000_000
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.tiers.nvme_crash_child", str(data_dir), str(start),
             str(frame_bytes), str(n_keys), str(spares), str(sync_interval_s)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        acked = b""
        try:
            for _ in range(2):  # let a couple of puts complete first
                line = child.stdout.readline()
                assert line, f"child died: {child.stderr.read().decode()[-2000:]}"
                acked += line
            if r % 2 == 0 and not spares:
                _wait_for_temp_file(data_dir, n_keys)
            else:
                time.sleep(random.uniform(0, 0.3))  # anywhere in the next few puts
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()  # no-op once it is dead; stops it if an assertion fired first
            # Through the buffered reader readline used: lines it read ahead are acks too
            # (communicate() would read the pipe's fd behind that buffer and lose them).
            rest = child.stdout.read()
            child.stderr.read()
            child.wait()
        assert child.returncode == -signal.SIGKILL
        numbers = [int(x) for x in (acked + rest).split(b"\n")[:-1]]  # whole lines only
        for i in numbers:
            model[i % n_keys] = i
        temps += _check_after_crash(data_dir, model, numbers[-1] + 1, frame_bytes, n_keys)
    return temps


def test_acknowledged_puts_survive_kill_9(tmp_path):
    data_dir = tmp_path / "crash"
    try:
        temps = _crash_rounds(data_dir, rounds=3, frame_bytes=32 * MiB)
        assert temps >= 1  # at least one kill landed mid-write (each even round waits for one)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)  # ~250 MiB


def test_acknowledged_puts_survive_kill_9_while_rewriting_spares(tmp_path):
    # Overwrites of equal-sized frames go through spare files (no temp file to wait
    # for), so these rounds kill at random points of the put cycle.
    data_dir = tmp_path / "crash"
    try:
        _crash_rounds(data_dir, rounds=4, frame_bytes=8 * MiB, spares=64)
        assert os.listdir(data_dir / ".recycle") == []  # each restart throws spares away
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def test_acknowledged_puts_survive_kill_9_under_a_group_commit(tmp_path):
    # Puts acknowledged before any sync: a kill -9 of the process loses none (the page cache is
    # the kernel's); a kill mid-write leaves a temp file, quarantined at start, never served.
    data_dir = tmp_path / "crash"
    try:
        _crash_rounds(data_dir, rounds=4, frame_bytes=8 * MiB, sync_interval_s=0.1)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.mark.slow
def test_acknowledged_puts_survive_many_kill_9(tmp_path):
    data_dir = tmp_path / "crash"
    try:
        temps = _crash_rounds(data_dir, rounds=20, frame_bytes=16 * MiB, n_keys=8)
        assert temps >= 5  # each even round waits for a temp file before it kills
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _wait_for_temp_file(data_dir: Path, n_keys: int, timeout_s: float = 10.0) -> None:
    # Only the child's keys' directories: a poll must be far shorter than a write.
    dirs = sorted({data_dir / crash_key(k).hex()[:2] for k in range(n_keys)})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for leaf in dirs:
            if any(name.endswith(".tmp") for name in os.listdir(leaf)):
                return
    raise AssertionError("the child never had a temp file open")


def _check_after_crash(data_dir: Path, model: dict[int, int], in_flight: int, frame_bytes: int,
                       n_keys: int) -> int:
    """Open a fresh tier: each key holds its last acknowledged frame (or the in-flight one)."""
    tier = NVMeTier(data_dir, 1 << 40)
    try:
        temps, corrupt = quarantined(tier)
        assert corrupt == 0  # a crash leaves complete files or temp files, never a torn frame
        assert temp_files(data_dir) == []
        for k in range(n_keys):
            allowed = {model.get(k)}
            if in_flight % n_keys == k:
                allowed.add(in_flight)
            got = tier.get(crash_key(k))
            number = None if got is None else frame_number(got)
            assert number in allowed, f"key {k}: found put {number}, expected one of {allowed}"
            if got is not None:
                assert bytes(got) == crash_frame(number, frame_bytes)
                model[k] = number
        return temps
    finally:
        tier.close()


# -- throughput ------------------------------------------------------------------------


def _drop_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _raw_put(path, data) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_atomic_put(path, data) -> None:
    """The same publish protocol as the tier (temp, sync, rename, sync dir), nothing else."""
    tmp = f"{path}.tmp"
    _raw_put(tmp, data)
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_get(path, size) -> bytearray:
    buf = bytearray(size)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.readv(fd, [buf])
    finally:
        os.close(fd)
    return buf


def bench_against_raw(data_dir: Path, size: int, repeats: int = 7) -> dict[str, float]:
    """Median seconds of tier put/get against raw file I/O, interleaved in the same run.

    raw put: open/write/fsync/close of one file; raw atomic put adds the rename
    and directory fsync the tier must do; raw get: open/read/close into a new buffer.
    """
    raw_dir = data_dir / "raw"
    raw_dir.mkdir(parents=True)
    data = payload(size, 5)
    t: dict[str, list[float]] = {}
    tier = NVMeTier(data_dir / "tier", 1 << 40)
    try:
        for r in range(repeats):  # interleaved, so drift in the VM hits both sides alike
            raw = raw_dir / f"f{r}"
            t.setdefault("raw put", []).append(_timed(lambda: _raw_put(raw, data)))
            t.setdefault("raw atomic put", []).append(_timed(lambda: _raw_atomic_put(f"{raw}a", data)))
            t.setdefault("tier put", []).append(_timed(lambda: tier.put(key(r), data)))
            t.setdefault("tier put_with", []).append(
                _timed(lambda: tier.put_with(key(100 + r), size, lambda v: _fill(v, data))))
        for r in range(repeats):
            raw, mine = raw_dir / f"f{r}", file_of(data_dir / "tier", key(r))
            _drop_cache(raw)
            _drop_cache(mine)
            t.setdefault("raw get cold", []).append(_timed(lambda: _raw_get(raw, size)))
            t.setdefault("tier get cold", []).append(_timed(lambda: tier.get(key(r))))
            t.setdefault("raw get warm", []).append(_timed(lambda: _raw_get(raw, size)))
            t.setdefault("tier get warm", []).append(_timed(lambda: tier.get(key(r))))
        assert bytes(tier.get(key(0))) == data
    finally:
        tier.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    return {name: statistics.median(v) for name, v in t.items()}


@pytest.mark.slow
@pytest.mark.parametrize("size", [32 * MiB, 1 * MiB])
def test_throughput_vs_raw(tmp_path, size):
    med = bench_against_raw(tmp_path / "bench", size)
    for name, s in med.items():
        print(f"{size // MiB:>3} MiB  {name:14s} {s * 1e3:8.2f} ms  {size / s / 1e9:6.2f} GB/s")
    # Small puts are bound by device flushes and journal commits: the tier pays two
    # (the file, then the directory after the rename) where a bare write pays one.
    # "raw atomic put" shows that cost; the tier's own overhead on top of it (one
    # copy, one hash, a JSON header) is ~0.1 ms, below this VM's run-to-run noise.
    if size >= 32 * MiB:
        assert med["raw put"] / med["tier put"] >= 0.8
    assert med["raw get cold"] / med["tier get cold"] >= 0.8
    assert med["raw get warm"] / med["tier get warm"] >= 0.8


def test_spare_files_are_reused_and_never_outlive_a_restart(tmp_path):
    tier = NVMeTier(tmp_path / "d", 64 * MiB)
    tier.put(key(1), payload(100_000, 1))
    tier.put(key(1), payload(100_000, 2))  # the first file becomes a spare
    tier.put(key(2), payload(100_000, 3))  # same size: written into that spare
    details = tier.stats().details
    assert details["spare_files_reused"] == "1" and details["spare_files"] == "0"
    assert bytes(tier.get(key(1))) == payload(100_000, 2) and bytes(tier.get(key(2))) == payload(100_000, 3)
    assert tier.delete(key(2)) and tier.stats().details["spare_files"] == "1"
    tier.close()
    again = NVMeTier(tmp_path / "d", 64 * MiB)
    assert again.stats().details["spare_files"] == "0" and os.listdir(tmp_path / "d" / ".recycle") == []
    assert bytes(again.get(key(1))) == payload(100_000, 2) and again.get(key(2)) is None
    again.close()

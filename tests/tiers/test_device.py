"""DeviceTier: the conformance suite plus pool, staging and compaction checks.

Tiers are built on ``KVSTORE_TEST_DEVICE`` (default ``cpu``); ``bench/gpu_check.py``
sets it to ``cuda:0`` to run this same file on a GPU. Every contract test runs
twice: with the default staging (none on cpu, 8 MiB pinned on CUDA) and with
tiny staging halves, so that frames cross many chunk boundaries.
"""

import os
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidInput, StoreClosed, TierUnavailable
from kvstore.memory.slab import Move
from tests.tiers.conformance import MiB, TierContract, key, payload, tier_state_machine
from tiers.device import DeviceTier

DEVICE = os.environ.get("KVSTORE_TEST_DEVICE", "cpu")
ON_CUDA = torch.device(DEVICE).type == "cuda"
SMALL_STAGING = 64 * 1024  # 32 KiB halves: a 16 MiB frame takes 512 chunks each way
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="KVSTORE_TEST_DEVICE is not a CUDA device")


def make(capacity_bytes: int, **kw) -> DeviceTier:
    return DeviceTier(capacity_bytes, device=DEVICE, **kw)


def sync() -> None:
    if ON_CUDA:
        torch.cuda.synchronize(DEVICE)


class TestDeviceTier(TierContract):
    @pytest.fixture(params=[None, SMALL_STAGING], ids=["default-staging", "small-staging"])
    def make_tier(self, request):
        made = []

        def build(capacity_bytes: int) -> DeviceTier:
            made.append(make(capacity_bytes, staging_bytes=request.param))
            return made[-1]

        yield build
        for tier in made:
            tier.close()

    def test_details_name_the_device(self, tier):
        stats = tier.stats()
        assert (stats.kind, stats.durable, stats.shared) == ("device", False, False)
        if ON_CUDA:
            assert stats.details["device"].startswith("cuda:") and "(" in stats.details["device"]
            assert stats.details["pinned_staging"] == "true"
        elif not torch.cuda.is_available():
            assert stats.details["device"] == "cpu (no CUDA)"
            assert stats.details["pinned_staging"] == "false"


class TestDeviceErrors:
    @pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
    @pytest.mark.parametrize("device", ["cuda:0", "cuda", torch.device("cuda", 0)])
    def test_cuda_without_cuda_is_unavailable(self, device):
        with pytest.raises(TierUnavailable, match="CUDA is not available"):
            DeviceTier(1 * MiB, device=device)

    @needs_cuda
    def test_missing_gpu_is_unavailable(self):
        with pytest.raises(TierUnavailable, match="CUDA devices exist"):
            DeviceTier(1 * MiB, device=f"cuda:{torch.cuda.device_count()}")

    @pytest.mark.parametrize("device", ["gpu", "meta", 3.5, object()])
    def test_bad_device_is_invalid_input(self, device):
        with pytest.raises(InvalidInput):
            DeviceTier(1 * MiB, device=device)

    @pytest.mark.parametrize("staging", [-1, 5, True, 1.5, "8MiB"])
    def test_bad_staging_is_invalid_input(self, staging):
        with pytest.raises(InvalidInput, match="staging_bytes"):
            make(1 * MiB, staging_bytes=staging)

    def test_failed_copy_is_typed_and_leaves_nothing(self, monkeypatch):
        tier = make(1 * MiB)

        def broken(dst, src):  # what a lost GPU looks like from torch
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(tier._in, "upload", broken)
        with pytest.raises(TierUnavailable, match="illegal memory access") as info:
            tier.put(key(1), b"abc")
        assert info.value.tier == tier.name
        stats = tier.stats()
        assert stats.entries == 0 and stats.details["arena_free_bytes"] == str(tier.arena_bytes)
        tier.close()


class TestPool:
    def test_puts_and_compaction_keep_one_pool(self):
        tier = make(4 * MiB, max_entries=64, staging_bytes=SMALL_STAGING)
        ptr = tier._pool.data_ptr()
        allocated = torch.cuda.memory_allocated(DEVICE) if ON_CUDA else None
        live: dict[int, bytes] = {}
        for round_ in range(6):  # fill, punch holes, then ask for a run only compaction can give
            first = round_ * 100
            for i in range(16):
                if sum(map(len, live.values())) + 240 * 1024 > tier.capacity_bytes:
                    break
                live[first + i] = payload(240 * 1024 - 64 * (i % 3), first + i)
                tier.put(key(first + i), live[first + i])
            for k in [k for k in live if k >= first][::2]:
                tier.delete(key(k))
                del live[k]
            big = first + 99
            live[big] = payload(1 * MiB - 64, big)
            tier.put(key(big), live[big])
            for k in list(live)[:-3]:  # keep a few survivors that later compactions must move
                tier.delete(key(k))
                del live[k]
        assert int(tier.stats().details["compactions"]) > 0
        assert tier._pool.data_ptr() == ptr
        if ON_CUDA:
            assert torch.cuda.memory_allocated(DEVICE) == allocated
        for k, data in live.items():
            assert bytes(tier.get(key(k))) == data
        tier.close()

    @pytest.mark.parametrize(
        "src, dst, size",
        [
            (64, 0, 10 * MiB),  # tiny distance, bounced through scratch in several pieces
            (5 * MiB, 0, 10 * MiB),  # distance above scratch: direct pieces of the distance
            (1 * MiB + 64, 128, 6 * MiB),  # distance below scratch, size above it
            (3 * MiB, 1 * MiB, 2 * MiB),  # adjacent ranges
            (9 * MiB, 0, 64),  # far apart and small
        ],
    )
    def test_move_is_overlap_safe(self, src, dst, size):
        tier = make(16 * MiB)
        n = tier.arena_bytes
        ref = (np.arange(n, dtype=np.int64) * 2654435761 % 251).astype(np.uint8)
        tier._pool.copy_(torch.from_numpy(ref))
        sync()  # that copy ran on the current stream; moves run on the tier's own
        tier._move([Move(src, dst, size)])
        ref[dst : dst + size] = ref[src : src + size].copy()
        assert np.array_equal(tier._pool.cpu().numpy(), ref)
        tier.close()

    def test_close_releases_the_pool(self):
        tier = make(8 * MiB)
        tier.put(key(1), payload(1000))
        before = torch.cuda.memory_allocated(DEVICE) if ON_CUDA else None
        tier.close()
        tier.close()
        assert tier._pool is None and tier._scratch is None
        if ON_CUDA:
            assert torch.cuda.memory_allocated(DEVICE) <= before - 8 * MiB
        with pytest.raises(StoreClosed):
            tier.get_tensor(key(1), torch.empty(1000, dtype=torch.uint8))


class TestBuffers:
    @pytest.fixture
    def tier(self):
        tier = make(32 * MiB, staging_bytes=8 * 1024)
        yield tier
        tier.close()

    @pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 8192, 8193, 3 * 4096 + 5, 1 * MiB + 1])
    def test_frames_across_chunk_boundaries(self, tier, n):
        data = payload(n, n)
        tier.put(key(n), data)
        assert bytes(tier.get(key(n))) == data
        out = np.zeros(n + 10, np.uint8)
        assert tier.get_into(key(n), out) == n
        assert out[:n].tobytes() == data and not out[n:].any()

    def test_cpu_tensors_in_and_out(self, tier):
        kv = torch.randn(4, 256, dtype=torch.float32).to(torch.float16)
        tier.put(key(1), kv)
        back = torch.empty_like(kv)
        assert tier.get_into(key(1), back) == kv.numel() * 2
        assert torch.equal(back, kv)

    def test_get_tensor_on_the_device(self, tier):
        data = payload(70_000, 7)
        tier.put(key(1), data)
        out = torch.zeros(80_000, dtype=torch.uint8, device=DEVICE)
        assert tier.get_tensor(key(1), out) == len(data)
        assert bytes(out[: len(data)].cpu().numpy()) == data
        assert not out[len(data) :].any()
        assert tier.get_into(key(1), torch.zeros_like(out)) == len(data)  # a device tensor routes here too
        assert tier.get_tensor(key(2), out) is None

    def test_get_tensor_refuses_bad_outs(self, tier):
        tier.put(key(1), payload(1000))
        with pytest.raises(InvalidInput):
            tier.get_tensor(key(1), torch.empty(999, dtype=torch.uint8, device=DEVICE))
        with pytest.raises(InvalidInput):
            tier.get_tensor(key(1), torch.empty(2000, 2, dtype=torch.uint8, device=DEVICE).t())
        with pytest.raises(InvalidInput):
            tier.get_tensor(key(1), bytearray(1000))
        with pytest.raises(InvalidInput):
            tier.get_into(key(1), memoryview(bytes(1000)))
        assert tier.stats().details["retired"] == "0"  # refused reads let their range go

    @needs_cuda
    def test_pinned_buffers_dma_directly(self, tier, monkeypatch):
        direct = []
        for lane in (tier._in, tier._out):
            monkeypatch.setattr(lane, "_direct", lambda host, f=lane._direct: direct.append(f(host)) or direct[-1])
        data = payload(3 * MiB + 3, 9)
        src = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
        src.numpy()[:] = np.frombuffer(data, np.uint8)
        tier.put(key(1), src)
        out = torch.zeros(len(data), dtype=torch.uint8, pin_memory=True)
        assert tier.get_into(key(1), out) == len(data)
        assert out.numpy().tobytes() == data
        out.zero_()
        assert tier.get_into(key(1), out.numpy()) == len(data)  # a pinned numpy view is found too
        assert out.numpy().tobytes() == data
        assert direct == [True, True, True]
        assert bytes(tier.get(key(1))) == data and direct[-1] is False  # get's own buffer is pageable

    def test_close_during_reads(self, tier):
        data = payload(256 * 1024, 5)
        tier.put(key(1), data)
        seen, stop = [], threading.Event()

        def read() -> None:
            while not stop.is_set():
                try:
                    got = tier.get(key(1))
                except StoreClosed:
                    seen.append("closed")
                    return
                seen.append(bytes(got) == data)

        reader = threading.Thread(target=read)
        reader.start()
        while not seen:
            time.sleep(0.001)
        tier.close()
        reader.join(5)
        stop.set()
        assert seen[-1] == "closed" and all(s is True for s in seen[:-1])


TestDeviceTierStateMachine = tier_state_machine(lambda cap: make(cap)).TestCase
TestStagedDeviceTierStateMachine = tier_state_machine(
    lambda cap: make(cap, staging_bytes=4096), max_examples=30
).TestCase

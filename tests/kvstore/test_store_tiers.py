"""The configured default stack (shm -> cxl -> nvme) under a real store."""

import os

import torch

from kvstore import EmbeddedStore, Settings
from tests.conftest import make_kv, make_spec

MiB = 1 << 20


def assert_served(store, got, kv, cold):
    """Hot tiers give back the very bytes; the cold tier holds int8 within 1%."""
    for e in store.entries():
        sl = slice(e.depth * 16, (e.depth + 1) * 16)
        if e.tier == cold:
            ref = kv[:, :, :, sl].float()
            assert float((got[:, :, :, sl].float() - ref).norm() / ref.norm()) < 0.01
        else:
            assert torch.equal(got[:, :, :, sl], kv[:, :, :, sl]), e.tier


def test_default_stack_fills_top_down_and_serves_from_every_tier(tmp_path):
    spec = make_spec(num_layers=8, num_kv_heads=4, head_dim=64)  # 64 KiB per 16-token block
    settings = Settings(shm_bytes=1 * MiB, cxl_bytes=1 * MiB, data_dir=str(tmp_path), nvme_bytes=64 * MiB)
    with EmbeddedStore(settings=settings) as store:
        assert [t.name for t in store.tiers] == ["shm", "cxl", "nvme"]
        tokens = list(range(16 * 48))  # 3 MiB of KV: more than shm and cxl hold together
        kv = make_kv(spec, len(tokens), seed=3)
        assert store.put_kv(spec, tokens, kv) == len(tokens)
        per_tier = {t.name: t.stats().entries for t in store.tiers}
        assert per_tier["shm"] > 0 and per_tier["cxl"] > 0 and per_tier["nvme"] > 0, per_tier
        got, n = store.get_kv(spec, tokens)
        assert n == len(tokens)
        assert_served(store, got, kv, cold="nvme")
        assert os.path.isdir(tmp_path / "nvme-log")  # a new data dir: the log layout
        segments = [t.path for t in store.tiers if hasattr(t, "segment")]  # this store's own, not all of /dev/shm
        assert segments and all(os.path.exists(p) for p in segments)
    assert not [p for p in segments if os.path.exists(p)], "shm arena left behind"


def test_redis_url_adds_the_redis_tier_above_nvme(tmp_path):
    from bench.tiers import private_redis

    with private_redis() as url:
        settings = Settings(shm_bytes=1 * MiB, cxl_bytes=1 * MiB, data_dir=str(tmp_path), redis_url=url)
        with EmbeddedStore(settings=settings) as store:
            assert [t.name for t in store.tiers] == ["shm", "cxl", "redis", "nvme"]
            spec = make_spec(num_layers=8, num_kv_heads=4, head_dim=64)
            tokens = list(range(16 * 40))
            kv = make_kv(spec, len(tokens), seed=4)
            store.put_kv(spec, tokens, kv)
            assert store.tiers[2].stats().entries > 0
            got, n = store.get_kv(spec, tokens)
            assert n == len(tokens)
            assert_served(store, got, kv, cold="redis")

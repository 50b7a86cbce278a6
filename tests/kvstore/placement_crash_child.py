"""Child for the crash-mid-move test: puts chains into fast nvme -> slow nvme while
the mover demotes as fast as it can; prints each chain's seed once put_kv returns."""

import sys

from kvstore import KVStore
from kvstore.engine.placement import PlacementConfig
from tests.conftest import make_kv, make_spec
from tiers.nvme import NVMeTier

MiB = 1 << 20


def main(fast_dir: str, slow_dir: str) -> None:
    spec = make_spec(num_layers=8, num_kv_heads=4, head_dim=64)  # 64 KiB blocks
    tiers = [NVMeTier(fast_dir, 2 * MiB, name="fast"), NVMeTier(slow_dir, 512 * MiB, name="slow")]
    config = PlacementConfig(interval_s=0.001, min_residency_s=0.0, move_bytes_per_s=1 << 40)
    store = KVStore(tiers, tier_codecs={"fast": "raw", "slow": "raw"}, placement=config,
                    tier_policies={"fast": {"high_watermark_frac": 0.5, "low_watermark_frac": 0.2}})
    seed = 0
    while True:
        tokens = list(range(seed * 1000, seed * 1000 + 64))
        store.put_kv(spec, tokens, make_kv(spec, 64, seed=seed))
        print(seed, flush=True)
        seed += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

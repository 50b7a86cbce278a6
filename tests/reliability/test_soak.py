"""A full store, kept full: nothing wrong served, memory and latency bounded, the log compacted.

``bench/reliability_kit/soak.py`` runs ``kvstore serve`` (shm over the nvme log layout, both
small) while a client puts fresh sequences as fast as it can and reads random earlier ones
back: 25 s in the default run, 5 minutes behind ``slow``.
"""

from __future__ import annotations

import pytest

from bench.reliability_kit.soak import soak

MiB = 1 << 20


FULL_TWICE = 2 * (64 + 256) * MiB // (512 * 1024) + 1
"""Puts of 512 KiB that fill the store's two tiers (64 MiB shm, 256 MiB nvme) twice over."""


def _check(figures: dict) -> None:
    print({k: v for k, v in figures.items() if k != "rss_anon_mib"}, figures["rss_anon_mib"][::5])  # -s
    assert figures["wrong"] == 0
    assert figures["hits"] > 0 and figures["puts"] >= FULL_TWICE  # full, twice over
    nvme = figures["nvme"]
    assert int(nvme["compactions"]) > 0  # the dead space of drops was reclaimed ...
    assert int(nvme["disk_bytes"]) <= 2 * 256 * MiB + 64 * MiB  # ... and the log stays bounded
    # latency does not grow with the time spent full
    assert figures["p99_last_half_ms"] <= 2 * figures["p99_first_half_ms"] + 50
    rss = figures["rss_anon_mib"]
    quarter = rss[len(rss) // 4]
    assert max(rss[len(rss) // 4:]) <= 1.3 * quarter, rss  # after warm-up, memory levels off


def test_a_full_store_soak(tmp_path):
    _check(soak(tmp_path, seconds=25, min_puts=FULL_TWICE))


@pytest.mark.slow
def test_a_full_store_soak_five_minutes(tmp_path):
    _check(soak(tmp_path, seconds=300, seed=1, min_puts=FULL_TWICE))

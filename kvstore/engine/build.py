"""Tiers from settings: the one place that knows each tier's constructor.

``Settings.tier_names()`` says which tiers, fastest first; this module builds
them. Tier modules are imported only when named, so an embedded store that
never uses Redis never imports redis-py.
"""

from __future__ import annotations

import os
from typing import Callable

from kvstore.config import Settings
from kvstore.tier import Tier

__all__ = ["build_tiers", "nvme_layout", "top_policies"]


def _memory(s: Settings) -> Tier:
    from tiers.memory import MemoryTier

    return MemoryTier(s.memory_bytes)


def _device(s: Settings) -> Tier:
    from tiers.device import DeviceTier

    return DeviceTier(s.device_bytes)


def _shm(s: Settings) -> Tier:
    from tiers.shm import ShmTier

    return ShmTier(s.shm_bytes)


def _cxl(s: Settings) -> Tier:
    from tiers.cxl import CXLTier

    return CXLTier(s.cxl_bytes, numa_node=s.cxl_node)


def _redis(s: Settings) -> Tier:
    from kvstore.errors import InvalidInput
    from tiers.redis import RedisTier

    if not s.redis_url:
        raise InvalidInput("the redis tier needs KVSTORE_REDIS_URL")
    return RedisTier(s.redis_url, s.redis_bytes, keyspace=s.redis_keyspace)


def nvme_layout(s: Settings) -> tuple[str, str]:
    """(the nvme tier's layout, its directory) for ``s``: ``auto`` is ``files`` where the data dir
    holds frames of that layout and none of the log's (an older data dir keeps its blocks), else
    ``log``."""
    files, log = os.path.join(s.data_dir, "nvme"), os.path.join(s.data_dir, "nvme-log")
    layout = s.nvme_layout
    if layout == "auto":
        layout = "files" if not os.path.isdir(log) and _holds_a_file(files) else "log"
    return layout, files if layout == "files" else log


def _holds_a_file(path: str) -> bool:
    """Whether any file lies under ``path`` (stops at the first)."""
    return any(files for _, _, files in os.walk(path))


def _nvme(s: Settings) -> Tier:
    layout, path = nvme_layout(s)
    if layout == "log":
        from tiers.nvme_log import LogTier

        return LogTier(path, s.nvme_bytes, sync_interval_s=s.nvme_sync_interval_s)
    from tiers.nvme import NVMeTier

    return NVMeTier(path, s.nvme_bytes, sync_interval_s=s.nvme_sync_interval_s)


_BUILDERS: dict[str, Callable[[Settings], Tier]] = {
    "memory": _memory, "device": _device, "shm": _shm, "cxl": _cxl, "redis": _redis, "nvme": _nvme,
}


def build_tiers(settings: Settings) -> list[Tier]:
    """The tiers ``settings`` names, built in order; on failure, those built are closed.

    Raises:
        InvalidInput: a bad tier list or a tier setting out of range.
        TierError: a tier's backing could not be set up (e.g. /dev/shm too small).
    """
    built: list[Tier] = []
    try:
        for name in settings.tier_names():
            built.append(_BUILDERS[name](settings))
    except BaseException:
        for tier in built:
            tier.close()
        raise
    return built


def top_policies(settings: Settings, tiers: list[Tier], given: dict | None) -> dict[str, dict]:
    """Placement policies by tier name: the top tier's low watermark from the settings, under
    whatever ``given`` (a caller's ``tier_policies``) names."""
    top = getattr(tiers[0], "name", None) if tiers else None  # not a tier: KVStore refuses it
    policies = {top: {"low_watermark_frac": settings.top_tier_low_watermark}} if top else {}
    for name, policy in (given or {}).items():
        policies[name] = {**policies.get(name, {}), **policy}
    return policies

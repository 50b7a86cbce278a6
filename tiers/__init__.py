"""Tier implementations, one module each, all behind ``kvstore.tier.Tier``.

Only ``memory`` is imported here: the others pull in optional backings (CUDA,
Redis, hugepages) and are imported by name when configured.
"""

from tiers.memory import MemoryTier

__all__ = ["MemoryTier"]

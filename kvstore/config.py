"""Settings, read from ``KVSTORE_*`` environment variables.

Defaults live in one place with their units. Sizes accept plain bytes or a
binary/decimal suffix (``512MiB``, ``4GiB``, ``1GB``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from decimal import Decimal
from typing import Mapping

from kvstore.codec import Codec
from kvstore.errors import InvalidInput

__all__ = ["Settings", "parse_size", "parse_rate", "TIER_KINDS", "SCRUB_BYTES_PER_S", "RECODE_BACKLOG_BYTES",
           "HIGH_WATERMARK_FRAC", "LOW_WATERMARK_FRAC"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_MAX_SIZE = 2**60
_REDIS_URL = re.compile(r"^(redis|rediss|redis\+cluster)://")
TIER_KINDS = ("memory", "device", "shm", "cxl", "redis", "nvme")
_ZERO_OFF = frozenset({"recode_backlog_bytes"})  # sizes where 0 means off
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SCRUB_BYTES_PER_S = 256 * 2**20
"""The background scrub's default rate, bytes per second: xxh3 hashes an arena's frames (out of
cache) at ~8 GB/s here, so 3% of a core in hashing; the scrub thread measured 4.8% in all
(``kvstore.engine.scrub``; docs/design.md, "Verified once")."""
HIGH_WATERMARK_FRAC = 0.95
"""Every tier's high watermark: new blocks are admitted into the top tier up to this share of its
capacity, and a tier above it sends its coldest down (``engine.placement_types.TierPolicy``)."""
LOW_WATERMARK_FRAC = 0.90
"""Every tier's low watermark by default: the share a tier's coldest are sent down to (the top
tier's is ``Settings.top_tier_low_watermark``)."""
RECODE_BACKLOG_BYTES = 256 * 2**20
"""Raw frame bytes puts may spill into cold tiers ahead of their int8 re-encode, by default
(``kvstore.engine.recode``): 128 MiB more disk at most than int8 for fp16 KV."""


def parse_size(text: str | int) -> int:
    """Bytes from ``"4GiB"``, ``"512 MB"`` or ``1048576``.

    Raises:
        InvalidInput: for anything else, naming the accepted units.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.match(str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise InvalidInput(f"a size is a number with an optional unit (KiB, MiB, GiB, KB, MB, GB), got {text!r}")
        value = int(Decimal(match.group(1)) * _UNITS[unit])  # exact: no float rounding
    if not 0 < value <= _MAX_SIZE:
        raise InvalidInput(f"a size must be positive and at most 1 EiB, got {text!r}")
    return value


def parse_rate(text: str | int) -> int:
    """Bytes per second from ``"256MiB"``, ``268435456`` or ``0`` (off): a size, or zero.

    Raises:
        InvalidInput: anything else.
    """
    if isinstance(text, bool):
        raise InvalidInput(f"a rate is bytes per second, e.g. 256MiB, or 0; got {text!r}")
    if text == 0 or (isinstance(text, str) and text.strip() == "0"):
        return 0
    return parse_size(text)


@dataclass(frozen=True, slots=True)
class Settings:
    """Engine settings. ``from_env()`` reads each field from ``KVSTORE_<FIELD>``."""

    tiers: str = "shm,cxl,nvme"
    """Tiers, fastest first, comma-separated (KVSTORE_TIERS). ``redis`` is put
    above ``nvme`` by itself when ``redis_url`` is set and the list omits it."""
    codec: str = Codec.RAW.value
    """Codec for new frames: raw, int8 or int8+lz4 (KVSTORE_CODEC)."""
    data_dir: str = "./kvstore-data"
    """Where the nvme tier keeps its files (KVSTORE_DATA_DIR)."""
    memory_bytes: int = 4 * 2**30
    """Capacity of the in-process memory tier, bytes (KVSTORE_MEMORY_BYTES)."""
    device_bytes: int = 2 * 2**30
    """Capacity of the device tier's preallocated pool, bytes (KVSTORE_DEVICE_BYTES)."""
    shm_bytes: int = 1 * 2**30
    """Capacity of the shared-memory arena, bytes; reserved in /dev/shm at start (KVSTORE_SHM_BYTES)."""
    cxl_bytes: int = 1 * 2**30
    """Capacity of the hugepage arena, bytes (KVSTORE_CXL_BYTES); hugetlb pages are pre-faulted at start,
    the THP fallback's come with the writes."""
    cxl_node: int | None = None
    """NUMA node for the cxl arena; default the highest-numbered one, the far node (KVSTORE_CXL_NODE)."""
    nvme_bytes: int = 64 * 2**30
    """Frame bytes the nvme tier may hold (KVSTORE_NVME_BYTES)."""
    nvme_sync_interval_s: float = 0.1
    """> 0 (the default, 0.1): the nvme tier's group commit: puts return once written through the
    page cache and one sync covers them within this many seconds, or at once for a durable put's
    check; a host crash may lose what the last interval wrote, a ``kill -9`` nothing
    (docs/reliability.md). 0 syncs every put before it returns (KVSTORE_NVME_SYNC_INTERVAL_S)."""
    nvme_layout: str = "auto"
    """How the nvme tier lays out frames (KVSTORE_NVME_LAYOUT): ``log``, frames appended to 64 MiB
    segment files under ``<data_dir>/nvme-log`` with a background compactor (``tiers.nvme_log``);
    ``files``, one safetensors file per frame under ``<data_dir>/nvme`` (``tiers.nvme``), several
    times slower for small blocks; ``auto`` (the default): ``files`` where ``<data_dir>/nvme``
    holds frames already and ``nvme-log`` does not (a data dir from before the log layout keeps
    its blocks), else ``log``. Each layout reads only its own directory."""
    redis_url: str | None = None
    """``redis://host:port/db`` or ``redis+cluster://host:port`` (KVSTORE_REDIS_URL)."""
    redis_bytes: int = 16 * 2**30
    """Frame bytes kvstore may keep in Redis, shared by every server on that keyspace (KVSTORE_REDIS_BYTES)."""
    redis_keyspace: str = "default"
    """Key prefix part, so several deployments can share one Redis (KVSTORE_REDIS_KEYSPACE)."""
    full_top_tier: str = "spill"
    """What a put does when the top tier is past its high watermark (puts outran the background
    demotions): ``spill`` writes it one tier down on the put's path (nothing dropped; the mover
    sends colder residents down behind the puts); ``evict`` drops the coldest top-tier blocks
    instead (KVSTORE_FULL_TOP_TIER)."""
    top_tier_low_watermark: float = LOW_WATERMARK_FRAC
    """The share of the top tier's capacity that the mover demotes down to once writes take the
    tier above it (KVSTORE_TOP_TIER_LOW_WATERMARK); puts are admitted up to the high watermark,
    0.95. The band between is room kept free for bursts of new blocks: a wider band (say 0.80)
    lands larger bursts in the top tier, at the price of a tier that sits that much emptier."""
    scrub_bytes_per_s: int = SCRUB_BYTES_PER_S
    """How fast the background scrub re-hashes the shm and cxl arenas, bytes per second (e.g.
    256MiB); 0 turns it off. Damage at rest is found within arena bytes / rate seconds
    (KVSTORE_SCRUB_BYTES_PER_S)."""
    recode_backlog_bytes: int = RECODE_BACKLOG_BYTES
    """Raw bytes a put may write into a cold (int8) tier ahead of their re-encode, which a
    background thread does behind it; past that a put encodes int8 itself; 0: always
    (KVSTORE_RECODE_BACKLOG_BYTES)."""

    def __post_init__(self) -> None:
        # Accept "4GiB" as well as ints; store plain bytes and the canonical codec name.
        for f in fields(self):
            if f.name.endswith("_bytes"):
                parse = parse_rate if f.name in _ZERO_OFF else parse_size
                object.__setattr__(self, f.name, parse(getattr(self, f.name)))
        object.__setattr__(self, "scrub_bytes_per_s", parse_rate(self.scrub_bytes_per_s))
        object.__setattr__(self, "codec", Codec.parse(self.codec).value)
        object.__setattr__(self, "tiers", ",".join(self.tier_names()))
        if self.cxl_node is not None and (isinstance(self.cxl_node, bool) or not isinstance(self.cxl_node, int)
                                          or self.cxl_node < 0):
            raise InvalidInput(f"cxl_node must be a non-negative int, got {self.cxl_node!r}")
        if self.full_top_tier not in ("spill", "evict"):
            raise InvalidInput(f"full_top_tier must be spill or evict, got {self.full_top_tier!r}")
        low = self.top_tier_low_watermark
        if isinstance(low, bool) or not isinstance(low, (int, float)) or not 0 < low <= HIGH_WATERMARK_FRAC:
            raise InvalidInput(f"top_tier_low_watermark must be a fraction in (0, {HIGH_WATERMARK_FRAC}] "
                               f"(the high watermark), got {low!r}")
        sync = self.nvme_sync_interval_s
        if isinstance(sync, bool) or not isinstance(sync, (int, float)) or not 0 <= sync <= 60:
            raise InvalidInput(f"nvme_sync_interval_s must be a number of seconds in [0, 60], got {sync!r}")
        if self.nvme_layout not in ("auto", "files", "log"):
            raise InvalidInput(f"nvme_layout must be auto, files or log, got {self.nvme_layout!r}")
        if self.redis_url is not None and not _REDIS_URL.match(str(self.redis_url)):
            raise InvalidInput(f"redis_url must start with redis://, rediss:// or redis+cluster://, got {self.redis_url!r}")

    def tier_names(self) -> list[str]:
        """The tiers to build, fastest first, with ``redis`` added above ``nvme`` when a URL is set.

        Raises:
            InvalidInput: an unknown or repeated tier name.
        """
        names = [n.strip().lower() for n in str(self.tiers).split(",") if n.strip()]
        unknown = [n for n in names if n not in TIER_KINDS]
        if unknown or not names or len(set(names)) != len(names):
            raise InvalidInput(f"tiers must be distinct names from {', '.join(TIER_KINDS)}, got {self.tiers!r}")
        if self.redis_url and "redis" not in names:
            at = names.index("nvme") if "nvme" in names else len(names)
            names.insert(at, "redis")
        return names

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Settings from ``KVSTORE_*`` variables, defaults for the rest.

        Raises:
            InvalidInput: naming the variable that holds a bad value.
        """
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(f"KVSTORE_{f.name.upper()}")
            if raw is None:
                continue
            try:
                values[f.name] = _parse_field(f.name, raw)
            except InvalidInput as exc:
                raise InvalidInput(f"KVSTORE_{f.name.upper()}: {exc}") from exc
        try:
            return cls(**values)  # type: ignore[arg-type]
        except InvalidInput as exc:
            raise InvalidInput(f"bad KVSTORE_* setting: {exc}") from exc


def _parse_field(name: str, raw: str) -> object:
    if name in _ZERO_OFF:
        return parse_rate(raw)
    if name.endswith("_bytes"):
        return parse_size(raw)
    if name.endswith("_bytes_per_s"):
        return parse_rate(raw)
    if name.endswith("_watermark"):
        try:
            return float(raw)
        except ValueError:
            raise InvalidInput(f"a fraction of the tier's capacity, e.g. 0.8, got {raw!r}") from None
    if name.endswith("_s"):
        try:
            return float(raw)
        except ValueError:
            raise InvalidInput(f"a number of seconds, got {raw!r}") from None
    if name == "cxl_node":
        if not raw.strip():
            return None
        if not raw.strip().isdigit():
            raise InvalidInput(f"a NUMA node number, got {raw!r}")
        return int(raw)
    return raw or None if name == "redis_url" else raw

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

__all__ = ["Settings", "parse_size"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_MAX_SIZE = 2**60
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


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


@dataclass(frozen=True, slots=True)
class Settings:
    """Engine settings. ``from_env()`` reads each field from ``KVSTORE_<FIELD>``."""

    memory_bytes: int = 4 * 2**30
    """Capacity of the default in-process memory tier, bytes (KVSTORE_MEMORY_BYTES)."""
    codec: str = Codec.RAW.value
    """Codec for new frames: raw, int8 or int8+lz4 (KVSTORE_CODEC)."""

    def __post_init__(self) -> None:
        # Accept "4GiB" as well as ints; store plain bytes and the canonical codec name.
        object.__setattr__(self, "memory_bytes", parse_size(self.memory_bytes))
        object.__setattr__(self, "codec", Codec.parse(self.codec).value)

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
                values[f.name] = parse_size(raw) if f.name.endswith("_bytes") else raw
            except InvalidInput as exc:
                raise InvalidInput(f"KVSTORE_{f.name.upper()}: {exc}") from exc
        try:
            return cls(**values)  # type: ignore[arg-type]
        except InvalidInput as exc:
            raise InvalidInput(f"bad KVSTORE_* setting: {exc}") from exc

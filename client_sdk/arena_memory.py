"""What a co-located client remembers of an arena: the slots it verified, the slot handles it
was given or found, and the reads it owes the server a report of (``client_sdk.arena.Arena``
holds one of each)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np

from kvstore import codec as codec_mod
from kvstore.keys import block_hashes
from kvstore.spec import KVSpec
from kvstore.wire.rest import MAX_TOUCH_KEYS

__all__ = ["VerifiedSlots", "HandleCache", "AccessLog"]


class VerifiedSlots:
    """Arena slots (index, generation) whose frame this client verified, with its header.

    A generation is never reused and a published slot's bytes never change, so while
    a read lease shows the same generation the bytes are those that verified: a repeat
    read copies and hashes nothing, as ``Arena.fill_from_handles`` does for ``get_kv``.
    """

    def __init__(self, max_entries: int = 65_536) -> None:
        self._max = max_entries
        self._slots: OrderedDict[tuple[int, int], "codec_mod.FrameHeader"] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, index: int, gen: int, checksum: int | None) -> "codec_mod.FrameHeader | None":
        with self._lock:
            header = self._slots.get((index, gen))
            if header is not None:
                self._slots.move_to_end((index, gen))
        return header if header is not None and (checksum is None or header.body_checksum == checksum) else None

    def add(self, index: int, gen: int, header: "codec_mod.FrameHeader") -> None:
        with self._lock:
            self._slots[(index, gen)] = header
            while len(self._slots) > self._max:
                self._slots.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()


class HandleCache:
    """Slot handles a co-located client was given, by block key, so a repeated get
    can skip asking the server where its blocks are.

    A remembered handle is only a hint: the reader copies under the slot's
    generation check, and the server makes the generation odd before a slot is
    deleted, moved or reused, so a stale handle reads as a miss (then the
    client asks the server) and never as another block's bytes.
    """

    MEMO_SEQUENCES = 1024
    MEMO_MAX_TOKENS = 8192
    """Sequences up to this long have their block keys memoized (at most 32 KiB of ids each)."""

    def __init__(self, max_entries: int = 65_536) -> None:
        self.max_entries = max_entries
        self._blocks: OrderedDict[str, dict] = OrderedDict()
        self._keys: OrderedDict[tuple[str, str, bytes], tuple[list[str], list[bytes]]] = OrderedDict()
        self._lock = threading.Lock()

    def keys_of(self, spec: KVSpec, tokens: np.ndarray, namespace: str) -> tuple[list[str], list[bytes]]:
        """The block keys of ``tokens``, hex and raw, memoized: an agent re-reads the same prefixes."""
        if len(tokens) > self.MEMO_MAX_TOKENS:
            raw = block_hashes(spec, tokens, namespace)
            return [k.hex() for k in raw], raw
        memo = (namespace, spec.fingerprint(), tokens.tobytes())
        keys = self._keys.get(memo)
        if keys is None:
            raw = block_hashes(spec, tokens, namespace)
            keys = ([k.hex() for k in raw], raw)
            with self._lock:
                self._keys[memo] = keys
                while len(self._keys) > self.MEMO_SEQUENCES:
                    self._keys.popitem(last=False)
        return keys

    def remember(self, blocks: Sequence[dict]) -> None:
        with self._lock:
            for b in blocks:
                if b.get("handle") is not None:
                    self._blocks[b["key"]] = b
                    self._blocks.move_to_end(b["key"])
            while len(self._blocks) > self.max_entries:
                self._blocks.popitem(last=False)

    def lookup(self, spec: KVSpec, tokens: np.ndarray, namespace: str) -> list[dict] | None:
        """Every full block of ``tokens`` with a remembered handle, or None if any is missing."""
        keys, _ = self.keys_of(spec, tokens, namespace)
        with self._lock:
            found = [self._blocks.get(k) for k in keys]
        return found if keys and None not in found else None  # type: ignore[return-value]

    def blocks(self, keys: Sequence[str]) -> list[dict | None]:
        """The remembered block (key, checksum, handle) of each hex key, or None."""
        with self._lock:
            return [self._blocks.get(k) for k in keys]

    def forget(self, blocks: Sequence[dict]) -> None:
        with self._lock:
            for b in blocks:
                self._blocks.pop(b["key"], None)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._keys.clear()

    def __len__(self) -> int:
        return len(self._blocks)


class AccessLog:
    """Reads a client served from remembered handles, for the server's heat and counters.

    Placement ranks blocks by how often they are read; reads the server never
    saw would let it demote the blocks a co-located agent uses most. They are
    reported in batches (``POST /v1/kv/touch``): when ``max_keys`` reads are
    pending or the oldest is ``max_age_s`` old, and when the client closes.
    Repeated reads of a key travel as one key and a count, so a hot loop over
    one prefix sends a few bytes, not a key per read.
    """

    def __init__(self, max_keys: int = 4096, max_age_s: float = 1.0) -> None:
        self.max_keys, self.max_age_s = max_keys, max_age_s
        self.on_pending: Callable[[], None] | None = None
        """Called (outside the lock, from the reading thread) when a read is added to an empty log:
        the client then sends the report within ``max_age_s`` even if no further read comes."""
        self._counts: dict[str, int] = {}
        self._reads = self._gets = self._requested = self._hit = 0
        self._since: float | None = None
        self._lock = threading.Lock()

    def add(self, blocks: Sequence[dict], requested: int, hit: int) -> None:
        with self._lock:
            counts = self._counts
            for b in blocks:
                counts[b["key"]] = counts.get(b["key"], 0) + 1
            self._reads += len(blocks)
            self._gets += 1
            self._requested += requested
            self._hit += hit
            first = self._since is None
            if first:
                self._since = time.monotonic()
        if first and self.on_pending is not None:
            self.on_pending()

    def due(self) -> bool:
        # One read of _since: the reporter thread's drain() may set it to None in between.
        since = self._since
        return since is not None and (self._reads >= self.max_keys or time.monotonic() - since >= self.max_age_s)

    MAX_REPORT_KEYS = MAX_TOUCH_KEYS
    """The most keys one report carries (the server's limit); more wait for the next report."""

    def drain(self) -> dict | None:
        """The next report (at most ``MAX_REPORT_KEYS`` keys), or None when nothing is pending."""
        with self._lock:
            if not self._counts and not self._gets:
                return None
            items = list(self._counts.items())
            now, rest = items[:self.MAX_REPORT_KEYS], items[self.MAX_REPORT_KEYS:]
            report = {"keys": [k for k, _ in now], "counts": [n for _, n in now], "gets": self._gets,
                      "tokens_requested": self._requested, "tokens_hit": self._hit}
            self._counts = dict(rest)
            self._reads = sum(n for _, n in rest)
            self._gets = self._requested = self._hit = 0
            if not rest:
                self._since = None  # else the rest keep the oldest read's time: due by age soon
            return report

"""Spec-mismatch hints: why a get found nothing when its tokens are stored under another spec.

A get whose spec differs from the writer's in one field (dtype float32 where the writer put
float16, another block size, another weights fingerprint) finds nothing, by design: the spec's
fingerprint seeds every key, so KV never crosses specs. But an empty answer reads as a cold
cache, and the caller recomputes forever. So the store remembers the specs it stored per
namespace and model (the newest ``SPECS_PER_MODEL``) and, when a get misses at its first block,
hashes that block's key under each sibling spec and asks the index. A hit there becomes a hint
naming how the stored spec differs. It is never an error (the empty answer is right), and it
costs nothing unless a get misses at block 0: then one blake3 and one index read per sibling.

Only specs this process stored are remembered (a frame names its spec's fingerprint, not the
spec itself): after a restart, hints come back with the next put of each spec.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Any

from kvstore.engine.core import EngineCore, is_current
from kvstore.errors import KVStoreWarning
from kvstore.keys import iter_block_hashes
from kvstore.spec import KVSpec

__all__ = ["SpecHints", "describe", "SPECS_PER_MODEL", "MAX_MODELS"]

SPECS_PER_MODEL = 16
"""Specs remembered per (namespace, model_id), the oldest forgotten first: one model rarely runs
under more dtypes, block sizes and weight revisions at once."""
MAX_MODELS = 4096
"""(namespace, model_id) pairs remembered, the least recently stored forgotten first: whatever
tenants send, the memory stays bounded (a spec is a few hundred bytes)."""
_MAX_WARNED = 4096
"""Spec pairs already warned of in this process; past it the set starts over (a repeat warning
is better than memory that grows with every pair ever seen)."""

_FIELDS = ("dtype", "block_tokens", "num_layers", "num_kv_heads", "head_dim", "fingerprint")
"""The wire fields (``KVSpec.to_dict``) a hint compares, model_id being the same by construction."""


def describe(stored: KVSpec, asked: KVSpec) -> str:
    """The hint's text: which fields of ``stored`` differ from ``asked``, with both values.

    Printable ASCII without line breaks (spec fields are), so it can travel as a header.
    """
    s, a = stored.to_dict(), asked.to_dict()
    diff = [f for f in _FIELDS if s[f] != a[f]]
    return (f"nothing is stored for this spec, but the first block of these tokens is stored under "
            f"another spec of model {stored.model_id!r}: stored as {' '.join(f'{f}={s[f]}' for f in diff)}, "
            f"asked {' '.join(f'{f}={a[f]}' for f in diff)}")


class SpecHints:
    """The specs a store stored, per namespace and model, and the hint a missed get gets from them.

    Args:
        core: the engine core whose index says where a block is stored.
    """

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._specs: OrderedDict[tuple[str, str], OrderedDict[str, KVSpec]] = OrderedDict()
        self._warned: set[tuple[str, str]] = set()

    def saw(self, spec: KVSpec, namespace: str) -> None:
        """Remember that ``spec`` was stored in ``namespace``: every put calls it (a few dict
        operations under a lock no read takes unless it missed)."""
        group_key, fp = (namespace, spec.model_id), spec.fingerprint()
        with self._lock:
            group = self._specs.get(group_key)
            if group is None:
                group = self._specs[group_key] = OrderedDict()
                if len(self._specs) > MAX_MODELS:
                    self._specs.popitem(last=False)
            else:
                self._specs.move_to_end(group_key)
            group[fp] = spec
            group.move_to_end(fp)
            if len(group) > SPECS_PER_MODEL:
                group.popitem(last=False)

    def stored_under(self, spec: KVSpec, toks: Any, namespace: str) -> KVSpec | None:
        """The newest other spec of ``spec``'s model under which the first block of ``toks`` (token
        ids, normalized) is stored in ``namespace``; None when there is none."""
        fp = spec.fingerprint()
        with self._lock:
            group = self._specs.get((namespace, spec.model_id))
            siblings = [s for f, s in reversed(group.items()) if f != fp] if group else []
        for other in siblings:
            if len(toks) < other.block_tokens:
                continue
            key = next(iter_block_hashes(other, toks[:other.block_tokens], namespace))
            if is_current(self._core.entry(key), namespace, other.fingerprint()):
                return other
        return None

    def after_miss(self, spec: KVSpec, toks: Any, namespace: str, into: list[str] | None) -> None:
        """What a get that found nothing at block 0 does: the hint, if any, is appended to ``into``
        when given (a server sends it on), else warned as a ``KVStoreWarning`` once per pair of
        specs (an in-process caller sees it without asking)."""
        other = self.stored_under(spec, toks, namespace)
        if other is None:
            return
        hint = describe(other, spec)
        if into is not None:
            into.append(hint)
            return
        pair = (spec.fingerprint(), other.fingerprint())
        with self._lock:
            if pair in self._warned:
                return
            if len(self._warned) >= _MAX_WARNED:
                self._warned.clear()
            self._warned.add(pair)
        warnings.warn(hint, KVStoreWarning, stacklevel=3)  # 3: the caller of KVStore.get_kv

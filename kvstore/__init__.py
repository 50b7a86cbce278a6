"""kvstore: a KV-cache store that treats attention KV as addressable state.

An agent ``put_kv``s the KV of a token sequence; any agent running the same
model ``get_kv``s the longest stored prefix instead of recomputing it.

    from kvstore import KVSpec, EmbeddedStore
    spec = KVSpec(model_id="llama-tiny", num_layers=8, num_kv_heads=2, head_dim=64,
                  dtype="float16", block_tokens=16, fingerprint="weights-rev-1")
    store = EmbeddedStore()
    n = store.put_kv(spec, tokens, kv)
    kv2, n2 = store.get_kv(spec, tokens)
"""

# Order matters: tiers import kvstore.tier, so the engine's leaf modules load
# before the store (which may import tiers).
from kvstore._version import __version__
from kvstore import errors
from kvstore.errors import (
    BlockNotFound,
    CorruptFrame,
    FrameError,
    InvalidInput,
    InvalidKey,
    InvalidKV,
    InvalidSpec,
    InvalidTokens,
    KVStoreError,
    NotDurable,
    StoreClosed,
    TierError,
    TierFull,
    TierIOError,
    TierUnavailable,
    UnsupportedFrame,
)
from kvstore.spec import KVSpec
from kvstore.keys import BlockHash, block_hashes, from_hex, to_hex
from kvstore.codec import Codec
from kvstore.tier import Tier, TierStats
from kvstore.config import Settings
from kvstore.index import IndexEntry
from kvstore.store import EmbeddedStore, KVStore, StoreStats

__all__ = [
    "__version__",
    "KVSpec",
    "EmbeddedStore",
    "KVStore",
    "StoreStats",
    "IndexEntry",
    "Settings",
    "Codec",
    "Tier",
    "TierStats",
    "BlockHash",
    "block_hashes",
    "to_hex",
    "from_hex",
    *errors.__all__,
]

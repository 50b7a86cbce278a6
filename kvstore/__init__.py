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

# Names load on first use (PEP 562): ``import kvstore.spec`` from the SDK runs this
# file, and must not drag in the store, placement or the tiers with it.
from kvstore._version import __version__

_ENGINE_ERRORS = (
    "KVStoreError", "InvalidInput", "InvalidSpec", "InvalidKV", "InvalidTokens", "InvalidKey",
    "FrameError", "CorruptFrame", "UnsupportedFrame", "BlockNotFound", "TierError", "TierUnavailable",
    "TierFull", "TierIOError", "StoreClosed", "NotDurable",
)

_WHERE = {
    "KVSpec": "kvstore.spec",
    "EmbeddedStore": "kvstore.engine.store",
    "KVStore": "kvstore.engine.store",
    "StoreStats": "kvstore.engine.store",
    "IndexEntry": "kvstore.engine.index",
    "Settings": "kvstore.config",
    "Codec": "kvstore.codec",
    "Tier": "kvstore.tier",
    "TierStats": "kvstore.tier",
    "BlockHash": "kvstore.keys",
    "block_hashes": "kvstore.keys",
    "to_hex": "kvstore.keys",
    "from_hex": "kvstore.keys",
    **{name: "kvstore.errors" for name in _ENGINE_ERRORS},
}

__all__ = ["__version__", *_WHERE]


def __getattr__(name: str) -> object:
    import importlib

    where = _WHERE.get(name)
    if where is None:  # a submodule, as ``import kvstore; kvstore.codec`` found it when this file imported them
        try:
            return importlib.import_module(f"kvstore.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvstore.{name}":
                raise
            raise AttributeError(f"module 'kvstore' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

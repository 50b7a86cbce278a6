"""Adapters between kvstore's KV layout and model libraries (transformers: issue #5)."""

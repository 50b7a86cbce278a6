"""The engine: the index and everything that changes it, placement, the mover, the shared
tier, recovery, frames by key, reserved puts, events, prefetch, and ``KVStore``, its facade.

It imports the foundation (``kvstore.spec``, ``keys``, ``codec``, ``tier`` ...) and the tiers;
nothing under it imports the server, the SDK or the CLI (``tests/test_package.py``).
"""

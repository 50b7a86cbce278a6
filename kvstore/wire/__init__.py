"""The wire: formats both ends of a connection import, so each is defined once.

- ``kvstore.wire.rest``: REST bodies (KV body, batch body) and headers.
- ``kvstore.wire.errors``: one status per error class, the JSON error body, and back.
- ``kvstore.wire.flight``: the Arrow Flight medium's schemas, tickets and error details.
- ``kvstore.wire.lmcache``: LMCache's ``lm://`` messages and key strings.
- ``kvstore.wire.channel``: the commit channel's frames (a co-located client's pooled put over a
  Unix socket).
- ``kvstore.wire.redis``: how frames lie in a shared Redis keyspace, and the zero-copy
  read path the Redis tier and the SDK's ``redis`` medium share.

Nothing here imports the store, the tiers, the server or the SDK; only ``redis`` and
``channel`` do I/O (on a socket their caller hands them).
"""

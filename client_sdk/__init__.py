"""The Python SDK (``KVClient``, ``AsyncKVClient``); it arrives with the server issue (#5).

It may import ``kvstore.spec``, ``kvstore.keys`` and ``kvstore.codec`` only.
"""

__all__: list[str] = []

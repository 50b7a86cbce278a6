"""The Python SDK: ``KVClient`` and ``AsyncKVClient``.

    from client_sdk import KVClient
    client = KVClient("http://127.0.0.1:8470", token=None, namespace="default")
    n = client.put_kv(spec, tokens, kv)
    kv2, n2 = client.get_kv(spec, tokens)

Both pick shared memory when the server runs on this host and HTTP otherwise
(``colocated=False`` forces HTTP). ``put_kv(..., wait=False)`` returns a
``PutHandle`` (``AsyncPutHandle``) once the KV is copied aside; ``flush()`` waits
for those puts, and a failed one is raised once more as ``PutFailed``.
Errors are ``kvstore.errors`` classes, the service ones (``Unauthorized``,
``Forbidden``, ``QuotaExceeded``, ``RetainQuotaExceeded``, ``PayloadTooLarge``, ``TooManyTokens``,
``MalformedRequest``, ``ConnectionFailed``, ``PutFailed``...) re-exported here. A get that finds
nothing while its tokens are stored under another spec of the model warns ``KVStoreWarning`` (once
per pair of specs per client), naming how the specs differ. ``EventFollower`` keeps a node's
block set (key -> tier) current from its snapshot and KV event stream, in a thread.
It imports ``kvstore.spec``, ``keys``, ``codec``, ``errors`` and ``memory.shm`` (the
arena reader for the co-located path), never the tiers or the store.
"""

from client_sdk.aio import AsyncKVClient
from client_sdk.client import KVClient
from client_sdk.events import EventFollower
from client_sdk.pending import AsyncPutHandle, PutHandle
from kvstore.errors import (BodyTimeout, ConnectionFailed, Forbidden, KVStoreWarning, MalformedRequest,
                            PayloadTooLarge, PutFailed, QuotaExceeded, RequestTimeout, RetainQuotaExceeded,
                            RouteNotFound, ServerBusy, ServiceError, TooManyTokens, Unauthorized)

__all__ = [
    "KVClient",
    "AsyncKVClient",
    "PutHandle",
    "AsyncPutHandle",
    "EventFollower",
    "ServiceError",
    "Unauthorized",
    "Forbidden",
    "MalformedRequest",
    "PayloadTooLarge",
    "TooManyTokens",
    "QuotaExceeded",
    "RetainQuotaExceeded",
    "RouteNotFound",
    "ConnectionFailed",
    "RequestTimeout",
    "BodyTimeout",
    "ServerBusy",
    "PutFailed",
    "KVStoreWarning",
]

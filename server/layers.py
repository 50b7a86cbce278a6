"""Layer-wise KV streaming: ``POST /v1/kv/get-layers``.

The request is ``/v1/kv/get``'s (a KV body: spec and tokens) and so is the
answer's byte layout: ``[L, 2, H, n, D]`` in C order is layer 0's
``[2, H, n, D]``, then layer 1's, and so on. What differs is how it leaves:
one send per layer, so the socket's flow control paces the stream, the first
layer is on the wire before the last is handed to the transport, and a client
(``client_sdk.layers``) hands layer 0 to its model while later layers are in
flight.

The KV is produced whole, by the same handler as ``/v1/kv/get`` (auth,
namespace, pooled buffer, error mapping, counters), before the first byte
goes. Producing it block by block would not start layer 0 any sooner: a
stored block is ``[L, 2, H, bt, D]``, so layer 0 of the prefix needs every
block read (and checksummed) first; a tier would have to read part of a
frame for that to change.
"""

from __future__ import annotations

from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from kvstore.wire.rest import H_SHAPE, H_TOKENS, KV_MEDIA
from server import data

__all__ = ["router", "LAYERS_ROUTE"]

LAYERS_ROUTE = "/v1/kv/get-layers"

router = APIRouter()


@router.post(LAYERS_ROUTE)
async def kv_get_layers(request: Request) -> StreamingResponse:
    """The KV of the longest stored prefix, sent one layer ``[2, H, n, D]`` at a time.

    Headers as ``/v1/kv/get``: ``X-KV-Tokens: n``, ``X-KV-Shape``, ``X-KV-Dtype`` and a
    Content-Length of the whole body (so a client knows ``n`` before any layer).

    Raises:
        Unauthorized, Forbidden, MalformedRequest, InvalidSpec, InvalidTokens: as ``/v1/kv/get``,
            before the answer starts (the app's handlers map them to their status).
    """
    whole = await data.kv_get(request)
    body = memoryview(whole.body)
    n_layers = int(whole.headers[H_SHAPE].split(",")[0])
    layer_nbytes = len(body) // n_layers if int(whole.headers[H_TOKENS]) else 0
    return StreamingResponse(_layers(body, layer_nbytes), media_type=KV_MEDIA, background=whole.background,
                             headers={k: v for k, v in whole.headers.items() if k != "content-type"})


async def _layers(body: memoryview, layer_nbytes: int) -> AsyncIterator[memoryview]:
    # One send per layer: uvicorn awaits the transport's drain between sends, so
    # the event loop copies at most a layer or so into its buffer at a time
    # instead of the whole answer, and layer 0 leaves before layer 1 is handed over.
    for at in range(0, len(body), layer_nbytes or 1):
        yield body[at:at + layer_nbytes]

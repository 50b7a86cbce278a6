"""The ``flight`` medium's wire contract: schemas, tickets, error details.

A server started with ``KVSTORE_FLIGHT_PORT`` runs an Arrow Flight server
(``server.flight``) and lists it in ``/v1/info`` as ``media.flight.port``; the
client (``client_sdk.flight.FlightMedium``) connects to the same host as the REST
url. Both import this module; nothing here does I/O.

Wire contract (every ticket and command is a JSON object):

- ``do_get`` ticket ``{"keys": [hex, ...], "codec": null | "raw" | "int8"}``, at
  most ``MAX_TICKET_KEYS`` keys: record batches of ``FRAMES_SCHEMA``, one row a
  key in ticket order, ``frame`` null for a key absent from the namespace.
- ``do_get`` ticket ``{"op": "layers", "spec": KVSpec.to_dict(), "tokens": [int]}``:
  the KV of the longest stored prefix, one record batch of ``LAYER_SCHEMA`` a
  layer (``[2, H, n, D]`` bytes); the schema metadata holds ``tokens`` (n),
  ``shape`` and ``dtype``.
- ``do_get`` ticket ``{"op": "probe", "bytes": n}``: n bytes of filler (at most
  ``MAX_PROBE_BYTES``) as ``FRAMES_SCHEMA`` batches, for the planner's estimates.
- ``do_put`` with command ``{"op": "frames"}`` and batches of ``FRAMES_SCHEMA``:
  the PutResult metadata is ``{"stored": n}``.

Calls carry ``authorization: Bearer <token>`` and ``x-kv-namespace``, as REST
requests do. A refused call is a Flight error whose ``extra_info`` is the REST
error body plus its status (``error_detail``), so the SDK raises the same typed
error either way.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from kvstore.errors import (ConnectionFailed, Forbidden, InvalidInput, MalformedRequest, RequestTimeout,
                            ServiceError, Unauthorized)
from kvstore.keys import HASH_BYTES, BlockHash, check_key
from kvstore.wire.errors import error_body, error_from, status_for

__all__ = ["FRAMES_SCHEMA", "LAYER_SCHEMA", "MAX_TICKET_KEYS", "MAX_PROBE_BYTES", "BATCH_BYTES",
           "GRPC_OPTIONS", "frames_batch", "batch_frames", "batches_of", "error_detail", "typed_error"]

FRAMES_SCHEMA = pa.schema([pa.field("key", pa.binary(HASH_BYTES), nullable=False), pa.field("frame", pa.binary())])
LAYER_SCHEMA = pa.schema([pa.field("layer", pa.int32(), nullable=False), pa.field("kv", pa.binary(), nullable=False)])
MAX_TICKET_KEYS = 65_536
"""Keys one ``do_get`` ticket may name, as a REST batch; ``FlightMedium`` splits longer lists."""
MAX_PROBE_BYTES = 64 << 20
"""Filler one probe ticket may ask for; the planner's probes are a few MB."""
BATCH_BYTES = 4 << 20
"""Frame bytes a record batch holds before the next one starts, either way. gRPC sends a
message only once it is whole, so a 32 MiB batch cannot overlap sending and receiving;
4 MiB ones do. A frame at least this big travels alone, with no copy (see ``frames_batch``)."""
GRPC_OPTIONS: tuple[tuple[str, Any], ...] = ()
"""gRPC channel arguments of the client (see ``FlightMedium``); measured in ``bench.flight``."""
_INT32_MAX = 2**31 - 1


# -- record batches ------------------------------------------------------------------------


def frames_batch(items: Sequence[tuple[bytes, Any]]) -> pa.RecordBatch:
    """A ``FRAMES_SCHEMA`` batch of ``(key, frame or None)`` pairs.

    A batch of one frame wraps that frame's memory (no copy); several frames are
    copied into one buffer, since a binary column's data is contiguous.

    Raises:
        InvalidKey: a key that is not 32 bytes.
        InvalidInput: frames over 2 GiB in one batch.
    """
    keys = pa.py_buffer(b"".join(check_key(k) for k, _ in items))
    views = [None if f is None else memoryview(f).cast("B") for _, f in items]
    lengths = np.fromiter((0 if v is None else len(v) for v in views), np.int64, len(views))
    offsets = np.zeros(len(views) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > _INT32_MAX:
        raise InvalidInput(f"a record batch holds at most {_INT32_MAX} frame bytes, got {offsets[-1]}")
    present = [v for v in views if v is not None]
    if len(present) == 1:
        data = pa.py_buffer(present[0])
    else:
        data = pa.py_buffer(b"".join(present))
    validity = None
    if len(present) < len(views):
        valid = np.fromiter((v is not None for v in views), np.bool_, len(views))
        validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    n = len(items)
    key_col = pa.Array.from_buffers(pa.binary(HASH_BYTES), n, [None, keys])
    frame_col = pa.Array.from_buffers(pa.binary(), n, [validity, pa.py_buffer(offsets.astype(np.int32)), data],
                                      null_count=n - len(present))
    return pa.RecordBatch.from_arrays([key_col, frame_col], schema=FRAMES_SCHEMA)


def batch_frames(batch: pa.RecordBatch) -> list[tuple[BlockHash, memoryview | None]]:
    """The ``(key, frame)`` rows of a ``FRAMES_SCHEMA`` batch; frames are views of the
    batch's memory (a view keeps that memory alive).

    Raises:
        MalformedRequest: the batch has another schema.
    """
    if batch.num_columns != 2 or not pa.types.is_fixed_size_binary(batch.column(0).type) \
            or batch.column(0).type.byte_width != HASH_BYTES \
            or not (pa.types.is_binary(batch.column(1).type) or pa.types.is_large_binary(batch.column(1).type)):
        raise MalformedRequest(f"record batch: must be {FRAMES_SCHEMA}, got {batch.schema}")
    keys_col, frames_col = batch.column(0), batch.column(1)
    n = batch.num_rows
    key_buf = memoryview(keys_col.buffers()[1]).cast("B")
    kat = keys_col.offset * HASH_BYTES
    keys = [BlockHash(bytes(key_buf[kat + i * HASH_BYTES:kat + (i + 1) * HASH_BYTES])) for i in range(n)]
    if keys_col.null_count:
        raise MalformedRequest("record batch: key must not be null")
    _, off_buf, data_buf = frames_col.buffers()
    off_type = np.int64 if pa.types.is_large_binary(frames_col.type) else np.int32
    offsets = np.frombuffer(off_buf, off_type, n + 1, frames_col.offset * np.dtype(off_type).itemsize).tolist()
    data = memoryview(data_buf).cast("B") if data_buf is not None else memoryview(b"")
    valid = frames_col.is_valid().to_numpy(zero_copy_only=False).tolist() if frames_col.null_count else [True] * n
    return [(keys[i], data[offsets[i]:offsets[i + 1]] if valid[i] else None) for i in range(n)]


def batches_of(items: Iterable[tuple[bytes, Any]], batch_bytes: int) -> Iterator[pa.RecordBatch]:
    """``items`` in record batches of about ``batch_bytes``: a frame that would overflow the
    batch being built starts the next one, so a big frame travels alone and uncopied."""
    pending: list[tuple[bytes, Any]] = []
    size = 0
    for key, frame in items:
        n = 0 if frame is None else memoryview(frame).nbytes
        if pending and size + n > batch_bytes:
            yield frames_batch(pending)
            pending, size = [], 0
        pending.append((key, frame))
        size += n
    if pending:
        yield frames_batch(pending)


# -- errors ------------------------------------------------------------------------------------


def error_detail(exc: BaseException) -> bytes:
    """The ``extra_info`` of a refused call: the REST error body and its status, as JSON."""
    return json.dumps({"status": status_for(exc), **error_body(exc)}, separators=(",", ":")).encode()


_BY_CLASS: tuple[tuple[type, type, int], ...] = (
    (fl.FlightUnauthenticatedError, Unauthorized, 401),
    (fl.FlightUnauthorizedError, Forbidden, 403),
    (fl.FlightTimedOutError, RequestTimeout, 504),
    (fl.FlightUnavailableError, ConnectionFailed, 503),
)


def typed_error(exc: pa.ArrowException, where: str) -> Exception:
    """The SDK error a Flight failure stands for: the server's typed error when it sent one
    (``error_detail``), else one chosen by the Flight error class."""
    info = getattr(exc, "extra_info", None) or b""
    try:
        detail = json.loads(info) if info else None
    except ValueError:
        detail = None
    if isinstance(detail, dict) and isinstance(detail.get("status"), int) and isinstance(detail.get("error"), dict):
        return error_from(detail["status"], detail)
    message = f"{where}: {str(exc).split('. Detail:')[0]}"
    for flight_cls, cls, status in _BY_CLASS:
        if isinstance(exc, flight_cls):
            return cls(message, status=status)
    return ServiceError(message)

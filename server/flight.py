"""Arrow Flight beside the REST app: frames by key in bulk, and KV layer by layer.

``create_app`` starts a ``FlightService`` when ``ServerSettings.flight_port`` is
set, publishes its port in ``/v1/info`` (``media.flight.port``) and stops it
first at shutdown. The tickets, schemas and error details are the SDK's
(``client_sdk.flight``); the rules are the REST routes': the same auth and
namespace headers (``server.requests``), the same engine calls (``KVStore.frames``' reads)
and quota check (``server.requests.put_frames``), the same typed errors.

Handlers run on gRPC's threads, never on the app's event loop, so they call
the store directly. Every failure leaves as a Flight error carrying the REST
error body; anything unexpected is logged and answered as an internal error,
without a traceback (pyarrow would otherwise send the caller one).
"""

from __future__ import annotations

import json
import logging
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import torch

from kvstore import codec as codec_mod
from kvstore.errors import InvalidInput, InvalidKV, KVStoreError, MalformedRequest, ServiceError
from kvstore.keys import HASH_BYTES, BlockHash
from kvstore.wire.errors import status_for
from kvstore.wire.flight import (BATCH_BYTES, FRAMES_SCHEMA, LAYER_SCHEMA, MAX_PROBE_BYTES, MAX_TICKET_KEYS,
                                 batch_frames, error_detail, frames_batch)
from kvstore.wire.rest import H_NAMESPACE
from server.auth import Principal
from server.config import ServerSettings, is_loopback
from server.errors import field_error
from server.requests import check_namespace, parse_keys, put_frames  # the REST routes' rules
from server.service import Service, parse_spec, parse_tokens, require

__all__ = ["FlightService", "start_flight", "flight_host"]

log = logging.getLogger("kvstore.server")

_HEADERS = "headers"
_ZEROS = memoryview(bytes(BATCH_BYTES))

_FLIGHT_ERRORS: dict[int, type[fl.FlightError]] = {
    401: fl.FlightUnauthenticatedError,
    403: fl.FlightUnauthorizedError,
    503: fl.FlightUnavailableError,
    504: fl.FlightTimedOutError,
}
"""The Flight class of a REST status; others are ``FlightServerError``. The SDK reads the
typed error from the detail, the class only says what gRPC tools will show."""


class _Headers(fl.ServerMiddleware):
    """The call's headers, for the handler (Flight hands them only to middleware)."""

    def __init__(self, headers: dict[str, list[Any]]) -> None:
        self.headers = headers

    def first(self, name: str) -> str | None:
        values = self.headers.get(name) or [None]
        value = values[0]
        return value.decode("latin-1") if isinstance(value, bytes) else value


class _HeadersFactory(fl.ServerMiddlewareFactory):
    def start_call(self, info: fl.CallInfo, headers: dict[str, list[Any]]) -> _Headers:
        return _Headers(headers)


def flight_host(settings: ServerSettings) -> str:
    """The host Flight binds: REST's, but loopback whenever auth is off (``serve``'s rule)."""
    return settings.host if settings.auth_enabled or is_loopback(settings.host) else "127.0.0.1"


class FlightService(fl.FlightServerBase):
    """The Flight server over one ``Service``; listening once constructed.

    Args:
        svc: the app's service (store, auth, quotas, metrics).
        host: the address to bind.
        port: the port; 0 picks a free one (``self.port`` says which).
        batch_bytes: frame bytes a streamed record batch holds (``kvstore.wire.flight.BATCH_BYTES``).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, svc: Service, host: str, port: int, *, batch_bytes: int = BATCH_BYTES) -> None:
        self.svc = svc
        self.batch_bytes = batch_bytes
        self._closing = threading.Event()
        try:
            super().__init__(fl.Location.for_grpc_tcp(host, port), middleware={_HEADERS: _HeadersFactory()})
        except pa.ArrowException as exc:
            raise OSError(f"Arrow Flight cannot listen on {host}:{port}: {exc}") from exc

    # -- the calls ------------------------------------------------------------------------

    def do_get(self, context: fl.ServerCallContext, ticket: fl.Ticket) -> fl.FlightDataStream:
        with self._errors("do_get"):
            _, ns = self._caller(context)
            req = _json_object(ticket.ticket, "ticket")
            op = require(req, "op", str, default="frames")
            if op == "frames":
                keys = _ticket_keys(req)
                codec = require(req, "codec", str, default=None)
                if codec is not None:
                    try:
                        codec = codec_mod.Codec.parse(codec).value
                    except InvalidInput as exc:
                        raise field_error(exc, "codec") from exc
                return fl.GeneratorStream(FRAMES_SCHEMA, self._frame_batches(keys, codec, frozenset({ns})))
            if op == "layers":
                return self._layers(req, ns)
            if op == "probe":
                return fl.GeneratorStream(FRAMES_SCHEMA, self._filler(_probe_bytes(req)))
            raise field_error(InvalidInput(f"unknown op {op!r}; known: 'frames', 'layers', 'probe'"), "ticket.op")

    def do_put(self, context: fl.ServerCallContext, descriptor: fl.FlightDescriptor,
               reader: fl.MetadataRecordBatchReader, writer: fl.FlightMetadataWriter) -> None:
        with self._errors("do_put"):
            principal, ns = self._caller(context)
            if descriptor.descriptor_type != fl.DescriptorType.CMD:
                raise MalformedRequest("descriptor: must be a command, {\"op\": \"frames\"}", field="descriptor")
            op = require(_json_object(descriptor.command, "descriptor.command"), "op", str, default="frames")
            if op != "frames":
                raise field_error(InvalidInput(f"unknown op {op!r}; do_put knows 'frames'"), "descriptor.op")
            stored = 0
            while True:
                if self._closing.is_set():
                    raise fl.FlightUnavailableError(f"the server is shutting down; {stored} frames were stored")
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                if chunk.data is None or not chunk.data.num_rows:
                    continue
                items = batch_frames(chunk.data)
                for i, (_, frame) in enumerate(items):
                    if frame is None:
                        raise field_error(InvalidInput(f"row {stored + i} has a null frame"), "frame")
                stored += put_frames(self.svc, principal, ns, items)
                self.svc.metrics.transfer.labels("in", "flight").inc(sum(len(f) for _, f in items))
            writer.write(pa.py_buffer(json.dumps({"stored": stored}).encode()))

    # -- helpers ------------------------------------------------------------------------------

    def _caller(self, context: fl.ServerCallContext) -> tuple[Principal, str]:
        """The caller and its namespace, from the call's headers.

        Raises:
            Unauthorized, Forbidden, InvalidSpec: as the REST routes do.
        """
        headers: _Headers = context.get_middleware(_HEADERS)
        principal = self.svc.auth.authenticate(headers.first("authorization"))
        return principal, check_namespace(principal, headers.first(H_NAMESPACE) or "default")

    def _frame_batches(self, keys: list[BlockHash], codec: str | None,
                       scope: frozenset[str]) -> Iterator[pa.RecordBatch]:
        """Record batches of ``keys``' frames, read as they are sent (a ticket's frames are
        never all in memory at once). A frame that would overflow the batch being built starts
        the next one, so a big frame travels alone and uncopied."""
        with self._errors("do_get frames"):
            pending: list[tuple[BlockHash, Any]] = []
            size = 0
            for key in keys:
                frame = self._frame(key, codec, scope)
                n = 0 if frame is None else memoryview(frame).nbytes
                if pending and size + n > self.batch_bytes:
                    yield self._sent(frames_batch(pending), size)
                    pending, size = [], 0
                pending.append((key, frame))
                size += n
            if pending:
                yield self._sent(frames_batch(pending), size)

    def _frame(self, key: BlockHash, codec: str | None, scope: frozenset[str]) -> Any:
        got = self.svc.store.frames.read(key, scope)
        if got is None:
            return None
        if codec is None:
            return got[0]
        try:
            return codec_mod.transcode(got[0], codec)
        except InvalidKV:  # NaN/Inf, which int8 cannot carry: the block goes as stored
            return got[0]

    def _sent(self, batch: pa.RecordBatch, nbytes: int) -> pa.RecordBatch:
        if self._closing.is_set():
            raise fl.FlightUnavailableError("the server is shutting down")
        self.svc.metrics.transfer.labels("out", "flight").inc(nbytes)
        return batch

    def _filler(self, nbytes: int) -> Iterator[pa.RecordBatch]:
        """``nbytes`` of zeros as frames of an all-zero key, sliced from one shared buffer."""
        with self._errors("do_get probe"):
            while nbytes > 0:
                n = min(nbytes, self.batch_bytes, len(_ZEROS))
                nbytes -= n
                yield frames_batch([(bytes(HASH_BYTES), _ZEROS[:n])])

    def _layers(self, req: dict, ns: str) -> fl.FlightDataStream:
        """The ``layers`` op: ``get_kv`` of the longest stored prefix, one layer a batch."""
        spec = parse_spec(require(req, "spec", dict))
        tokens = parse_tokens(require(req, "tokens", list), limit=self.svc.settings.max_tokens_per_request)
        kv, n = self.svc.store.get_kv(spec, tokens, ns)
        meta = {"tokens": str(n), "shape": json.dumps(list(kv.shape[1:])), "dtype": spec.dtype}
        schema = LAYER_SCHEMA.with_metadata(meta)

        def batches() -> Iterator[pa.RecordBatch]:
            with self._errors("do_get layers"):
                for layer in range(kv.shape[0] if n else 0):
                    data = kv[layer].contiguous().view(-1).view(torch.uint8).numpy()  # the store's, uncopied
                    offsets = pa.py_buffer(np.array([0, len(data)], np.int32))
                    col = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, pa.py_buffer(data)])
                    batch = pa.RecordBatch.from_arrays([pa.array([layer], pa.int32()), col], schema=schema)
                    yield self._sent(batch, len(data))

        return fl.GeneratorStream(schema, batches())

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Every failure as a Flight error with the REST error body (``error_detail``)."""
        try:
            yield
        except fl.FlightError:
            raise
        except KVStoreError as exc:
            status = status_for(exc)
            if status in (401, 403):
                self.svc.metrics.auth_failures.labels(str(status)).inc()
            elif status >= 500:
                log.warning("flight %s failed: %s: %s", what, type(exc).__name__, exc)
            raise _FLIGHT_ERRORS.get(status, fl.FlightServerError)(str(exc), error_detail(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the caller gets no traceback, the log does
            log.exception("flight %s: unexpected error", what)
            raise fl.FlightInternalError("internal server error",
                                         error_detail(ServiceError("internal server error"))) from exc

    # -- lifetime -----------------------------------------------------------------------------

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop serving: streams end at their next batch; waits up to ``timeout_s`` for calls
        to finish (a stuck one is left to the process's exit, and logged)."""
        if self._closing.is_set():
            return
        self._closing.set()
        done = threading.Thread(target=self.shutdown, name="kvstore-flight-shutdown", daemon=True)
        done.start()
        done.join(timeout_s)
        if done.is_alive():
            log.warning("kvstore: Arrow Flight calls still running after %.0f s; not waiting for them", timeout_s)


def start_flight(svc: Service, settings: ServerSettings) -> FlightService:
    """Start the Flight server of ``settings.flight_port`` over ``svc``.

    Raises:
        OSError: the port cannot be bound.
    """
    assert settings.flight_port is not None
    return FlightService(svc, flight_host(settings), settings.flight_port)


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise MalformedRequest(f"{what}: not JSON: {exc}", field=what) from exc
    if not isinstance(data, dict):
        raise MalformedRequest(f"{what}: must be a JSON object, got {type(data).__name__}", field=what)
    return data


def _probe_bytes(req: dict[str, Any]) -> int:
    nbytes = require(req, "bytes", int)
    if not 0 <= nbytes <= MAX_PROBE_BYTES:
        raise field_error(InvalidInput(f"must be in [0, {MAX_PROBE_BYTES}], got {nbytes}"), "bytes")
    return nbytes


def _ticket_keys(req: dict[str, Any]) -> list[BlockHash]:
    keys = require(req, "keys", list)
    if len(keys) > MAX_TICKET_KEYS:
        raise field_error(InvalidInput(f"at most {MAX_TICKET_KEYS} keys a ticket, got {len(keys)}"), "keys")
    return parse_keys(keys)

"""The ``flight`` medium: frames by key over Arrow Flight, beside the REST app.

A server started with ``KVSTORE_FLIGHT_PORT`` runs an Arrow Flight server
(``server.flight``) and lists it in ``/v1/info`` as ``media.flight.port``; the
client connects to the same host as the REST url. The wire contract
(schemas, tickets, error details) is ``kvstore.wire.flight``, which the server
imports too; this module is ``FlightMedium``, the client.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterator, Mapping, Sequence
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import torch

from client_sdk import _common as c
from client_sdk.media import Medium
from kvstore import codec as codec_mod
from kvstore.codec import Codec
from kvstore.errors import ConnectionFailed, FrameError, InvalidInput, RouteNotFound, ServiceError
from kvstore.keys import BlockHash, block_hashes, check_key, validate_namespace
from kvstore.spec import KVSpec
from kvstore.wire.flight import (BATCH_BYTES, FRAMES_SCHEMA, GRPC_OPTIONS, MAX_TICKET_KEYS,
                                 batch_frames, batches_of, typed_error)
from kvstore.wire.rest import H_NAMESPACE

__all__ = ["FlightMedium"]

# -- the medium ----------------------------------------------------------------------------------


class FlightMedium(Medium):
    """Frames by key over Arrow Flight.

    Args:
        url_or_host: the server's host, or its REST url (``http://host:port``; the host is taken).
        port: the Flight port (``/v1/info``'s ``media.flight.port``).
        token: bearer token, as for ``KVClient``.
        namespace: the namespace every call works in.
        timeout_s: per-call deadline (None: none).
        batch_bytes: frame bytes a put's record batch holds (``BATCH_BYTES``).
        grpc_options: gRPC channel arguments, ``(name, value)`` pairs.
    """

    name = "flight"
    remote = True
    codecs = (None, "int8")

    def __init__(self, url_or_host: str, port: int, token: str | None = None, namespace: str = "default", *,
                 timeout_s: float | None = 60.0, batch_bytes: int = BATCH_BYTES,
                 grpc_options: Sequence[tuple[str, Any]] = GRPC_OPTIONS) -> None:
        host = urlsplit(url_or_host).hostname if "://" in url_or_host else url_or_host
        if not host:
            raise ValueError(f"url_or_host must be a host or http://host[:port], got {url_or_host!r}")
        self.host, self.port = host, int(port)
        self.namespace = validate_namespace(namespace)
        self.batch_bytes = batch_bytes
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        headers.append((H_NAMESPACE.encode(), self.namespace.encode()))
        self._options = fl.FlightCallOptions(headers=headers, timeout=timeout_s)
        self._where = f"grpc://{self._netloc()}"
        self._client: fl.FlightClient | None = fl.FlightClient(
            fl.Location.for_grpc_tcp(host, self.port), generic_options=list(grpc_options) or None)

    @classmethod
    def from_info(cls, url: str, info: Mapping[str, Any], token: str | None = None, namespace: str = "default",
                  **kwargs: Any) -> "FlightMedium":
        """The medium a server offers in its ``/v1/info`` answer, on the REST url's host.

        Raises:
            RouteNotFound: the server offers no Flight medium.
        """
        offer = (info.get("media") or {}).get("flight")
        if not isinstance(offer, Mapping) or not isinstance(offer.get("port"), int):
            raise RouteNotFound(f"{url} offers no Arrow Flight medium (its server sets KVSTORE_FLIGHT_PORT)",
                                status=404)
        return cls(url, offer["port"], token, namespace, **kwargs)


    def _netloc(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def _flight(self) -> fl.FlightClient:
        if self._client is None:
            raise ConnectionFailed(f"{self._where}: the medium is closed")
        return self._client

    def get_frames(self, keys: Sequence[BlockHash], *, codec: str | None = None) -> list[memoryview | None]:
        """The frames of ``keys`` in order (views of Arrow memory), None for each absent one.

        Args:
            codec: ``"int8"`` (or ``"raw"``) to have the server transcode each frame; a block
                int8 cannot carry (NaN/Inf) comes as stored. None: as stored.

        Raises:
            InvalidKey, InvalidInput: a bad key or codec (checked here first).
            Unauthorized, Forbidden, ConnectionFailed, RequestTimeout, ServiceError: from the call.
        """
        return [frame for _, frame in self._frames([check_key(k) for k in keys], codec)]

    def get_kv(self, spec: KVSpec, tokens: Any, out: Any = None, *,
               codec: str | None = None) -> tuple[torch.Tensor, int]:
        """The KV of the longest stored prefix, ``(kv [L, 2, H, n, D], n)``, each block decoded as
        its batch arrives, while gRPC receives the next (about 1.5x the default's rate here:
        fetch all, then decode).

        Args:
            out: as ``KVClient.get_kv``; the result is a view of its first bytes.
            codec: as ``get_frames``.
        """
        spec = c.check_spec(spec)
        keys = block_hashes(spec, tokens, self.namespace)
        bt = spec.block_tokens
        try:
            kv = c.result_tensor(spec, len(keys) * bt, out)
        except InvalidInput:
            if out is None:
                raise
            return super().get_kv(spec, tokens, out, codec=codec)  # out fits only a shorter prefix
        good = 0
        rows = self._frames(keys, codec)
        try:
            for _, frame in rows:
                if frame is None:
                    break
                try:
                    codec_mod.decode(frame, out=kv[:, :, :, good * bt:(good + 1) * bt])
                except FrameError:  # wrong KV is never returned: the prefix ends here
                    break
                good += 1
        finally:
            rows.close()  # cancels the rest of the stream
        n = good * bt
        if good == len(keys):
            return kv, n
        if out is None:
            return kv[:, :, :, :n].contiguous(), n
        prefix = kv[:, :, :, :n].clone()  # it moves to the front of out's bytes, over itself
        dst = c.result_tensor(spec, n, out)
        dst.copy_(prefix)
        return dst, n

    def _frames(self, keys: list[BlockHash], codec: str | None) -> Iterator[tuple[BlockHash, memoryview | None]]:
        """``(key, frame)`` rows of ``keys`` as they arrive, a ticket per ``MAX_TICKET_KEYS`` keys;
        closing the generator cancels the call in flight."""
        wire_codec = None if codec is None else Codec.parse(codec).value
        for start in range(0, len(keys), MAX_TICKET_KEYS):
            part = keys[start:start + MAX_TICKET_KEYS]
            ticket = json.dumps({"keys": [k.hex() for k in part], "codec": wire_codec}, separators=(",", ":"))
            got = 0
            reader = None
            try:
                reader = self._flight().do_get(fl.Ticket(ticket.encode()), self._options)
                while True:
                    try:
                        chunk = reader.read_chunk()
                    except StopIteration:
                        break
                    for key, frame in batch_frames(chunk.data) if chunk.data is not None else ():
                        if got >= len(part) or key != part[got]:
                            raise ServiceError(f"{self._where}: the answer's row {got} is not the key asked for")
                        got += 1
                        yield key, frame
            except pa.ArrowException as exc:
                raise typed_error(exc, f"{self._where} do_get") from exc
            except GeneratorExit:
                if reader is not None:
                    reader.cancel()
                raise
            if got != len(part):
                raise ServiceError(f"{self._where}: the answer holds {got} keys, not the {len(part)} asked for")

    def put_frames(self, items: Sequence[tuple[BlockHash, Any]]) -> int:
        """Store ``(key, frame)`` pairs; returns how many were stored.

        Frames go in record batches of about ``batch_bytes``; the server stores each batch as
        it arrives, so on an error the batches before it may be stored.

        Raises:
            CorruptFrame, InvalidInput: a frame the store refuses.
            QuotaExceeded, TierFull, Unauthorized, Forbidden, ConnectionFailed: from the call.
        """
        if not items:
            return 0
        batches = batches_of(items, self.batch_bytes)
        descriptor = fl.FlightDescriptor.for_command(b'{"op":"frames"}')
        try:
            writer, answers = self._flight().do_put(descriptor, FRAMES_SCHEMA, self._options)
            try:
                for batch in batches:
                    writer.write_batch(batch)
                writer.done_writing()
                answer = answers.read()
            finally:
                writer.close()
        except pa.ArrowException as exc:
            raise typed_error(exc, f"{self._where} do_put") from exc
        try:
            return int(json.loads(answer.to_pybytes())["stored"])
        except (AttributeError, ValueError, KeyError, TypeError) as exc:
            raise ServiceError(f"{self._where}: do_put answered {answer!r}, not {{'stored': n}}") from exc

    def probe(self, nbytes: int) -> None:
        """Receive ``nbytes`` of filler the way a get receives frames (0: one round trip), for
        the planner's estimates.

        Raises:
            InvalidInput: over ``MAX_PROBE_BYTES``.
            ConnectionFailed, RequestTimeout, ServiceError: from the call.
        """
        ticket = json.dumps({"op": "probe", "bytes": int(nbytes)}).encode()
        try:
            reader = self._flight().do_get(fl.Ticket(ticket), self._options)
            while True:
                try:
                    reader.read_chunk()
                except StopIteration:
                    return
        except pa.ArrowException as exc:
            raise typed_error(exc, f"{self._where} probe") from exc

    def get_kv_layers(self, spec: KVSpec, tokens: Any) -> Iterator[tuple[int, torch.Tensor]]:
        """The KV of the longest stored prefix, a layer at a time as each arrives:
        ``(layer_index, kv [2, H, n, D])``; nothing when no block is stored.

        Each tensor is this caller's own (copied from the batch: Arrow memory is read-only).

        Raises:
            InvalidSpec, InvalidTokens: bad input (checked here first).
            Unauthorized, Forbidden, ConnectionFailed, ServiceError: from the call.
        """
        spec = c.check_spec(spec)
        toks = c.tokens_of(tokens)
        ticket = json.dumps({"op": "layers", "spec": spec.to_dict(), "tokens": toks.tolist()}, separators=(",", ":"))
        reader = None
        try:
            reader = self._flight().do_get(fl.Ticket(ticket.encode()), self._options)
            meta = reader.schema.metadata or {}
            n = int(meta.get(b"tokens", b"-1"))
            shape = (2, spec.num_kv_heads, n, spec.head_dim)
            if n < 0 or n % spec.block_tokens:
                raise ServiceError(f"{self._where}: a layer stream for {n} tokens")
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    return
                batch = chunk.data
                for i in range(batch.num_rows if batch is not None else 0):
                    yield int(batch.column(0)[i].as_py()), _layer_tensor(batch.column(1), i, shape, spec)
        except pa.ArrowException as exc:
            raise typed_error(exc, f"{self._where} do_get layers") from exc
        except GeneratorExit:  # the caller stopped early: end the stream on the server too
            if reader is not None:
                reader.cancel()
            raise

    def close(self) -> None:
        """Close the channel; idempotent."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> "FlightMedium":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _layer_tensor(col: pa.Array, i: int, shape: tuple[int, ...], spec: KVSpec) -> torch.Tensor:
    nbytes = math.prod(shape) * spec.element_size
    _, offsets, data = col.buffers()
    at = int(np.frombuffer(offsets, np.int32, 1, (col.offset + i) * 4)[0])
    end = int(np.frombuffer(offsets, np.int32, 1, (col.offset + i + 1) * 4)[0])
    if end - at != nbytes:
        raise ServiceError(f"a layer of {end - at} bytes, the spec says {nbytes} for shape {list(shape)}")
    out = torch.empty(shape, dtype=spec.torch_dtype)
    c.byte_view(out)[:] = memoryview(data).cast("B")[at:end]
    return out

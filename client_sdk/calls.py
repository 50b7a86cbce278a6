"""The SDK's sans-I/O core: every request as data, every answer parsed, no socket in sight.

A ``Call`` says what to send (method, path, body parts, content type) and how to
read a 2xx answer. The transports (``client_sdk.transport``) carry a call over a
socket, sync or async, under one retry policy; the clients' methods are built
from the builders here, so ``KVClient`` and ``AsyncKVClient`` send the same bytes
and read the same answers by construction. Error answers become the typed error
their body names (``kvstore.wire.errors.error_from``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar
from urllib.parse import urlencode

from client_sdk import _common as c
from kvstore.keys import BlockHash, block_hashes, check_key
from kvstore.spec import KVSpec
from kvstore.errors import InvalidInput
from kvstore.wire.rest import BATCH_MEDIA, FRAME_MEDIA, JSON_MEDIA, KV_MEDIA, pad64

__all__ = ["Call", "json_call", "kv_call", "json_answer", "raw_answer", "hexes", "key_hex"]

T = TypeVar("T")


def json_answer(body: bytes) -> Any:
    return json.loads(body) if body else None


def raw_answer(body: bytes) -> bytes:
    return body


_RAISE = object()


@dataclass(slots=True)
class Call(Generic[T]):
    """One request and how to read its answer.

    Args:
        parse: turns a 2xx body into the result.
        missing: the result of a 404 (``get_block``'s None); by default a 404 raises.
    """

    method: str
    path: str
    parts: Sequence[Any] = ()
    content_type: str | None = None
    parse: Callable[[bytes], T] = json_answer  # type: ignore[assignment]
    missing: Any = _RAISE

    @property
    def answers_missing(self) -> bool:
        return self.missing is not _RAISE


def json_call(method: str, path: str, payload: Any = None, params: Mapping[str, Any] | None = None,
              parse: Callable[[Any], T] | None = None) -> Call[T]:
    """A call with a JSON body (or none) whose answer is JSON, then ``parse``d."""
    if params:
        path = f"{path}?{urlencode({k: v for k, v in params.items() if v is not None})}"
    parts = () if payload is None else (json.dumps(payload, separators=(",", ":")).encode(),)
    reader = json_answer if parse is None else (lambda body: parse(json_answer(body)))
    return Call(method, path, parts, JSON_MEDIA if parts else None, reader)


def kv_call(path: str, spec: KVSpec, toks: Any, kv: Any = None, *, with_kv: bool = True,
            parse: Callable[[Any], T] | None = None) -> Call[T]:
    """A call with a KV body (``kvstore.wire.rest``) whose answer is JSON, then ``parse``d."""
    reader = json_answer if parse is None else (lambda body: parse(json_answer(body)))
    return Call("POST", path, c.kv_parts(spec, toks, kv, with_kv=with_kv), KV_MEDIA, reader)


def key_hex(key: Any) -> str:
    """A block key as the wire names it: 64 hex digits (bytes are checked, strings passed on)."""
    return check_key(key).hex() if isinstance(key, (bytes, bytearray, memoryview)) else str(key)


def hexes(keys: Sequence[BlockHash]) -> list[str]:
    return [check_key(k).hex() for k in keys]


# -- the data surface's calls ----------------------------------------------------------------


def lookup_blocks(spec: KVSpec, tokens: Any, *, sync: bool = False) -> Call[dict]:
    """The lookup answer; ``sync``: after the server's durable tiers synced what they acknowledged
    (a durable put's check: ``durable_tokens`` then counts blocks a crash cannot take)."""
    return kv_call("/v1/lookup?sync=1" if sync else "/v1/lookup", c.check_spec(spec), c.tokens_of(tokens), None)


def lookup(spec: KVSpec, tokens: Any, stats: c.ClientStats | None = None) -> Call[int]:
    """The tokens of the stored prefix; with ``stats``, the answer's ``hint`` is warned of (``c.warn_hint``)."""
    spec = c.check_spec(spec)

    def tokens_of(answer: dict) -> int:
        if stats is not None:
            c.warn_hint(stats, spec, answer.get("hint"))
        return int(answer["tokens"])
    return kv_call("/v1/lookup", spec, c.tokens_of(tokens), None, parse=tokens_of)


def delete(spec: KVSpec, tokens: Any) -> Call[int]:
    return kv_call("/v1/kv/delete", c.check_spec(spec), c.tokens_of(tokens), None,
                   parse=lambda a: int(a["deleted_blocks"]))


def _kv_query(path: str, spec: KVSpec, tokens: Any, parse: Callable[[Any], T] | None = None,
              **params: Any) -> Call[T]:
    """A KV body without KV (as a lookup sends: compact for long conversations), the route's own
    fields in the query."""
    query = urlencode({k: v for k, v in params.items() if v is not None})
    return kv_call(f"{path}?{query}" if query else path, c.check_spec(spec), c.tokens_of(tokens), None, parse=parse)


def prefetch(spec: KVSpec, tokens: Any) -> Call[int]:
    return _kv_query("/v1/kv/prefetch", spec, tokens, parse=lambda a: int(a["tokens"]))


def retain(spec: KVSpec, tokens: Any, ttl_s: float, priority: int) -> Call[dict]:
    return _kv_query("/v1/kv/retain", spec, tokens, ttl_s=ttl_s, priority=priority)


def release(spec: KVSpec, tokens: Any) -> Call[int]:
    return _kv_query("/v1/kv/release", spec, tokens, parse=lambda a: int(a["blocks"]))


def handoff(spec: KVSpec, tokens: Any, to: str, ttl_s: float | None) -> Call[dict]:
    return _kv_query("/v1/kv/handoff", spec, tokens, to=to, ttl_s=ttl_s)


def check_handoff(handoff: Any, wait: bool) -> None:
    """``put_kv``'s ``handoff``: None, or where the consumer reads (``"here"``, ``"shared"``, a node).

    Raises:
        InvalidInput: not a non-empty string, or asked of a put that does not wait (a hand-off
            names stored blocks; call ``handoff`` once the put's handle is done).
    """
    if handoff is None:
        return
    if not isinstance(handoff, str) or not handoff:
        raise InvalidInput(f"handoff must be 'here', 'shared' or a node name, got {handoff!r}")
    if not wait:
        raise InvalidInput("handoff needs wait=True: a hand-off places stored blocks; with wait=False call "
                           "handoff(spec, tokens, to=...) once the put's handle is done")


def put_kv_http(spec: KVSpec, toks: Any, kv: Any) -> Call[int]:
    """``POST /v1/kv/put``: a token-major KV body that also offers its block-major layout
    (``c.KVPutBody``), which the transport sends instead to a server that takes it."""
    return Call("POST", "/v1/kv/put", c.KVPutBody(spec, toks, kv), KV_MEDIA,
                lambda body: int(json_answer(body)["stored_tokens"]))


def get_block(key: BlockHash) -> Call[bytes | None]:
    return Call("GET", f"/v1/blocks/{check_key(key).hex()}", parse=raw_answer, missing=None)


def put_block(key: BlockHash, frame: Any) -> Call[None]:
    return Call("PUT", f"/v1/blocks/{check_key(key).hex()}", [frame], FRAME_MEDIA, lambda body: None)


def delete_block(key: BlockHash) -> Call[bool]:
    call = json_call("DELETE", f"/v1/blocks/{check_key(key).hex()}", parse=lambda a: bool(a["deleted"]))
    call.missing = False  # BlockNotFound: nothing was there to delete
    return call


def get_blocks(keys: Sequence[BlockHash], codec: str | None = None) -> Call[list[bytes | None]]:
    payload: dict[str, Any] = {"keys": hexes(keys)}
    if codec is not None:
        payload["codec"] = codec
    call = json_call("POST", "/v1/blocks/get", payload)
    call.parse = c.frames_of
    return call


def raw_blocks(hex_keys: Sequence[str]) -> Call[bytes]:
    """``get_blocks`` by hex key, answered as the raw batch body (``c.fill_from_batch`` reads it in place)."""
    call = json_call("POST", "/v1/blocks/get", {"keys": list(hex_keys)})
    call.parse = raw_answer
    return call


def put_blocks(items: Sequence[tuple[BlockHash, Any]], make_room: bool = False) -> Call[int]:
    path = "/v1/blocks/put?make_room=true" if make_room else "/v1/blocks/put"
    return Call("POST", path, c.batch_parts(items), BATCH_MEDIA, lambda body: int(json_answer(body)["stored"]))


def delete_blocks(keys: Sequence[BlockHash]) -> Call[int]:
    return json_call("POST", "/v1/blocks/delete", {"keys": hexes(keys)}, parse=lambda a: int(a["deleted"]))


def blocks_exist(keys: Sequence[BlockHash]) -> Call[list[bool]]:
    return json_call("POST", "/v1/blocks/exists", {"keys": hexes(keys)},
                     parse=lambda a: [bool(x) for x in a["present"]])


def block_handles(hex_keys: Sequence[str], count: bool = True) -> Call[dict]:
    payload: dict[str, Any] = {"keys": list(hex_keys)}
    if not count:
        payload["count"] = False
    return json_call("POST", "/v1/blocks/handles", payload)


def pin_blocks(keys: Sequence[BlockHash], ttl_s: float) -> Call[int]:
    return json_call("POST", "/v1/blocks/pin", {"keys": hexes(keys), "ttl_s": ttl_s},
                     parse=lambda a: int(a["pinned"]))


def engine_name(h: Any) -> str | int:
    """An engine's block name as the wire takes it: bytes in hex, an int (vLLM's 64-bit form) as it is."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h).hex()
    if isinstance(h, int) and not isinstance(h, bool):
        return h
    raise InvalidInput(f"an engine's block hash is bytes or an int, got {type(h).__name__}")


def name_blocks(spec: KVSpec, tokens: Any, namespace: str, engine_hashes: Sequence[Any], first: int,
                parent: Any, with_tokens: bool) -> Call[int]:
    """``POST /v1/blocks/names`` for blocks ``first``.. of ``tokens`` (see ``DataCalls.name_blocks``)."""
    spec, toks = c.check_spec(spec), c.tokens_of(tokens)
    bt, n = spec.block_tokens, len(engine_hashes)
    if first < 0 or not n or (first + n) * bt > len(toks):
        raise InvalidInput(f"{n} engine hashes from block {first} do not fit {len(toks)} tokens "
                           f"of {bt}-token blocks")
    keys = block_hashes(spec, toks[:(first + n) * bt], namespace)[first:]
    body: dict[str, Any] = {"blocks": [{"key": k.hex(), "engine_hash": engine_name(h)}
                                       for k, h in zip(keys, engine_hashes)],
                            "parent": None if parent is None else engine_name(parent)}
    if with_tokens:
        body["tokens"] = toks[first * bt:(first + n) * bt].tolist()
    return json_call("POST", "/v1/blocks/names", body, parse=lambda a: int(a["named"]))


def unpin_blocks(keys: Sequence[BlockHash]) -> Call[int]:
    return json_call("POST", "/v1/blocks/unpin", {"keys": hexes(keys)}, parse=lambda a: int(a["unpinned"]))


def evict_mine(selectors: Mapping[str, Any]) -> Call[dict]:
    return json_call("POST", "/v1/evict", dict(selectors))


def report_connector(engine: str, instance: str, counters: Mapping[str, float]) -> Call[None]:
    return json_call("POST", "/v1/connectors/report", {"engine": engine, "instance": instance,
                                                       "counters": dict(counters)}, parse=lambda a: None)


def info() -> Call[dict]:
    return json_call("GET", "/v1/info")


def health() -> Call[dict]:
    return json_call("GET", "/healthz")


def ready() -> Call[dict]:
    return json_call("GET", "/readyz")


def metrics() -> Call[str]:
    return Call("GET", "/metrics", parse=lambda body: body.decode())


def policy() -> Call[Any]:
    return json_call("GET", "/v1/policy")


def touch(report: Mapping[str, Any]) -> Call[Any]:
    return json_call("POST", "/v1/kv/touch", dict(report))


def decisions(records: Sequence[Mapping[str, Any]]) -> Call[Any]:
    return json_call("POST", "/v1/decisions", {"decisions": list(records)})


def staging_lease(nbytes: int) -> Call[dict]:
    return json_call("POST", "/v1/staging/lease", {"nbytes": nbytes})


def drop_lease(lease: str) -> Call[Any]:
    return json_call("DELETE", f"/v1/staging/lease/{lease}")


def reserve_put(spec: KVSpec, toks: Any, pid: int) -> Call[dict]:
    """Top-tier slots for a put's new blocks (``/v1/kv/reserve``): the KV body without its KV."""
    return kv_call(f"/v1/kv/reserve?pid={pid}", spec, toks, None, with_kv=False)


def commit_put(reservation: str, checksums: list[int]) -> Call[int]:
    return json_call("POST", "/v1/kv/commit", {"reservation": reservation, "checksums": checksums},
                     parse=lambda answer: int(answer["stored_tokens"]))


def pool_slots(spec: KVSpec, pid: int, pool: str, count: int, slot_bytes: int,
               returning: Sequence[int] = ()) -> Call[dict]:
    """Pool slots for this client's pooled puts (``/v1/kv/pool``): the KV body without tokens or KV.
    ``returning``: offsets of idle slots (of another size) given back first."""
    extra = (',"returning":[' + ",".join(str(o) for o in returning) + "]") if returning else ""
    return Call("POST", f"/v1/kv/pool?pid={pid}&pool={pool}&count={count}&slot_bytes={slot_bytes}",
                c.kv_parts(spec, c.tokens_of([]), None, extra=extra), KV_MEDIA)


def put_pooled(spec: KVSpec, toks: Any, pid: int, pool: str, writes: Sequence[tuple[int, int, int]], count: int,
               slot_bytes: int) -> Call[dict]:
    """A put whose new blocks were written into pool slots (``/v1/kv/put-pooled``): one request.
    ``writes``: (depth, slot offset, body checksum) per block written; ``count`` slots to grant back."""
    extra = ',"writes":[' + ",".join(f"[{d},{o},{k}]" for d, o, k in writes) + "]"
    return Call("POST", f"/v1/kv/put-pooled?pid={pid}&pool={pool}&count={count}&slot_bytes={slot_bytes}",
                c.kv_parts(spec, toks, None, extra=extra), KV_MEDIA)


def put_pooled_blocks(pid: int, pool: str, writes: Sequence[tuple[str, int, int]], count: int,
                      slot_bytes: int, returning: Sequence[int] = ()) -> Call[dict]:
    """Frames written into pool slots, stored by key (``/v1/blocks/put-pooled``): one request.
    ``writes``: (key hex, slot offset, body checksum) per frame (none: a grant only, which may
    give back the idle slots at ``returning`` first)."""
    body: dict[str, Any] = {"blocks": [{"key": k, "offset": o, "checksum": c} for k, o, c in writes]}
    if returning:
        body["returning"] = list(returning)
    return json_call("POST", f"/v1/blocks/put-pooled?pid={pid}&pool={pool}&count={count}&slot_bytes={slot_bytes}",
                     body)


def release_pool(pid: int, pool: str) -> Call[Any]:
    return json_call("DELETE", f"/v1/kv/pool?pid={pid}&pool={pool}")


def abort_put(reservation: str) -> Call[Any]:
    return json_call("DELETE", f"/v1/kv/reserve/{reservation}")


# -- the admin surface's calls ----------------------------------------------------------------


def evict(selectors: dict[str, Any], dry_run: bool) -> Call[dict]:
    if "keys" in selectors:
        selectors["keys"] = [key_hex(k) for k in selectors["keys"]]
    if isinstance(selectors.get("prefix"), dict) and isinstance(selectors["prefix"].get("spec"), KVSpec):
        p = dict(selectors["prefix"])
        p["spec"] = p["spec"].to_dict()
        p["tokens"] = [int(t) for t in c.tokens_of(p["tokens"])]
        selectors["prefix"] = p
    return json_call("POST", "/admin/evict", {**selectors, "dry_run": dry_run})


def pin_body(keys: Any, spec: KVSpec | None, tokens: Any, namespace: str, ttl_s: float | None) -> dict:
    """The body of ``/admin/pin``: keys, or a spec and tokens (in ``namespace``)."""
    body: dict[str, Any] = {}
    if keys is not None:
        body["keys"] = [key_hex(k) for k in keys]
    else:
        body.update(spec=c.check_spec(spec).to_dict(), tokens=[int(t) for t in c.tokens_of(tokens)],
                    namespace=namespace)
    if ttl_s is not None:
        body["ttl_s"] = ttl_s
    return body


def entries(sort: str, order: str, limit: int, offset: int, **filters: Any) -> Call[dict]:
    return json_call("GET", "/admin/entries", params=c.entries_params(sort, order, limit, offset, **filters))


def put_layout(keys: Sequence[BlockHash], sizes: Sequence[int]) -> tuple[list[BlockHash], list[int]]:
    """The keys checked, and each frame's offset in one staging range (64-byte aligned)."""
    keys = [check_key(k) for k in keys]
    if len(sizes) != len(keys):
        raise InvalidInput(f"sizes: {len(sizes)} for {len(keys)} keys")
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + pad64(int(n)))
    return keys, offsets

"""What the routes do with a request before the store sees it, written once for all of them:
who is calling, what the body says, and what a write costs the caller's quota.

Authentication is one call, ``caller(request)`` (``authenticate`` where a route needs no
namespace, ``admin_caller`` for the admin token), made first thing in every route rather than
through ``Depends``: the hot routes are dispatched without FastAPI's router and dependency
resolver (``server.app``'s ``_Direct``), so a ``Depends`` would not even run there, and every
route reads the same way. A dependency remains only as a guard, ``authenticated`` /
``admin_only``, on routes whose declared query parameters FastAPI validates before the route
body runs (every ``/admin`` router, ``/v1/probe``): there it makes a caller without a valid
token get 401 (403 for a tenant at ``/admin``) rather than a 422 about a parameter. The guards
call the same functions.

Bodies: ``spec_and_tokens`` reads the input of a get, lookup or handles request (a KV body, or
JSON ``{"spec", "tokens"}``); ``streamed_kv_head`` reads a streamed KV body's head and tokens
(a block-major put's, whose KV goes on to its slots); ``parse_key`` and ``parse_keys`` turn hex
keys into block keys, naming the field when one is bad.

Token counts: no request carries more than ``max_tokens_per_request`` token ids
(``KVSTORE_MAX_TOKENS_PER_REQUEST``; 413 ``TooManyTokens``, field ``tokens``). A KV body says how
many in its head (``head_tokens``), checked before the ids are looked at; a JSON body is refused
before it is read when its declared length already must hold more, and before it is parsed when
its length or its count of commas (one between every two ids) does: Python's ints cost ~40 bytes
an id while they are checked, so a list is counted before it becomes objects where it can be.

Quotas: ``charge_blocks`` checks a put of KV against the tenant's quota before the blocks are
encoded; ``put_frames`` checks and stores frames that come encoded (the block routes, Arrow
Flight).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from fastapi import Request

from kvstore import codec as codec_mod
from kvstore.errors import FrameError, InvalidInput, InvalidSpec, MalformedRequest, RouteNotFound
from kvstore.keys import BlockHash, from_hex
from kvstore.spec import KVSpec
from kvstore.wire.rest import (H_AGENT, H_NAMESPACE, KV_MEDIA, KV_PREFIX_BYTES, MAX_HEADER_BYTES,
                               KVHeader, kv_tokens_at, parse_kv_head)
from server.auth import Authenticator, Principal
from server.errors import field_error
from server.inflight import BodyStream
from server.service import Service, json_body, parse_spec, parse_tokens, require, too_many_tokens

__all__ = [
    "svc_of", "authenticate", "caller", "namespace_of", "admin_caller", "check_namespace", "authenticated", "admin_only",
    "colocated_only", "agent_of", "agent_name", "is_kv_body", "media_of", "spec_and_tokens", "head_tokens", "streamed_kv_head",
    "JSON_BYTES_PER_TOKEN",
    "parse_key", "parse_keys",
    "BLOCK_OVERHEAD_BYTES", "charge_blocks", "put_frames",
]


def svc_of(request: Request) -> Service:
    """The app's ``Service`` (``app.state.svc``)."""
    return request.app.state.svc


# -- who is calling ---------------------------------------------------------------------------


def authenticate(request: Request, *, colocated: bool = False) -> tuple[Service, Principal]:
    """The service and the caller behind the request's bearer token.

    Args:
        colocated: refuse (404) unless this server offers the co-located (shm) path; checked
            after the token, so a stranger learns nothing about the server.

    Raises:
        Unauthorized: (401) auth is on and the token is missing, malformed or unknown.
        RouteNotFound: (404) ``colocated`` and the path is off.
    """
    svc = svc_of(request)
    p = svc.auth.authenticate(request.headers.get("authorization"))
    if colocated:
        colocated_only(svc)
    return svc, p


def caller(request: Request, *, colocated: bool = False) -> tuple[Service, Principal, str]:
    """``authenticate``, and the namespace the request works in (``X-KV-Namespace``, ``default``
    when absent), which the caller's token must grant.

    Raises:
        Unauthorized, RouteNotFound: as ``authenticate``.
        Forbidden: (403) another tenant's namespace. InvalidSpec: (422) not a namespace name.
    """
    svc, p = authenticate(request, colocated=colocated)
    return svc, p, namespace_of(request, p)


def namespace_of(request: Request, p: Principal) -> str:
    """The request's namespace (``X-KV-Namespace``, ``default`` when absent) if ``p`` may use it;
    for a route that checks something else between the token and the namespace.

    Raises:
        Forbidden, InvalidSpec: as ``check_namespace``.
    """
    return check_namespace(p, request.headers.get(H_NAMESPACE, "default"))


def admin_caller(request: Request) -> tuple[Service, Principal]:
    """``authenticate``, for the admin token only.

    Raises:
        Unauthorized: (401) as ``authenticate``. Forbidden: (403) a tenant's token.
    """
    svc, p = authenticate(request)
    return svc, Authenticator.require_admin(p)


def check_namespace(p: Principal, namespace: str) -> str:
    """``namespace`` if ``p`` may use it (the REST header's rule; Arrow Flight's too).

    Raises:
        Forbidden: another tenant's namespace. InvalidSpec: not a namespace name (field ``X-KV-Namespace``).
    """
    try:
        return p.check_namespace(namespace)
    except InvalidSpec as exc:
        raise field_error(exc, H_NAMESPACE) from exc


async def authenticated(request: Request) -> None:
    """``authenticate`` as a guard (``dependencies=[Depends(authenticated)]``), for a route whose
    query parameters FastAPI validates before the route runs: 401 comes before their 422."""
    authenticate(request)


async def admin_only(request: Request) -> None:
    """``admin_caller`` as the guard of every ``/admin`` router: 401, then 403 for a tenant,
    before FastAPI looks at a route's parameters."""
    admin_caller(request)


def colocated_only(svc: Service) -> None:
    """Raise a 404 where the co-located path is off (no shm tier, or ``colocated=false``)."""
    if svc.staging is None or svc.shm is None:
        raise RouteNotFound("the co-located path is off here (no shm tier, or colocated=false)", status=404)


def agent_of(request: Request) -> str | None:
    """The caller's agent id (``x-kv-agent``), or None: absent, or not a short printable name
    (a hint for learning hand-offs; a bad one is ignored, not refused)."""
    return agent_name(request.headers.get(H_AGENT))


def agent_name(agent: str | None) -> str | None:
    """``agent`` when it is an agent id (a short printable name), else None (``agent_of``'s rule)."""
    if agent is None or not 0 < len(agent) <= 128 or not agent.isprintable():
        return None
    return agent


# -- what the body says -----------------------------------------------------------------------


def is_kv_body(request: Request) -> bool:
    """Whether the body is a KV body (``kvstore.wire.rest``) rather than JSON."""
    return media_of(request) == KV_MEDIA


def media_of(request: Request) -> str:
    """The body's media type (``content-type`` without its parameters)."""
    return request.headers.get("content-type", "").split(";")[0].strip()


JSON_BYTES_PER_TOKEN = 24
"""The most bytes a token id takes in a JSON list, pretty-printed even: ten digits, a comma, a line
break and a dozen spaces of indent. A longer body must hold more ids than the cap allows."""
_BODY_SLACK = MAX_HEADER_BYTES + 128
"""Bytes of a body besides its token ids: a KV body's head (at most 1 MiB, padded), or a JSON
object's spec and route fields."""
_COMMA_SLACK = 4096
"""Commas a JSON body may have outside its token list (the spec's, the route's fields, commas
inside strings): a count past the cap plus these is more ids than the cap, whatever the rest."""


def _declared_fits(request: Request, cap: int, bytes_per_token: int) -> None:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap * bytes_per_token + _BODY_SLACK:
        raise too_many_tokens(f"a body of {declared} bytes", cap)


def head_tokens(svc: Service, raw: Any, head: KVHeader) -> np.ndarray:
    """The token ids of a KV body (a view of ``raw``), once its head's count is within the cap.

    Raises:
        TooManyTokens: (413, ``tokens``) over ``max_tokens_per_request``.
    """
    _head_fits(svc, head)
    return np.frombuffer(raw, "<u4", head.n_tokens, head.tokens_at)


def _head_fits(svc: Service, head: KVHeader) -> None:
    cap = svc.settings.max_tokens_per_request
    if head.n_tokens > cap:
        raise too_many_tokens(f"{head.n_tokens} token ids", cap)


async def streamed_kv_head(svc: Service, body: BodyStream) -> tuple[KVHeader, np.ndarray]:
    """The head and token ids at the start of a KV body read part by part (``KV_BLOCKS_MEDIA``):
    ``body`` is left at the KV, and ``body.expected`` set to the length the head describes. The
    token count is checked before its ids are read.

    Raises:
        MalformedRequest: (400) the head cannot be parsed, or the body ends inside it.
        TooManyTokens: (413, ``tokens``) more ids than ``max_tokens_per_request``.
    """
    prefix = await body.read(KV_PREFIX_BYTES)
    start = prefix + await body.read(kv_tokens_at(prefix) - KV_PREFIX_BYTES)
    head = parse_kv_head(start)
    body.expected = head.total
    _head_fits(svc, head)
    raw = start + await body.read(head.kv_at - head.tokens_at)
    return head, np.frombuffer(raw, "<u4", head.n_tokens, head.tokens_at)


async def spec_and_tokens(request: Request) -> tuple[KVSpec, np.ndarray]:
    """Spec and tokens of a get/lookup/handles request: a KV body without KV bytes, or JSON
    ``{"spec", "tokens"}``. The body stays cached on the request for the route's own fields.

    Raises:
        MalformedRequest: a KV body whose length is not what its header says, or that carries KV.
        TooManyTokens: (413, ``tokens``) more ids than ``max_tokens_per_request``: from the body's
            declared length before it is read, from its length and commas before it is parsed.
        InvalidSpec, InvalidTokens, InvalidInput: (422) naming the field.
    """
    svc = svc_of(request)
    cap = svc.settings.max_tokens_per_request
    if is_kv_body(request):
        _declared_fits(request, cap, 4)
        raw = await request.body()
        head = parse_kv_head(raw)
        if head.kv_tokens or len(raw) != head.total:
            raise MalformedRequest(f"body: {len(raw)} bytes, the header describes {head.total} "
                                   "(kv_tokens must be 0 here)", field="body")
        tokens = head_tokens(svc, raw, head)
        return parse_spec(head.spec), tokens
    _declared_fits(request, cap, JSON_BYTES_PER_TOKEN)
    raw = await request.body()
    if len(raw) > cap * JSON_BYTES_PER_TOKEN + _BODY_SLACK or raw.count(b",") > cap + _COMMA_SLACK:
        raise too_many_tokens(f"a JSON body of {len(raw)} bytes and {raw.count(b',')} commas", cap)
    data = await json_body(request)
    return parse_spec(require(data, "spec", dict)), parse_tokens(require(data, "tokens", list), limit=cap)


def parse_key(hex_key: Any, field: str = "key") -> BlockHash:
    """A block key from its hex form.

    Raises:
        InvalidInput: (422, ``field``) not the hex of a block key.
    """
    try:
        return from_hex(hex_key)
    except InvalidInput as exc:
        raise field_error(exc, field) from exc


def parse_keys(hex_keys: Sequence[Any], field: str = "keys") -> list[BlockHash]:
    """``parse_key`` of each; a bad one names ``field``. The caller bounds how many."""
    return [parse_key(k, field) for k in hex_keys]


# -- what a write costs -----------------------------------------------------------------------


BLOCK_OVERHEAD_BYTES = 4096
"""Bytes charged to a tenant's quota per new block on top of its raw KV bytes, when a put is
checked before its blocks are encoded (so before their frame sizes are known): a generous bound
on what a frame adds to the KV (its header, the kvstore metadata, each region's padding to 64
bytes: a few hundred bytes in all), so the frames' overhead cannot take a tenant over its quota.
Frames that come encoded (``put_frames``) are charged their own size instead."""


def charge_blocks(svc: Service, p: Principal, ns: str, spec: KVSpec, tokens: Any) -> None:
    """Check a put of ``tokens``' KV against ``p``'s quota: only the blocks not stored yet count,
    each as its KV bytes plus ``BLOCK_OVERHEAD_BYTES``. Reads the index: run it off the loop.

    Raises:
        QuotaExceeded: (507) the new blocks would take the tenant over its quota.
    """
    if p.quota_bytes is None:
        return
    have = svc.store.lookup(spec, tokens, ns) // spec.block_tokens
    new_blocks = spec.full_blocks(len(tokens)) - have
    svc.quotas.check(p, ns, new_blocks * (spec.block_nbytes + BLOCK_OVERHEAD_BYTES))


def _held(svc: Service, ns: str, key: BlockHash, frame: Any) -> bool:
    """Whether the store keeps what it holds for ``key`` over ``frame`` (the same frame, or another
    namespace's: ``FrameStore.put`` leaves both): not stored, so not charged. A writer that skips
    only what the arena shows copies again what a lower tier holds."""
    old = svc.store.entry(key)
    if old is None:
        return False
    try:
        return old.namespace != ns or old.checksum == codec_mod.read_header(frame, prefix=True).body_checksum
    except FrameError:
        return False  # the put refuses it, and says why


def put_frames(svc: Service, p: Principal, ns: str, frames: Sequence[tuple[BlockHash, Any]], *,
               make_room: bool = False) -> int:
    """Store encoded frames by key, their bytes checked against ``p``'s quota first (the block
    routes' puts and Arrow Flight's ``do_put``). Blocking: run it off the loop.

    Args:
        make_room: place them as ``put_kv`` places blocks (colder entries are demoted or evicted)
            instead of falling through full tiers.

    Returns:
        How many frames were stored.

    Raises:
        QuotaExceeded: (507) over the tenant's quota; nothing stored.
        FrameError, InvalidInput: a frame that does not verify or names another namespace.
        TierFull, TierError: no tier took one (the frames before it are stored).
    """
    if p.quota_bytes is not None:
        svc.quotas.check(p, ns, sum(len(memoryview(f).cast("B")) for key, f in frames if not _held(svc, ns, key, f)))
    for key, frame in frames:
        svc.store.frames.put(key, frame, ns, make_room=make_room)
    return len(frames)

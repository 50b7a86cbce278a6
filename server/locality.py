"""Locality routes: prefetch, conversation retention and hand-off (``KVStore.prefetch``,
``retain``, ``release``, ``handoff``).

Each takes the input of ``/v1/lookup`` (a KV body, or JSON ``{"spec", "tokens"}``) plus its own
fields: in the JSON object, or as query parameters beside a KV body. Every route works in the
request's namespace (``X-KV-Namespace``), which the caller's token must grant: another tenant's
namespace is 403 before anything is looked at or retained.

Retention is paid for by the caller's tenant (``Principal.name``): its retained bytes are bounded
by the token's ``retain_quota_bytes``, else ``KVSTORE_RETAIN_QUOTA_BYTES``, else a quarter of the
top tier; past it the answer is 507 ``RetainQuotaExceeded`` naming the quota. Unlike an eviction,
a retention is not written to the audit log: like a tenant's block pins it is a routine,
self-expiring data call, and ``explain`` and ``/admin/entries`` show it while it lasts.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvstore.errors import InvalidInput
from server.auth import Principal
from server.errors import field_error
from server.requests import caller, is_kv_body, spec_and_tokens
from server.service import Service, json_body, require

__all__ = ["router", "retain_quota"]

router = APIRouter()


def retain_quota(svc: Service, p: Principal) -> int:
    """Bytes ``p``'s tenant may keep retained: its token's own quota, else the server's, else
    (0) a quarter of the top tier, so retained conversations never crowd everyone else out."""
    if p.retain_quota_bytes is not None:
        return p.retain_quota_bytes
    return svc.settings.retain_quota_bytes or svc.store.tiers[0].capacity_bytes // 4


async def _fields(request: Request) -> dict[str, Any]:
    """The route's own fields: the JSON body, or the query of a KV body (numbers parsed)."""
    if not is_kv_body(request):
        return await json_body(request)  # the body is cached: spec_and_tokens read it already
    out: dict[str, Any] = {}
    for name, value in request.query_params.items():
        if name == "to":
            out[name] = value
            continue
        try:
            out[name] = int(value) if name == "priority" else float(value)
        except ValueError:
            raise field_error(InvalidInput(f"must be a number, got {value!r}"), name) from None
    return out


def _ttl(svc: Service, value: Any) -> float:
    """A retention's ``ttl_s``, checked against ``retain_max_ttl_s``.

    Raises:
        InvalidInput: (422, field ``ttl_s``) not a number, not finite, not above 0, or past the bound.
    """
    most = svc.settings.retain_max_ttl_s
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise field_error(InvalidInput(f"must be a number of seconds in (0, {most:g}], got {value!r}"), "ttl_s")
    if value > most:
        raise field_error(InvalidInput(f"{value:g} s is over the server's longest retention, {most:g} s "
                                       "(KVSTORE_RETAIN_MAX_TTL_S)"), "ttl_s")
    return float(value)


def _priority(data: dict[str, Any]) -> int:
    priority = require(data, "priority", int, default=0)
    if not 0 <= priority <= 9:
        raise field_error(InvalidInput(f"must be an int in 0..9, got {priority}"), "priority")
    return priority


@router.post("/v1/kv/prefetch")
async def kv_prefetch(request: Request) -> JSONResponse:
    """Bring the longest stored prefix to the top tier in the background (blocks only the shared
    tier holds are adopted into this node's arena first); answers at once with the tokens it will
    bring: ``{"tokens", "block_tokens"}``."""
    svc, _, ns = caller(request)
    spec, tokens = await spec_and_tokens(request)
    n = await svc.run(svc.store.prefetch, spec, tokens, ns)
    return JSONResponse({"tokens": n, "block_tokens": spec.block_tokens})


@router.post("/v1/kv/retain")
async def kv_retain(request: Request) -> JSONResponse:
    """Keep the stored prefix in the top tier for ``ttl_s`` seconds at ``priority`` (0-9): a soft
    pin, charged to the caller's tenant. Answers ``KVStore.retain``'s dict."""
    svc, p, ns = caller(request)
    spec, tokens = await spec_and_tokens(request)
    data = await _fields(request)
    ttl = _ttl(svc, require(data, "ttl_s", (int, float)))
    priority = _priority(data)
    answer = await svc.run(svc.store.retain, spec, tokens, ns, ttl_s=ttl, priority=priority, owner=p.name,
                           quota_bytes=retain_quota(svc, p))
    return JSONResponse(answer)


@router.post("/v1/kv/release")
async def kv_release(request: Request) -> JSONResponse:
    """End the caller's tenant's retention of the stored prefix: ``{"blocks": n}`` released."""
    svc, p, ns = caller(request)
    spec, tokens = await spec_and_tokens(request)
    return JSONResponse({"blocks": await svc.run(svc.store.release, spec, tokens, ns, owner=p.name)})


@router.post("/v1/kv/handoff")
async def kv_handoff(request: Request) -> JSONResponse:
    """Place the stored prefix where its next reader reads it: ``to`` ``"here"`` (default) holds it
    in this node's top tier for ``ttl_s`` (default ``KVSTORE_HANDOFF_TTL_S``), a retention of the
    caller's tenant; a node's name or ``"shared"`` writes it through to the shared tier now (422
    where there is none). Answers ``{"tokens", "blocks", "held", "shared", "to"}``."""
    svc, p, ns = caller(request)
    spec, tokens = await spec_and_tokens(request)
    data = await _fields(request)
    to = require(data, "to", str, default="here")
    ttl = require(data, "ttl_s", (int, float), default=None)
    ttl = svc.settings.handoff_ttl_s if ttl is None else _ttl(svc, ttl)
    try:
        answer = await svc.run(svc.store.handoff, spec, tokens, ns, to=to, ttl_s=ttl, owner=p.name,
                               quota_bytes=retain_quota(svc, p))
    except InvalidInput as exc:  # a bad ``to``, or another node with no shared tier between them
        raise field_error(exc, "to") from exc
    return JSONResponse(answer)

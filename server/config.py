"""Service settings: what ``kvstore serve`` adds to the engine's ``Settings``.

Each field has an env form ``KVSTORE_<FIELD>``; ``kvstore serve`` flags override
them. Engine fields (tiers, sizes, data dir, Redis URL, codec) stay in
``kvstore.config.Settings``.

Tokens come from ``KVSTORE_TOKENS_FILE`` (a JSON file) and/or ``KVSTORE_TOKENS``
(the same JSON inline)::

    {"<token>": {"tenant": "acme", "namespaces": ["acme", "shared"], "quota_bytes": "10GiB",
                 "retain_quota_bytes": "1GiB"}}

``quota_bytes`` and ``retain_quota_bytes`` are optional. The admin token (``KVSTORE_ADMIN_TOKEN``) is separate.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvstore.codec import Codec
from kvstore.config import parse_size
from server.inflight import default_inflight_bytes
from kvstore.errors import InvalidInput
from kvstore.keys import validate_namespace

__all__ = ["ServerSettings", "TenantGrant", "load_tokens", "parse_tier_codecs", "is_loopback", "DEFAULT_PORT"]

DEFAULT_PORT = 8470
_MIN_TOKEN_CHARS = 8


@dataclass(frozen=True, slots=True)
class TenantGrant:
    """What one bearer token may do."""

    tenant: str
    namespaces: frozenset[str]
    """Namespaces the tenant may read and write; another tenant's are invisible to it."""
    quota_bytes: int | None = None
    """Frame bytes the tenant's namespaces may hold in all; a put over it gets 507."""
    retain_quota_bytes: int | None = None
    """Frame bytes the tenant may keep retained; None: ``KVSTORE_RETAIN_QUOTA_BYTES``."""


def load_tokens(data: Any, source: str) -> dict[str, TenantGrant]:
    """Validate a tokens mapping (parsed JSON).

    Raises:
        InvalidInput: naming the source, the token's tenant and the bad field.
    """
    if not isinstance(data, Mapping):
        raise InvalidInput(f"{source}: tokens must be a JSON object of token -> grant")
    grants: dict[str, TenantGrant] = {}
    for token, grant in data.items():
        if not isinstance(token, str) or len(token) < _MIN_TOKEN_CHARS or any(c.isspace() for c in token):
            raise InvalidInput(f"{source}: a token must be a string of at least {_MIN_TOKEN_CHARS} "
                               "characters without spaces")
        if not isinstance(grant, Mapping):
            raise InvalidInput(f"{source}: the grant of a token must be an object")
        unknown = sorted(set(grant) - {"tenant", "namespaces", "quota_bytes", "retain_quota_bytes"})
        if unknown:
            raise InvalidInput(f"{source}: unknown grant field(s) {unknown}")
        tenant = grant.get("tenant")
        if not isinstance(tenant, str) or not tenant:
            raise InvalidInput(f"{source}: grant.tenant must be a non-empty string")
        namespaces = grant.get("namespaces")
        if not isinstance(namespaces, list) or not namespaces:
            raise InvalidInput(f"{source}: tenant {tenant!r}: grant.namespaces must be a non-empty list")
        try:
            ns = frozenset(validate_namespace(n) for n in namespaces)
            quota = grant.get("quota_bytes")
            quota = None if quota is None else parse_size(quota)
            retain = grant.get("retain_quota_bytes")
            retain = None if retain is None else parse_size(retain)
        except InvalidInput as exc:
            raise InvalidInput(f"{source}: tenant {tenant!r}: {exc}") from exc
        grants[token] = TenantGrant(tenant, ns, quota, retain)
    return grants


def parse_tier_codecs(text: str | None) -> dict[str, str]:
    """``"redis=raw,nvme=int8"`` -> ``{"redis": "raw", "nvme": "int8"}``.

    Raises:
        InvalidInput: a malformed pair or an unknown codec.
    """
    out: dict[str, str] = {}
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        name, sep, codec = pair.partition("=")
        if not sep or not name.strip():
            raise InvalidInput(f"tier codecs are tier=codec pairs, got {pair!r}")
        out[name.strip()] = Codec.parse(codec.strip()).value
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Settings of the HTTP service. ``from_env()`` reads ``KVSTORE_<FIELD>``."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    admin_token: str | None = None
    tokens_file: str | None = None
    tokens: str | None = None
    """Inline tokens JSON (KVSTORE_TOKENS), merged over the file's."""
    max_body_bytes: int = 1 << 30
    """Largest request body, bytes; more gets 413. 1 GiB holds a 3,200-token put of a
    70B-class model (80 layers, 8 KV heads, head dim 128, fp16: 320 KiB a token)."""
    max_inflight_bytes: int = 0
    """Most memory all request bodies in flight hold together (KVSTORE_MAX_INFLIGHT_BYTES); a body
    part past it waits ``inflight_wait_s`` for room, then gets 503 with Retry-After. A quarter
    is kept for bodies of at most a sixteenth of it, so large uploads cannot starve ordinary
    calls. 0: a quarter of the machine's memory, between 1 and 16 GiB (``server.inflight``)."""
    inflight_wait_s: float = 2.0
    """How long a body part waits for room under ``max_inflight_bytes`` before 503."""
    max_tokens_per_request: int = 1 << 20
    """Most token ids one request may carry (KVSTORE_MAX_TOKENS_PER_REQUEST); more gets 413
    ``TooManyTokens`` (field ``tokens``) before they are parsed where the body's size already
    says so. 1,048,576: the longest context windows served today, so no real sequence is cut;
    as JSON a list of that many is at most ~12.6 MB, which Python turns into ~55 MB of ints
    while it checks them (a 20M-token list grew the server by 1 GB before this cap)."""
    colocated: bool = True
    """Offer shm handles to clients on this host (they must be able to open the arena)."""
    commit_channel: bool = True
    """Serve co-located clients' pooled puts over a Unix socket as well as HTTP
    (``server.commit_channel``; KVSTORE_COMMIT_CHANNEL): the same request without HTTP's cost.
    0: they commit over HTTP."""
    reserved_puts: bool = True
    """Let co-located clients write a put's frames straight into top-tier slots and commit their
    checksums (``kvstore.engine.reserved``; KVSTORE_RESERVED_PUTS). The server checks each frame's header
    at commit and its body at the first read. 0: co-located puts go through staging."""
    staging_bytes: int = 256 << 20
    """Shared-memory staging area that co-located puts write into, bytes."""
    tier_codecs: str = ""
    """Per-tier codec overrides, ``redis=raw,nvme=int8`` (KVSTORE_TIER_CODECS)."""
    audit_log: str | None = None
    """JSON-lines file of admin actions; default ``<data_dir>/audit.jsonl``."""
    torch_threads: int = 1
    """torch intra-op threads in ``kvstore serve``: KV copies are memory-bound, requests run in
    parallel already, and torch's thread team stalled 1 MiB puts from 1.2 ms to 15 ms here
    (two cores, a busy neighbour). 0 leaves torch's default."""
    graceful_timeout_s: float = 30.0
    """How long shutdown waits for in-flight requests."""
    body_timeout_s: float = 30.0
    """Longest wait for the next part of a request body (KVSTORE_BODY_TIMEOUT_S); a body of
    declared length must also average ``body_min_rate`` past it. A client that stalls or trickles
    longer (a slow-loris upload) gets 408 and its connection closed. 0: no limit."""
    body_min_rate: int = 1 << 20
    """Bytes a second a body of declared length must average after ``body_timeout_s``
    (KVSTORE_BODY_MIN_RATE; default 1 MiB: a 1 GiB body may take 30 s + 17 min)."""
    gc_freeze_after_s: float = 0.2
    """``kvstore serve`` freezes its long-lived objects out of Python's collector at start and
    after a full collection that took longer than this (KVSTORE_GC_FREEZE_AFTER_S;
    ``server.collector``): at a million blocks one took 1.18 s with every thread waiting. 0: off."""
    history_interval_s: float = 5.0
    """Seconds between samples of the read counters for ``/admin/history`` (the dashboard's
    hit ratio over time); 720 samples are kept, an hour at the default."""
    log_level: str = "info"
    flight_port: int | None = None
    """Port of the Arrow Flight bulk path beside the REST app (``server.flight``): None runs
    none, 0 takes a free port at start (``/v1/info`` shows it as ``media.flight.port``)."""
    lmcache_port: int | None = None
    """Port of the ``lm://`` listener for LMCache's remote connector (``server.lmcache_listener``),
    on ``host``: None runs none, 0 takes a free one (``/admin/stats`` shows it)."""
    lmcache_host: str | None = None
    """Where the ``lm://`` listener binds; default loopback, whatever REST binds: LMCache's
    protocol has no authentication, so set this only where only LMCache workers reach it."""
    lmcache_namespace: str = "lmcache"
    """The namespace LMCache's chunks are stored in."""
    max_event_subscribers: int = 1024
    """Open ``GET /v1/events`` streams the server takes (KVSTORE_MAX_EVENT_SUBSCRIBERS); one more
    gets 503. Each costs a cursor into the one event ring, not a queue of its own."""
    event_queue: int = 65_536
    """Events kept for subscribers (KVSTORE_EVENT_QUEUE): how far one may fall behind, or how old
    a ``Last-Event-ID`` may be, before it gets a "lost events, resync" marker."""
    kv_events_endpoint: str | None = None
    """Where to publish KV events in vLLM's wire format (msgpack over a ZMQ PUB socket), e.g.
    ``tcp://*:5557`` (KVSTORE_KV_EVENTS_ENDPOINT): KV-aware routers subscribe unchanged. None: off."""
    kv_events_topic: str = ""
    """The topic of every ZMQ message (vLLM's ``topic``; empty by default, as vLLM's)."""
    kv_events_replay_endpoint: str | None = None
    """A ZMQ ROUTER address where subscribers ask for missed batches by sequence number, as vLLM's
    publisher offers (KVSTORE_KV_EVENTS_REPLAY_ENDPOINT). None: no replay."""
    retain_quota_bytes: int = 0
    """Frame bytes one tenant may keep retained (``retain``, ``handoff``) at once
    (KVSTORE_RETAIN_QUOTA_BYTES); a token's ``retain_quota_bytes`` overrides it. 0: a quarter of
    the top tier's capacity."""
    retain_max_ttl_s: float = 3600.0
    """Longest retention a call may ask for (KVSTORE_RETAIN_MAX_TTL_S); longer gets 422."""
    handoff_ttl_s: float = 120.0
    """How long ``handoff(to="here")`` keeps a hand-off's blocks retained for its consumer
    (KVSTORE_HANDOFF_TTL_S)."""
    grants: dict[str, TenantGrant] = field(default_factory=dict, compare=False)
    """Parsed tokens (filled from ``tokens_file`` and ``tokens``)."""

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InvalidInput(f"port must be an int in [0, 65535], got {self.port!r}")
        fp = self.flight_port
        if fp is not None and (isinstance(fp, bool) or not isinstance(fp, int) or not 0 <= fp <= 65535):
            raise InvalidInput(f"flight_port must be None or an int in [0, 65535], got {fp!r}")
        if fp and fp == self.port:
            raise InvalidInput(f"flight_port must differ from port ({self.port}): Flight listens beside REST")
        lp = self.lmcache_port
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 65535):
            raise InvalidInput(f"lmcache_port must be None or an int in [0, 65535], got {lp!r}")
        if lp and lp in (self.port, fp):
            raise InvalidInput(f"lmcache_port must differ from port and flight_port, got {lp}")
        try:
            validate_namespace(self.lmcache_namespace)
        except InvalidInput as exc:
            raise InvalidInput(f"lmcache_namespace: {exc}") from None
        bt = self.body_timeout_s
        if isinstance(bt, bool) or not isinstance(bt, (int, float)) or not 0 <= bt < float("inf"):  # NaN too
            raise InvalidInput(f"body_timeout_s must be a number of seconds >= 0, got {bt!r}")
        gf = self.gc_freeze_after_s
        if isinstance(gf, bool) or not isinstance(gf, (int, float)) or not 0 <= gf < float("inf"):
            raise InvalidInput(f"gc_freeze_after_s must be a number of seconds >= 0, got {gf!r}")
        hi = self.history_interval_s
        if isinstance(hi, bool) or not isinstance(hi, (int, float)) or not 0 < hi < float("inf"):
            raise InvalidInput(f"history_interval_s must be a number of seconds > 0, got {hi!r}")
        object.__setattr__(self, "max_body_bytes", parse_size(self.max_body_bytes))
        object.__setattr__(self, "body_min_rate", _size("body_min_rate", self.body_min_rate))
        cap = self.max_inflight_bytes
        cap = default_inflight_bytes() if cap in (0, "0") else _size("max_inflight_bytes", cap)
        if cap < 1 << 20:
            raise InvalidInput(f"max_inflight_bytes must be 0 (the default) or at least 1 MiB, got {cap}")
        object.__setattr__(self, "max_inflight_bytes", cap)
        for name in ("max_event_subscribers", "event_queue"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (16 if name == "event_queue" else 0):
                raise InvalidInput(f"{name} must be an int >= {16 if name == 'event_queue' else 0}, got {v!r}")
        rq = self.retain_quota_bytes
        object.__setattr__(self, "retain_quota_bytes", 0 if rq in (0, "0") else _size("retain_quota_bytes", rq))
        for name in ("retain_max_ttl_s", "handoff_ttl_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
                raise InvalidInput(f"{name} must be a number of seconds in (0, 86400], got {v!r}")
        if self.handoff_ttl_s > self.retain_max_ttl_s:  # a hand-off's hold is a retention like any
            raise InvalidInput(f"handoff_ttl_s ({self.handoff_ttl_s:g}) must be at most retain_max_ttl_s "
                               f"({self.retain_max_ttl_s:g})")
        mt = self.max_tokens_per_request
        if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= 1 << 32:
            raise InvalidInput(f"max_tokens_per_request must be an int in [1, 2**32], got {mt!r}")
        wait = self.inflight_wait_s
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < float("inf"):
            raise InvalidInput(f"inflight_wait_s must be a number of seconds >= 0, got {wait!r}")
        object.__setattr__(self, "staging_bytes", parse_size(self.staging_bytes))
        if self.admin_token is not None and len(self.admin_token) < _MIN_TOKEN_CHARS:
            raise InvalidInput(f"admin_token must be at least {_MIN_TOKEN_CHARS} characters")
        parse_tier_codecs(self.tier_codecs)
        grants = dict(self.grants)
        if self.tokens_file:
            try:
                with open(self.tokens_file, encoding="utf-8") as f:
                    data = json.load(f)
            except OSError as exc:
                raise InvalidInput(f"tokens file {self.tokens_file!r} cannot be read: {exc}") from exc
            except ValueError as exc:
                raise InvalidInput(f"tokens file {self.tokens_file!r} is not JSON: {exc}") from exc
            grants.update(load_tokens(data, f"tokens file {self.tokens_file!r}"))
        if self.tokens:
            try:
                data = json.loads(self.tokens)
            except ValueError as exc:
                raise InvalidInput(f"KVSTORE_TOKENS is not JSON: {exc}") from exc
            grants.update(load_tokens(data, "KVSTORE_TOKENS"))
        if self.admin_token is not None and self.admin_token in grants:
            raise InvalidInput("the admin token must differ from every tenant token")
        object.__setattr__(self, "grants", grants)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.grants) or self.admin_token is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "ServerSettings":
        """Settings from ``KVSTORE_*``; ``overrides`` (not None) win, as flags do.

        Raises:
            InvalidInput: naming the variable that holds a bad value.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "grants":
                continue
            raw = env.get(f"KVSTORE_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = _parse(f.name, raw)
            except (InvalidInput, ValueError) as exc:
                raise InvalidInput(f"KVSTORE_{f.name.upper()}: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _size(name: str, value: Any) -> int:
    try:
        return parse_size(value)
    except InvalidInput as exc:
        raise InvalidInput(f"{name}: {exc}") from None


def _parse(name: str, raw: str) -> Any:
    if name in ("port", "flight_port", "lmcache_port"):
        if not raw.strip().isdigit():
            raise InvalidInput(f"a port number, got {raw!r}")
        return int(raw)
    if name in ("colocated", "reserved_puts", "commit_channel"):
        if raw.strip().lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise InvalidInput(f"1/0, true/false or yes/no, got {raw!r}")
        return raw.strip().lower() in ("1", "true", "yes")
    if name in ("graceful_timeout_s", "body_timeout_s", "history_interval_s", "inflight_wait_s",
                "retain_max_ttl_s", "handoff_ttl_s", "gc_freeze_after_s"):
        return float(raw)
    if name in ("max_event_subscribers", "event_queue", "max_tokens_per_request"):
        if not raw.strip().isdigit():
            raise InvalidInput(f"a count, got {raw!r}")
        return int(raw)
    if name == "torch_threads":
        if not raw.strip().isdigit():
            raise InvalidInput(f"a thread count (0: torch's default), got {raw!r}")
        return int(raw)
    return raw

"""Bearer tokens -> principals, and which namespaces a principal may touch.

Tokens are compared in constant time: each presented token is hashed and the
digest is compared with every known token's digest by ``hmac.compare_digest``,
with no early exit, so neither the match nor its position leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from kvstore.errors import Forbidden, Unauthorized
from kvstore.keys import validate_namespace
from server.config import ServerSettings, TenantGrant

__all__ = ["Principal", "Authenticator", "ANONYMOUS"]


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling."""

    name: str
    """Tenant name, ``admin``, or ``anonymous`` when auth is off."""
    namespaces: frozenset[str] | None
    """Namespaces it may use; None means any (admin, or auth off)."""
    admin: bool = False
    quota_bytes: int | None = None
    retain_quota_bytes: int | None = None
    """The tenant's own retention quota; None: the server's ``retain_quota_bytes``."""

    def check_namespace(self, namespace: str) -> str:
        """``namespace`` if this principal may use it.

        Raises:
            InvalidSpec: not a valid namespace name.
            Forbidden: another tenant's namespace.
        """
        validate_namespace(namespace)
        if self.namespaces is not None and namespace not in self.namespaces:
            raise Forbidden(f"namespace {namespace!r} is not granted to tenant {self.name!r}")
        return namespace


ANONYMOUS = Principal("anonymous", None, admin=True)
"""Auth off (loopback only): everything is allowed."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(b"kvstore-token\x00" + token.encode("utf-8", "surrogatepass")).digest()


class Authenticator:
    """Maps ``Authorization: Bearer <token>`` to a ``Principal``."""

    def __init__(self, settings: ServerSettings) -> None:
        self.enabled = settings.auth_enabled
        self._entries: list[tuple[bytes, Principal]] = []
        for token, grant in settings.grants.items():
            self._entries.append((_digest(token), _principal(grant)))
        if settings.admin_token is not None:
            self._entries.append((_digest(settings.admin_token), Principal("admin", None, admin=True)))

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller behind an Authorization header.

        Raises:
            Unauthorized: auth is on and the header is missing, malformed or unknown.
        """
        if not self.enabled:
            return ANONYMOUS
        if not authorization:
            raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("the Authorization header must be 'Bearer <token>'")
        presented = _digest(token.strip())
        found: Principal | None = None
        for digest, principal in self._entries:  # every entry, always: no early exit
            if hmac.compare_digest(digest, presented):
                found = principal
        if found is None:
            raise Unauthorized("unknown bearer token")
        return found

    @staticmethod
    def require_admin(principal: Principal) -> Principal:
        if not principal.admin:
            raise Forbidden(f"/admin needs the admin token; tenant {principal.name!r} has none")
        return principal


def _principal(grant: TenantGrant) -> Principal:
    return Principal(grant.tenant, grant.namespaces, quota_bytes=grant.quota_bytes,
                     retain_quota_bytes=grant.retain_quota_bytes)

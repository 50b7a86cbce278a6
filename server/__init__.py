"""The HTTP service: ``create_app(store, settings)`` and ``serve(...)`` behind ``kvstore serve``.

Routes: ``/v1`` data (KV and blocks), ``/admin`` operators, ``/healthz``,
``/readyz``, ``/metrics``. Nothing imports ``server``.
"""

from server.app import create_app
from server.config import ServerSettings, TenantGrant
from server.serve import serve

__all__ = ["create_app", "serve", "ServerSettings", "TenantGrant"]

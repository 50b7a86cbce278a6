"""The operators' dashboard: ``GET /admin/ui``, one page and its two assets.

The page is static and holds no data, so it is served without a token; it asks
for the admin token once (kept in the tab's ``sessionStorage``) and reads and
acts through the ``/admin`` JSON routes, which check it on every call. Nothing
loads from elsewhere (many deployments have no internet), and the CSP says so:
scripts, styles and requests go to this origin only, and the page cannot be framed.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from kvstore.errors import RouteNotFound

__all__ = ["router", "STATIC_DIR"]

STATIC_DIR = Path(__file__).parent / "static"

_ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}

_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(prefix="/admin/ui", include_in_schema=False)


def _asset(name: str) -> Response:
    media = _ASSETS.get(name)
    if media is None:
        raise RouteNotFound(f"/admin/ui/{name}: no such file (the page is /admin/ui)", status=404)
    return Response((STATIC_DIR / name).read_bytes(), media_type=media, headers=_HEADERS)


@router.get("")
async def page() -> Response:
    """The dashboard page."""
    return _asset("index.html")


@router.get("/{name}")
async def asset(name: str) -> Response:
    """The page's script and style sheet."""
    return _asset(name)

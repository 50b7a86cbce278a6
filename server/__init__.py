"""The HTTP service (FastAPI app factory, routes, auth, error mapping).

It arrives with the server issue (#5); the package exists so the layout fixed
in DESIGN.md holds from the first commit. Nothing imports ``server``.
"""

__all__: list[str] = []

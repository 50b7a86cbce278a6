"""The ``kvstore`` command: the composition root. ``main`` (``kvstore.cli.main``) is the
command itself (serve, bench); ``kvstore.cli.client`` holds the client commands. Nothing in
the house imports this package (``tests/test_package.py``)."""

from kvstore.cli.main import main

__all__ = ["main"]

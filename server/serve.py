"""``kvstore serve``: build the store from settings and run the app under uvicorn.

uvicorn uses uvloop and httptools when they are installed (``loop``/``http``
"auto"). On SIGTERM or SIGINT it stops accepting, lets in-flight requests
finish (up to ``graceful_timeout_s``), runs the app's shutdown, which closes
the store (durable tiers flushed, the shm arena and staging unlinked), and
re-raises the signal, so the exit status is the conventional one: killed by
SIGTERM, or 130 after SIGINT (its KeyboardInterrupt is caught here, after the
shutdown, so Ctrl-C prints no traceback).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import uvicorn

from kvstore.config import Settings
from kvstore.engine.store import EmbeddedStore
from server.app import create_app
from server.collector import Collector
from server.config import ServerSettings, is_loopback, parse_tier_codecs

__all__ = ["serve", "effective_host"]


def effective_host(settings: ServerSettings, err: TextIO = sys.stderr) -> str:
    """The host to bind: loopback whenever no token is configured, said out loud."""
    if settings.auth_enabled:
        return settings.host
    if not is_loopback(settings.host):
        print(f"kvstore serve: no tokens configured: binding to 127.0.0.1 instead of {settings.host} "
              "(set KVSTORE_TOKENS_FILE or KVSTORE_ADMIN_TOKEN to serve other hosts)", file=err)
        return "127.0.0.1"
    print(f"kvstore serve: no tokens configured: auth is off, serving loopback only ({settings.host})", file=err)
    return settings.host


def serve(settings: ServerSettings, engine: Settings, *, err: TextIO = sys.stderr) -> int:
    """Run until a signal; returns 0 (a re-raised signal ends the process first)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = effective_host(settings, err)
    if settings.torch_threads:  # this process is the server's own: see ServerSettings.torch_threads
        import torch

        torch.set_num_threads(settings.torch_threads)
    store = EmbeddedStore(settings=engine, tier_codecs=parse_tier_codecs(settings.tier_codecs) or None,
                          event_capacity=settings.event_queue)
    try:
        app = create_app(store, settings, close_store=True)
    except BaseException:
        store.close()
        raise
    tiers = ", ".join(f"{t.name}" for t in store.tiers)
    print(f"kvstore serve: http://{host}:{settings.port} tiers: {tiers}; data dir {engine.data_dir}; "
          f"auth {'on' if settings.auth_enabled else 'off'}", file=err, flush=True)
    uninstall = Collector(settings.gc_freeze_after_s).install()  # this process is the server's own
    config = uvicorn.Config(app, host=host, port=settings.port, loop="auto", http="auto", lifespan="on",
                            timeout_graceful_shutdown=settings.graceful_timeout_s, access_log=False,
                            log_level=settings.log_level.lower(), server_header=False)
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raised SIGINT after a clean shutdown
        return 130
    finally:
        uninstall()
        store.close()  # idempotent; the app's shutdown normally did it already
    return 0 if server.started else 1

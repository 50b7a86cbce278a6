"""Live servers for the service tests: uvicorn in a thread here; ``kvstore serve`` in a subprocess
is ``bench.reliability_kit.serve_process.ServeProcess`` (shipped: the bench's scenarios start it too).

Both listen on a free loopback port. A thread server shares the test's
process (fast to start, the store is inspectable); a subprocess is what a
user runs (signals, exit codes, another process's shared memory).
"""

from __future__ import annotations

import threading
import time

import uvicorn

from bench.serving import free_port


class ThreadServer:
    """``uvicorn.Server`` running ``app`` in a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.port = port or free_port()
        self.host = host
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning", lifespan="on",
                                access_log=False, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def svc(self):
        """The app's ``server.service.Service`` (its store, staging, audit log)."""
        return self.server.config.app.state.svc

    @property
    def store(self):
        return self.svc.store

    def start(self, timeout_s: float = 20.0) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)

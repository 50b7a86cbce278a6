"""Live servers for the service tests: uvicorn in a thread here; ``kvstore serve`` in a subprocess
is ``bench.reliability_kit.serve_process.ServeProcess`` (shipped: the bench's scenarios start it too).

Both listen on a free loopback port. A thread server shares the test's
process (fast to start, the store is inspectable); a subprocess is what a
user runs (signals, exit codes, another process's shared memory).
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn



class ThreadServer:
    """``uvicorn.Server`` running ``app`` in a daemon thread."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None) -> None:
        # The socket is bound here and handed to uvicorn: picking a free port and
        # binding it later let another test's process take it in between (CI saw
        # "address already in use"). SO_REUSEADDR lets a test restart on its port.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port or 0))
        self.port = self.sock.getsockname()[1]
        self.host = host
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning", lifespan="on",
                                access_log=False, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

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
        self.sock.close()

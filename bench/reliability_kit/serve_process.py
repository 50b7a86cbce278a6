"""``kvstore serve`` in a child process, as a user runs it, held as an object a scenario can kill.

``bench.serving.kvstore_server`` is the bench's usual server, a context manager that owns its
temp dir. The reliability scenarios need more: ``kill -9`` mid-storm and a restart on the same
port over the same data directory (crash), signals and exit codes, and the server's log when
it did not start. The service tests start their subprocess servers with this class too.

The child gets ``PR_SET_PDEATHSIG``, so it dies with its parent even when that is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from bench.serving import free_port

__all__ = ["ServeProcess", "small_env", "serving"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def small_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """Env for a ``kvstore serve`` child with small arenas (the defaults prefault 2 GiB)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(data_dir), KVSTORE_SHM_BYTES="64MiB", KVSTORE_CXL_BYTES="32MiB",
               KVSTORE_NVME_BYTES="256MiB", KVSTORE_STAGING_BYTES="64MiB", KVSTORE_LOG_LEVEL="warning")
    env.update(extra)
    return env


class ServeProcess:
    """``kvstore serve`` in a child process on a free port (or ``port``: a restart keeps its address)."""

    def __init__(self, env: dict[str, str], *args: str, port: int | None = None,
                 cmd: list[str] | None = None) -> None:
        self.port = port or free_port()
        self.env = env
        self.args = args
        self.cmd = cmd or [sys.executable, "-m", "kvstore.cli", "serve", "--port", str(self.port), *args]
        """The command line; one given as is (e.g. a compose command) takes its port from ``env``."""
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(env.get("KVSTORE_DATA_DIR", ".")) / f"serve-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "ServeProcess":
        """Start the child and wait until ``/healthz`` answers 200.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout_s`` (with its log's tail).
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"kvstore serve on {self.port} did not start:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL (what a crash looks like) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL after 30 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()
            return None


@contextlib.contextmanager
def serving(env: dict[str, str], *args: str) -> Iterator[ServeProcess]:
    """A started ``ServeProcess`` for the block; stopped after."""
    proc = ServeProcess(env, *args).start()
    try:
        yield proc
    finally:
        proc.stop()

"""Child processes for the benchmarks: free ports, waiting for health, ``kvstore serve`` sized for a run.

Every bench that needs a server runs it as ``kvstore serve`` in a child
process, so each row pays the same process boundary a user's client does.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

__all__ = ["free_port", "wait_http", "child", "stop", "kvstore_serve", "kvstore_server", "reply_line",
           "JsonWorker", "json_workers",
           "LineDriver"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(port: int, proc: subprocess.Popen, path: str = "/healthz", timeout_s: float = 60) -> None:
    """Return once ``GET path`` answers below 500; raise if the child exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1).status_code < 500:
                return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"server on port {port} did not start")


def reply_line(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """The next line a child writes on its stdout pipe ("" when it exited), within ``timeout_s``.

    For children that answer one line a command, so nothing sits in the pipe's buffer
    unread while ``select`` waits.

    Raises:
        RuntimeError: no line in time; the child is killed, so a hung peer cannot hang the bench.
    """
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{what} did not answer within {timeout_s:.0f} s; it was killed")
    return proc.stdout.readline()


@contextlib.contextmanager
def child(cmd: list[str], port: int, env: dict | None = None,
          path: str = "/healthz") -> Iterator[subprocess.Popen]:
    """Run ``cmd`` while the block runs (yields its process); SIGTERM (then kill) after."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(port, proc, path)
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM, then kill after ``timeout_s``; returns once the child is gone."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def kvstore_serve(name: str, **env: str) -> Iterator[str]:
    """``kvstore serve`` on a free port with its data in a temp dir here; yields its URL.

    Args: as ``kvstore_server``'s.
    """
    with kvstore_server(name, **env) as (url, _):
        yield url


@contextlib.contextmanager
def kvstore_server(name: str, **env: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """``kvstore serve`` on a free port with its data in a temp dir here; yields its URL and process.

    Args:
        name: names the temp dir (``.kvstore-bench-<name>-*``), removed after.
        env: ``KVSTORE_*`` settings over the bench defaults (512 MiB shm, 64 MiB cxl and
            staging, warnings only).
    """
    workdir = tempfile.mkdtemp(prefix=f".kvstore-bench-{name}-", dir=".")
    port = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    full.update(KVSTORE_DATA_DIR=os.path.join(workdir, "data"), KVSTORE_SHM_BYTES="512MiB",
                KVSTORE_CXL_BYTES="64MiB", KVSTORE_STAGING_BYTES="64MiB", KVSTORE_LOG_LEVEL="warning")
    full.update(env)
    try:
        with child([sys.executable, "-m", "kvstore.cli", "serve", "--port", str(port)], port, full) as proc:
            yield f"http://127.0.0.1:{port}", proc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class JsonWorker:
    """A bench's worker process (``python -m <module> worker ...``): JSON commands on its stdin,
    one JSON line back per command. ``what`` names it in errors."""

    def __init__(self, argv: list[str], what: str, timeout_s: float = 300.0) -> None:
        self.what, self.timeout_s = what, timeout_s
        self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)

    def reply(self) -> dict:
        line = reply_line(self.proc, self.timeout_s, self.what)
        if not line:
            raise RuntimeError(f"{self.what} exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send(cmd="close")
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def json_workers(argvs: list[list[str]], what: str, timeout_s: float = 300.0) -> Iterator[list[JsonWorker]]:
    """Start one ``JsonWorker`` per argv, wait until each says ``{"ready": true}``; closed after."""
    workers: list[JsonWorker] = []
    try:
        workers = [JsonWorker(argv, what, timeout_s) for argv in argvs]
        for w in workers:
            if not w.reply().get("ready"):
                raise RuntimeError(f"{what} failed to start")
        yield workers
    finally:
        for w in workers:
            w.close()


class LineDriver:
    """A child that answers one JSON line per command on its stdout (an engine's driver script in
    the engine's venv); what it prints itself goes to ``log``.

    ``name`` says who it is in errors. A reply ``{"ok": false, "error": ...}`` raises
    ``_error``'s exception (RuntimeError unless a subclass says otherwise).
    """

    name = "the driver"

    def __init__(self, args: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as stderr:
            self.proc = subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                         text=True, bufsize=1, cwd=cwd)

    def _read(self, timeout_s: float, what: str) -> dict:
        line = reply_line(self.proc, timeout_s, f"{self.name} ({what})")
        if not line:
            raise RuntimeError(f"{self.name} exited ({self.proc.poll()}) during {what}; log: {self.tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise self._error(what, reply.get("error"))
        return reply

    def _error(self, what: str, error: Any) -> Exception:
        return RuntimeError(f"{self.name} {what}: {error}; log: {self.tail()}")

    def _send(self, cmd: dict, timeout_s: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s, cmd["cmd"])

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError as exc:
            return f"(unreadable: {exc})"

    def close(self) -> None:
        """Ask it to quit; kill it when it does not within a minute."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "LineDriver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

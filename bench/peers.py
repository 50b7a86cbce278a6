"""What users would run instead of kvstore, as rows for ``bench.sampling.interleave``.

===================  ==========================================================
row                  one operation
===================  ==========================================================
redis-py put / get   ``SET`` / ``GET`` of one value of the frame's bytes, one
                     connection, against the redis-server the Redis tier uses
pickle put / get     the pattern our seed warns about: ``torch.save`` the tensor,
                     send it with httpx to a FastAPI service that keeps the
                     bytes; get them back and ``torch.load`` them
lmcache * put / get  LMCache 0.5.6 in its own virtualenv, driven by
                     ``bench/lmcache_driver.py`` one sample at a time: its
                     in-process ``LocalCPUBackend``, its ``lm://`` server with
                     its connector, and its Redis connector (same redis-server),
                     on its 32 MiB bf16 chunk ``[2, 32, 256, 1024]``
===================  ==========================================================

The pickle service loads with ``weights_only=True`` (a restricted unpickler):
the bench measures the pattern without running arbitrary pickles itself.
LMCache's samples come back over a pipe as the seconds its driver timed,
so the pipe is outside its clock.

    python -m bench.peers pickle PORT     the pickle service (what ``PickleService`` spawns)
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from fastapi import Request, Response  # module level: FastAPI resolves the routes' annotations here

from bench.sampling import Row, timed
from bench.serving import child, free_port, reply_line

__all__ = ["LMCACHE_VENV", "LMCACHE_CHUNK", "LMCACHE_CHUNK_BYTES", "lmcache_python", "install_lmcache", "LMCacheDriver",
           "PickleService", "redis_rows"]

ROOT = Path(__file__).resolve().parent.parent
LMCACHE_VENV = ROOT / ".venv-lmcache"
LMCACHE_VERSION = "0.5.6"
LMCACHE_CHUNK = (2, 32, 256, 1024)
"""bf16: 32 MiB, LMCache's default chunk of 256 tokens of a 32-layer model with 1,024 KV channels."""
LMCACHE_CHUNK_BYTES = 2 * math.prod(LMCACHE_CHUNK)
LMCACHE_BACKENDS = ("local_cpu", "lm", "redis")
DRIVER_TIMEOUT_S = 180.0
"""Its slowest command, an lm setup, waits up to 60 s for the server; a sample takes well under 1 s."""
_NO_TRACKING = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


# -- redis-py --------------------------------------------------------------------------------


def redis_rows(url: str, frame: memoryview) -> tuple[dict[str, Row], Any]:
    """``redis-py put`` and ``redis-py get`` of ``frame``'s bytes, and a closer."""
    import redis

    client = redis.Redis.from_url(url)
    name = f"kvstore-bench-raw-{os.getpid()}-{len(frame)}"
    client.set(name, frame)

    def get() -> None:
        if len(client.get(name)) != len(frame):
            raise AssertionError("redis-py returned another value")

    def close() -> None:
        client.delete(name)
        client.close()

    n = len(frame)
    return {"redis-py put": Row(n, timed(lambda: client.set(name, frame))),
            "redis-py get": Row(n, timed(get))}, close


# -- naive pickle over FastAPI ---------------------------------------------------------------


def pickle_app():
    """PUT /kv/{key} keeps the body; GET /kv/{key} returns it: a dict behind FastAPI."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI()
    blobs: dict[str, bytes] = {}

    @app.put("/kv/{key}")
    async def put(key: str, request: Request) -> dict:
        blobs[key] = await request.body()
        return {"stored": len(blobs[key])}

    @app.get("/kv/{key}")
    async def get(key: str) -> Response:
        if key not in blobs:
            raise HTTPException(404, f"no {key}")
        return Response(blobs[key], media_type="application/octet-stream")

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return app


class PickleService:
    """The pickle service in a child process and an httpx client to it."""

    def __init__(self) -> None:
        import httpx

        port = free_port()
        with contextlib.ExitStack() as stack:  # a failure half-way stops what was started
            stack.enter_context(child([sys.executable, "-m", "bench.peers", "pickle", str(port)], port))
            self._client = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120))
            self._stack = stack.pop_all()

    def rows(self, kv: torch.Tensor, nbytes: int) -> dict[str, Row]:
        key = f"kv-{nbytes}"

        def put() -> None:
            buf = io.BytesIO()
            torch.save(kv, buf)
            self._client.put(f"/kv/{key}", content=buf.getvalue()).raise_for_status()

        def get() -> torch.Tensor:
            r = self._client.get(f"/kv/{key}")
            r.raise_for_status()
            return torch.load(io.BytesIO(r.content), weights_only=True)

        put()
        if not torch.equal(get(), kv):
            raise AssertionError("the pickle service returned other KV")
        return {"pickle put": Row(nbytes, timed(put)), "pickle get": Row(nbytes, timed(get))}

    def close(self) -> None:
        self._stack.close()


# -- LMCache ---------------------------------------------------------------------------------


def lmcache_python(venv: Path = LMCACHE_VENV) -> Path | None:
    """The LMCache virtualenv's interpreter when LMCache imports there, else None."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    probe = subprocess.run([str(python), "-c", "import lmcache.v1.storage_backend.local_cpu_backend, xxhash, lz4, blake3"],
                           capture_output=True, env={**os.environ, **_NO_TRACKING}, timeout=120)
    return python if probe.returncode == 0 else None


def install_lmcache(venv: Path = LMCACHE_VENV, log: Any = print) -> Path:
    """Create ``venv`` and install LMCache 0.5.6 there (about a minute here); returns its python.

    torch is pinned to the version this project uses; on our machines pip takes that CPU build
    from local disk (see the README), while a looser pin pulls a multi-GB CUDA build.

    Raises:
        RuntimeError: the install failed (pip's output is in the message).
    """
    python = venv / "bin" / "python"
    if not python.exists():
        log(f"creating {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log(f"installing lmcache=={LMCACHE_VERSION} into {venv}")
    started = time.monotonic()
    # xxhash and lz4: kvstore's SDK, which the L2 adapter plug-in imports inside LMCache's server
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", f"lmcache=={LMCACHE_VERSION}",
                           f"torch=={torch.__version__.split('+')[0]}", "xxhash", "lz4", "blake3"],
                          capture_output=True, text=True, env={**os.environ, **_NO_TRACKING})
    if done.returncode != 0 or lmcache_python(venv) is None:
        raise RuntimeError(f"installing lmcache into {venv} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    log(f"lmcache installed in {time.monotonic() - started:.0f} s")
    return python


class LMCacheDriver:
    """``bench/lmcache_driver.py`` under LMCache's interpreter, one JSON line a command."""

    def __init__(self, python: Path, log: Path) -> None:
        env = {**os.environ, **_NO_TRACKING}
        env.pop("PYTHONPATH", None)  # the driver runs on LMCache's venv alone
        self.log = log
        with open(log, "w") as stderr:  # LMCache logs a lot; the progress display stays readable
            self._proc = subprocess.Popen([str(python), str(ROOT / "bench" / "lmcache_driver.py")], env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                          text=True, bufsize=1)
        self.backends: list[str] = []
        self.notes: list[str] = []

    def call(self, **cmd: Any) -> dict:
        """Send one command; its reply, or RuntimeError naming the driver's error."""
        assert self._proc.stdin and self._proc.stdout
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        line = reply_line(self._proc, DRIVER_TIMEOUT_S, f"the LMCache driver ({cmd['cmd']})")
        if not line:
            raise RuntimeError(f"the LMCache driver exited ({self._proc.poll()}) during {cmd['cmd']}; "
                               f"its log ends: {self._log_tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"LMCache {cmd.get('backend', '')} {cmd['cmd']}: {reply.get('error')} "
                               f"(log: {self.log})")
        return reply

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-1500:]
        except OSError as exc:
            return f"(unreadable: {exc})"

    def setup(self, redis_url: str | None) -> None:
        """Set up each backend that can run here; a note for each that cannot.

        The driver runs torch with as many threads as this process, so LMCache's copies
        get the cores kvstore's client side gets.
        """
        for backend in LMCACHE_BACKENDS:
            if backend == "redis" and redis_url is None:
                self.notes.append("lmcache redis: no redis-server")
                continue
            try:
                self.call(cmd="setup", backend=backend, redis_url=redis_url, shape=list(LMCACHE_CHUNK),
                          dtype="bfloat16", torch_threads=torch.get_num_threads())
                if not self.call(cmd="verify", backend=backend)["equal"]:
                    raise RuntimeError("the chunk read back differs from the one written")
            except RuntimeError as exc:
                self.notes.append(f"lmcache {backend}: {exc}")
                continue
            self.backends.append(backend)

    def rows(self) -> dict[str, Row]:
        """A put and a get row for each backend that set up."""
        nbytes = LMCACHE_CHUNK_BYTES

        def op(backend: str, which: str) -> Any:
            return lambda: float(self.call(cmd="sample", backend=backend, op=which)["seconds"])

        names = {"local_cpu": "lmcache local_cpu", "lm": "lmcache lm://", "redis": "lmcache redis"}
        return {f"{names[b]} {which}": Row(nbytes, op(b, which)) for b in self.backends for which in ("put", "get")}

    def close(self) -> None:
        """Stop the driver (and its lm server); a failed teardown becomes a note."""
        try:
            self.call(cmd="close")
        except RuntimeError as exc:
            self.notes.append(f"lmcache close: {exc}")
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


@contextlib.contextmanager
def lmcache(python: Path, redis_url: str | None, log: Path) -> Iterator[LMCacheDriver]:
    """The driver, set up, while the block runs; its stderr goes to ``log``."""
    driver = LMCacheDriver(python, log)
    try:
        driver.setup(redis_url)
        yield driver
    finally:
        driver.close()


if __name__ == "__main__":  # the pickle service, for PickleService's child process
    import uvicorn

    uvicorn.run(pickle_app(), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)

"""Time LMCache 0.5.6 storing and fetching one KV chunk, one sample per request.

Run it with the Python of a virtualenv that has lmcache==0.5.6 (it does not
import kvstore). It reads one JSON object per line on stdin and answers each
with one JSON line on stdout, so a benchmark can interleave LMCache samples
with its own:

    {"cmd": "setup", "backend": B, "shape": [2, 32, 256, 1024], "dtype": "bfloat16",
     "redis_url": "redis://127.0.0.1:PORT", "torch_threads": N}  -> {"ok": true, "server_pid": pid | null}
    {"cmd": "sample", "backend": B, "op": "put" | "get"} -> {"ok": true, "seconds": s, "bytes": n}
    {"cmd": "verify", "backend": B}                     -> {"ok": true, "equal": bool}
    {"cmd": "put_key", "backend": B, "key": n, "seed": s}   -> {"ok": true}
    {"cmd": "get_key", "backend": B, "key": n, "seed": s}   -> {"ok": true, "found": bool, "equal": bool,
                                                             "shape": [...], "dtype": str, "fmt": str}
    {"cmd": "exists_key", "backend": B, "key": n}        -> {"ok": true, "exists": bool}
    {"cmd": "list_keys", "backend": B}                   -> {"ok": true, "connector": ..., "wire": [str]}
    {"cmd": "close"}                                    -> {"ok": true}, then exit

The *_key commands work on chunk key ``n`` with data that is a pure function of
the seed ``s`` (what the kvstore integration test checks a server against).

A failed command answers {"ok": false, "error": "<type>: <message>"} and the
driver reads on. Several backends may be set up at once.

Backends (B):

- local_cpu: LMCache's in-process CPU tier, LocalCPUBackend. A put allocates a
  MemoryObj from its allocator, copies the user's tensor in and hands it to the
  backend. A get looks the chunk up and copies it out into a user tensor. Both
  copies are timed because kvstore's own timings include them.
- lm: LMCache's own cache server, started here as a child process
  (`python -m lmcache.v1.server 127.0.0.1 PORT cpu`), reached through
  RemoteBackend with an lm:// URL, as an LMCache engine would reach it.
- redis: the same RemoteBackend with a redis:// URL, against a Redis server
  that the caller runs.
- any other name, with "lm_url": the same RemoteBackend over that lm:// URL, to a
  server the caller runs (kvstore's lm:// listener).

Remote puts and gets go through RemoteBackend, so they include what LMCache
adds around the connector: the event-loop hop, the naive serde and the
allocation from the local CPU tier that receives a get. The local CPU tier
only lends memory there; nothing is cached in it, so every remote get really
travels.

A put sample times the copy in and the store until LMCache holds the chunk
(for lm:// until the server has it, see Remote.put). Any untimed step that
makes room for the put comes before the timer. Puts rewrite one key; gets read
the chunk stored at setup.

A get copies into one output tensor made at setup and reused, as an engine
reuses its KV buffer; a fresh 32 MiB tensor per get would mostly time page
faults.

Anything LMCache prints goes to stderr; stdout carries only the replies.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any


def _claim_stdout() -> io.TextIOWrapper:
    """Keep the real stdout for replies and point fd 1 at stderr.

    Done before torch and lmcache are imported, so nothing they print or log,
    from Python or from native code, can land in the reply stream.
    """
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return replies


_REPLIES = _claim_stdout()
# LMCache reports usage over the network unless told not to; the lm server
# child inherits these too.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObj  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402

MODEL = "kvstore-bench"
# Distinct keys so a failed put sample cannot spoil what get samples read.
GET_KEY, PUT_KEY, VERIFY_KEY = 1, 2, 3
# Room for the three chunks above plus one in flight, with slack; GB as LMCache counts.
CPU_TIER_GB = 0.5
SERVER_START_TIMEOUT_S = 60.0
WAIT_TIMEOUT_S = 60.0


class Chunk:
    """Shape, dtype and the LMCache objects that describe one chunk."""

    def __init__(self, shape: list[int], dtype_name: str) -> None:
        if len(shape) != 4:
            raise ValueError(f"shape must be [kv, layers, tokens, hidden], got {shape}")
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype_name!r}")
        self.shape = torch.Size(shape)
        self.dtype = dtype
        kv, layers, tokens, hidden = shape
        self.metadata = LMCacheMetadata(
            model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=dtype, kv_shape=(layers, kv, tokens, 1, hidden),
            chunk_size=tokens,
        )
        self.data = self.random()
        # Reused for every get: see the module docstring.
        self.out = torch.zeros(self.shape, dtype=self.dtype)

    def random(self, seed: int | None = None) -> torch.Tensor:
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        return torch.randn(self.shape, generator=gen).to(self.dtype)

    def key(self, n: int) -> CacheEngineKey:
        return CacheEngineKey(MODEL, 1, 0, n, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def config(self, remote_url: str | None) -> Any:
        # local_cpu=False for remote backends: the CPU tier then only lends
        # memory and never answers a get itself.
        return LMCacheEngineConfig.from_defaults(
            chunk_size=self.shape[2], local_cpu=remote_url is None,
            max_local_cpu_size=CPU_TIER_GB, remote_url=remote_url, remote_serde="naive",
        )


def _copy_in(cpu: LocalCPUBackend, chunk: Chunk, src: torch.Tensor) -> MemoryObj:
    obj = cpu.allocate(chunk.shape, chunk.dtype, MemoryFormat.KV_2LTD)
    if obj is None:
        raise MemoryError("LocalCPUBackend could not allocate a chunk")
    obj.tensor.copy_(src)
    return obj


class LocalCPU:
    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        self.cpu = LocalCPUBackend(chunk.config(None), chunk.metadata, dst_device="cpu")

    def prepare_put(self, key: CacheEngineKey) -> None:
        # LocalCPUBackend silently ignores a put to a key it holds, so the last
        # copy is dropped first, outside the timer; each put then stores anew.
        self.cpu.remove(key)

    def put(self, key: CacheEngineKey, src: torch.Tensor) -> None:
        obj = _copy_in(self.cpu, self.chunk, src)
        self.cpu.submit_put_task(key, obj)  # synchronous for this backend
        # The backend took its own reference; drop ours as StorageManager.batched_put does.
        obj.ref_count_down()

    def get(self, key: CacheEngineKey, out: torch.Tensor) -> None:
        obj = self.cpu.get_blocking(key)
        if obj is None:
            raise KeyError("chunk not in LocalCPUBackend")
        try:
            out.copy_(obj.tensor)
        finally:
            obj.ref_count_down()

    def close(self) -> None:
        self.cpu.close()


class Remote:
    """RemoteBackend over lm:// or redis://; puts overwrite their key.

    Overwriting rather than writing fresh keys: the lm server has neither
    delete nor eviction, so fresh keys would grow it by 32 MiB per sample.
    Neither LMCache nor the servers skip an overwrite, so the whole chunk
    still travels and is stored each time.
    """

    def __init__(self, chunk: Chunk, url: str, loop: asyncio.AbstractEventLoop,
                 server: subprocess.Popen | None = None) -> None:
        self.chunk = chunk
        self.url = url
        self.loop = loop
        self.server = server
        config = chunk.config(url)
        self.cpu = LocalCPUBackend(config, chunk.metadata, dst_device="cpu")
        try:
            self.remote = RemoteBackend(config, chunk.metadata, loop, self.cpu, dst_device="cpu")
            if self.remote.connection is None:  # RemoteBackend logs why and carries on
                raise ConnectionError(f"LMCache could not connect to {url}; see stderr")
        except BaseException:
            self.cpu.close()
            raise

    def prepare_put(self, key: CacheEngineKey) -> None:
        # RemoteBackend skips a put while the same key is still listed as in
        # flight; that listing is cleared by a callback that may run just after
        # the previous put's future resolved.
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while self.remote.exists_in_put_tasks(key):
            if time.monotonic() > deadline:
                raise TimeoutError("previous put still listed as in flight")
            time.sleep(0.0005)

    def put(self, key: CacheEngineKey, src: torch.Tensor) -> None:
        obj = _copy_in(self.cpu, self.chunk, src)
        try:
            self.remote.submit_put_task(key, obj).result(WAIT_TIMEOUT_S)
            # An lm:// put resolves once the bytes are handed to the socket,
            # with no reply. The server serves one connection in order, so its
            # answer to this exists query means the chunk is stored.
            if self.url.startswith("lm://") and not self.remote.contains(key):
                raise RuntimeError("lm server does not hold the chunk after put")
        finally:
            obj.ref_count_down()

    def get(self, key: CacheEngineKey, out: torch.Tensor) -> None:
        obj = self.remote.get_blocking(key)
        if obj is None:  # RemoteBackend logs the cause and returns None
            raise KeyError(f"get from {self.url} returned nothing; see stderr")
        try:
            out.copy_(obj.tensor)
        finally:
            obj.ref_count_down()

    def close(self) -> None:
        try:
            connector = self.remote.connection
            if connector is not None and self.url.startswith("redis://"):
                # RedisConnector.close() in 0.5.6 deadlocks: on the event loop it
                # blocks on a job queued to that same loop. Do its steps here.
                inner = connector.getWrappedConnector()

                async def close_redis() -> None:
                    await inner.pq_executor.shutdown_async(wait=False)
                    await inner.connection.aclose()

                asyncio.run_coroutine_threadsafe(close_redis(), self.loop).result(WAIT_TIMEOUT_S)
            else:
                self.remote.close()
            self.cpu.close()
        finally:
            if self.server is not None:
                _stop(self.server)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_lm_server() -> tuple[subprocess.Popen, int]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr,
    )
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lm server exited with {proc.returncode}; see stderr")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    _stop(proc)
    raise TimeoutError(f"lm server not listening after {SERVER_START_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Driver:
    def __init__(self) -> None:
        self.backends: dict[str, LocalCPU | Remote] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: threading.Thread | None = None

    def event_loop(self) -> asyncio.AbstractEventLoop:
        # RemoteBackend needs a loop running in another thread, as in an engine.
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            self.loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.loop_thread.start()
        return self.loop

    def backend(self, name: str) -> LocalCPU | Remote:
        if name not in self.backends:
            raise KeyError(f"backend {name!r} is not set up")
        return self.backends[name]

    def setup(self, req: dict[str, Any]) -> dict[str, Any]:
        name = req["backend"]
        if name in self.backends:
            raise ValueError(f"backend {name!r} is already set up")
        if req.get("torch_threads"):  # the caller's own, so LMCache's copies get the same cores
            torch.set_num_threads(int(req["torch_threads"]))
        chunk = Chunk(list(req.get("shape", [2, 32, 256, 1024])), req.get("dtype", "bfloat16"))
        backend: LocalCPU | Remote
        if name == "local_cpu":
            backend = LocalCPU(chunk)
        elif name == "redis":
            backend = Remote(chunk, req["redis_url"], self.event_loop())
        elif name == "lm":
            proc, port = _start_lm_server()
            try:
                backend = Remote(chunk, f"lm://127.0.0.1:{port}", self.event_loop(), proc)
            except BaseException:
                _stop(proc)
                raise
        elif req.get("lm_url"):
            if not str(req["lm_url"]).startswith("lm://"):
                raise ValueError(f"lm_url must be lm://HOST:PORT, got {req['lm_url']!r}")
            backend = Remote(chunk, req["lm_url"], self.event_loop())
        else:
            raise ValueError(f"unknown backend {name!r} (give lm_url for a server of your own)")
        try:
            # Store the chunk get samples read, and read it once: this also
            # warms connections and memory so the first sample is not a cold one.
            backend.put(chunk.key(GET_KEY), chunk.data)
            backend.get(chunk.key(GET_KEY), chunk.out)
        except BaseException:
            backend.close()
            raise
        self.backends[name] = backend
        server = getattr(backend, "server", None)
        return {"ok": True, "server_pid": server.pid if server is not None else None}

    def sample(self, req: dict[str, Any]) -> dict[str, Any]:
        backend = self.backend(req["backend"])
        chunk = backend.chunk
        op = req["op"]
        if op == "put":
            key = chunk.key(PUT_KEY)
            backend.prepare_put(key)
            start = time.perf_counter()
            backend.put(key, chunk.data)
        elif op == "get":
            key = chunk.key(GET_KEY)
            start = time.perf_counter()
            backend.get(key, chunk.out)
        else:
            raise ValueError(f"unknown op {op!r}")
        seconds = time.perf_counter() - start
        return {"ok": True, "seconds": seconds, "bytes": chunk.nbytes}

    def verify(self, req: dict[str, Any]) -> dict[str, Any]:
        backend = self.backend(req["backend"])
        chunk = backend.chunk
        key = chunk.key(VERIFY_KEY)
        # Fresh data, so a stale copy of earlier data cannot pass.
        data = chunk.random()
        out = torch.zeros_like(data)
        backend.prepare_put(key)
        backend.put(key, data)
        backend.get(key, out)
        return {"ok": True, "equal": bool(torch.equal(out, data))}

    def remote(self, req: dict[str, Any]) -> Remote:
        backend = self.backend(req["backend"])
        if not isinstance(backend, Remote):
            raise ValueError(f"backend {req['backend']!r} is not a remote one")
        return backend

    def put_key(self, req: dict[str, Any]) -> dict[str, Any]:
        backend = self.remote(req)
        key = backend.chunk.key(int(req["key"]))
        backend.prepare_put(key)
        backend.put(key, backend.chunk.random(int(req["seed"])))
        return {"ok": True}

    def get_key(self, req: dict[str, Any]) -> dict[str, Any]:
        backend = self.remote(req)
        chunk = backend.chunk
        obj = backend.remote.get_blocking(chunk.key(int(req["key"])))
        if obj is None:
            return {"ok": True, "found": False}
        try:
            md = obj.metadata
            return {"ok": True, "found": True, "equal": bool(torch.equal(obj.tensor, chunk.random(int(req["seed"])))),
                    "shape": list(md.shape), "dtype": str(md.dtype).replace("torch.", ""), "fmt": md.fmt.name}
        finally:
            obj.ref_count_down()

    def exists_key(self, req: dict[str, Any]) -> dict[str, Any]:
        backend = self.remote(req)
        return {"ok": True, "exists": bool(backend.remote.contains(backend.chunk.key(int(req["key"]))))}

    def list_keys(self, req: dict[str, Any]) -> dict[str, Any]:
        """The connector's own ``list()`` (a stub in LMCache 0.5.6: None, and nothing sent), and
        LIST on the wire, built and read with LMCache's own message classes."""
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage

        backend = self.remote(req)
        connector = backend.remote.connection
        listed = asyncio.run_coroutine_threadsafe(connector.list(), self.event_loop()).result(WAIT_TIMEOUT_S)
        host, port = backend.url[len("lm://"):].rsplit(":", 1)
        msg = ClientMetaMessage(ClientCommand.LIST, backend.chunk.key(0), 0, MemoryFormat.KV_2LTD, torch.float16,
                                torch.Size([0, 0, 0, 0]))
        with socket.create_connection((host, int(port)), timeout=WAIT_TIMEOUT_S) as sock:
            sock.sendall(msg.serialize())
            meta = ServerMetaMessage.deserialize(_recv_exact(sock, ServerMetaMessage.packlength()))
            body = _recv_exact(sock, meta.length).decode()
        return {"ok": True, "connector": listed, "code": int(meta.code), "wire": body.split("\n") if body else [],
                "connector_class": type(getattr(connector, "getWrappedConnector", lambda: connector)()).__name__}

    def close(self) -> None:
        errors = []
        for name, backend in list(self.backends.items()):
            try:
                backend.close()
            except Exception as exc:  # keep closing the others, servers included
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
            del self.backends[name]
        if self.loop is not None and self.loop_thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join(WAIT_TIMEOUT_S)
        if errors:
            raise RuntimeError("; ".join(errors))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"the server closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def _reply(obj: dict[str, Any]) -> None:
    _REPLIES.write(json.dumps(obj) + "\n")
    _REPLIES.flush()


def main() -> int:
    driver = Driver()
    handlers = {"setup": driver.setup, "sample": driver.sample, "verify": driver.verify, "put_key": driver.put_key,
                "get_key": driver.get_key, "exists_key": driver.exists_key, "list_keys": driver.list_keys}
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                req = json.loads(line)
                cmd = req.get("cmd")
                if cmd == "close":
                    break
                if cmd not in handlers:
                    raise ValueError(f"unknown cmd {cmd!r}")
                _reply(handlers[cmd](req))
            except Exception as exc:
                _reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        # Runs on close, on end of input and on interrupt, so no lm server
        # outlives the driver.
        try:
            driver.close()
            closed: dict[str, Any] = {"ok": True}
        except Exception as exc:
            closed = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    _reply(closed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

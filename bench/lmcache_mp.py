"""A stock ``lmcache server`` (LMCache 0.5.6's multi-process server) with an L2 adapter, and its driver.

LMCache lives in a venv of its own (``bench.peers.lmcache_python``); nothing here imports
it. ``LMCacheServer`` runs ``lmcache server`` from that venv on free ports with one
``--l2-adapter`` (kvstore's ``KVStoreL2Adapter`` plugin, or LMCache's own ``mock`` and
``fs``), this checkout on its ``PYTHONPATH`` so the plugin imports. ``MPDriver`` runs
``bench/lmcache_mp_driver.py`` under the same venv: LMCache's own vLLM-side adapters store,
look up and retrieve KV through the server, one JSON line a command.

``bench_l2`` measures the L2 legs through each adapter in one run:

==============  ===========================================================================
figure          what it times
==============  ===========================================================================
l2 store        after the engine's store landed in L1: until the store controller has
                nothing in flight and ``skip_l1`` dropped the chunks from L1 (the L2 put)
lookup          the scheduler's lookup: L2 lookup-and-lock, then the L2 load into L1
retrieve        L1 to the engine's paged KV (the same for every adapter; a control)
==============  ===========================================================================

    python -m bench.lmcache_mp [--chunks 64] [--chunk-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.serving import LineDriver, free_port, kvstore_serve

__all__ = ["ROOT", "DRIVER", "KVSTORE_DEPS", "lmcache_env", "missing_modules", "adapter_spec", "LMCacheServer",
           "MPDriver", "bench_l2"]

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "bench" / "lmcache_mp_driver.py"
KVSTORE_DEPS = ("numpy", "blake3", "xxhash", "lz4", "redis", "httpx", "torch")
"""What ``client_sdk`` imports; a venv made with ``pip install lmcache==0.5.6`` lacks xxhash and lz4."""
START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 300.0
MODEL = "kvstore-bench/lmcache-mp"


def lmcache_env(**extra: str) -> dict[str, str]:
    """The environment of LMCache processes: this checkout importable, no telemetry, no kvstore settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_") and k != "VIRTUAL_ENV"}
    env.update(PYTHONPATH=str(ROOT), LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1")
    env.update(extra)
    return env


def missing_modules(python: Path) -> list[str]:
    """kvstore's dependencies that ``python`` (LMCache's venv) cannot import: the plugin needs them all."""
    probe = ("import importlib.util, json; print(json.dumps([m for m in %r if importlib.util.find_spec(m) is None]))"
             % (KVSTORE_DEPS,))
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=lmcache_env(), timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{python} cannot run a probe: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def adapter_spec(kind: str, **params: Any) -> dict:
    """The ``--l2-adapter`` object: ``kvstore`` (``params`` are its adapter_params), ``mock``, or ``fs``
    (``params``: ``base_path``)."""
    if kind == "kvstore":
        return {"type": "plugin", "module_path": "kvstore.integrations.lmcache", "class_name": "KVStoreL2Adapter",
                "adapter_params": params}
    if kind == "mock":
        return {"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 10, **params}
    if kind == "fs":
        return {"type": "fs", **params}
    raise ValueError(f"unknown adapter kind {kind!r} (kvstore, mock, fs)")


class LMCacheServer:
    """``lmcache server`` with one L2 adapter, on free ports; ``skip_l1``, so stored chunks live in L2 alone.

    Args:
        python: LMCache's interpreter (``lmcache`` sits beside it).
        l2_adapter: the ``--l2-adapter`` object (``adapter_spec``).
        log: where its output goes.
        chunk_tokens: ``--chunk-size``.
        l1_gb: ``--l1-size-gb``.
    """

    def __init__(self, python: Path, l2_adapter: dict, log: Path, *, chunk_tokens: int = 64,
                 l1_gb: float = 0.25) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log = log
        self.cmd = [str(Path(python).parent / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(self.port),
                    "--http-host", "127.0.0.1", "--http-port", str(self.http_port), "--chunk-size", str(chunk_tokens),
                    "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",  # required beside --l1-size-gb
                    "--supported-transfer-mode", "engine_driven", "--l2-store-policy", "skip_l1",
                    "--l2-adapter", json.dumps(l2_adapter)]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Where the engine's adapters connect (ZMQ)."""
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "LMCacheServer":
        """Start it and return once ``/healthcheck`` answers 200 (about 5 s).

        Raises:
            RuntimeError: it exited (a plugin that does not import stops it) or never got ready;
                the message ends with its log.
        """
        import httpx

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, env=lmcache_env(), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # SIGINT to its group: LMCache's clean stop
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.http_url}/healthcheck", timeout=1).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"lmcache server did not get ready (exit {self.proc.returncode}); log:\n{self.tail()}")

    def status(self) -> dict:
        """``GET /status``: L1, the controllers and each L2 adapter's ``report_status``."""
        import httpx

        return httpx.get(f"{self.http_url}/status", timeout=10).raise_for_status().json()

    def adapter_status(self) -> dict:
        return self.status()["storage_manager"]["l2_adapters"][0]

    def l2_objects(self, page_size: int = 1000) -> list[dict]:
        """``GET /cache/objects?tier=l2``: the first page of what the adapter lists (``list_l2_keys``)."""
        import httpx

        answer = httpx.get(f"{self.http_url}/cache/objects", params={"tier": "l2", "page_size": page_size}, timeout=10)
        return answer.raise_for_status().json()["entries"]

    def delete_l2(self, keys: list[dict]) -> dict:
        """``DELETE /cache/objects`` of ``keys`` (entries' ``key``) from L2: the adapter's ``delete``."""
        import httpx

        answer = httpx.request("DELETE", f"{self.http_url}/cache/objects", json={"keys": keys, "tier": "l2"},
                               timeout=60)
        return answer.raise_for_status().json()

    def healthy(self) -> bool:
        """Whether ``/healthcheck`` answers 200 (the server is up, whatever its L2 says)."""
        import httpx

        try:
            return httpx.get(f"{self.http_url}/healthcheck", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError as exc:
            return f"(unreadable: {exc})"

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGINT (LMCache closes its adapters), then SIGKILL after ``timeout_s``; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "LMCacheServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class MPDriver(LineDriver):
    """``bench/lmcache_mp_driver.py`` under LMCache's interpreter; ``call`` sends one command, returns its reply."""

    name = "the LMCache MP driver"

    def __init__(self, python: Path, log: Path) -> None:
        super().__init__([str(python), str(DRIVER)], lmcache_env(), log)

    def call(self, cmd: str, **args: Any) -> dict:
        """The driver's reply to ``cmd``.

        Raises:
            RuntimeError: the driver answered an error, exited, or did not answer in time.
        """
        reply = self._send({"cmd": cmd, **args}, CALL_TIMEOUT_S)
        del reply["ok"]
        return reply

    def connect(self, server: LMCacheServer, *, layers: int = 2, heads: int = 2, head_size: int = 64,
                block: int = 16, max_tokens: int = 1024) -> dict:
        """Register a paged KV cache (bf16, vLLM's layout) with ``server``."""
        return self.call("connect", url=server.url, status_url=f"{server.http_url}/status", model=MODEL,
                         layers=layers, heads=heads, head_size=head_size, block=block, max_tokens=max_tokens)


def bench_l2(python: Path | None = None, kvstore_url: str | None = None, log_dir: Path | None = None, *,
             chunks: int = 64, chunk_tokens: int = 64, repeats: int = 5, layers: int = 4, heads: int = 4,
             head_size: int = 128, kinds: tuple[str, ...] = ("kvstore", "mock", "fs")) -> dict:
    """Store, look up and retrieve ``chunks`` chunks through each L2 adapter; medians of ``repeats``.

    Each repeat stores fresh tokens (so every store reaches L2), then looks them up and
    retrieves them (LMCache loads them from L2: ``skip_l1`` left none in L1) and checks the
    bytes. ``kvstore`` runs against ``kvstore_url``, or a ``kvstore serve`` started here.
    The servers' and the driver's logs go to ``log_dir`` (default: a temp dir, removed).
    Chunks are bf16 KV of ``layers`` x ``heads`` x ``head_size`` (512 KiB at the defaults).

    Returns:
        ``{"chunk_bytes", "chunks", "repeats", "rows": [{"adapter", "l2_store_s", "l2_store_gbps",
        "lookup_s", "lookup_gbps", "retrieve_s", "hit_tokens", "identical"}]}``.

    Raises:
        RuntimeError: LMCache or its venv is missing, a server did not start, or a run failed.
    """
    from bench.peers import lmcache_python

    python = python or lmcache_python()
    if python is None:
        raise RuntimeError("no .venv-lmcache with lmcache==0.5.6")
    missing = missing_modules(python)
    if missing:
        raise RuntimeError(f"{python} lacks kvstore's dependencies {missing} (pip install them there)")
    tokens = chunks * chunk_tokens
    geometry = dict(layers=layers, heads=heads, head_size=head_size, block=16, max_tokens=tokens)
    chunk_bytes = 2 * layers * chunk_tokens * heads * head_size * 2
    rows = []
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lmcache-mp-")))
        logs = Path(log_dir) if log_dir is not None else work
        if "kvstore" in kinds and kvstore_url is None:
            kvstore_url = stack.enter_context(kvstore_serve("lmcache-mp", KVSTORE_SHM_BYTES="1GiB",
                                                            KVSTORE_STAGING_BYTES="256MiB"))
        driver = stack.enter_context(MPDriver(python, logs / "lmcache-mp-driver.log"))
        for kind in kinds:
            params = {"kvstore": {"url": kvstore_url}, "fs": {"base_path": str(work / "fs")}}.get(kind, {})
            l1_gb = max(0.25, 4 * tokens * chunk_bytes / chunk_tokens / (1 << 30))
            with LMCacheServer(python, adapter_spec(kind, **params), logs / f"lmcache-server-{kind}.log",
                               chunk_tokens=chunk_tokens, l1_gb=round(l1_gb, 2)) as server:
                driver.connect(server, **geometry)
                try:
                    rows.append(_measure(driver, kind, tokens, repeats))
                finally:
                    driver.call("disconnect")
            if kind == "fs":
                shutil.rmtree(work / "fs", ignore_errors=True)
    return {"chunk_bytes": chunk_bytes, "chunks": chunks, "chunk_tokens": chunk_tokens, "repeats": repeats,
            "rows": rows}


def _measure(driver: MPDriver, kind: str, tokens: int, repeats: int) -> dict:
    stores, fetches = [], []
    for r in range(repeats + 1):  # the first round warms up (connections, arenas, page faults)
        seed = 1000 * r + 7
        s = driver.call("store", seed=seed, tokens=tokens)
        if not s["settled"]:
            raise RuntimeError(f"{kind}: the L2 store did not finish")
        f = driver.call("fetch", seed=seed, tokens=tokens)
        if r:
            stores.append(s)
            fetches.append(f)
    nbytes = stores[0]["nbytes"]
    store_s = statistics.median(s["l2_store_s"] for s in stores)
    lookup_s = statistics.median(f["lookup_s"] for f in fetches)
    return {"adapter": kind, "l2_store_s": store_s, "l2_store_gbps": nbytes / store_s / 1e9,
            "lookup_s": lookup_s, "lookup_gbps": nbytes / lookup_s / 1e9,
            "retrieve_s": statistics.median(f["retrieve_s"] for f in fetches),
            "hit_tokens": min(f["hit_tokens"] for f in fetches), "tokens": tokens,
            "identical": all(f["identical"] for f in fetches)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--url", default=None, help="a running kvstore serve (default: start one)")
    args = ap.parse_args(argv)
    result = bench_l2(chunks=args.chunks, chunk_tokens=args.chunk_tokens, repeats=args.repeats, kvstore_url=args.url)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

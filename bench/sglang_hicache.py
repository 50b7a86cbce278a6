"""SGLang's HiCache on CPU in its own venv (``bench/sglang_driver.py``), for tests and ``kvstore bench engines``."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.engines import ROOT, engine_env
from bench.serving import reply_line

__all__ = ["HiCacheDriver", "kvstore_extra", "bench_backends", "DRIVER", "LAYOUTS"]

DRIVER = ROOT / "bench" / "sglang_driver.py"
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 300.0


def kvstore_extra(url: str, namespace: str, *, interface_v1: bool = True, **more: Any) -> dict:
    """``--hicache-storage-backend-extra-config`` for kvstore, as a user writes it."""
    return {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang",
            "class_name": "KVStoreHiCacheStorage", "interface_v1": int(interface_v1), "url": url,
            "namespace": namespace, **more}


class HiCacheDriver:
    """One driver process; ``call(cmd=..., ...)`` returns its reply (raises on ``ok: false``)."""

    def __init__(self, python: Path, log: Path) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as stderr:
            self.proc = subprocess.Popen([str(python), str(DRIVER)], env=engine_env(), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1, cwd=ROOT)
        self.ready = self._read(START_TIMEOUT_S, "start")

    def _read(self, timeout_s: float, what: str) -> dict:
        line = reply_line(self.proc, timeout_s, f"the SGLang driver ({what})")
        if not line:
            raise RuntimeError(f"the SGLang driver exited ({self.proc.poll()}) during {what}; log: {self.tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise DriverError(f"SGLang {what}: {reply.get('error')}")
        return reply

    def call(self, **cmd: Any) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(CALL_TIMEOUT_S, cmd["cmd"])

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError as exc:
            return f"(unreadable: {exc})"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "HiCacheDriver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DriverError(RuntimeError):
    """The driver answered ``ok: false`` (its reason in the message)."""


GEOMETRY = dict(page=16, layers=8, heads=4, head_dim=128, dtype="bfloat16", device_tokens=16 * 128 * 2 + 64,
                host_ratio=4.0)
"""128 pages of 256 KiB (16 tokens x 8 layers x 4 KV heads x 128 dims, bf16, K and V): 32 MiB a batch."""


def bench_backends(python: Path, url: str, log: Path, *, pages: int = 128, repeat: int = 7,
                   layouts: tuple[str, ...] = ("page_first", "layer_first")) -> list[dict]:
    """One batch of ``pages`` pages through kvstore's backend (zero-copy calls) and SGLang's ``file``
    backend (on this host's temp disk), with a plain copy of the same pages, per layout.

    Returns rows: ``{"layout", "backend", "bytes", "set_s", "get_s", "get_repeat_s", "memcpy_s"}``.
    """
    rows = []
    with HiCacheDriver(python, log) as driver, tempfile.TemporaryDirectory(prefix="kvstore-hicache-file-") as disk:
        for layout in layouts:
            for backend, extra in (("kvstore", kvstore_extra(url, f"bench-{layout}")),
                                   ("file", {"file_storage_path": str(Path(disk) / layout)})):
                driver.call(cmd="setup", layout=layout, backend="dynamic" if backend == "kvstore" else "file",
                            extra=extra, **GEOMETRY)
                got = driver.call(cmd="bench", pages=pages, repeat=repeat)
                rows.append({"layout": layout, "backend": backend, **{k: got[k] for k in
                             ("bytes", "set_s", "get_s", "get_repeat_s", "memcpy_s")}})
    return rows

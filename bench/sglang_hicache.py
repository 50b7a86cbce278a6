"""SGLang's HiCache on CPU in its own venv (``bench/sglang_driver.py``), for tests and ``kvstore bench engines``."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.engines import ROOT, engine_env
from bench.serving import LineDriver

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


class HiCacheDriver(LineDriver):
    """One driver process; ``call(cmd=..., ...)`` returns its reply (raises ``DriverError`` on ``ok: false``)."""

    name = "the SGLang driver"

    def __init__(self, python: Path, log: Path) -> None:
        super().__init__([str(python), str(DRIVER)], engine_env(), log, cwd=ROOT)
        self.ready = self._read(START_TIMEOUT_S, "start")

    def _error(self, what: str, error: Any) -> Exception:
        return DriverError(f"SGLang {what}: {error}")

    def call(self, **cmd: Any) -> dict:
        return self._send(cmd, CALL_TIMEOUT_S)


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

"""The audit log: who evicted, pinned or migrated what, how many blocks and bytes.

Records are appended to a JSON-lines file (fsynced: an operator's eviction is
worth a disk flush) and the latest ones are kept in memory for ``/admin/audit``.
At start the file's tail is read back, so the log outlives a restart.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from typing import Any

__all__ = ["AuditLog"]

log = logging.getLogger("kvstore.server.audit")


class AuditLog:
    """Append-only admin action records.

    Args:
        path: JSON-lines file, created with its directory; None keeps memory only.
        keep: records kept in memory.
    """

    def __init__(self, path: str | None, keep: int = 10_000) -> None:
        self.path = path
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._next_id = 1
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._load()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:  # type: ignore[arg-type]
                lines = f.readlines()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:  # a torn last line after a crash: skip it
                continue
            if isinstance(record, dict):
                self._recent.append(record)
                self._next_id = max(self._next_id, int(record.get("id", 0)) + 1)

    def record(self, who: str, action: str, **details: Any) -> dict[str, Any]:
        """Append one record; returns it (with its id and time)."""
        with self._lock:
            entry = {"id": self._next_id, "time_s": time.time(), "who": who, "action": action, **details}
            self._next_id += 1
            self._recent.append(entry)
            if self.path:
                try:
                    with open(self.path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(entry, separators=(",", ":"), default=str) + "\n")
                        f.flush()
                        os.fsync(f.fileno())
                except OSError as exc:  # the action happened; losing its line must not undo it
                    log.error("audit record %s could not be written to %s: %s", entry["id"], self.path, exc)
        return entry

    def list(self, limit: int = 100, offset: int = 0, action: str | None = None) -> tuple[int, list[dict]]:
        """(total matching, records newest first from ``offset``)."""
        with self._lock:
            records = [r for r in reversed(self._recent) if action is None or r.get("action") == action]
        return len(records), records[offset:offset + limit]

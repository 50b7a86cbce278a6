"""A small tmpfs mounted for a test: the way to provoke ENOSPC for real (needs root)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """Yield ``where`` with a tmpfs of ``size`` (``1m``, ``3m``) mounted on it; skip without root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to provoke ENOSPC needs root")
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)

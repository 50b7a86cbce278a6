"""A default weights fingerprint: the content of a model directory, so KV never outlives its weights.

Every engine integration needs a ``KVSpec`` fingerprint that changes whenever the
weights change. A model name does not (a fine-tune keeps it), and neither do file
sizes or a safetensors header (new values, same shapes). So the default is a
content hash: ``weights_fingerprint(model_dir)`` hashes ``config.json`` (it decides
rope, norms and head layout, which all shape the KV) and every weights file in the
directory (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``), each with
its relative name and size, in name order. Tokenizer and generation files are left
out: the store is keyed by token ids, and sampling does not change the KV.

Hashing gigabytes takes seconds (blake3, several GB/s), so each file's digest is
cached under ``$KVSTORE_CACHE_DIR`` (default ``~/.cache/kvstore``), keyed by the
file's path, device, inode, size and modification time: any rewrite of the file
misses the cache and is hashed again. An engine and a transformers agent that load
the same directory get the same fingerprint.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path

import blake3

from kvstore.errors import InvalidSpec

__all__ = ["weights_fingerprint", "WEIGHT_SUFFIXES"]

log = logging.getLogger("kvstore.integrations.weights")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_DOMAIN = b"kvstore/weights/v1\x00"
_CHUNK = 16 << 20
_lock = threading.Lock()


def _cache_path() -> Path:
    root = os.environ.get("KVSTORE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvstore")
    return Path(root) / "weights-digests.json"


def _load_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_cache(path: Path, cache: dict[str, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".weights-digests.")
        with os.fdopen(fd, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home only costs the next start a re-hash
        log.debug("weights digest cache not written: %s", exc)


def _file_digest(path: Path) -> str:
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weights_fingerprint(model_dir: str | os.PathLike) -> str:
    """``"w-"`` and 32 hex digits naming the content of ``model_dir``'s config and weights.

    Raises:
        InvalidSpec: ``model_dir`` is not a directory, or holds no weights file.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise InvalidSpec(f"no model directory at {str(model_dir)!r} to fingerprint; pass an explicit fingerprint")
    files = sorted(p for p in root.rglob("*") if p.is_file() and (p.name == "config.json" or
                                                                   p.suffix in WEIGHT_SUFFIXES))
    if not any(p.suffix in WEIGHT_SUFFIXES for p in files):
        raise InvalidSpec(f"{str(root)!r} holds no weights file ({', '.join(WEIGHT_SUFFIXES)}); "
                          "pass an explicit fingerprint")
    cache_path = _cache_path()
    with _lock:
        cache = _load_cache(cache_path)
        dirty = False
        h = blake3.blake3(_DOMAIN)
        for p in files:
            st = p.stat()
            ident = f"{p.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"
            digest = cache.get(ident)
            if digest is None:
                digest = cache[ident] = _file_digest(p)
                dirty = True
            name = p.relative_to(root).as_posix().encode()
            h.update(len(name).to_bytes(4, "little") + name + st.st_size.to_bytes(8, "little"))
            h.update(bytes.fromhex(digest))
        if dirty:
            _save_cache(cache_path, cache)
    return "w-" + h.hexdigest()[:32]

"""``kvstore doctor``: check a host before ``kvstore serve`` runs there, and say what to fix.

It reads the settings ``kvstore serve`` would use (``Settings`` and ``ServerSettings``: defaults,
then ``KVSTORE_*``, then these flags) and prints one line per check, OK, WARN or FAIL, with what
it found; a WARN or FAIL line is followed by the fix, a command or a setting. It exits 1 when
any check FAILs (a WARN is a slower or less safe setup, not a broken one), else 0.

Each check is a function returning a ``Result`` that takes the paths it reads (``/proc/meminfo``,
``/dev/shm``, sysfs) as arguments, so tests can hand it fake ones. The sizes a tier reserves are
computed with the tiers' own constants (``tiers.arena``, ``kvstore.memory.shm``, ``tiers.cxl``),
so a change there changes what the doctor asks for.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import mmap
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["Result", "doctor_parser", "doctor", "run_checks", "load_settings", "check_shm",
           "check_hugepages", "check_numa", "check_memory", "check_disk", "check_port", "check_redis",
           "check_engine", "check_torch", "shm_segment_bytes", "cxl_map_bytes"]

OK, WARN, FAIL = "OK", "WARN", "FAIL"
ENGINES = ("vllm", "sglang", "lmcache")
ENGINE_TIMEOUT_S = 60.0
"""An engine venv's import probe's limit: vLLM imports in ~6 s on two busy cores; a minute means hung."""
REDIS_TIMEOUT_S = 2.0
NODE_DIR = "/sys/devices/system/node"
THP_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_WALK_LIMIT = 200_000
"""Files the disk check sizes under the nvme directory at most: a doctor that takes minutes is not run."""


@dataclass(frozen=True, slots=True)
class Result:
    """One check's outcome: ``fix`` is None for OK."""

    check: str
    status: str
    found: str
    fix: str | None = None


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{int(n)} B"


def _flag_size(n: int) -> str:  # floored to whole MiB, so the suggested size fits
    return f"{max(n, 0) >> 20}MiB"


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` (or a node's meminfo) as name -> bytes; the HugePages_* counts stay counts."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            # A node's file prefixes each line with "Node N "; the name is the word before the colon.
            name, _, rest = line.partition(":")
            words = rest.split()
            if words and words[0].isdigit():
                out[name.split()[-1]] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
    return out


def _ranges(text: str) -> list[int]:
    """``"0-3,8"`` (sysfs lists) -> [0, 1, 2, 3, 8]."""
    out: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def online_nodes(node_dir: str = NODE_DIR) -> list[int]:
    """NUMA nodes online, as ``tiers.cxl.online_nodes`` reads them, from ``node_dir``."""
    try:
        return _ranges(_read(os.path.join(node_dir, "online")) or "") or [0]
    except ValueError:
        return [0]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    text = _read(path)
    return int(text) if text and text.isdigit() else None


def shm_segment_bytes(capacity: int) -> int:
    """What ``ShmTier(capacity)`` reserves in /dev/shm: its slot table, then the arena with a
    cache line of slack per slot (``tiers/shm.py``, ``tiers/arena.py``)."""
    from kvstore.memory.shm import ROW, TABLE_AT
    from tiers.arena import ALIGN, default_max_entries

    slots = default_max_entries(capacity)
    return _round_up(TABLE_AT + slots * ROW, 4096) + capacity + slots * ALIGN


def cxl_map_bytes(capacity: int) -> int:
    """What ``CXLTier(capacity)`` maps: its arena rounded up to whole 2 MiB pages (``tiers/cxl.py``)."""
    from tiers.arena import ALIGN, default_max_entries
    from tiers.cxl import HUGE_PAGE

    return _round_up(capacity + default_max_entries(capacity) * ALIGN, HUGE_PAGE)


def load_settings(data_dir: str | None = None, port: int | None = None, redis_url: str | None = None,
                  environ: Mapping[str, str] | None = None) -> tuple[Any, Any]:
    """``(Settings, ServerSettings)`` as ``kvstore serve`` builds them: defaults, ``KVSTORE_*``, flags.

    Raises:
        KVStoreError: a bad variable or flag, named.
    """
    from kvstore.config import Settings
    from server.config import ServerSettings

    engine = Settings.from_env(environ)
    changes = {k: v for k, v in {"data_dir": data_dir, "redis_url": redis_url}.items() if v is not None}
    return replace(engine, **changes), ServerSettings.from_env(environ, port=port)


def check_shm(engine: Any, server: Any, shm_dir: str = "/dev/shm") -> Result:
    """/dev/shm holds the shm tier's arena and, for co-located clients, the staging area."""
    if "shm" not in engine.tier_names():
        return Result("shm", OK, "the shm tier is not configured: nothing is reserved in /dev/shm")
    tier = shm_segment_bytes(engine.shm_bytes)
    staging = server.staging_bytes if server.colocated else 0
    need = tier + staging
    what = f"the shm tier {_size(tier)}" + (f" + co-located staging {_size(staging)}" if staging else "")
    if not os.path.isdir(shm_dir):
        return Result("shm", FAIL, f"{shm_dir} does not exist; {what} must go there",
                      f"mount -t tmpfs -o size={-(-need // 2**30)}G tmpfs {shm_dir}")
    st = os.statvfs(shm_dir)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    found = f"{shm_dir}: {_size(free)} free of {_size(total)}; needs {_size(need)} ({what})"
    if free >= need:
        return Result("shm", OK, found)
    grow = f"{-(-(total - free + need) // 2**30)}G"
    fix = f"mount -o remount,size={grow} {shm_dir} (Docker: --shm-size={grow}; compose: shm_size: {grow})"
    # Table and slack cost 128 B per 4 KiB slot (shm_segment_bytes); a MiB covers the rounding.
    fit = (free - staging) * 4096 // (4096 + 128) - (1 << 20)
    if fit >= 1 << 20:
        fix += f", or shrink the tier: --shm-bytes {_flag_size(fit)} (KVSTORE_SHM_BYTES)"
    if staging:
        fix += ", or KVSTORE_STAGING_BYTES smaller / KVSTORE_COLOCATED=0 for the staging area"
    return Result("shm", FAIL, found, fix)


def check_hugepages(engine: Any, meminfo: str = "/proc/meminfo", nr_hugepages: str = "/proc/sys/vm/nr_hugepages",
                    node_dir: str = NODE_DIR, thp: str = THP_FILE) -> Result:
    """The cxl tier maps its arena with MAP_HUGETLB and falls back to THP without enough free pages."""
    if "cxl" not in engine.tier_names():
        return Result("hugepages", OK, "the cxl tier is not configured: no hugepages are used")
    info = read_meminfo(meminfo)
    arena = cxl_map_bytes(engine.cxl_bytes)
    if "HugePages_Total" not in info:
        return Result("hugepages", WARN, "this kernel has no hugetlb pages: the cxl arena uses THP or 4 KiB pages",
                      "a kernel with CONFIG_HUGETLBFS, or accept the fallback")
    page = info.get("Hugepagesize", 2 << 20)
    need = -(-arena // page)
    nr = _read_int(nr_hugepages)
    nr = info["HugePages_Total"] if nr is None else nr
    free = info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)  # reserved pages are promised already
    nodes = online_nodes(node_dir)
    node = engine.cxl_node if engine.cxl_node is not None else max(nodes)
    mode = next(iter(re.findall(r"\[(\w+)\]", _read(thp) or "")), "unknown")  # "always [madvise] never"
    fallback = (f"falls back to transparent hugepages (THP {mode})" if mode in ("always", "madvise")
                else f"falls back to 4 KiB pages (THP {mode})")
    found = f"vm.nr_hugepages={nr}, {free} free ({_size(page)} pages); the cxl arena ({_size(arena)}) needs {need}"
    if free < need:
        target = nr + need - max(free, 0)
        return Result("hugepages", WARN, f"{found}: it {fallback}",
                      f"sysctl -w vm.nr_hugepages={target} (keep it: echo vm.nr_hugepages={target} "
                      f"> /etc/sysctl.d/90-kvstore.conf)")
    pool = os.path.join(node_dir, f"node{node}", "hugepages", f"hugepages-{page >> 10}kB")
    node_free = _read_int(os.path.join(pool, "free_hugepages"))
    if len(nodes) > 1 and node_free is not None and node_free < need:
        # mmap reserves from the global pool; the bound node may still be short at fault-in.
        node_nr = _read_int(os.path.join(pool, "nr_hugepages")) or 0
        return Result("hugepages", WARN, f"{found}; node{node}, where it binds, has {node_free} free: it {fallback}",
                      f"echo {node_nr + need - node_free} > {pool}/nr_hugepages")
    return Result("hugepages", OK, f"{found}: MAP_HUGETLB on node{node}")


def _node_text(node_dir: str, node: int) -> str:
    base = os.path.join(node_dir, f"node{node}")
    try:
        cpus = len(_ranges(_read(os.path.join(base, "cpulist")) or ""))
    except ValueError:
        cpus = 0
    try:
        mem = _size(read_meminfo(os.path.join(base, "meminfo")).get("MemTotal", 0))
    except OSError:
        mem = "? memory"
    return f"node{node} {cpus} CPUs, {mem}" if cpus else f"node{node} no CPUs (far memory), {mem}"


def check_numa(engine: Any, node_dir: str = NODE_DIR) -> Result:
    """NUMA layout: which node the cxl arena binds to, and advice for more than one node."""
    nodes = online_nodes(node_dir)
    layout = "; ".join(_node_text(node_dir, n) for n in nodes)
    cxl = "cxl" in engine.tier_names()
    if cxl and engine.cxl_node is not None and engine.cxl_node not in nodes:
        return Result("numa", FAIL, f"KVSTORE_CXL_NODE={engine.cxl_node} is not online (online: {nodes})",
                      f"set KVSTORE_CXL_NODE to one of {nodes}, or unset it (the highest node)")
    bind = f"; the cxl arena binds to node{engine.cxl_node if engine.cxl_node is not None else max(nodes)}" \
        if cxl else ""
    found = f"{len(nodes)} node{'s' if len(nodes) > 1 else ''} ({layout}){bind}"
    if len(nodes) == 1:
        return Result("numa", OK, found)
    near = next((n for n in nodes if "no CPUs" not in _node_text(node_dir, n)), nodes[0])
    return Result("numa", WARN, found,
                  f"keep the server on its engine's node (the GPU's: cat /sys/bus/pci/devices/<gpu>/numa_node): "
                  f"numactl --cpunodebind={near} --membind={near} kvstore serve ...; KVSTORE_CXL_NODE picks the "
                  f"cxl tier's node")


def check_memory(engine: Any, server: Any, meminfo: str = "/proc/meminfo",
                 device_in_ram: bool | None = None) -> Result:
    """MemTotal and MemAvailable against what the in-RAM tiers (and tmpfs) hold when full."""
    names = engine.tier_names()
    if device_in_ram is None:  # without CUDA the device tier's pool is a CPU tensor
        import torch

        device_in_ram = not torch.cuda.is_available()
    parts: list[tuple[str, str, int]] = []  # (label, how to shrink it, bytes)
    if "memory" in names:
        parts.append(("memory", "--memory-bytes", engine.memory_bytes))
    if "device" in names and device_in_ram:
        parts.append(("device (CPU)", "--device-bytes", engine.device_bytes))
    if "shm" in names:
        parts.append(("shm", "--shm-bytes", shm_segment_bytes(engine.shm_bytes)))
        if server.colocated:
            parts.append(("staging", "KVSTORE_STAGING_BYTES=", server.staging_bytes))
    if "cxl" in names:
        parts.append(("cxl", "--cxl-bytes", cxl_map_bytes(engine.cxl_bytes)))
    info = read_meminfo(meminfo)
    total, avail = info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    need = sum(p[2] for p in parts)
    listed = " + ".join(f"{label} {_size(n)}" for label, _, n in parts) or "none"
    found = f"MemTotal {_size(total)}, MemAvailable {_size(avail)}; in-RAM tiers take {_size(need)} ({listed})"
    if need <= avail:
        return Result("memory", OK, found)
    limit = total if need > total else avail
    label, flag, big = max(parts, key=lambda p: p[2])
    smaller = big - (need - limit)
    fix = (f"shrink the {label} tier: {flag}{'' if flag.endswith('=') else ' '}{_flag_size(int(smaller * 0.9))}"
           if smaller > 64 << 20 else f"leave the {label} tier out (--tiers) or shrink several")
    if need > total:
        return Result("memory", FAIL, found + ": more than the machine has", fix)
    return Result("memory", WARN, found + ": more than is available now", fix + ", or free memory")


def _fs_type(path: str, mounts: str = "/proc/self/mounts") -> str:
    """The file system holding ``path``: the longest mount point above it."""
    real, best, kind = os.path.realpath(path), "", "unknown file system"
    for fields in (line.split() for line in (_read(mounts) or "").splitlines()):
        point = fields[1].replace("\\040", " ") if len(fields) > 2 else ""  # mounts escapes a space as \040
        if point and (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, f"{fields[2]} on {fields[0]}"
    return kind


def _stored_bytes(path: str) -> tuple[int, bool]:
    """Bytes of files under ``path`` and whether all were counted (``_WALK_LIMIT``)."""
    total = seen = 0
    for root, _, files in os.walk(path):
        for name in files:
            seen += 1
            if seen > _WALK_LIMIT:
                return total, False
            with contextlib.suppress(OSError):  # a file the tier removed meanwhile
                total += os.stat(os.path.join(root, name)).st_size
    return total, True


def _probe_dir(path: str) -> tuple[str | None, str | None]:
    """(why ``path`` is not writable, why it refuses O_DIRECT): None for fine."""
    try:
        fd, name = tempfile.mkstemp(dir=path, prefix=".kvstore-doctor-")
    except OSError as exc:
        return exc.strerror or str(exc), None
    os.close(fd)
    try:
        if not hasattr(os, "O_DIRECT"):
            return None, "no O_DIRECT on this platform"
        fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
        try:
            os.write(fd, mmap.mmap(-1, 4096))  # one page, page-aligned: O_DIRECT's unit, as tiers/nvme.py writes
        finally:
            os.close(fd)
        return None, None
    except OSError as exc:
        return None, exc.strerror or str(exc)
    finally:
        os.unlink(name)


def check_disk(engine: Any, mounts: str = "/proc/self/mounts") -> Result:
    """The data dir (audit log, nvme tier): writable, room for the nvme tier, O_DIRECT."""
    data_dir = os.path.abspath(engine.data_dir)
    base = data_dir
    while not os.path.lexists(base):  # serve makes the missing part; test what exists above it
        base = os.path.dirname(base)
    if not os.path.isdir(base):
        return Result("disk", FAIL, f"data dir {data_dir}: {base} is a file, not a directory",
                      f"--data-dir a directory (KVSTORE_DATA_DIR), or move {base} away")
    where = data_dir if base == data_dir else f"{data_dir} (to be made in {base})"
    denied, direct = _probe_dir(base)
    if denied:
        return Result("disk", FAIL, f"data dir {where}: cannot write: {denied}",
                      f"chown/chmod {base} for the server's user, or --data-dir elsewhere (KVSTORE_DATA_DIR)")
    kind = _fs_type(base, mounts)
    if "nvme" not in engine.tier_names():
        return Result("disk", OK, f"data dir {where}: {kind}, writable; the nvme tier is not configured")
    st = os.statvfs(base)
    free = st.f_bavail * st.f_frsize
    from kvstore.engine.build import nvme_layout  # lazy, as the doctor's other kvstore imports

    stored, complete = _stored_bytes(nvme_layout(engine)[1])  # the directory the tier will read
    held = f" + {'' if complete else 'at least '}{_size(stored)} the tier holds" if stored else ""
    found = (f"data dir {where}: {kind}, writable, {_size(free)} free{held} for the nvme tier's "
             f"{_size(engine.nvme_bytes)}; O_DIRECT {'ok' if direct is None else 'refused: ' + direct}")
    if free + stored < engine.nvme_bytes:
        # 90%: frame files carry a 4 KiB header and the file system its own blocks.
        return Result("disk", FAIL, found, f"--nvme-bytes {_flag_size(int((free + stored) * 0.9))} "
                                           f"(KVSTORE_NVME_BYTES), or --data-dir on a disk with "
                                           f"{_size(engine.nvme_bytes - stored)} free")
    if direct is not None:
        return Result("disk", WARN, found + ": the nvme tier falls back to buffered writes (slower on large "
                                            "frames)", "--data-dir on a local ext4 or xfs file system")
    return Result("disk", OK, found)


def _port_owner(port: int, proc: str = "/proc") -> str | None:
    """``"name (pid N)"`` of the process listening on TCP ``port``, when /proc tells."""
    inodes: set[str] = set()
    for table in ("net/tcp", "net/tcp6"):
        for cols in (row.split() for row in (_read(os.path.join(proc, table)) or "").splitlines()[1:]):
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rpartition(":")[2], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for pid in (p for p in os.listdir(proc) if p.isdigit()) if inodes else ():
        try:
            fds = os.listdir(os.path.join(proc, pid, "fd"))
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(proc, pid, "fd", fd)) in inodes:
                    return f"{_read(os.path.join(proc, pid, 'comm'))} (pid {pid})"
            except OSError:
                continue
    return None


def _bind(host: str, port: int) -> OSError | None:
    """Bind and close; the error, or None. create_server sets SO_REUSEADDR, as uvicorn does, so a
    port in TIME_WAIT is free here as there."""
    try:
        with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET):
            return None
    except OSError as exc:
        return exc


def check_port(host: str, port: int, name: str = "port", flag: str = "--port") -> Result:
    """Bind ``host:port`` and close it, as the server would bind it."""
    env = "KVSTORE_" + flag.lstrip("-").replace("-", "_").upper()
    if port == 0:
        return Result(name, OK, f"{flag} 0: the server takes a free port")
    exc = _bind(host, port)
    if exc is None:
        return Result(name, OK, f"{host}:{port} is free to bind")
    if exc.errno == errno.EADDRINUSE:
        owner = _port_owner(port)
        spare = next((p for p in range(port + 1, min(port + 50, 65536)) if _bind(host, p) is None), None)
        alt = f"serve on another port: {flag} {spare} ({env})" if spare else f"pick another {flag} ({env})"
        stop = f"stop {owner}" if owner else f"stop its listener (ss -ltnp 'sport = :{port}')"
        return Result(name, FAIL, f"{host}:{port} is in use" + (f" by {owner}" if owner else ""), f"{stop}, or {alt}")
    if exc.errno == errno.EACCES:
        return Result(name, FAIL, f"{host}:{port}: {exc.strerror}",
                      f"a port of 1024 or more ({flag}, {env}), or grant CAP_NET_BIND_SERVICE")
    return Result(name, FAIL, f"cannot bind {host}:{port}: {exc.strerror or exc}",
                  "--host / KVSTORE_HOST an address of this host (0.0.0.0 for all)")


def check_redis(url: str | None, redis_bytes: int | None = None, timeout_s: float = REDIS_TIMEOUT_S) -> Result:
    """PING the Redis of the redis tier (``--redis-url`` / ``KVSTORE_REDIS_URL``), when one is set."""
    if not url:
        return Result("redis", OK, "not configured (--redis-url / KVSTORE_REDIS_URL): no shared tier")
    from urllib.parse import urlsplit

    import redis
    from redis.cluster import RedisCluster

    from kvstore.errors import InvalidInput
    from kvstore.wire.redis import connect_options, redact

    shown = redact(url)
    try:
        cluster, plain, options = connect_options(url, timeout_s, timeout_s)  # the tier's own client options
    except InvalidInput as exc:
        return Result("redis", FAIL, str(exc), "--redis-url redis://HOST:PORT/DB or redis+cluster://HOST:PORT")
    parts = urlsplit(plain)
    host, port = parts.hostname or "127.0.0.1", parts.port or 6379
    start = time.perf_counter()
    try:
        client = (RedisCluster if cluster else redis.Redis).from_url(plain, **options)
        try:
            client.ping()
            took = (time.perf_counter() - start) * 1e3
            info = {} if cluster else client.info()
        finally:
            client.close()
    except redis.AuthenticationError as exc:
        return Result("redis", FAIL, f"{shown}: {exc}", "put the password in the URL: redis://:PASSWORD@HOST:PORT/DB")
    except (redis.RedisError, OSError) as exc:
        return Result("redis", FAIL, f"{shown}: {type(exc).__name__}: {exc}",
                      f"start Redis there (redis-server --port {port} --daemonize yes on {host}), or point "
                      f"--redis-url / KVSTORE_REDIS_URL at a running one")
    found = f"PONG from {shown} in {took:.1f} ms" + (" (a cluster node)" if cluster else
                                                      f" (Redis {info.get('redis_version', '?')})")
    cap = int(info.get("maxmemory", 0) or 0)
    if cap and redis_bytes and cap < redis_bytes:
        return Result("redis", WARN, f"{found}; its maxmemory {_size(cap)} is below the tier's "
                                     f"{_size(redis_bytes)}: Redis refuses or evicts first",
                      f"--redis-bytes {_flag_size(cap)} (KVSTORE_REDIS_BYTES), or redis-cli config set "
                      f"maxmemory {redis_bytes}")
    return Result("redis", OK, found)


def _lmcache_install(root: Path) -> str:
    """The commands .ci/run makes ``.venv-lmcache`` with, read from it so the two cannot drift."""
    steps = [line.strip() for line in (_read(str(root / ".ci" / "run")) or "").splitlines() if ".venv-lmcache" in line and not
             line.strip().startswith("#") and ("-m venv" in line or "pip install" in line)]
    return f"cd {root} && " + " && ".join(steps) if steps else f"make {root}/.venv-lmcache as .ci/run does"


def check_engine(engine: str, python: str | Path | None = None, probe: str | None = None,
                 timeout_s: float = ENGINE_TIMEOUT_S) -> Result:
    """Whether ``engine``'s venv exists and imports it (``python``: that venv's interpreter, to inject one)."""
    name = f"engine:{engine}"
    try:
        from bench import engines
    except ImportError as exc:
        return Result(name, FAIL, f"bench.engines does not import ({exc}): engine venvs come from a checkout",
                      "run kvstore doctor in a kvstore checkout (its root on PYTHONPATH)")
    if engine == "lmcache":
        venv = engines.ROOT / ".venv-lmcache"
        code, fix, dist = probe or "import lmcache", _lmcache_install(engines.ROOT), "lmcache"
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
    else:
        venv = engines.venv_path(engine)
        code, fix, dist = probe or engines.ENGINES[engine][1], f"python -m bench.engines ensure {engine}", engine
        env = engines.engine_env()
    exe = Path(python) if python is not None else venv / "bin" / "python"
    venv = exe.parent.parent
    if not exe.exists():
        # A venv named for another lock hash is one the lock has moved past.
        old = sorted(p.name for p in venv.parent.glob(f"{engine}-*") if p != venv) if python is None else []
        more = f" (the lock changed since {', '.join(old)})" if old else ""
        return Result(name, FAIL, f"no {engine} venv at {venv}{more}", f"{fix} (from {engines.ROOT})")
    shown = code
    if probe is None:  # the version as a courtesy: a module without one must not fail the probe
        code += f"\nimport sys\nprint(getattr(sys.modules.get({dist!r}), '__version__', ''))"
    start = time.perf_counter()
    try:
        done = subprocess.run([str(exe), "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              env=env, cwd=engines.ROOT)
    except subprocess.TimeoutExpired:
        return Result(name, FAIL, f"{venv}: the import did not finish in {timeout_s:g} s",
                      f"run {exe} -c {shown!r} to see where it hangs; else remake it: {fix}")
    except OSError as exc:
        return Result(name, FAIL, f"{venv}: cannot run {exe}: {exc}", fix)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["exit status " + str(done.returncode)])[-1]
        return Result(name, FAIL, f"{venv} does not import {engine}: {last}", fix)
    version = (done.stdout.strip().splitlines() or [""])[-1] if probe is None else ""
    what = f"{dist} {version}" if version else dist
    return Result(name, OK, f"{venv}: {what} imports in {time.perf_counter() - start:.1f} s")


def torch_pin(pyproject: str | Path | None = None) -> str | None:
    """The ``torch==X`` pin of the checkout's pyproject.toml, else of the installed kvstore."""
    import tomllib

    path = Path(pyproject) if pyproject else Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        deps: Iterable[str] = tomllib.loads(path.read_text()).get("project", {}).get("dependencies", [])
    except (OSError, tomllib.TOMLDecodeError):
        from importlib import metadata

        try:
            deps = metadata.requires("kvstore") or []
        except metadata.PackageNotFoundError:
            deps = []
    for dep in deps:
        pinned = re.match(r"^\s*torch\s*==\s*([^\s;,]+)", dep)
        if pinned:
            return pinned.group(1)
    return None


def check_torch(pyproject: str | Path | None = None) -> Result:
    """torch imports, its build (CPU or CUDA), GPUs seen, and the version against the pin."""
    pin = torch_pin(pyproject)
    want = f"torch=={pin}" if pin else "torch"
    py = f"Python {sys.version.split()[0]}"
    try:
        import torch
    except Exception as exc:  # a broken wheel raises more than ImportError (OSError for a missing .so)
        return Result("torch", FAIL, f"{py}; torch does not import: {exc}", f"pip install {want}")
    cuda = torch.version.cuda
    gpus = torch.cuda.device_count() if cuda and torch.cuda.is_available() else 0
    build = f"CUDA {cuda} build, {gpus} GPU(s) visible" if cuda else "CPU build: the device tier runs on the CPU"
    found = f"{py}, torch {torch.__version__} ({build})"
    if pin and torch.__version__.split("+")[0] != pin:
        return Result("torch", WARN, f"{found}; pyproject.toml pins {want}", f"pip install {want}")
    if cuda and not gpus:
        return Result("torch", WARN, found + ": the device tier falls back to the CPU",
                      "check nvidia-smi and CUDA_VISIBLE_DEVICES")
    return Result("torch", OK, found)


def run_checks(data_dir: str | None = None, port: int | None = None, redis_url: str | None = None,
               engines: Sequence[str] = ()) -> list[Result]:
    torch = check_torch()
    try:
        engine, server = load_settings(data_dir, port, redis_url)
    except Exception as exc:  # a bad KVSTORE_* variable, or torch too broken for the settings to load
        return [Result("settings", FAIL, str(exc), "correct or unset the variable or flag it names"), torch]
    sizes = ", ".join(f"{n} {_size(getattr(engine, f'{n}_bytes'))}" for n in engine.tier_names())
    found = f"tiers {engine.tiers} ({sizes}); data dir {os.path.abspath(engine.data_dir)}; {server.host}:{server.port}"
    results = [Result("settings", OK, found), check_shm(engine, server), check_hugepages(engine), check_numa(engine),
               check_memory(engine, server), check_disk(engine), check_port(server.host, server.port)]
    for attr, flag in (("flight_port", "--flight-port"), ("lmcache_port", "--lmcache-port")):
        value = getattr(server, attr)
        if value:
            host = server.host if attr == "flight_port" else (server.lmcache_host or "127.0.0.1")
            results.append(check_port(host, value, name=attr.replace("_", " "), flag=flag))
    results += [check_redis(engine.redis_url, engine.redis_bytes), torch]
    results += [check_engine(e) for e in dict.fromkeys(engines)]
    return results


def render(results: Sequence[Result]) -> str:
    width = max(len(r.check) for r in results)
    lines = [f"kvstore doctor on {socket.gethostname()}: the settings `kvstore serve` would use here"]
    for r in results:
        lines.append(f"{r.status:<4}  {r.check:<{width}}  {r.found}")
        if r.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {r.fix}")
    counts = {s: sum(r.status == s for r in results) for s in (OK, WARN, FAIL)}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def doctor_parser(sub: Any) -> None:
    """``kvstore doctor``'s parser, under the ``kvstore`` command's subparsers."""
    p = sub.add_parser("doctor", help="check this host for kvstore serve (shm, hugepages, NUMA, disk, Redis, "
                                      "port, engine venvs) and say what to fix")
    p.add_argument("--data-dir", default=None, help="data dir to check (KVSTORE_DATA_DIR; default: serve's)")
    p.add_argument("--port", type=int, default=None, help="port to check (KVSTORE_PORT; default: serve's)")
    p.add_argument("--redis-url", default=None, help="Redis to PING (KVSTORE_REDIS_URL; default: none)")
    p.add_argument("--engine", action="extend", nargs="+", choices=ENGINES, default=[],
                   help="also check these engines' venvs import (vllm, sglang: bench.engines; lmcache: .venv-lmcache)")
    p.add_argument("--json", action="store_true", help="print a JSON list of {check, status, found, fix}")


def doctor(args: argparse.Namespace) -> int:
    results = run_checks(args.data_dir, args.port, args.redis_url, args.engine)
    print(json.dumps([asdict(r) for r in results], indent=1) if args.json else render(results))
    return 1 if any(r.status == FAIL for r in results) else 0

"""The cxl tier: an arena of hugepage memory bound to a (far) NUMA node.

On a machine with CXL memory expanders the expander shows up as a CPU-less
NUMA node; binding the arena there puts frames on it. Where no such node exists
(one socket, one node) the same code binds to the highest-numbered node, so it
runs everywhere, and ``LatencyTier`` (``tiers/latency.py``) adds CXL's latency
and bandwidth on top when a test or a benchmark wants to model it.

How the arena is made, in order, and why:

1. ``mmap(MAP_ANONYMOUS|MAP_PRIVATE|MAP_HUGETLB)`` through libc (Python 3.11's
   ``mmap`` module has no ``MAP_HUGETLB``). A private hugetlb mapping reserves
   its pages at mmap time, so "no hugepages reserved" is an ``ENOMEM`` here,
   not a ``SIGBUS`` at first touch. On any failure we fall back to a plain
   anonymous mapping, aligned to 2 MiB and advised ``MADV_HUGEPAGE`` (THP).
2. ``mbind(MPOL_BIND)`` to the node, before the first touch: a policy applies
   to pages faulted in after it, and moving pages later costs a copy.
3. A hugetlb arena: pre-fault every page (``MADV_POPULATE_WRITE``, else a
   memset) so that a put never takes a page fault; its pages are reserved at
   mmap anyway, and populate reports a failure as an errno instead of a
   ``SIGBUS`` on a hugetlb mapping the node cannot back. A THP arena (the
   fallback) is not pre-faulted: its pages come with the first write into
   them, 2 MiB at a time, so an idle server holds only the memory its frames
   use (pre-faulted, the default 1 GiB arena was 1 GiB of an idle server's
   anonymous memory, issue 34's ``<= 300 MiB`` target four times over). Once
   frames have left, their huge pages go back to the kernel when the store is
   idle (``release_free``, called by ``kvstore.engine.trim``).

``stats().details`` says what was obtained, read back from the kernel (smaps
and ``get_mempolicy``), never what was asked for.

Closing. ``ArenaTier.close`` clears the maps and then calls ``_close_arena``.
A reader that pinned its range before close may still be copying, and a put
may still be in its writer; unmapping under either would crash the process.
Every access to the mapping therefore runs between ``_enter`` and ``_leave``,
which count it; ``_close_arena`` stops new accesses (they raise
``StoreClosed``) and unmaps only when the count drops to zero, so close waits
for in-flight copies (including a slow ``put_with`` writer) to finish.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import re
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from kvstore.errors import InvalidInput, StoreClosed, TierIOError
from kvstore.memory.slab import Move
from kvstore.tier import Buffer, FrameWriter
from tiers.arena import ArenaTier

__all__ = ["CXLTier", "online_nodes"]

HUGE_PAGE = 2 << 20
PROT_RW = 0x1 | 0x2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_HUGETLB = 0x02, 0x20, 0x40000
MADV_DONTNEED, MADV_HUGEPAGE, MADV_POPULATE_WRITE = 4, 14, 23  # POPULATE_WRITE: Linux 5.14+
MPOL_BIND = 2
MPOL_F_NODE, MPOL_F_ADDR = 1, 2
# (mbind, get_mempolicy) syscall numbers; libnuma is not a dependency.
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}
FACTS_TTL_S = 5.0
"""How long page facts stay cached: stats() runs under the arena lock and a
smaps read costs ~5 ms in a process with torch loaded. Hugetlb facts never
change; THP ones can (khugepaged), so they are re-read at most this often."""
NODE_SAMPLES = 8  # pages whose node get_mempolicy checks, spread over the arena
_NODE_DIR = "/sys/devices/system/node"


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.syscall.restype = ctypes.c_long
    return libc


_LIBC = _libc()
_MAP_FAILED = ctypes.c_void_p(-1).value


def _errno_text(err: int) -> str:
    return f"{errno.errorcode.get(err, err)} ({os.strerror(err)})"


def online_nodes() -> list[int]:
    """NUMA nodes with memory online, from sysfs; ``[0]`` where the kernel has no NUMA."""
    try:
        with open(f"{_NODE_DIR}/online") as f:
            text = f.read().strip()
    except OSError:
        return [0]
    nodes: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        nodes.extend(range(int(lo), int(hi or lo) + 1))
    return nodes or [0]


@dataclass(slots=True)
class _Mapping:
    """One mmap'd arena and how it was obtained."""

    addr: int
    length: int
    hugetlb: bool
    hugetlb_note: str
    """"obtained", "not requested", or why MAP_HUGETLB was refused."""
    thp_note: str
    """madvise(MADV_HUGEPAGE)'s outcome on the fallback path; "n/a" with hugetlb."""


def _mmap(length: int, flags: int) -> tuple[int | None, int]:
    addr = _LIBC.mmap(None, length, PROT_RW, MAP_PRIVATE | MAP_ANONYMOUS | flags, -1, 0)
    if addr in (None, _MAP_FAILED):
        return None, ctypes.get_errno()
    return addr, 0


def _map_thp(length: int) -> tuple[int, str]:
    """An anonymous mapping on a 2 MiB boundary, advised for THP: (addr, madvise outcome)."""
    # Over-map by one huge page and trim, so every 2 MiB of the arena can be a THP.
    raw, err = _mmap(length + HUGE_PAGE, 0)
    if raw is None:
        raise TierIOError(f"cannot map a {length}-byte arena: {_errno_text(err)}")
    addr = -(-raw // HUGE_PAGE) * HUGE_PAGE
    if addr > raw:
        _LIBC.munmap(raw, addr - raw)
    tail = raw + length + HUGE_PAGE - (addr + length)
    if tail:
        _LIBC.munmap(addr + length, tail)
    if _LIBC.madvise(addr, length, MADV_HUGEPAGE) != 0:
        return addr, f"madvise failed: {_errno_text(ctypes.get_errno())}"
    return addr, "madvised"


def _map_arena(length: int, hugepages: bool) -> _Mapping:
    if hugepages:
        addr, err = _mmap(length, MAP_HUGETLB)
        if addr is not None:
            return _Mapping(addr, length, True, "obtained", "n/a")
        note = f"refused: {_errno_text(err)}; fell back to THP"
    else:
        note = "not requested"
    addr, thp = _map_thp(length)
    return _Mapping(addr, length, False, note, thp)


def _bind(addr: int, length: int, node: int) -> str:
    """mbind the range to ``node``: "ok", or why not (the tier still works, unbound)."""
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        return f"failed: no mbind syscall number for {platform.machine()}"
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    # The kernel reads maxnode - 1 bits, hence the + 1 (libnuma does the same).
    rc = _LIBC.syscall(calls[0], ctypes.c_void_p(addr), ctypes.c_ulong(length), ctypes.c_int(MPOL_BIND),
                       mask, ctypes.c_ulong(words * 64 + 1), ctypes.c_uint(0))
    return "ok" if rc == 0 else f"failed: {_errno_text(ctypes.get_errno())}"


def _prefault(addr: int, length: int) -> str:
    """Fault in every page now. Raises TierIOError when the kernel cannot back them."""
    if _LIBC.madvise(addr, length, MADV_POPULATE_WRITE) == 0:
        return "MADV_POPULATE_WRITE"
    err = ctypes.get_errno()
    if err != errno.EINVAL:  # EINVAL: a kernel older than 5.14; anything else is real
        raise TierIOError(f"cannot fault in the {length}-byte arena: {_errno_text(err)}")
    ctypes.memset(addr, 0, length)
    return "memset"


ON_DEMAND = "none: THP pages fault in at their first write"


def _place(mapping: _Mapping, node: int) -> tuple[str, str]:
    """mbind, then fault a hugetlb mapping in: (mbind outcome, prefault method). Unmaps on failure."""
    try:
        bound = _bind(mapping.addr, mapping.length, node)
        return bound, _prefault(mapping.addr, mapping.length) if mapping.hugetlb else ON_DEMAND
    except BaseException:
        _LIBC.munmap(mapping.addr, mapping.length)
        raise


def _make_arena(length: int, node: int, hugepages: bool) -> tuple[_Mapping, str, str]:
    """A bound mapping, pre-faulted if hugetlb: (mapping, mbind outcome, prefault method)."""
    mapping = _map_arena(length, hugepages)
    try:
        return (mapping, *_place(mapping, node))
    except TierIOError as exc:
        if not mapping.hugetlb:
            raise
        # mmap reserves from the global pool; the bound node may still hold too few.
        addr, thp = _map_thp(length)
        note = f"refused at fault-in on node {node}: {exc}; fell back to THP"
        mapping = _Mapping(addr, length, False, note, thp)
        return (mapping, *_place(mapping, node))


_VMA = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def _smaps_kib(addr: int, length: int) -> dict[str, int]:
    """Sum of smaps' kB fields over the mappings inside [addr, addr + length)."""
    totals: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = _VMA.match(line)
            if head:
                start, end = int(head[1], 16), int(head[2], 16)
                inside = start < addr + length and end > addr
                continue
            if inside and line.endswith(" kB\n"):
                field, _, value = line.partition(":")
                if field == "KernelPageSize":
                    totals[field] = max(totals.get(field, 0), int(value.split()[0]))
                else:
                    totals[field] = totals.get(field, 0) + int(value.split()[0])
    return totals


def _nodes_of(addr: int, length: int, page: int) -> str:
    """Nodes that sampled pages really sit on (get_mempolicy MPOL_F_NODE|MPOL_F_ADDR)."""
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        return "unknown: no get_mempolicy syscall number"
    pages = max(1, length // page)
    nodes = set()
    for i in sorted({p * (pages - 1) // max(1, NODE_SAMPLES - 1) for p in range(NODE_SAMPLES)}):
        node = ctypes.c_int(-1)
        rc = _LIBC.syscall(calls[1], ctypes.byref(node), None, ctypes.c_ulong(0),
                           ctypes.c_void_p(addr + i * page), ctypes.c_ulong(MPOL_F_NODE | MPOL_F_ADDR))
        if rc != 0:
            return f"unknown: get_mempolicy {_errno_text(ctypes.get_errno())}"
        nodes.add(node.value)
    return ",".join(map(str, sorted(nodes)))


def _page_facts(mapping: _Mapping) -> dict[str, str]:
    """Page size, huge bytes and nodes the kernel reports for the mapping now."""
    try:
        kib = _smaps_kib(mapping.addr, mapping.length)
    except OSError as exc:  # no /proc: say so rather than guess
        return {"page_size": f"unknown: {exc}", "numa_nodes_observed": "unknown"}
    page_kib = kib.get("KernelPageSize", 4)
    hugetlb = (kib.get("Private_Hugetlb", 0) + kib.get("Shared_Hugetlb", 0)) * 1024
    thp = kib.get("AnonHugePages", 0) * 1024
    if page_kib == HUGE_PAGE // 1024:
        size = "2 MiB (hugetlb)"
    else:
        size = f"{page_kib} KiB" + (" + THP" if thp else " (no THP obtained)" if kib.get("Rss", 0)
                                    else " (nothing faulted in yet)")
    return {
        "page_size": size,
        "hugetlb_bytes": str(hugetlb),
        "thp_bytes": str(thp),
        "resident_bytes": str(kib.get("Rss", 0) * 1024 + hugetlb),
        "numa_nodes_observed": _nodes_of(mapping.addr, mapping.length, page_kib * 1024),
    }


class CXLTier(ArenaTier):
    """A process-local arena tier in hugepage memory bound to one NUMA node.

    Args:
        capacity_bytes: frame bytes the tier admits.
        name: unique within a store.
        numa_node: node to bind to; default the highest-numbered online node
            (the far one, where a CXL expander appears).
        max_entries: slot count; see ``default_max_entries``.
        hugepages: try ``MAP_HUGETLB`` first; False goes straight to THP.

    Raises:
        InvalidInput: a bad capacity or slot count, or ``numa_node`` is not an
            online node (a config error, refused before anything is mapped).
        TierIOError: the kernel could not map or fault in the arena.

    A failed ``mbind`` on an online node is not an error: the arena works,
    unbound, and ``stats().details["mbind"]`` says why it failed.
    """

    kind = "cxl"
    durable = False
    shared = False

    def __init__(self, capacity_bytes: int, *, name: str = "cxl", numa_node: int | None = None,
                 max_entries: int | None = None, hugepages: bool = True) -> None:
        super().__init__(capacity_bytes, name=name, max_entries=max_entries)
        self.numa_node = _check_node(numa_node)
        self.map_bytes = -(-self.arena_bytes // HUGE_PAGE) * HUGE_PAGE
        self._map, self._mbind, self._prefault = _make_arena(self.map_bytes, self.numa_node, hugepages)
        self._unmap = weakref.finalize(self, _LIBC.munmap, self._map.addr, self._map.length)
        # Not at exit: the kernel frees it anyway, and a daemon thread may still be copying.
        self._unmap.atexit = False
        raw = (ctypes.c_uint8 * self.map_bytes).from_address(self._map.addr)
        self._arr: np.ndarray | None = np.frombuffer(raw, np.uint8)
        self._inflight = 0
        self._map_cond = threading.Condition(threading.Lock())
        self._facts = _page_facts(self._map)
        self._facts_at = time.monotonic()

    # -- the mapping, guarded against close ------------------------------------------

    # Plain enter/leave rather than a @contextmanager: every copy goes through
    # here, and a generator-based context costs ~1.5 us, a fifth of a small put.
    def _enter(self) -> np.ndarray:
        """The arena as a uint8 array, kept mapped until the matching ``_leave``."""
        with self._map_cond:
            arr = self._arr
            if arr is None:
                raise StoreClosed(f"tier {self.name!r} is closed")
            self._inflight += 1
            return arr

    def _leave(self) -> None:
        with self._map_cond:
            self._inflight -= 1
            if self._arr is None and not self._inflight:
                self._map_cond.notify_all()  # close is waiting for us

    def _close_arena(self) -> None:
        with self._map_cond:
            self._arr = None
            self._map_cond.wait_for(lambda: self._inflight == 0)
        self._unmap()

    # -- moving bytes ----------------------------------------------------------------

    def _copy_in(self, offset: int, frame: memoryview) -> None:
        if not len(frame):
            return
        arr = self._enter()
        try:
            # numpy's copy is a memcpy that releases the GIL; memoryview assignment keeps it.
            np.copyto(arr[offset:offset + len(frame)], np.frombuffer(frame, np.uint8))
        finally:
            self._leave()

    def _copy_out(self, offset: int, length: int) -> Buffer:
        arr = self._enter()
        try:
            return arr[offset:offset + length].copy()
        finally:
            self._leave()

    @contextlib.contextmanager
    def _lent(self, offset: int, length: int) -> Iterator[memoryview]:
        arr = self._enter()  # kept mapped while lent: close waits for us
        try:
            with memoryview(arr[offset:offset + length]) as view:
                yield view
        finally:
            self._leave()

    def _copy_out_into(self, offset: int, length: int, out: memoryview) -> None:
        if not length:
            return
        arr = self._enter()
        try:
            np.copyto(np.asarray(out)[:length], arr[offset:offset + length])
        finally:
            self._leave()

    def _move(self, moves: list[Move]) -> None:
        self._enter()
        try:
            for m in moves:  # ranges may overlap: memmove, never memcpy
                ctypes.memmove(self._map.addr + m.dst, self._map.addr + m.src, m.size)
        finally:
            self._leave()

    def _fill(self, offset: int, size: int, writer: FrameWriter) -> int:
        view = memoryview(self._enter()[offset:offset + size])
        try:
            return writer(view)
        finally:
            try:
                view.release()
            except BufferError:  # the writer kept an export; the slot outlives it anyway
                pass
            self._leave()

    # -- what an operator sees -------------------------------------------------------

    def _release_pages(self, offset: int, length: int) -> int:
        """A THP arena's whole huge pages inside the free range, dropped (``MADV_DONTNEED``: the
        next write faults in a zeroed page). A hugetlb arena keeps its pages: they are reserved
        for it at mmap, and its puts never fault."""
        start, end = -(-offset // HUGE_PAGE) * HUGE_PAGE, (offset + length) // HUGE_PAGE * HUGE_PAGE
        if self._map.hugetlb or end <= start:
            return 0
        self._enter()  # kept mapped while the kernel drops its pages
        try:
            if _LIBC.madvise(self._map.addr + start, end - start, MADV_DONTNEED) != 0:
                return 0  # the pages stay: nothing is lost but the memory
        finally:
            self._leave()
        return end - start

    def _refresh_facts(self) -> None:
        """Re-read THP facts when stale; hugetlb pages cannot change under us."""
        if self._map.hugetlb or time.monotonic() - self._facts_at < FACTS_TTL_S:
            return
        try:
            self._enter()
        except StoreClosed:  # unmapped: keep the last facts read
            return
        try:
            self._facts = _page_facts(self._map)
            self._facts_at = time.monotonic()
        finally:
            self._leave()

    def _details(self) -> dict[str, str]:
        self._refresh_facts()
        backing = "MAP_HUGETLB" if self._map.hugetlb else f"MADV_HUGEPAGE ({self._map.thp_note})"
        return {
            "backing": f"anonymous mmap, {backing}",
            "map_bytes": str(self.map_bytes),
            "hugetlb": self._map.hugetlb_note,
            **self._facts,
            "numa_node_requested": str(self.numa_node),
            "mbind": self._mbind,
            "prefault": self._prefault,
            "latency_model": "none: native DRAM speed (wrap in tiers.latency.LatencyTier to model CXL)",
        }


def _check_node(numa_node: int | None) -> int:
    nodes = online_nodes()
    if numa_node is None:
        return max(nodes)
    if isinstance(numa_node, bool) or not isinstance(numa_node, int) or numa_node not in nodes:
        raise InvalidInput(f"numa_node must be an online node ({nodes}), got {numa_node!r}")
    return numa_node

"""The reliability scenarios, as functions that run one and return its figures.

``tests/reliability/test_*.py`` assert on the figures; ``kvstore bench reliability`` runs the
same scenarios at full size and tabulates them. Each uses real processes: ``kvstore serve``
(``serve_process.ServeProcess``), client processes started by module name
(``python -m bench.reliability_kit.load_worker``: importable wherever kvstore is installed),
and real files and shared memory.

``run_crashes`` is the crash scenario: cycles of a storm of ``crash_client`` processes, a
``kill -9`` of the server, and a restart that checks every acknowledged put. Its parameters
make the server move acknowledged data while it dies, and prove it did before each kill:

- the log layout's compactor (``mode="scratch"``, ``watch="compactions"``, small segments
  through ``log_tier``): the clients also put and delete scratch sequences, so sealed segments
  turn mostly dead and the compactor rewrites the acknowledged frames beside them;
- background demotion (``mode="demote"``, ``watch="demotions"``, ``KVSTORE_TIERS=shm,nvme``
  with a small shm tier): a put is acknowledged once placement's demotion made it durable.
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from client_sdk import KVClient
from bench.reliability_kit.crash_client import NAMESPACE as CRASH_NAMESPACE
from bench.reliability_kit.crash_client import SPEC, scratch, sequence
from bench.reliability_kit.load_worker import FAMILIES, NAMESPACE, PER_FAMILY, SPECS, expected_kv, matches, tokens_of
from bench.reliability_kit.serve_process import ServeProcess
from bench.serving import free_port

__all__ = ["WORKERS", "CLIENTS", "run_load", "run_crashes", "CRASHES", "WATCHES", "churn", "crash_env", "damage",
           "fuzz_blocks"]


WORKERS = 16


def run_load(tmp_path, ops_per_worker: int, seed: int = 0, lossy: bool = False, restart: bool = False) -> dict:
    """The scenario against a fresh server; its figures.

    Args:
        lossy: keep the cold tiers' default int8 and check gets within its rounding;
            otherwise every tier is raw and gets are checked bit for bit.
        restart: once the workers have made ``RESTART_AFTER_PUTS`` puts, stop the server and start
            another on the same port and data: co-located workers hold the old arena mapped
            and must map the new one (its shm segments are new), never read the old as the new.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # Upper tiers of a few MiB against ~40 MiB of sequences: puts push blocks down, gets
    # pull them back up, and deletes and evictions race both.
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "data"), KVSTORE_SHM_BYTES="4MiB", KVSTORE_CXL_BYTES="4MiB",
               KVSTORE_NVME_BYTES="512MiB", KVSTORE_STAGING_BYTES="32MiB", KVSTORE_LOG_LEVEL="warning")
    if not lossy:  # every tier raw: then any difference from the expected KV is wrong KV
        env["KVSTORE_TIER_CODECS"] = "cxl=raw,nvme=raw"
    if restart:  # more of the sequences stay in the arena, where co-located gets read with no request
        env["KVSTORE_SHM_BYTES"] = "24MiB"
    server = ServeProcess(env).start()
    restarted = False
    try:
        workers = [subprocess.Popen([sys.executable, "-m", "bench.reliability_kit.load_worker", server.url, str(w),
                                     str(ops_per_worker), str(seed), *(["lossy"] if lossy else [])],
                                    stdout=subprocess.PIPE, text=True)
                   for w in range(WORKERS)]
        if restart:
            restarted = _restart_midway(server, workers)
        results, failed = [], []
        for w, proc in enumerate(workers):
            out, _ = proc.communicate(timeout=3600)
            if proc.returncode:
                failed.append((w, proc.returncode))
            else:
                results.append(json.loads(out.strip().splitlines()[-1]))
        swept = _sweep(server.url, lossy)
        moves = httpx.get(f"{server.url}/admin/moves", params={"limit": 10_000}, timeout=30).json()["moves"]
        health = httpx.get(f"{server.url}/healthz", timeout=10).status_code
    finally:
        server.stop()
    latencies: dict[str, list[float]] = {}
    for r in results:
        for op, ts in r["latencies"].items():
            latencies.setdefault(op, []).extend(ts)
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
    figures = {
        "ops": sum(r["ops"] for r in results), "failed_workers": failed,
        "mismatches": sum(r["mismatches"] for r in results) + swept["mismatches"],
        "verified_tokens": sum(r["verified_tokens"] for r in results) + swept["tokens"],
        "errors": dict(errors), "moves": len(moves), "health": health, "swept_mismatches": swept["mismatches"],
        "examples": [e for r in results for e in r["examples"]][:10],
        "media": sorted({r["medium"] for r in results if r["medium"]}),
        "gets_with_no_request": sum(r.get("gets_with_no_request", 0) for r in results),
        "restarted": restarted,
        "arenas_mapped": [len(r.get("arenas_mapped", [])) for r in results],
        "arenas_read": len({a for r in results for a in r.get("arenas_read", [])}),
        "p50_ms": {op: 1e3 * statistics.median(ts) for op, ts in latencies.items()},
        "p99_ms": {op: 1e3 * sorted(ts)[int(0.99 * (len(ts) - 1))] for op, ts in latencies.items()},
    }
    return figures


RESTART_AFTER_PUTS = 200
"""Puts the workers make before ``run_load(restart=True)`` restarts the server: about half of the
test's run (16 workers of 80 operations, 30% puts)."""


def _puts(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(r'^kvstore_store_ops_total\{counter="put_calls"\} ([0-9.e+]+)$', text, re.M)
    if match is None:
        raise RuntimeError("/metrics shows no put_calls counter (kvstore_store_ops_total)")
    return int(float(match.group(1)))


def _restart_midway(server: ServeProcess, workers: list[subprocess.Popen]) -> bool:
    """Once the workers made ``RESTART_AFTER_PUTS`` puts (or all exited first: False), stop the
    server and start another on its port and data directory."""
    deadline = time.monotonic() + 300
    while _puts(server.url) < RESTART_AFTER_PUTS:
        if all(w.poll() is not None for w in workers):
            return False
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers made fewer than {RESTART_AFTER_PUTS} puts in 300 s")
        time.sleep(0.05)
    server.stop()
    server.start()
    return True


def _sweep(url: str, lossy: bool) -> dict:
    """After the storm: every sequence reads back as its expected prefix, whatever survived."""
    mismatches = tokens = 0
    with KVClient(url, namespace=NAMESPACE, colocated=False, plan=False) as client:
        for which, spec in enumerate(SPECS):
            for seq in range(FAMILIES * PER_FAMILY):
                toks = tokens_of(seq)
                kv, n = client.get_kv(spec, toks)
                tokens += n
                if n and not matches(kv, expected_kv(which, toks[:n]), lossy):
                    mismatches += 1
    return {"mismatches": mismatches, "tokens": tokens}


CLIENTS = 4
PUTS_PER_CYCLE = 20_000
"""Room for one client's puts in a cycle (it makes a few hundred): cycle c numbers them from c * this."""


def crash_env(data: Path, **settings: str) -> dict[str, str]:
    """The crash scenario's server environment; ``settings`` adds or replaces KVSTORE_* variables
    (``KVSTORE_NVME_LAYOUT="log"``, ``KVSTORE_TIERS="shm,nvme"``...)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    # raw on nvme (a cold tier keeps int8 by default): then any difference is damage, not rounding
    env.update(KVSTORE_DATA_DIR=str(data), KVSTORE_TIERS="nvme", KVSTORE_TIER_CODECS="nvme=raw",
               KVSTORE_LOG_LEVEL="warning")
    env.update(settings)
    return env


_SERVE_WITH_LOG_TIER = """\
import json, sys
from tiers.nvme_log import LogTier
LogTier.__init__.__kwdefaults__.update(json.loads(sys.argv[1]))
from kvstore.cli.main import main
sys.exit(main(sys.argv[2:]))
"""
"""``kvstore serve`` with other defaults for the log tier's keyword settings (segment size, the
compactor's interval and dead fraction): no KVSTORE_* variable sets them, and a test needs
segments small enough to fill, seal and be compacted within a storm of a second or two."""


def _crash_server(data: Path, port: int, settings: dict[str, str], log_tier: dict | None) -> ServeProcess:
    env = crash_env(data, **settings)
    if not log_tier:
        return ServeProcess(env, port=port)
    cmd = [sys.executable, "-c", _SERVE_WITH_LOG_TIER, json.dumps(log_tier), "serve", "--port", str(port)]
    return ServeProcess(env, port=port, cmd=cmd)


def _compactions(stats: dict) -> int:
    """Segments the log tier compacted (rewrote and removed) since the server started."""
    return sum(int(t["details"].get("compactions", 0)) for t in stats["tiers"])


def _demotions(stats: dict) -> int:
    """Blocks placement moved down a tier (shm -> nvme) since the server started."""
    return int(stats["moves"]["demoted"])


WATCHES = {"compactions": _compactions, "demotions": _demotions}
"""What a scenario may prove happened during each storm: a counter of ``/admin/stats``."""


def _watched(url: str, watch: str) -> int:
    return WATCHES[watch](httpx.get(f"{url}/admin/stats", timeout=30).json())


def _await_rise(url: str, watch: str, since: int, clients: list[subprocess.Popen], timeout_s: float = 120) -> None:
    """Return once ``watch`` rose above ``since`` (the kill may then come at any point of that work);
    RuntimeError if it did not within ``timeout_s`` or a client exited first: the storm proved nothing."""
    deadline = time.monotonic() + timeout_s
    while _watched(url, watch) <= since:
        if any(proc.poll() is not None for proc in clients):
            raise RuntimeError(f"a crash client exited before any {watch} (exit codes {[p.poll() for p in clients]})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {watch} during the storm in {timeout_s:.0f} s")
        time.sleep(0.05)


@dataclass
class _Report:
    """What one crash client said before the kill (``crash_client``'s lines)."""

    acked: list[int] = field(default_factory=list)
    """Puts acknowledged as durable, in the order acknowledged."""
    stored: set[int] = field(default_factory=set)
    """Puts stored but reported not yet durable (``~i``)."""
    scratched: set[int] = field(default_factory=set)
    """Puts whose scratch sequence was put and deleted (``-i``)."""
    in_flight: int = 0
    """The put it had started when the server died: one past the last it reported."""
    exit_code: int = 0
    """Non-zero: the client failed on its own (killed by the scenario, or ended by the server's
    death, is 0)."""

    @classmethod
    def parse(cls, out: str, start: int, exit_code: int) -> "_Report":
        """The report of a client that numbered its puts from ``start``."""
        report = cls(exit_code=exit_code)
        last = start - 1
        for line in out.splitlines():  # a line is only ever written whole
            if line.startswith("~"):
                report.stored.add(int(line[1:]))
            elif line.startswith("-"):
                report.scratched.add(int(line[1:]))
            elif line.strip():
                report.acked.append(int(line))
            else:
                continue
            last = max(last, int(line.lstrip("~-")))
        report.in_flight = last + 1
        return report


def _cycle(server: ServeProcess, cycle: int, rng: random.Random, mode: str,
           watch: str | None) -> tuple[dict[int, _Report], int]:
    """One storm and kill: each client's report, and how far ``watch`` rose between the clients
    being ready and the kill (0 without one)."""
    start = cycle * PUTS_PER_CYCLE
    clients = [subprocess.Popen([sys.executable, "-m", "bench.reliability_kit.crash_client", server.url, str(c),
                                 str(start), mode], stdout=subprocess.PIPE, text=True)
               for c in range(CLIENTS)]
    rose = 0
    try:
        for c, proc in enumerate(clients):
            assert proc.stdout is not None
            if (line := proc.stdout.readline()) != "ready\n":
                raise RuntimeError(f"crash client {c} did not start (exit {proc.poll()}, said {line!r})")
        since = _watched(server.url, watch) if watch else 0
        if watch:
            _await_rise(server.url, watch, since, clients)
        proc_timer = rng.uniform(0.3, 2.0)
        try:
            clients[0].wait(timeout=proc_timer)  # a client that dies early fails the test below
        except subprocess.TimeoutExpired:
            pass
        if watch:  # read just before the kill: what this storm did, the server's start-up excluded
            rose = _watched(server.url, watch) - since
        server.kill()  # SIGKILL, mid-storm
    finally:
        for proc in clients:
            proc.kill()
    reports = {}
    for c, proc in enumerate(clients):
        out, _ = proc.communicate(timeout=30)
        # -9: killed by us; 0: it saw the server go (ConnectionFailed); else it failed on its own
        reports[c] = _Report.parse(out, start, 0 if proc.returncode in (0, -9) else proc.returncode)
    return reports, rose


def _segments(data: Path) -> list[tuple[int, Path]]:
    """The log layout's segment files (``<id>.open``, ``<id>.seg``) by id: the order they were written."""
    seg_dir = data / "nvme-log" / "segments"
    found = [(int(p.stem, 16), p) for p in seg_dir.glob("*.*") if p.suffix in (".open", ".seg")] \
        if seg_dir.is_dir() else []
    return sorted(found)


def _copied_frames(data: Path, after: int) -> int:
    """Frame records in segments numbered above ``after`` that a compaction copied there, read from
    the files as the kill left them: a copy keeps its record's seq, so it sits after records of
    higher seqs (fresh appends take ever higher seqs, segment after segment)."""
    from tiers.nvme_log_format import FRAME, scan

    copied = top = 0
    for seg_id, path in _segments(data):
        fd = os.open(path, os.O_RDONLY)
        try:  # headers only; the scan stops where a torn tail starts, as the next start does
            for rec in scan(fd, os.fstat(fd).st_size, verify=False):
                copied += seg_id > after and rec.kind == FRAME and rec.seq < top
                top = max(top, rec.seq)
        finally:
            os.close(fd)
    return copied


def _same_or_prefix(client: KVClient, tokens: list[int]) -> tuple[int, bool]:
    """What a get of ``tokens`` serves: (tokens, whether they are bit for bit the put's prefix)."""
    kv, n = client.get_kv(SPEC, tokens)
    return n, (not n or torch.equal(kv, expected_kv(0, tokens[:n])))


def _check_cycle(client: KVClient, reports: dict[int, _Report], all_acked: list[tuple[int, int]],
                 figures: dict, mode: str) -> None:
    """After a restart: every put not acknowledged serves a bit-exact prefix or nothing, every
    deleted scratch sequence nothing, and every acknowledged put so far (this cycle's and all
    before) all of itself, bit for bit."""
    for c, report in reports.items():
        all_acked.extend((c, i) for i in report.acked)
        figures["acknowledged"] += len(report.acked)
        figures["acknowledged_after_demotion"] += len(report.stored.intersection(report.acked))
        for i in sorted(report.stored.difference(report.acked)) + [report.in_flight]:
            n, exact = _same_or_prefix(client, sequence(c, i))
            figures["in_flight_found"] += bool(n)
            figures["torn_served"] += not exact
        for i in report.acked if mode == "scratch" else ():
            if i in report.scratched:  # its delete returned: the scratch must not come back
                figures["deleted_checked"] += 1
                figures["resurrected"] += client.lookup(SPEC, scratch(c, i)) > 0
            else:  # put or being deleted as the server died: a prefix or nothing
                figures["torn_served"] += not _same_or_prefix(client, scratch(c, i))[1]
    for c, i in all_acked:
        tokens = sequence(c, i)
        n, exact = _same_or_prefix(client, tokens)
        figures["checked"] += 1
        figures["lost"] += n < len(tokens)
        figures["torn_served"] += n == len(tokens) and not exact


CRASHES: dict[str, dict] = {
    "group commit": {},
    "compaction": {"mode": "scratch", "watch": "compactions",
                   "log_tier": {"segment_bytes": 512 << 10, "compact_interval_s": 0.05}},
    "demotion": {"mode": "demote", "watch": "demotions", "KVSTORE_TIERS": "shm,nvme", "KVSTORE_SHM_BYTES": "4MiB"},
}
"""The crash scenarios, as ``run_crashes`` arguments (module docstring):

- group commit: the nvme tier alone, the log layout under its group commit (the defaults);
- compaction: 512 KiB segments (a few dozen 32 KiB blocks) looked at for compaction within 50 ms of
  sealing (defaults: 64 MiB, 1 s), clients putting and deleting scratch sequences beside;
- demotion: four clients' puts (128-384 KiB each) overrun a 4 MiB shm tier at once: placement
  demotes to nvme all the time, and puts past its high watermark spill there directly (durable at
  once). The checking server runs on the same tiers: its gets promote what they read, its clean
  stop drops shm, and the next cycle finds an acknowledged put only where the promotion kept its
  durable copy (``IndexEntry.kept``)."""


def run_crashes(tmp_path: Path, cycles: int, seed: int = 0, *, mode: str = "durable", watch: str | None = None,
                log_tier: dict | None = None, **settings: str) -> dict:
    """Cycles of: a server on ``tmp_path``'s data, a storm of ``CLIENTS`` crash clients, kill -9 at a
    seeded moment, a restart that checks every put (``_check_cycle``).

    Args:
        mode: the crash clients' (``crash_client``): ``durable``, ``scratch`` or ``demote``.
        watch: a counter of ``WATCHES`` (``compactions``, ``demotions``) that must rise during each
            storm before the kill is timed; figures[watch] sums the rises.
        log_tier: the log tier's keyword settings for both servers (``_SERVE_WITH_LOG_TIER``).
        settings: KVSTORE_* settings of the server under the storm (``crash_env``).

    Returns:
        ``{"cycles", "acknowledged", "checked", "lost", "torn_served", "in_flight_found",
        "client_errors", ...}``, with ``acknowledged_after_demotion`` (puts first ``NotDurable``,
        acknowledged once demoted), ``deleted_checked`` and ``resurrected`` (scratch sequences
        deleted, and found again), ``copied_frames`` (compacted copies on disk at the kills, log
        layout) and the watched counter's total and ``<watch>_by_cycle``.
    """
    rng = random.Random(seed)
    data, port = tmp_path / "data", free_port()
    all_acked: list[tuple[int, int]] = []
    figures = {"cycles": 0, "acknowledged": 0, "checked": 0, "lost": 0, "torn_served": 0, "in_flight_found": 0,
               "client_errors": 0, "acknowledged_after_demotion": 0, "deleted_checked": 0, "resurrected": 0,
               "copied_frames": 0}
    if watch:
        figures[watch], figures[f"{watch}_by_cycle"] = 0, []
    for cycle in range(cycles):
        before = max((i for i, _ in _segments(data)), default=0)  # this storm's server writes the ones after
        server = _crash_server(data, port, settings, log_tier).start()
        reports, rose = _cycle(server, cycle, rng, mode, watch)
        # each client makes progress; a demote client's acknowledgements wait on placement, so
        # there the cycle needs one at least
        progressed = any if mode == "demote" else all
        assert progressed(r.acked for r in reports.values()), f"no acknowledgements in cycle {cycle}: {reports}"
        figures["client_errors"] += sum(bool(r.exit_code) for r in reports.values())
        figures["copied_frames"] += _copied_frames(data, before)
        if watch:
            figures[watch] += rose
            figures[f"{watch}_by_cycle"].append(rose)
        server = _crash_server(data, port, settings, log_tier).start()
        try:
            with KVClient(server.url, namespace=CRASH_NAMESPACE, colocated=False, plan=False) as client:
                _check_cycle(client, reports, all_acked, figures, mode)
        finally:
            server.stop()
        stray = [p for p in data.rglob("*.tmp") if "quarantine" not in p.parts]
        assert not stray, f"temp files among the data after a restart: {stray[:5]}"
        figures["cycles"] += 1
    return figures


def churn(tmp_path: Path, cycles: int) -> dict:
    """``memory_churn`` in its own process (a clean resident set); its figures."""
    done = subprocess.run([sys.executable, "-m", "bench.reliability_kit.memory_churn", str(cycles), str(tmp_path)],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"memory_churn failed: {done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def damage(frame: bytes, rng: random.Random) -> bytes:
    """``frame`` with one bit flipped, cut short, extended, or replaced by random bytes."""
    how = rng.choice(("flip", "truncate", "extend", "random"))
    if how == "flip":
        at = rng.randrange(len(frame))
        return frame[:at] + bytes([frame[at] ^ (1 << rng.randrange(8))]) + frame[at + 1:]
    if how == "truncate":
        return frame[:rng.randrange(len(frame))]
    if how == "extend":
        return frame + rng.randbytes(rng.randint(1, 64))
    return rng.randbytes(rng.randint(0, 4096))


def fuzz_blocks(tmp_path: Path, cases: int, seed: int = 0) -> dict:
    """Damaged frames to ``PUT /v1/blocks/{key}`` and ``POST /v1/blocks/put`` of a fresh server.

    Returns:
        ``{"cases", "statuses": {status: count}, "5xx", "stored", "healthy"}``: "stored" counts
        damaged frames the server kept (must be 0).
    """
    from client_sdk.media import encode_blocks

    rng = random.Random(seed)
    tokens = list(range(12_000, 12_016))
    [(key, frame)] = [(bytes(k), bytes(f)) for k, f in encode_blocks(SPECS[0], tokens, expected_kv(0, tokens), "fuzz")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(KVSTORE_DATA_DIR=str(tmp_path / "fuzz-data"), KVSTORE_LOG_LEVEL="warning")
    server = ServeProcess(env).start()
    statuses: Counter[int] = Counter()
    stored = 0
    try:
        with httpx.Client(base_url=server.url, headers={"X-KV-Namespace": "fuzz"}, timeout=30) as http:
            for _ in range(cases):
                bad = damage(frame, rng)
                statuses[http.put(f"/v1/blocks/{key.hex()}", content=bad).status_code] += 1
                body = json.dumps({"blocks": [{"key": key.hex(), "frame": bad.hex()}]})
                statuses[http.post("/v1/blocks/put", content=body,
                                   headers={"content-type": "application/json"}).status_code] += 1
                if http.head(f"/v1/blocks/{key.hex()}").status_code == 200:
                    stored += 1
                    http.delete(f"/v1/blocks/{key.hex()}")
            healthy = http.get("/healthz").status_code == 200
    finally:
        server.stop()
    return {"cases": 2 * cases, "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "5xx": sum(v for k, v in statuses.items() if k >= 500), "stored": stored, "healthy": healthy}

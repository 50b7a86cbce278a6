"""``kvstore bench steady --quick``: every row, the full stores really full, their policies at work.

No timing is asserted (figures live in docs/benchmarks.md); what is checked is that the bench
measures what it says: both full stores were filled to their top tier's high watermark, the
default one kept every block and spilled what its band could not hold, and the evicting one
dropped its coldest blocks.
"""

import json

from bench.steady import SIZES, run


def test_the_steady_bench_fills_two_stores_and_reports_every_row(tmp_path):
    result = run(quick=True, out_dir=tmp_path)
    rows = {(r["size"], r["medium"]): r for r in result["rows"]}
    assert set(rows) == {(size, medium) for size, *_ in SIZES for medium in ("co-located", "HTTP")}
    for row in rows.values():
        assert all(row[store]["mb_s"] > 0 for store in ("empty", "full", "full evict"))
        assert row["full / empty"] > 0 and row["full evict / empty"] > 0
    full, evict = result["full stores"]["full"], result["full stores"]["full evict"]
    assert full["filled_mib"] >= 200 and evict["filled_mib"] >= 200  # 256 MiB top tiers, filled first
    # spill keeps every block of a put: a 1 MiB put lands in the top tier's band or below it,
    # whichever the mover's room-ahead left it (timing), but all 16 blocks are somewhere
    assert sum(rows[("1 MiB", "co-located")]["full: last burst"].values()) == 16
    # a 32 MiB put never fits the band (5% of 256 MiB): spill sends it below the full top tier
    assert all(rows[("32 MiB", m)]["full: last burst"].get("nvme") for m in ("co-located", "HTTP"))
    assert full["moves during the samples"].get("demoted", 0) > 0  # writes above low made room ahead
    assert evict["moves during the samples"].get("evicted", 0) > 0  # evict: the coldest dropped
    assert "evicted" not in full["moves during the samples"]  # spill drops nothing (nvme has room)
    scale = result["scale"]  # a full top tier of 20k blocks against 2k, every put making room
    assert scale["sizes"] == [2_000, 20_000] and scale["ratio"] > 0
    assert all(f["blocks"] >= 0.85 * n for n, f in zip(scale["sizes"], scale["filled"].values()))
    assert all(m["demoted"] >= 16 for m in scale["moves"].values())
    latency = scale["latency"]  # the same stores with placement rounds running: put and get p50, p99
    assert all(latency[op][str(n)]["p99_ms"] >= latency[op][str(n)]["p50_ms"] > 0
               for op in ("put", "get") for n in scale["sizes"])
    assert all(latency["placement_rounds"][str(n)] >= 2 for n in scale["sizes"])  # a round each turn at least
    arena = result["arena_scale"]  # the arena allocator, full and churned: 20k frames against 2k
    assert arena["sizes"] == [2_000, 20_000] and all(r > 0 for r in arena["ratio"].values())
    assert arena["free_ranges"]["20000"] > 5 * arena["free_ranges"]["2000"]  # the holes grow with the arena
    writers = result["writers"]  # 1 and 4 writer threads in process, the store full: they spill
    assert writers["threads"] == [1, 4] and all(v > 0 for v in writers["puts_per_s"].values())
    assert writers["ratio"] > 0 and writers["blocks_by_tier"]["nvme"] > 0
    assert writers["recode"]["spilled_raw_blocks"] == 0  # 64 KiB blocks: quantized on the put's path
    many = result["clients"]  # 1 and 8 client processes, each op and medium, on the full store
    assert {(r["op"], r["medium"], r["clients"]) for r in many["rows"]} == {
        (op, medium, n) for op in ("put", "get") for medium in ("co-located", "HTTP") for n in (1, 8)}
    assert all(r["ops"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in many["rows"])
    spill = result["spill"]  # every variant wrote and synced; raw is its own yardstick
    assert set(spill["mb_s"]) == {"raw", "files, group commit", "log, group commit", "files, sync each put",
                                  "log, sync each put"}
    assert all(v > 0 for v in spill["mb_s"].values()) and spill["vs_raw"]["raw"] == 1.0
    assert json.loads((tmp_path / result["path"].split("/")[-1]).read_text())["rows"]


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def _settled(pid: int, want_stopped: bool, timeout_s: float = 10.0) -> bool:
    """Whether ``pid`` is (or is not) stopped within ``timeout_s``: a signal reaches a process
    running on the other core a moment after ``kill`` returns."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (_state(pid) == "T") == want_stopped:
            return True
        time.sleep(0.01)
    return False


def test_a_sample_stops_the_other_servers_and_continues_them_even_on_error():
    import subprocess
    import sys

    import pytest

    from bench.steady import _alone

    procs = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for name in ("empty", "full", "full evict")}
    pids = {name: p.pid for name, p in procs.items()}
    try:
        with pytest.raises(RuntimeError):
            with _alone(pids, "full"):
                assert _settled(pids["empty"], True) and _settled(pids["full evict"], True)
                assert _state(pids["full"]) != "T"  # the sampled store runs
                procs["empty"].kill()  # a neighbour dies meanwhile
                procs["empty"].wait()
                raise RuntimeError("a failed put")
        # continued, though the sample failed and a neighbour is gone
        assert _settled(pids["full evict"], False) and _settled(pids["full"], False)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()

"""``bench/placement.py``: a quick run end to end, Belady by hand, and the trace generators."""

import json
from collections import Counter, OrderedDict

import numpy as np
import pytest

from bench import placement as bp

TRACES = ["zipf-0.8", "zipf-1", "zipf-1.2", "zipf-1+scan", "shifting-hot", "agent-sessions", "oscillation"]


def test_quick_run_writes_every_row_the_json_and_the_plot(tmp_path):
    result = bp.run(quick=True, out_dir=tmp_path)
    rows = {(r["trace"], r["policy"]) for r in result["rows"]}
    expected = {(t, p) for t in TRACES for p in ("heat", "lru", "lfu", "belady")} | {("oscillation", "heat-nohyst")}
    assert rows == expected
    for r in result["rows"]:
        assert 0 <= r["hit_ratio"] <= 1 and r["moves"] >= 0 and r["bytes_moved"] >= 0
        assert r["moves_per_1k"] == pytest.approx(1000 * r["moves"] / (4_000 - 400))
    for r in result["rows"]:
        if r["policy"] == "belady":
            assert r["vs_belady"] == 1.0
        elif r["policy"] == "heat":
            assert r["moves"] > 0
    names = [c["name"] for c in result["checks"]]
    assert len(names) == 2 + len(TRACES) and all(isinstance(c["passed"], bool) for c in result["checks"])
    assert "Belady" in names[0] and "hysteresis" in names[-1]
    saved = json.loads((tmp_path / result["path"].rsplit("/", 1)[1]).read_text())
    assert saved["rows"] == result["rows"] and saved["checks"] == result["checks"]
    assert saved["setup"]["placement_defaults"]["hysteresis"] is True
    assert open(result["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    table = bp.format_table(result)
    assert all(t in table for t in TRACES) and "checks:" in table and "heat-nohyst" in table


def test_full_run_meets_the_placement_targets(tmp_path):
    """The acceptance targets on the full traces (seed 0). A simulation on a simulated
    clock: deterministic, so this guards the policy, not the machine's speed."""
    result = bp.run(out_dir=tmp_path)
    failed = [f"{c['name']}: {c['detail']}" for c in result["checks"] if not c["passed"]]
    assert not failed, failed


def test_belady_on_the_textbook_reference_string():
    # Silberschatz's example: 3 frames, optimal replacement takes 9 faults in 20 references.
    refs = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    got = bp.belady(refs, 3)
    assert (got["misses"], got["hits"], got["insertions"]) == (9, 11, 9)
    assert got["hit_ratio"] == pytest.approx(11 / 20)


def test_belady_by_hand_with_warmup():
    # capacity 2: 1 m, 2 m, 3 m (evicts 2: next used at 4, after 1 at 3), 1 h, 2 m, 1 h
    refs = [1, 2, 3, 1, 2, 1]
    assert bp.belady(refs, 2)["hits"] == 2
    warm = bp.belady(refs, 2, warmup=4)  # counts only the last two: 2 m, 1 h
    assert (warm["hits"], warm["misses"], warm["hit_ratio"]) == (1, 1, 0.5)
    assert warm["hit_ratio_all"] == pytest.approx(2 / 6)
    assert bp.belady([5, 5, 5], 1)["hits"] == 2


def _lru_hits(refs, capacity):
    cache, hits = OrderedDict(), 0
    for k in refs:
        if k in cache:
            hits += 1
            cache.move_to_end(k)
        else:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[k] = None
    return hits


@pytest.mark.parametrize("seed", range(5))
def test_belady_is_never_beaten_by_lru(seed):
    refs = np.random.default_rng(seed).integers(0, 30, 500).tolist()
    for capacity in (1, 5, 12):
        assert bp.belady(refs, capacity)["hits"] >= _lru_hits(refs, capacity)
    assert bp.belady(refs, 30)["misses"] == len(set(refs))  # everything fits: compulsory misses only


def test_traces_are_deterministic_and_seeded():
    a, b, c = bp.make_traces(quick=True), bp.make_traces(quick=True), bp.make_traces(quick=True, seed=1)
    assert [t.name for t in a] == TRACES
    for x, y, z in zip(a, b, c):
        assert np.array_equal(x.keys, y.keys) and x.params == y.params
        assert not np.array_equal(x.keys, z.keys)
        assert len(x.keys) == 4_000 and x.keys.dtype.kind == "i"
    assert [len(t.keys) for t in bp.make_traces()] == [40_000] * len(TRACES)


def test_zipf_skew_grows_with_alpha():
    shares = []
    for alpha in (0.8, 1.0, 1.2):
        keys = bp.zipf_trace(alpha, n_keys=1000, n_accesses=20_000, seed=3).keys
        assert keys.min() >= 0 and keys.max() < 1000
        shares.append(Counter(keys.tolist()).most_common(1)[0][1] / len(keys))
    assert shares[0] < shares[1] < shares[2]
    assert shares[1] == pytest.approx(1 / sum(1 / r for r in range(1, 1001)), rel=0.1)  # rank 1 of Zipf 1.0


def test_scan_trace_interleaves_one_off_sequential_scans():
    t = bp.scan_trace(n_keys=100, n_accesses=1_000, scan_len=40, scan_every=160, seed=0)
    keys = t.keys.tolist()
    assert keys[160:200] == list(range(100, 140)) and keys[360:400] == list(range(140, 180))
    scanned = [k for k in keys if k >= 100]
    assert len(scanned) == len(set(scanned))  # every scanned block is read once
    assert all(k < 100 for k in keys[:160] + keys[200:360])


def test_shifting_trace_moves_its_hot_set():
    t = bp.shifting_trace(n_keys=1000, n_accesses=8_000, hot_frac_keys=0.1, hot_frac_accesses=0.9,
                          period=2_000, seed=0)
    hot_sets = []
    for start in range(0, 8_000, 2_000):
        counts = Counter(t.keys[start:start + 2_000].tolist())
        hot = {k for k, n in counts.most_common(100)}
        assert sum(counts[k] for k in hot) / 2_000 > 0.85
        hot_sets.append(hot)
    assert all(len(hot_sets[i] & hot_sets[i + 1]) < 30 for i in range(3))


def test_oscillation_trace_alternates_two_disjoint_sets_after_the_cold_load():
    t = bp.oscillation_trace(hot_keys=20, cold_keys=100, n_accesses=1_100, phase_accesses=100, seed=0)
    keys = t.keys.tolist()
    cold = keys[:100]
    assert len(set(cold)) == 100 and not set(cold) & set(keys[100:])
    phases = [set(keys[s:s + 100]) for s in range(100, 1_100, 100)]
    a, b = phases[0], phases[1]
    assert not a & b and len(a | b) <= 40
    assert all(p <= (a if i % 2 == 0 else b) for i, p in enumerate(phases))


def test_sessions_trace_reads_prefix_chains_then_tails():
    t = bp.sessions_trace(n_accesses=3_000, n_prompts=2, prefix_blocks=4, active=3, first_tail=2, tail_growth=1,
                          mean_turns=3, seed=0)
    keys = t.keys.tolist()
    prompts = [list(range(0, 4)), list(range(4, 8))]
    starts = [i for i in range(len(keys) - 4) if keys[i:i + 4] in prompts]
    assert starts[0] == 0 and len(starts) > 50
    for s, e in zip(starts, starts[1:]):
        turn = keys[s + 4:e]
        assert len(turn) >= 3 and all(k >= 8 for k in turn)  # the session's own blocks follow the prompt
        assert turn[-1] == max(keys[:e])  # each turn ends by writing a never-seen block
    counts = Counter(keys)
    assert counts[0] > counts[max(keys[:1000])]  # shared prefix blocks are the hottest

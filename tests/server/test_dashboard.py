"""The dashboard's routes: the page and its assets, and the JSON it draws from
(watermarks, the heat histogram, the hit ratio history, entry filters)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from client_sdk import KVClient
from kvstore.keys import block_hashes
from server.admin import heat_histogram
from server.history import History, Sample, _point
from tests.conftest import FakeClock, make_kv
from tests.server.conftest import ACME, ADMIN, TOKENS, make_store

AUTH = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def env(serve_app):
    srv = serve_app(tokens=json.dumps(TOKENS), admin_token=ADMIN, history_interval_s=0.1)
    admin = KVClient(srv.url, token=ADMIN, namespace="acme", colocated=False)
    acme = KVClient(srv.url, token=ACME, namespace="acme", colocated=False)
    yield srv, admin, acme
    admin.close()
    acme.close()


def test_page_and_assets_need_no_token_and_hold_no_data(env, spec):
    srv, _, acme = env
    acme.put_kv(spec, list(range(32)), make_kv(spec, 32))
    key = srv.store.entries()[0].key.hex()
    for path, kind in (("/admin/ui", "text/html"), ("/admin/ui/dashboard.js", "text/javascript"),
                       ("/admin/ui/dashboard.css", "text/css")):
        resp = httpx.get(srv.url + path)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(kind), path
        csp = resp.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert key not in resp.text and "acme" not in resp.text  # static: the data comes from /admin with the token
    page = httpx.get(srv.url + "/admin/ui").text
    assert "http://" not in page and "https://" not in page.replace("http://www.w3.org", "")  # nothing from a CDN
    for bad in ("/admin/ui/secret.txt", "/admin/ui/..%2Fadmin.py", "/admin/ui/index.html/x"):
        resp = httpx.get(srv.url + bad)
        assert resp.status_code == 404 and resp.json()["error"]["type"] == "RouteNotFound", bad
    assert httpx.get(srv.url + "/admin/stats").status_code == 401  # the data routes still want the token
    assert httpx.get(srv.url + "/admin/stats", headers={"authorization": f"Bearer {ACME}"}).status_code == 403


def test_tiers_carry_their_watermarks(env):
    _, admin, _ = env
    tiers = admin.admin.tiers()
    assert [(t["name"], t["low_watermark_frac"], t["high_watermark_frac"]) for t in tiers] == \
        [("shm", 0.90, 0.95), ("memory", 0.90, 0.95)]


def test_heat_histogram_counts_every_entry_by_tier(env, spec):
    srv, admin, acme = env
    hot, cold = list(range(64)), list(range(1000, 1064))
    acme.put_kv(spec, hot, make_kv(spec, 64))
    acme.put_kv(spec, cold, make_kv(spec, 64))
    for _ in range(6):
        acme.get_kv(spec, hot)
    for key in block_hashes(spec, cold, "acme")[:2]:
        srv.store.migrate(key, "memory")
    heat = admin.admin.heat(bins=8)
    assert heat["entries"] == 8 and heat["sampled"] is False
    by_tier = {"shm": 0, "memory": 0}
    for b in heat["bins"]:
        assert b["lo"] < b["hi"]
        for t, n in b["counts"].items():
            by_tier[t] += n
    for t, n in heat["zero"].items():
        by_tier[t] += n
    assert by_tier == {"shm": 6, "memory": 2}
    assert [b["lo"] for b in heat["bins"]] == sorted(b["lo"] for b in heat["bins"])
    hottest = next(b for b in reversed(heat["bins"]) if sum(b["counts"].values()))
    assert hottest["counts"]["shm"] == 4  # the four blocks read six times are the hottest
    resp = httpx.get(f"{srv.url}/admin/heat", params={"bins": 0}, headers=AUTH)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "bins"


def test_heat_histogram_of_a_sample_scales_up_and_handles_one_rate():
    rates = [("a", 0.01)] * 5 + [("b", 0.0)] * 5
    h = heat_histogram(rates, ["a", "b"], 4, total=100)
    assert h["sampled"] is True and h["entries"] == 100
    assert len(h["bins"]) == 1 and h["bins"][0]["counts"] == {"a": 50, "b": 0}
    assert h["bins"][0]["lo"] <= 0.01 < h["bins"][0]["hi"]
    assert h["zero"] == {"a": 0, "b": 50}
    assert heat_histogram([], ["a"], 4, total=0) == {"bins": [], "zero": {"a": 0}, "entries": 0, "sampled": False,
                                                   "unit": "reads per second"}


def test_history_splits_the_hit_ratio_by_the_tier_that_served(env, spec):
    srv, admin, acme = env
    a, b = list(range(64)), list(range(5000, 5064))
    acme.put_kv(spec, a, make_kv(spec, 64))
    acme.put_kv(spec, b, make_kv(spec, 64))
    for key in block_hashes(spec, b, "acme"):
        assert srv.store.migrate(key, "memory")
    time.sleep(0.25)  # an idle interval or two of the live sampler first
    points = admin.admin.history()["points"]
    assert admin.admin.history()["interval_s"] == 0.1 and len(admin.admin.history(limit=2)["points"]) == 2
    idle = [p for p in points if p["tokens_requested"] == 0]
    assert idle and all(p["hit_ratio"] is None and set(p["tiers"].values()) == {None} for p in idle)
    # One interval sampled by hand, so all three gets fall in it: the split is exact.
    history = History(srv.store, interval_s=3600)
    history.sample()
    acme.get_kv(spec, a)
    acme.get_kv(spec, b)
    acme.get_kv(spec, list(range(9000, 9064)))  # a miss: 64 tokens asked, none served
    (point,) = history.points()
    assert point["tokens_requested"] == 3 * 64 and point["gets"] == 3
    assert point["hit_ratio"] == pytest.approx(2 / 3)
    assert point["tiers"] == pytest.approx({"shm": 1 / 3, "memory": 1 / 3})
    assert point["reads"] == {"shm": 4, "memory": 4}  # the block reads behind that split
    assert srv.store.stats().reads_by_tier == {"shm": 4, "memory": 4}
    later = admin.admin.history()["points"]  # the live sampler saw the same gets
    assert sum(p["tokens_requested"] for p in later) == 3 * 64
    assert all(sum(p["tiers"].values()) == pytest.approx(p["hit_ratio"]) for p in later if p["tokens_requested"])


def test_history_points_and_bounds():
    a = Sample(0.0, 100.0, 0, 0, 0, {"t1": 10})
    b = Sample(9.0, 105.0, 4, 64, 48, {"t1": 12, "t2": 1})  # the wall clock jumped: seconds come from the other
    p = _point(a, b, ["t1", "t2"])
    assert p["seconds"] == 5.0 and p["gets"] == 4 and p["hit_ratio"] == 0.75
    assert p["tiers"] == pytest.approx({"t1": 0.5, "t2": 0.25}) and p["reads"] == {"t1": 2, "t2": 1}
    only_blocks = _point(a, Sample(1.0, 101.0, 0, 0, 0, {"t1": 11}), ["t1"])  # a block route read: no tokens asked
    assert only_blocks["hit_ratio"] is None and only_blocks["tiers"] == {"t1": None}
    with pytest.raises(ValueError):
        History(None, interval_s=0)  # type: ignore[arg-type]


def test_entries_filter_by_heat_and_age(serve_app, spec):
    clock = FakeClock()
    srv = serve_app(make_store(clock=clock), tokens=json.dumps(TOKENS), admin_token=ADMIN, history_interval_s=0.1)
    admin = KVClient(srv.url, token=ADMIN, namespace="acme", colocated=False)
    acme = KVClient(srv.url, token=ACME, namespace="acme", colocated=False)
    old, new = list(range(32)), list(range(700, 732))
    acme.put_kv(spec, old, make_kv(spec, 32))
    clock.advance(1.5)  # ages the old entries (and their heat) by the store's clock: no sleep
    acme.put_kv(spec, new, make_kv(spec, 32))
    for _ in range(8):
        acme.get_kv(spec, new)
    old_keys = {k.hex() for k in block_hashes(spec, old, "acme")}
    new_keys = {k.hex() for k in block_hashes(spec, new, "acme")}
    assert {e["key"] for e in admin.admin.entries(min_age_s=0.75)["entries"]} == old_keys
    assert {e["key"] for e in admin.admin.entries(max_age_s=0.75)["entries"]} == new_keys
    rates = {e["key"]: e["heat_per_s"] for e in admin.admin.entries()["entries"]}
    cut = (max(rates[k] for k in old_keys) + min(rates[k] for k in new_keys)) / 2
    hot = admin.admin.entries(min_heat_per_s=cut)
    assert hot["total"] == 2 and {e["key"] for e in hot["entries"]} == new_keys
    assert {e["key"] for e in admin.admin.entries(max_heat_per_s=cut)["entries"]} == old_keys
    assert admin.admin.entries(min_heat_per_s=cut, namespace="beta")["total"] == 0
    resp = httpx.get(f"{srv.url}/admin/entries", params={"min_age_s": -1}, headers=AUTH)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "min_age_s"
    admin.close()
    acme.close()


def test_a_colocated_get_counts_each_block_read_once(serve_app, spec):
    """Blocks below shm come without a handle and are fetched by /v1/blocks/get, which counts them:
    the handles answer counts only the blocks read through a handle."""
    srv = serve_app()
    tokens = list(range(64))
    with KVClient(srv.url) as client:
        client.put_kv(spec, tokens, make_kv(spec, 64))
        keys = block_hashes(spec, tokens, "default")
        assert srv.store.migrate(keys[3], "memory")
        kv, n = client.get_kv(spec, tokens)
        assert n == 64 and client.stats.last_medium == "shm"
    assert srv.store.stats().reads_by_tier == {"shm": 3, "memory": 1}
    assert srv.store.entry(keys[3]).hits == 1


def _sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from /metrics text, labels matched in any order."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line.split(" ")[0] for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{labels} in /metrics")


def test_colocated_reads_agree_in_stats_metrics_and_the_dashboard(serve_app, spec):
    """Issue 22, item 6: two co-located gets served every token from shm. `kvstore stats`,
    /metrics and the dashboard's data report the same shm reads, none of them 0."""
    srv = serve_app(tokens=json.dumps(TOKENS), admin_token=ADMIN)
    tokens = list(range(96))
    with KVClient(srv.url, token=ACME, namespace="acme") as c:  # co-located: shm
        c.put_kv(spec, tokens, make_kv(spec, 96))
        for _ in range(2):
            kv, n = c.get_kv(spec, tokens)
            assert n == 96 and c.stats.last_medium == "shm"
        assert c.stats.shm_cached_gets == 2  # both found in the arena's key index: reported at close
    blocks = 96 // spec.block_tokens
    want = 2 * blocks

    cli = [sys.executable, "-m", "kvstore.cli", "stats", "--url", srv.url, "--token", ADMIN]
    out = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["counters"]["tokens_hit"] == stats["counters"]["tokens_requested"] == 2 * 96
    shm = next(t for t in stats["tiers"] if t["name"] == "shm")
    assert shm["reads"] == stats["reads_by_tier"]["shm"] == want
    assert shm["backend_counters"]["hits"] == 0  # the tier's own counters never saw those reads
    table = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    header = next(line for line in table.stdout.splitlines() if line.startswith("tier"))
    assert header.split()[-1] == "reads" and "hits" not in header
    row = next(line for line in table.stdout.splitlines() if line.startswith("shm "))
    assert int(row.split()[-1]) == want

    metrics = httpx.get(f"{srv.url}/metrics").text
    assert _sample(metrics, "kvstore_tier_reads_total", tier="shm") == want
    assert _sample(metrics, "kvstore_tier_hits_total", tier="shm") == want

    tiers = httpx.get(f"{srv.url}/admin/tiers", headers=AUTH).json()["tiers"]  # the dashboard's tier bars
    assert {t["name"]: t["reads"] for t in tiers} == {"shm": want, "memory": 0}
    history = httpx.get(f"{srv.url}/admin/history", headers=AUTH).json()["points"]  # its hit ratio chart
    assert sum(p["reads"]["shm"] for p in history) == want  # every point since the first sample, at start
    assert sum(p["tokens_requested"] for p in history) == 2 * 96
    busy = [p for p in history if p["tokens_requested"]]
    assert sum(p["tiers"]["shm"] * p["tokens_requested"] for p in busy) == pytest.approx(2 * 96)

"""``kvstore prefetch|retain|release`` and the ``kvstore serve`` flags of issue 24's settings,
against a real ``kvstore serve`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from bench.reliability_kit.serve_process import ServeProcess, small_env
from client_sdk import KVClient
from tests.conftest import make_kv, make_spec


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    """Auth off (loopback): the owner of a retention is ``anonymous``. A 48 KiB retention quota
    holds 5 blocks of the spec below; retentions of at most 100 s; hand-offs held 33 s."""
    data = tmp_path_factory.mktemp("serve")
    p = ServeProcess(small_env(data / "data"), "--retain-quota-bytes", "48KiB", "--retain-max-ttl-s", "100",
                     "--handoff-ttl-s", "33").start()
    yield p
    p.stop()


def _admin(proc, path: str) -> dict:
    return httpx.get(proc.url + path, timeout=10).json()


def _tiers(proc, namespace: str) -> list[str]:
    return [e["tier"] for e in _admin(proc, f"/admin/entries?namespace={namespace}&sort=age")["entries"]]


def test_prefetch_retain_release_commands(proc, tmp_path):
    spec = make_spec()
    tokens = list(range(64))
    with KVClient(proc.url, namespace="conv", colocated=False) as c:
        assert c.put_kv(spec, tokens, make_kv(spec, 64)) == 64
    for entry in _admin(proc, "/admin/entries?namespace=conv")["entries"]:
        httpx.post(proc.url + "/admin/migrate", json={"key": entry["key"], "tier": "nvme"}, timeout=10)
    assert _tiers(proc, "conv") == ["nvme"] * 4
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec.to_dict()))
    common = ("--url", proc.url, "--namespace", "conv", "--spec", str(spec_file), "--tokens", json.dumps(tokens))

    out = run("prefetch", *common)
    assert out.returncode == 0 and out.stdout.strip() == "prefetching 64 tokens", out.stderr
    deadline = time.monotonic() + 10
    while _tiers(proc, "conv") != ["shm"] * 4:
        assert time.monotonic() < deadline, _tiers(proc, "conv")
        time.sleep(0.05)

    out = run("retain", *common, "--ttl", "60", "--priority", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("retained 64 tokens (4 blocks, ") and "at priority 2" in out.stdout
    assert f"of {48 << 10} bytes" in out.stdout
    rows = _admin(proc, "/admin/entries?namespace=conv")["entries"]
    assert {r["retained"]["owner"] for r in rows} == {"anonymous"}
    explained = _admin(proc, f"/admin/explain/{rows[0]['key']}")["retained"]
    assert explained["priority"] == 2 and 0 < explained["expires_in_s"] <= 60

    out = run("release", *common)
    assert out.returncode == 0 and out.stdout.strip() == "released 4 blocks", out.stderr
    assert all(r["retained"] is None for r in _admin(proc, "/admin/entries?namespace=conv")["entries"])


def test_the_serve_flags_bound_retention_and_hand_offs(proc, tmp_path):
    spec = make_spec()
    tokens = list(range(5000, 5000 + 8 * 16))  # 8 blocks: over the 48 KiB quota
    with KVClient(proc.url, namespace="flags", colocated=False) as c:
        c.put_kv(spec, tokens, make_kv(spec, len(tokens)))
        held = c.handoff(spec, tokens[:16])
        assert held["held"] == 1
    key = _admin(proc, "/admin/entries?namespace=flags&sort=age&order=asc&limit=1")["entries"][0]["key"]
    assert 25 < _admin(proc, f"/admin/explain/{key}")["retained"]["expires_in_s"] <= 33  # --handoff-ttl-s
    common = ("--url", proc.url, "--namespace", "flags", "--spec", json.dumps(spec.to_dict()),
              "--tokens", json.dumps(tokens))
    too_long = run("retain", *common, "--ttl", "101")  # --retain-max-ttl-s 100
    assert too_long.returncode == 1 and "InvalidInput" in too_long.stderr
    assert "KVSTORE_RETAIN_MAX_TTL_S" in too_long.stderr
    over = run("retain", *common, "--ttl", "50")  # --retain-quota-bytes 48KiB
    assert over.returncode == 1 and "RetainQuotaExceeded" in over.stderr and str(48 << 10) in over.stderr
    bad = run("retain", "--url", proc.url, "--spec", "{not json", "--tokens", "[1]", "--ttl", "5")
    assert bad.returncode == 2 and "--spec" in bad.stderr


def test_serve_maps_every_new_flag_to_its_setting(monkeypatch):
    """The flags reach ``ServerSettings`` (the server itself is not started here)."""
    import importlib

    from kvstore.cli import main

    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)
    seen = {}
    # server/__init__ re-exports the function under the module's name: patch the module itself
    monkeypatch.setattr(importlib.import_module("server.serve"), "serve", lambda settings, engine: seen.setdefault("s", settings) and 0)
    assert main(["serve", "--max-event-subscribers", "7", "--event-queue", "128",
                 "--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-topic", "kv",
                 "--kv-events-replay-endpoint", "tcp://127.0.0.1:5558", "--retain-quota-bytes", "1MiB",
                 "--retain-max-ttl-s", "90", "--handoff-ttl-s", "12.5"]) == 0
    s = seen["s"]
    assert (s.max_event_subscribers, s.event_queue, s.kv_events_endpoint, s.kv_events_topic,
            s.kv_events_replay_endpoint, s.retain_quota_bytes, s.retain_max_ttl_s, s.handoff_ttl_s) == (
        7, 128, "tcp://127.0.0.1:5557", "kv", "tcp://127.0.0.1:5558", 1 << 20, 90.0, 12.5)


@pytest.mark.parametrize("flag, value, words", [("--event-queue", "3", "event_queue"),
                                                 ("--retain-max-ttl-s", "0", "retain_max_ttl_s"),
                                                 # the default hand-off hold (120 s) would pass the maximum
                                                 ("--retain-max-ttl-s", "60", "handoff_ttl_s")])
def test_serve_refuses_bad_values_of_the_new_flags(tmp_path, flag, value, words):
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", flag, value], capture_output=True, text=True,
                         timeout=120, env=small_env(tmp_path / "data"))
    assert out.returncode == 2 and words in out.stderr, out.stderr

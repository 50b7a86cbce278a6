import json
import subprocess
import sys

import kvstore


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, timeout=300, **kw)


def test_version():
    res = run("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"kvstore {kvstore.__version__}"


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("kvstore")
    assert exe, "the kvstore console script is not on PATH (pip install -e .)"
    assert subprocess.run([exe, "--version"], capture_output=True, text=True).returncode == 0


def test_bench_codec_quick_writes_every_row(tmp_path):
    res = run("bench", "codec", "--quick", "--no-real", "--repeats", "1", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "int8" in res.stdout and "memcpy" in res.stdout
    (path,) = tmp_path.glob("codec-*.json")
    result = json.loads(path.read_text())
    assert {r["size"] for r in result["rows"]} == {"1MiB", "64KiB"}
    for row in result["rows"]:
        assert row["memcpy_gbps"]["median"] > 0
        assert set(row["codecs"]) == {"raw", "int8", "int8+lz4"}
        for name, c in row["codecs"].items():
            assert c["encode_gbps"]["median"] > 0 and c["decode_gbps"]["median"] > 0
            assert c["rel_error"] == 0 if name == "raw" else c["rel_error"] <= 0.01
            assert c["size_ratio"] < 0.7 if name != "raw" else c["size_ratio"] >= 1


def test_bench_rejects_bad_repeats(tmp_path):
    res = run("bench", "codec", "--repeats", "0", "--out", str(tmp_path))
    assert res.returncode == 2 and "--repeats" in res.stderr


def test_serve_says_not_yet():
    res = run("serve")
    assert res.returncode == 2 and "not yet" in res.stderr


def test_bench_tiers_quick_measures_every_tier(tmp_path):
    res = run("bench", "tiers", "--quick", "--repeats", "1", "--out", str(tmp_path), "--dir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    (path,) = tmp_path.glob("tiers-*.json")
    result = json.loads(path.read_text())
    assert result["notes"] == []  # every tier ran, none was skipped
    assert {(r["tier"], r["size"]) for r in result["rows"]} == {
        (t, s) for t in ("memory", "device", "shm", "cxl", "redis", "nvme") for s in ("1MiB", "64KiB")}
    for row in result["rows"]:
        assert row["put_gbps"]["median"] > 0 and row["raw_get_gbps"]["median"] > 0
    assert not list(tmp_path.glob(".kvstore-bench-*")), "the bench cleans up its work dir"


def test_bench_tiers_rejects_unknown_tier(tmp_path):
    res = run("bench", "tiers", "--tiers", "shm,tape", "--out", str(tmp_path))
    assert res.returncode == 2 and "tape" in res.stderr

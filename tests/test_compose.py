"""docker-compose.yml: valid for ``docker-compose config``, and its kvstore service's command and
environment start the server natively against a test-started redis-server (no Docker engine here)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from bench.reliability_kit.serve_process import ServeProcess
from bench.serving import free_port
from client_sdk import KVClient
from kvstore.config import parse_size
from tests.conftest import make_kv, make_spec
from tests.tiers.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
TOKEN = "compose-admin-token-123"
_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def _resolve(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}``."""
    def sub(m: re.Match) -> str:
        name, op, arg = m.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == "-" else ""
    return _VAR.sub(sub, str(value))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture
def redis_server():
    srv = RedisServer().start()
    yield srv
    srv.stop()


def test_compose_file_validates():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.skip("docker-compose is not installed (.ci/run installs Debian's package)")
    env = {**os.environ, "KVSTORE_ADMIN_TOKEN": TOKEN}
    res = subprocess.run([exe, "-f", str(COMPOSE), "config"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    resolved = yaml.safe_load(res.stdout)
    assert set(resolved["services"]) == {"redis", "kvstore"}
    assert resolved["services"]["kvstore"]["environment"]["KVSTORE_ADMIN_TOKEN"] == TOKEN
    # without the token it refuses, saying why
    env.pop("KVSTORE_ADMIN_TOKEN")
    res = subprocess.run([exe, "-f", str(COMPOSE), "config"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode != 0 and "KVSTORE_ADMIN_TOKEN" in res.stderr


def test_compose_services_have_what_the_stack_needs(compose):
    redis, kv = compose["services"]["redis"], compose["services"]["kvstore"]
    assert redis["image"].startswith("redis:")
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    env = kv["environment"]
    assert kv["build"] == "." and env["KVSTORE_REDIS_URL"].startswith("redis://redis:")
    volume = next(v for v in kv["volumes"] if v.endswith(":" + env["KVSTORE_DATA_DIR"]))
    assert volume.split(":")[0] in compose["volumes"]  # a named volume for the nvme tier
    assert parse_size(kv["shm_size"].upper().replace("GB", "GiB")) > (
        parse_size(env["KVSTORE_SHM_BYTES"]) + parse_size(env["KVSTORE_STAGING_BYTES"]))
    assert any("/readyz" in part for part in kv["healthcheck"]["test"])
    assert "8470:8470" in kv["ports"] and env["KVSTORE_PORT"] == "8470"
    assert kv["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compose_command_and_environment_start_the_server_natively(compose, tmp_path, redis_server):
    service = compose["services"]["kvstore"]
    assert service["command"][:2] == ["kvstore", "serve"]
    env = {k: _resolve(v, {"KVSTORE_ADMIN_TOKEN": TOKEN}) for k, v in service["environment"].items()}
    port = free_port()
    env.update(
        # what the container's network and volume provide, here
        KVSTORE_REDIS_URL=env["KVSTORE_REDIS_URL"].replace("redis:6379", f"127.0.0.1:{redis_server.port}"),
        KVSTORE_DATA_DIR=str(tmp_path / "data"), KVSTORE_PORT=str(port),
        KVSTORE_HOST="127.0.0.1",  # the container binds 0.0.0.0; a test host stays on loopback
        # sized down for the test machine; everything else is the compose file's
        KVSTORE_SHM_BYTES="64MiB", KVSTORE_STAGING_BYTES="32MiB", KVSTORE_CXL_BYTES="32MiB",
    )
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    child_env.update(env)
    # the compose command as the container runs it: the console script on PATH
    cmd = [shutil.which(service["command"][0]) or service["command"][0], *service["command"][1:]]
    proc = ServeProcess(child_env, port=port, cmd=cmd).start()
    try:
        ready = httpx.get(f"{proc.url}/readyz", timeout=10).json()
        assert ready["status"] == "ok", ready
        assert [t["name"] for t in ready["tiers"]] == ["shm", "cxl", "redis", "nvme"]
        health = [part.replace(":8470/", f":{port}/") for part in service["healthcheck"]["test"][1:]]
        assert health[0] == "python"
        assert subprocess.run([sys.executable, *health[1:]], timeout=30).returncode == 0
        spec = make_spec()
        with KVClient(proc.url, token=TOKEN, colocated=False) as c:
            assert c.put_kv(spec, list(range(32)), make_kv(spec, 32)) == 32
            assert c.get_kv(spec, list(range(32)))[1] == 32
        assert httpx.get(f"{proc.url}/v1/info").status_code == 401  # the token is required
    finally:
        proc.stop()

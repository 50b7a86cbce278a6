"""Real redis-server processes for the Redis tier's tests.

``RedisServer`` is one standalone server; ``RedisClusterServers`` is a
3-master Redis Cluster made of them. Each process listens on free loopback
ports, keeps its files in its own temp dir, persists nothing, and is started
with ``PR_SET_PDEATHSIG`` so that it dies with the test run even when pytest
itself is killed (fixtures' finalizers stop them in every other case).
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from bench.serving import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port`` with no persistence."""

    def __init__(self, *extra_args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.dir = Path(tempfile.mkdtemp(prefix="kvstore-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, socket_connect_timeout=1)

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Start the process and wait until it answers PING.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout_s``.
        """
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--logfile", "redis.log",
                *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        with redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=0.2) as probe:
            while True:
                try:
                    probe.ping()
                    return self
                except redis.RedisError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.kill()
                        raise RuntimeError(f"redis-server on port {self.port} did not start: {self.log()}")
                    time.sleep(0.02)

    def flushall(self) -> None:
        with self.client() as client:
            client.flushall()

    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the process (what a crash looks like) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL works on a stopped process too
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Kill the process and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterServers:
    """A Redis Cluster of ``masters`` masters, each with ``replicas`` replicas, on loopback.

    ``node_timeout_ms`` is how long a master may be unreachable before its replica takes over.
    """

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 15000) -> None:
        self.replicas = replicas
        self.nodes: list[RedisServer] = []
        for _ in range(masters * (1 + replicas)):
            # cluster-port: the bus port defaults to port+10000, which may be taken.
            self.nodes.append(RedisServer("--cluster-enabled", "yes", "--cluster-config-file",
                                          "nodes.conf", "--cluster-port", str(free_port()),
                                          "--cluster-node-timeout", str(node_timeout_ms),
                                          # a replica fails over however stale it thinks it is: on a
                                          # loaded test machine its own estimate refused it
                                          "--cluster-replica-validity-factor", "0"))

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout_s: float = 30.0) -> "RedisClusterServers":
        """Start every node, join them into one cluster, wait for ``cluster_state:ok``.

        Raises:
            RuntimeError: a node did not start or the cluster did not form in time.
        """
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run([REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas),
                            "--cluster-yes"], check=True, capture_output=True, timeout=timeout_s)
            self._wait_ok(time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, deadline: float) -> None:
        """Until every live node says ``cluster_state:ok``, with all 16384 slots served by live masters."""
        while True:
            states = []
            live = {node.port for node in self.nodes if node.proc is not None and node.proc.poll() is None}
            for node in self.nodes:
                if node.port not in live:
                    continue
                try:
                    with node.client() as client:
                        info = client.cluster("info")
                        owners = {int(r[2][1]) for r in client.execute_command("CLUSTER SLOTS")}
                except redis.RedisError:
                    states.append(False)
                    continue
                states.append(info.get("cluster_state") == "ok" and owners <= live and
                              int(info.get("cluster_slots_ok", 0)) == 16384)
            if all(states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster did not reach cluster_state:ok: {states}")
            time.sleep(0.05)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait for the cluster to serve every slot from a live master again (after a failover)."""
        self._wait_ok(time.monotonic() + timeout_s)

    def masters(self) -> list[RedisServer]:
        """The live nodes that are masters now."""
        out = []
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            with node.client() as client:
                if client.info("replication").get("role") == "master":
                    out.append(node)
        return out

    def flushall(self) -> None:
        for node in self.masters() if self.replicas else self.nodes:
            node.flushall()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

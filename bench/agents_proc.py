"""What the agents demo's processes share: the private server, the agents' environment, their
JSON-line reports (``bench.agents`` and ``bench.agents_handoff`` both spawn agents).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

from bench.serving import free_port, stop, wait_http

__all__ = ["AGENT_TIMEOUT_S", "DemoFailed", "child_env", "serving", "json_lines"]

_REPO = Path(__file__).resolve().parents[1]
_SERVE_ENV = {"KVSTORE_SHM_BYTES": "256MiB", "KVSTORE_CXL_BYTES": "32MiB", "KVSTORE_NVME_BYTES": "256MiB",
              "KVSTORE_STAGING_BYTES": "64MiB", "KVSTORE_LOG_LEVEL": "warning"}
"""Arenas sized for the demo: the defaults reserve and prefault GiBs it never uses."""
AGENT_TIMEOUT_S = 300.0
"""An agent still running after this is killed (a hung child must not hang the demo)."""


class DemoFailed(RuntimeError):
    """The demo could not run: transformers is missing, the server did not start, or an agent failed."""


def child_env() -> dict[str, str]:
    # The caller's KVSTORE_* settings are for their own server, not this private one.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    return env


@contextlib.contextmanager
def serving(workdir: Path, timeout_s: float = 60.0, env: dict[str, str] | None = None) -> Iterator[str]:
    """``kvstore serve`` on a free loopback port until the block ends (SIGTERM, then wait).

    Args:
        env: settings over the demo's (``_SERVE_ENV``).

    Yields:
        Its URL, once ``/healthz`` answers.

    Raises:
        DemoFailed: it exited or did not answer within ``timeout_s`` (the message has its log).
    """
    port = free_port()
    log_path = workdir / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--port", str(port),
                                 "--data-dir", str(workdir / "data")],
                                env={**child_env(), **_SERVE_ENV, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(port, proc, timeout_s=timeout_s)
        except RuntimeError:
            raise DemoFailed(f"kvstore serve did not start:\n{log_path.read_text(errors='replace')[-2000:]}") from None
        yield url
    finally:
        stop(proc)


def json_lines() -> Callable[[dict[str, Any]], None]:
    """In an agent process: the function that reports one event to the parent, a JSON line on
    the real stdout; ``print`` goes to stderr from here on, so only those lines reach the pipe."""
    out = sys.stdout
    sys.stdout = sys.stderr

    def emit(event: dict[str, Any]) -> None:
        out.write(json.dumps(event) + "\n")
        out.flush()
    return emit

"""A vLLM engine process (``bench/vllm_driver.py`` under the vLLM venv), for tests and ``kvstore bench vllm``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench.engines import ROOT, engine_env
from bench.serving import reply_line

__all__ = ["VLLMEngine", "make_model", "DRIVER"]

DRIVER = ROOT / "bench" / "vllm_driver.py"
START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 600.0


def make_model(python: Path, directory: Path, **shape: Any) -> Path:
    """Save a seeded random Llama into ``directory`` (``--layers``, ``--hidden``... as keywords)."""
    args = [str(python), str(DRIVER), "make-model", str(directory)]
    for name, value in shape.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    done = subprocess.run(args, capture_output=True, text=True, env=engine_env(), timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"make-model failed: {done.stderr[-3000:]}")
    return directory


class VLLMEngine:
    """One engine process; ``generate`` sends prompts of token ids and returns the driver's reply.

    Args:
        python: the vLLM venv's interpreter.
        model: the model directory.
        log: where the engine's own output goes.
        connector: ``none``, ``kvstore`` or ``example``.
        kv_config: ``kv_connector_extra_config``.
        options: more ``serve`` flags (``block_size=128``, ``prefix_caching=True``...).
    """

    def __init__(self, python: Path, model: Path, log: Path, connector: str = "none",
                 kv_config: dict | None = None, env: dict[str, str] | None = None, **options: Any) -> None:
        args = [str(python), str(DRIVER), "serve", "--model", str(model), "--connector", connector]
        if kv_config is not None:
            args += ["--kv-config", json.dumps(kv_config)]
        for name, value in options.items():
            flag = f"--{name.replace('_', '-')}"
            if value is True:
                args.append(flag)
            elif value not in (False, None):
                args += [flag, str(value)]
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as stderr:
            self.proc = subprocess.Popen(args, env=engine_env(**(env or {})), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True, bufsize=1)
        ready = self._read(START_TIMEOUT_S, "start")
        self.start_s = ready.get("start_s")

    def _read(self, timeout_s: float, what: str) -> dict:
        line = reply_line(self.proc, timeout_s, f"the vLLM engine ({what})")
        if not line:
            raise RuntimeError(f"the vLLM engine exited ({self.proc.poll()}) during {what}; log: {self.tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"vLLM {what}: {reply.get('error')}; log: {self.tail()}")
        return reply

    def call(self, **cmd: Any) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(CALL_TIMEOUT_S, cmd["cmd"])

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> dict:
        return self.call(cmd="generate", prompts=prompts, max_tokens=max_tokens)

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError as exc:
            return f"(unreadable: {exc})"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""A vLLM engine process (``bench/vllm_driver.py`` under the vLLM venv), for tests and ``kvstore bench vllm``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench.engines import ROOT, engine_env
from bench.serving import LineDriver

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


class VLLMEngine(LineDriver):
    """One engine process; ``generate`` sends prompts of token ids and returns the driver's reply.

    Args:
        python: the vLLM venv's interpreter.
        model: the model directory.
        log: where the engine's own output goes.
        connector: ``none``, ``kvstore`` or ``example``.
        kv_config: ``kv_connector_extra_config``.
        options: more ``serve`` flags (``block_size=128``, ``prefix_caching=True``...).
    """

    name = "the vLLM engine"

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
        super().__init__(args, engine_env(**(env or {})), log)
        ready = self._read(START_TIMEOUT_S, "start")
        self.start_s = ready.get("start_s")

    def call(self, **cmd: Any) -> dict:
        return self._send(cmd, CALL_TIMEOUT_S)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> dict:
        return self.call(cmd="generate", prompts=prompts, max_tokens=max_tokens)

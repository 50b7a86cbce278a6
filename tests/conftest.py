import os
import re
import time

import pytest
import torch
from hypothesis import settings

from kvstore import KVSpec

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_spec(**overrides) -> KVSpec:
    fields = dict(model_id="llama-tiny", num_layers=4, num_kv_heads=2, head_dim=16,
                  dtype="float16", block_tokens=16, fingerprint="weights-rev-1")
    fields.update(overrides)
    return KVSpec(**fields)


def make_kv(spec: KVSpec, num_tokens: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.kv_shape(num_tokens), generator=gen).to(spec.torch_dtype)


@pytest.fixture
def spec() -> KVSpec:
    return make_spec()


class FakeClock:
    """A clock a test advances by hand: ``KVStore(clock=FakeClock())`` ages entries, heat and
    pins together, with no sleep (a store passes the clock it is given to placement too)."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = float(now)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def require_venv(found, why: str, flag: str):
    """``found`` (an engine venv's interpreter), or skip saying ``why``: a failure where ``flag``
    (set by ``.ci/run``, which makes the venvs) says the venv must be there."""
    if found is None:
        if os.environ.get(flag) == "1":
            pytest.fail(f"{flag}=1 but {why}")
        pytest.skip(why)
    return found


def wait_until(predicate, timeout_s: float = 10.0, what: str = "the condition", step_s: float = 0.02):
    """Poll ``predicate`` until it returns something true (returned), or fail the test after
    ``timeout_s``: a deadline, not a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout_s:g} s")
        time.sleep(step_s)


def shm_segments(pid: int) -> set[str]:
    """The shared-memory segments in /dev/shm that process ``pid`` made (shm arenas and staging
    name themselves ``<prefix>.<kind>.<pid>.<hex>``): what a test may check, whatever else on the
    machine makes or removes shared memory meanwhile."""
    return {name for name in os.listdir("/dev/shm") if re.fullmatch(rf"[^.]+\.[^.]+\.{pid}\.[0-9a-f]+", name)}



def fail_nth_commit(monkeypatch, tier, n: int) -> None:
    """Make ``tier``'s ``n``-th ``commit_reserved`` from now fail as a tier closing mid-commit
    does: the slot taken back, ``StoreClosed`` raised (the others commit as before)."""
    from kvstore.errors import StoreClosed

    commit, calls = tier.commit_reserved, []

    def nth_fails(key, slot, reserved, length):
        calls.append(key)
        if len(calls) == n:
            tier.abort_reserved(slot, reserved)
            raise StoreClosed("injected: the tier closed during the commit")
        return commit(key, slot, reserved, length)
    monkeypatch.setattr(tier, "commit_reserved", nth_fails)

"""A kvstore with some traffic, to look at its dashboard (``/admin/ui``).

It starts a private ``kvstore serve`` with small tiers (so placement has work to
do), an admin token, and two agents' worth of puts and Zipf-distributed gets in
two namespaces, then a pin and a dry-run eviction, so every panel has something
to show. It prints the page's address and the token, keeps the traffic going,
and stops on Ctrl-C.

    python examples/dashboard.py [--seconds N] [--screenshot PATH]

With ``--screenshot`` it opens the page in headless Chromium (Debian's
``/usr/bin/chromium``, driven by Playwright: ``pip install -e '.[dev]'``), saves a
full-page PNG and stops; ``docs/dashboard.png`` is made that way.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import httpx  # noqa: E402
import torch  # noqa: E402

from client_sdk import KVClient  # noqa: E402
from kvstore import KVSpec  # noqa: E402
from bench.reliability_kit.serve_process import ServeProcess, small_env  # noqa: E402

TOKEN = "dashboard-demo-admin-token"
SPEC = KVSpec("llama-tiny", num_layers=8, num_kv_heads=2, head_dim=64, dtype="float16", block_tokens=16,
              fingerprint="demo-weights-1")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]


def prompts(n: int, length: int, base: int) -> list[list[int]]:
    return [list(range(base + i * 10_000, base + i * 10_000 + length)) for i in range(n)]


def traffic(url: str, seconds: float, rng: random.Random) -> None:
    """Puts, then Zipf-ish gets over them, from two namespaces."""
    agents = {"planner": prompts(24, 128, 0), "coder": prompts(12, 256, 5_000_000)}
    clients = {ns: KVClient(url, token=TOKEN, namespace=ns) for ns in agents}
    try:
        for ns, seqs in agents.items():
            for toks in seqs:
                kv = torch.randn(SPEC.kv_shape(len(toks)), dtype=torch.float16)
                clients[ns].put_kv(SPEC, toks, kv)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ns = rng.choice(list(agents))
            seqs = agents[ns]
            i = min(len(seqs) - 1, int(rng.paretovariate(1.2)) - 1)
            clients[ns].get_kv(SPEC, seqs[i])
            time.sleep(0.01)
    finally:
        for c in clients.values():
            c.close()


def admin_actions(url: str) -> None:
    """A pin and a dry run, so the audit log and the explain panel have rows."""
    h = {"authorization": f"Bearer {TOKEN}"}
    toks = prompts(1, 128, 0)[0]
    httpx.post(f"{url}/admin/pin", json={"spec": SPEC.to_dict(), "tokens": toks, "namespace": "planner"},
               headers=h).raise_for_status()
    httpx.post(f"{url}/admin/evict", json={"namespace": "coder", "dry_run": True}, headers=h).raise_for_status()


def screenshot(url: str, path: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1700})
        page.goto(f"{url}/admin/ui")
        page.fill("#token", TOKEN)
        page.click("#login-button")
        page.wait_for_selector(".tier")
        page.locator("#entries tbody tr").first.click()
        page.wait_for_selector("#explain:not([hidden])")
        time.sleep(4)  # two refreshes: the charts have their latest points
        page.screenshot(path=path, full_page=True)
        browser.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds of gets before the screenshot (default 20)")
    ap.add_argument("--screenshot", default=None, help="save a PNG of the page here, then stop")
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="kvstore-dashboard-") as tmp:
        env = small_env(Path(tmp), KVSTORE_ADMIN_TOKEN=TOKEN, KVSTORE_SHM_BYTES="4MiB", KVSTORE_CXL_BYTES="8MiB",
                        KVSTORE_HISTORY_INTERVAL_S="1", KVSTORE_LOG_LEVEL="warning")
        proc = ServeProcess(env).start()
        try:
            print(f"dashboard: {proc.url}/admin/ui  (admin token: {TOKEN})", flush=True)
            traffic(proc.url, args.seconds / 2, rng)
            admin_actions(proc.url)
            traffic(proc.url, args.seconds / 2, rng)
            if args.screenshot:
                screenshot(proc.url, args.screenshot)
                print(f"wrote {args.screenshot}")
                return 0
            print("traffic goes on; Ctrl-C stops", flush=True)
            while True:
                traffic(proc.url, 60, rng)
        except KeyboardInterrupt:
            return 0
        finally:
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())

"""The dashboard end to end: ``kvstore serve`` with seeded data, the page in headless Chromium.

Chromium is Debian's (``/usr/bin/chromium``, which ``.ci/run`` installs), driven by
Playwright's Python driver; nothing is downloaded. Where the browser is missing the
test is skipped, unless ``KVSTORE_REQUIRE_BROWSER=1`` (set by ``.ci/run``) makes that
a failure. The screenshot goes to ``tests/artifacts/`` (not committed).
"""

from __future__ import annotations

import os
import re
import shutil
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from bench.reliability_kit.serve_process import ServeProcess, small_env
from client_sdk import KVClient
from tests.conftest import make_kv, make_spec

CHROMIUM = os.environ.get("KVSTORE_CHROMIUM", "/usr/bin/chromium")
ADMIN = "dashboard-admin-token-0123"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
# What the machine's probe starts Chromium with: no sandbox as root, and none of the
# background traffic a closed network refuses.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                 "--disable-background-networking", "--disable-component-update"]


def _browser_or_skip():
    have = shutil.which(CHROMIUM) or os.path.exists(CHROMIUM)
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        sync_playwright = None
    if have and sync_playwright is not None:
        return sync_playwright, expect
    why = f"no Chromium at {CHROMIUM}" if not have else "playwright is not installed (pip install -e '.[dev]')"
    if os.environ.get("KVSTORE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"KVSTORE_REQUIRE_BROWSER=1 but {why}")
    pytest.skip(why)


def fmt_bytes(n: int) -> str:
    """The page's own formatting (dashboard.js fmtBytes; JavaScript's toFixed rounds half up)."""
    units, i, v = ["B", "KiB", "MiB", "GiB", "TiB"], 0, Decimal(n)
    while v >= 1024 and i < len(units) - 1:
        v, i = v / 1024, i + 1  # exact: n / 1024**i ends in finitely many decimals
    return f"{n} B" if i == 0 else f"{v.quantize(Decimal('0.1'), ROUND_HALF_UP)} {units[i]}"


@pytest.fixture
def seeded(tmp_path) -> Iterator[ServeProcess]:
    """``kvstore serve`` (real uvicorn, shm + cxl + nvme) with blocks in two namespaces."""
    env = small_env(tmp_path / "data", KVSTORE_ADMIN_TOKEN=ADMIN, KVSTORE_HISTORY_INTERVAL_S="0.5",
                    KVSTORE_SHM_BYTES="1MiB")
    proc = ServeProcess(env).start()
    spec = make_spec(head_dim=64)
    with KVClient(proc.url, token=ADMIN, namespace="default") as c:
        for i in range(8):  # 8 x 4 blocks of 32 KiB: more than the 1 MiB shm tier holds
            c.put_kv(spec, list(range(i * 100, i * 100 + 64)), make_kv(spec, 64, seed=i))
        for _ in range(5):
            c.get_kv(spec, list(range(64)))
        # an engine's scheduler and worker report apart; the board sums them
        c.report_connector("vllm", "engine-1/scheduler", {"looked_up_tokens": 512, "offered_tokens": 448})
        c.report_connector("vllm", "engine-1/worker", {"loaded_tokens": 384, "saved_tokens": 640, "load_errors": 1,
                                                       "failed_blocks": 3})
    with KVClient(proc.url, token=ADMIN, namespace="scratch") as c:
        for i in range(3):
            c.put_kv(spec, list(range(9000 + i * 100, 9000 + i * 100 + 32)), make_kv(spec, 32, seed=50 + i))
    key = _admin(proc, "/admin/entries?limit=1&sort=age&order=desc&namespace=default")["entries"][0]["key"]
    moved = httpx.post(proc.url + "/admin/migrate", json={"key": key, "tier": "nvme"},
                       headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert moved.json()["moved"] is True, moved.text
    yield proc
    proc.stop()


def _admin(proc: ServeProcess, path: str) -> dict:
    resp = httpx.get(proc.url + path, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    resp.raise_for_status()
    return resp.json()


def test_dashboard_in_headless_chromium(seeded):
    sync_playwright, expect = _browser_or_skip()
    proc = seeded
    tiers = {t["name"]: t for t in _admin(proc, "/admin/tiers")["tiers"]}
    total = _admin(proc, "/admin/entries?limit=1")["total"]
    scratch = _admin(proc, "/admin/entries?limit=1&namespace=scratch")["total"]
    assert total == 8 * 4 + 3 * 2 and scratch == 6
    assert tiers["cxl"]["entries"] > 0  # the seeding overflowed shm: more than one bar to check

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(proc.url + "/admin/ui")

            # A wrong token: a clear error, and no admin data anywhere on the page.
            page.wait_for_selector("#login:not([hidden])")
            page.fill("#token", "not-the-admin-token-xyz")
            page.click("#login-button")
            error = page.wait_for_selector("#login-error:not([hidden])")
            assert "refused this token" in error.text_content() and "401" in error.text_content()
            assert page.is_hidden("#dashboard")
            assert page.locator(".tier").count() == 0 and page.locator("#entries tbody tr").count() == 0
            assert page.evaluate("sessionStorage.getItem('kvstore.adminToken')") is None

            # The right token: the tier bars show what the server holds.
            page.fill("#token", ADMIN)
            page.click("#login-button")
            page.wait_for_selector(".tier[data-tier='cxl']")
            assert page.is_hidden("#login")
            assert page.evaluate("sessionStorage.getItem('kvstore.adminToken')") == ADMIN
            for name, t in tiers.items():
                row = page.locator(f".tier[data-tier='{name}']")
                assert int(row.get_attribute("data-used-bytes")) == t["used_bytes"], name
                assert int(row.get_attribute("data-entries")) == t["entries"], name
                label = row.locator(".label").text_content()
                assert f"{fmt_bytes(t['used_bytes'])} of {fmt_bytes(t['capacity_bytes'])}" in label, label
                assert f"{t['entries']} entries" in label, label
                assert row.locator(".mark.high").count() == 1 and row.locator(".mark.low").count() == 1
            expect(page.locator("#entries-total")).to_have_text(f"{total} matching")
            expect(page.locator("#health")).to_have_text("ok")

            # The other panels drew what the server says.
            expect(page.locator("#moves tbody tr").first).to_contain_text("migrated: by an operator")
            assert page.locator("#moves tbody tr").first.locator("td").nth(3).text_content() == "nvme"
            assert page.locator("#decisions tbody tr").count() > 0  # the seeding client reported its decisions
            assert page.locator("#decision-chart circle").count() > 0
            assert page.locator("#heat-chart rect").count() > 0
            expect(page.locator("#hit-chart circle").first).to_be_attached()  # the seeding's gets, per interval
            expect(page.locator("#canary")).to_contain_text("baseline")
            # The planner's prediction error: the server's figure, with the definition it is of.
            error = _admin(proc, "/admin/decisions?limit=4096")["prediction_error"]
            expect(page.locator("#prediction-error")).to_contain_text(
                f"over {error['samples']} transfers: the {error['definition']}")
            expect(page.locator("#canary")).to_contain_text("prediction error: the " + error["definition"])
            row = page.locator("#connectors tbody tr").first  # an engine connector's report
            expect(row).to_contain_text("vllm")
            heads = page.locator("#connectors thead th").all_text_contents()
            cells = dict(zip(heads, row.locator("td").all_text_contents()))
            assert (cells["instances"], cells["looked up"], cells["offered"], cells["loaded"], cells["saved"]) == \
                ("2", "512", "448", "384", "640")
            assert cells["hit ratio"] == "75.0%"  # loaded / looked up: the server's figure
            assert _admin(proc, "/admin/connectors")["connectors"][0]["hit_ratio"] == 0.75
            assert cells["errors"] == "1 (3 blocks recomputed)"
            expect(page.locator("#connectors-note")).to_contain_text("Hit ratio: loaded / looked up.")

            # Explain on click, then pin: the pin lands in the audit log.
            first = page.locator("#entries tbody tr").first
            key = first.get_attribute("data-key")
            first.click()
            page.wait_for_selector("#explain:not([hidden])")
            assert page.text_content("#explain-key") == key
            page.click("#pin-button")
            expect(page.locator("#pin-result")).to_have_text("pinned 1 block")
            page.wait_for_selector("#audit tbody tr[data-action='pin']")

            # Evict the scratch namespace: a dry run first, which removes nothing...
            page.select_option("#evict-by", "namespace")
            page.fill("#evict-namespace", "scratch")
            assert page.is_disabled("#evict-confirm")
            page.click("#evict-dry-run")
            expect(page.locator("#evict-result")).to_have_text(re.compile("^Dry run"))
            assert f"would remove {scratch} blocks" in page.text_content("#evict-result")
            assert page.text_content("#evict-confirm") == f"Evict {scratch} blocks"
            page.wait_for_selector("#audit tbody tr[data-action='evict'][data-dry-run='true']")
            assert _admin(proc, "/admin/entries?limit=1")["total"] == total

            # ...then the real one: the entry count drops and an audit row appears.
            page.click("#evict-confirm")
            expect(page.locator("#evict-result")).to_have_text(re.compile("^Evicted"))
            assert re.search(rf"removed {scratch} blocks", page.text_content("#evict-result"))
            expect(page.locator("#entries-total")).to_have_text(f"{total - scratch} matching")
            page.wait_for_selector("#audit tbody tr[data-action='evict'][data-dry-run='false']")
            assert _admin(proc, "/admin/entries?limit=1")["total"] == total - scratch
            assert _admin(proc, "/admin/entries?limit=1&namespace=scratch")["total"] == 0
            actions = [(r["action"], r.get("dry_run")) for r in _admin(proc, "/admin/audit")["records"]]
            assert actions[:3] == [("evict", False), ("evict", True), ("pin", None)]  # newest first
            assert page.is_disabled("#evict-confirm")  # a confirm is good for one dry run only

            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)

            # Forget the token: back to the prompt, the data gone from view.
            page.click("#logout")
            page.wait_for_selector("#login:not([hidden])")
            assert page.is_hidden("#dashboard")
            assert errors == []
        finally:
            browser.close()


def test_a_revoked_token_sends_the_page_back_to_the_prompt(seeded):
    """A token that stops working mid-session (here: a stale one left in sessionStorage) is
    refused with a message, not left showing the last data it fetched."""
    sync_playwright, expect = _browser_or_skip()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(seeded.url + "/admin/ui")
            page.evaluate("sessionStorage.setItem('kvstore.adminToken', 'a-stale-token-000000')")
            page.reload()
            error = page.wait_for_selector("#login-error:not([hidden])")
            assert "refused this token" in error.text_content()
            assert page.is_hidden("#dashboard") and page.locator(".tier").count() == 0
        finally:
            browser.close()

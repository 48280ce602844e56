"""Headless Chromium for the browser tests (hub pages, JupyterLab, the course site): one way to start it, and a page
signed in to a hub."""
from __future__ import annotations

import contextlib
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


@contextlib.contextmanager
def chromium():
    """A headless Chromium browser, closed afterwards."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def signed_in_page(hub_url: str, user: str, password: str, failure_png: Path | None = None, timeout_ms: int = 60_000):
    """A page signed in to the hub at `hub_url` through its login form; on an error inside the block, a screenshot
    goes to `failure_png` first."""
    with chromium() as browser:
        page = browser.new_page()
        page.set_default_timeout(timeout_ms)
        try:
            page.goto(f"{hub_url}/hub/login")
            page.fill("input[name=username]", user)
            page.fill("input[name=password]", password)
            page.click("#login_submit")
            page.wait_for_load_state()
            yield page
        except Exception:
            if failure_png is not None:
                page.screenshot(path=str(failure_png))
            raise

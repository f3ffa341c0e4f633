"""One real-browser check of the demo: headless Chromium types a Bangla message into `python -m demo`
(started as a user starts it), sees the streamed Bangla reply, and saves a screenshot."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO
from fixtures_serve import (
    BN_QUESTION,
    serve_run,  # noqa: F401  (pytest fixture)
)

from training.text import script_counts

CHROMIUM = Path("/usr/bin/chromium")
# scripts/test.sh installs Debian's chromium when run as root; without it this skips, and under CI=true
# the skip fails the run (tests/conftest.py): CI must drive a real browser.
pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not found: install Debian's chromium "
                                 "(apt-get install chromium, or run scripts/test.sh as root) for the browser test")]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
KEEP_ENV = "PRODIP_KEEP_SCREENSHOTS"
ARTIFACTS = REPO / "tests" / "artifacts"
STARTUP_S = 90
REPLY_TIMEOUT_MS = 60_000
SPEED_MARK = "টোকেন/সেকেন্ড"  # the status line shown when a reply is complete


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo_url(serve_run):  # noqa: F811
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, "-m", "demo", "--model", str(serve_run), "--port", str(port),
                             "--threads", "1"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"python -m demo exited {proc.returncode}: {proc.stdout.read()[-2000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() - t0 > STARTUP_S:
                raise AssertionError(f"demo did not come up on {url} in {STARTUP_S}s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert "gradio.live" not in out, "the demo opened a public share link without --share"


def test_browser_chat_in_bangla(demo_url, tmp_path):
    from playwright.sync_api import sync_playwright

    shot = tmp_path / "demo-chat.png"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(demo_url, wait_until="domcontentloaded")
            box = page.locator("#message textarea")
            box.wait_for(timeout=REPLY_TIMEOUT_MS)
            assert "বাংলা" in page.title() or "প্রদীপ" in page.title()
            assert "বাংলায়" in (box.get_attribute("placeholder") or "")
            box.fill(BN_QUESTION)
            box.press("Enter")
            page.locator("#status").get_by_text(SPEED_MARK).wait_for(timeout=REPLY_TIMEOUT_MS)
            chat = page.locator("#chatbot").inner_text()
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert BN_QUESTION in chat
    reply = chat.split(BN_QUESTION, 1)[1]
    assert script_counts(reply).get("bn", 0) > 0, f"no Bangla reply on the page: {chat!r}"
    assert shot.stat().st_size > 0
    if os.environ.get(KEEP_ENV):
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, ARTIFACTS / shot.name)

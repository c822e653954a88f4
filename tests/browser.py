"""A real browser for the inbox's tests (tests/test_ui.py, tests/e2e/test_ui.py): Debian's
chromium under its chromium-driver, driven by selenium (hack/lib.sh ``ensure_chromium`` installs
them; ``AGENTFAST_CHROMIUM`` and ``AGENTFAST_CHROMEDRIVER`` name others). Screenshots go to
``$AGENTFAST_ARTIFACTS/ui`` (default ``test-artifacts/ui`` in the checkout)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = os.environ.get("AGENTFAST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("AGENTFAST_CHROMEDRIVER", "/usr/bin/chromedriver")
ARTIFACTS = Path(os.environ.get("AGENTFAST_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts")) / "ui"


@contextmanager
def chromium() -> Iterator[WebDriver]:
    """A headless Chromium under chromedriver. Fails (never skips) when either is missing."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} missing: hack/test.sh installs Debian's chromium and chromium-driver (hack/lib.sh ensure_chromium)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1100"):
        options.add_argument(arg)  # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: WebDriver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    assert driver.save_screenshot(str(path)), path
    print(f"screenshot: {path}")
    return path


def after_click(driver: WebDriver, element_id: str) -> str:
    """The text of the element ``element_id`` of the page a click led to, once it is there."""
    try:
        found = WebDriverWait(driver, 20, poll_frequency=0.1).until(lambda d: d.find_elements(By.ID, element_id))
    except TimeoutException:
        pytest.fail(f"#{element_id} did not appear; the page at {driver.current_url}:\n{driver.page_source[:3000]}")
    return str(found[0].text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

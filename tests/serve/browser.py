"""Headless Chromium for the chat page's tests: Debian's chromium driven by its chromedriver
through Selenium (`make test` installs both as root when missing, see the Makefile)."""

from __future__ import annotations

import shutil

import pytest

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
WINDOW = (1280, 860)


def missing() -> str | None:
    """Why no browser can be had here, or None when one can."""
    if shutil.which("chromedriver") is None:
        return "chromedriver is not installed (Debian: apt-get install chromium chromium-driver; `make test` does it as root)"
    if not any(shutil.which(name) for name in CHROMIUM):
        return "chromium is not installed (Debian: apt-get install chromium chromium-driver; `make test` does it as root)"
    return None


def start_chromium():
    """A headless Chromium under Selenium; the caller quits it. Skips the test when there is no
    browser to be had; a browser that is there but fails to start fails the test."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(shutil.which(n) for n in CHROMIUM if shutil.which(n))
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={WINDOW[0]},{WINDOW[1]}", "--force-device-scale-factor=1"):
        options.add_argument(flag)
    # The driver named explicitly: Selenium would otherwise try to download one.
    return webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)

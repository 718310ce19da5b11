"""A real browser for tests of the pages ``newsvec serve`` serves: Debian's headless Chromium,
driven through its ChromeDriver by Selenium (the W3C WebDriver protocol: real keyboard events,
screenshots, the browser's console). Selenium is told both binaries, so its Selenium Manager
downloads nothing. Missing Chromium, ChromeDriver or Selenium skips the test with what to
install, and fails it under CI=true (``tests.emulators.skip_or_fail``); ``make browser``
(which ``.ci/run`` calls) installs Chromium and ChromeDriver with apt-get where they are missing.

- ``chromium(log_dir)``: one browser, quit at the end of the ``with``; a module starts one
  (the ``browser`` fixture: ``from tests.browser import browser_fixture  # noqa: F401``);
- ``resize``: the viewport's size in CSS pixels (``DESKTOP``, or a phone's 320 wide);
- ``wait_for``: a condition on the page, polled;
- ``screenshot``: a PNG into the test's folder, and into ``NEWSVEC_SCREENSHOTS`` when set (how
  docs/images/ is made: ``NEWSVEC_SCREENSHOTS=docs/images`` with
  ``pytest tests/serve/test_pages_browser.py``);
- ``page_errors``: what the page's console logged as errors (a script error, a refused
  Content-Security-Policy), beside the failed requests it expects.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.emulators import skip_or_fail

CHROMIUM = Path(os.environ.get("NEWSVEC_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("NEWSVEC_CHROMEDRIVER", "/usr/bin/chromedriver"))
# Headless, and nothing that reaches out: without the background-networking flags Chromium calls
# Google's hosts at every start, which a closed network refuses.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--lang=en-US")
DESKTOP = (1280, 900)
SCREENSHOTS_ENV = "NEWSVEC_SCREENSHOTS"


def _selenium():
    try:
        from selenium import webdriver
    except ImportError:
        skip_or_fail("selenium is not installed: pip install -e '.[test]' (make setup)")
    return webdriver


@contextlib.contextmanager
def chromium(log_dir: Path) -> Iterator[Any]:
    """A headless Chromium with a fresh profile in ``log_dir`` (ChromeDriver's log there too),
    its viewport ``DESKTOP``; yields Selenium's driver."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    if missing:
        skip_or_fail(f"no {' or '.join(missing)}: apt-get install chromium chromium-driver "
                     "(make browser installs them)")
    webdriver = _selenium()
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager: never a download
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={log_dir / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(str(CHROMEDRIVER), log_output=str(log_dir / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        driver.set_page_load_timeout(60)
        resize(driver, *DESKTOP)
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module", name="browser")
def browser_fixture(tmp_path_factory) -> Iterator[Any]:
    """One headless Chromium for the module (see ``chromium``)."""
    with chromium(tmp_path_factory.mktemp("chromium")) as driver:
        yield driver


def resize(driver, width: int, height: int) -> None:
    """The viewport ``width`` x ``height`` CSS pixels, at a device scale of 1 (``mobile`` below
    600: a phone's layout viewport, as a 320-pixel-wide phone shows the page)."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})


def wait_for(driver, condition: Callable[[Any], Any], what: str, timeout_s: float = 60) -> Any:
    """``condition(driver)``'s first truthy value, polled; fails naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition(driver)
        except Exception:  # pylint: disable=broad-except  # the page is changing: poll again
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def screenshot(driver, folder: Path, name: str) -> Path:
    """The viewport as ``folder/name`` (a PNG); copied into ``$NEWSVEC_SCREENSHOTS`` when set."""
    path = folder / name
    path.write_bytes(driver.get_screenshot_as_png())
    if os.environ.get(SCREENSHOTS_ENV):
        target = Path(os.environ[SCREENSHOTS_ENV])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target / name)
    return path


def page_errors(driver, expected: tuple[str, ...] = ()) -> list[str]:
    """The console's SEVERE entries since the last call (a script error, a Content-Security-
    Policy refusal), but those holding one of ``expected`` (a request the test expects to fail:
    ``"status of 401"``)."""
    return [entry["message"] for entry in driver.get_log("browser")
            if entry["level"] == "SEVERE" and not any(e in entry["message"] for e in expected)]

"""The operator's page of ``newsvec serve`` (``GET /status``: ``pipeline.serve.pages``) in a real
browser (headless Chromium through Selenium: ``tests.browser``), over two streaming outputs
written by the streaming sink as ``tests/serve/test_status.py`` writes them: a healthy one (its
``healthy`` fixture) and one whose first window does not balance, its record's run id and a
dead-letter reason of the second window holding ``<script>window.__pwned=1</script>``.

Each output is served by the real service, started once for the module (uvicorn on a loopback
port, no API key: a keyless service answers loopback names, as the operator's browser opens it) with
``test_status``'s stand-in engine (``StatusEngine``, a FAKE: ``/status`` embeds nothing). What is
asserted, as the browser draws the page: the healthy output has no red row, its windows show
their counts and both SVG charts are drawn; the unbalanced window's row is red (the computed
colours of its cells are those ``pipeline.serve.pages.CSS`` sets for ``tr.unbalanced td``, and a
healthy row's are not) with its reason shown; the output's ``<script>`` shows as text and never
runs; and the console logged no error (a refused Content-Security-Policy would be one).

With ``NEWSVEC_SCREENSHOTS=docs/images`` the unbalanced output's page is written to
docs/images/status-page.png."""
from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.browser import (
    DESKTOP,
    browser_fixture,  # noqa: F401  # the browser fixture
    page_errors,
    resize,
    screenshot,
    wait_for,
)
from tests.serve.conftest import need, serving
from tests.serve.test_status import (
    StatusEngine,
    _stamp,
    healthy,  # noqa: F401  # the healthy streaming output's fixture
    records,
    streaming_config,
    write_streaming,
)
from transforms.types import LedgerRecord

PWNED = "<script>window.__pwned=1</script>"
# pipeline.serve.pages.CSS: "tr.unbalanced td ... { background: #fdd; color: #a00; }", as
# getComputedStyle gives them; a healthy row's cells keep the page's (transparent, #222).
RED_BACKGROUND = "rgb(255, 221, 221)"
RED_TEXT = "rgb(170, 0, 0)"
# The one error expected: the browser asks for /favicon.ico by itself (the page links no icon),
# and the keyless service has none (404).
NO_ICON = ("/favicon.ico - Failed to load resource",)


@pytest.fixture(scope="module")
def unbalanced(tmp_path_factory) -> tuple[Path, dt.datetime]:
    """The three windows, the second's dead letter of reason ``PWNED``; the first window's record
    counts a message more than it wrote, its run id ``PWNED``. (The output, the first start.)"""
    out = tmp_path_factory.mktemp("status-unbalanced")
    base = write_streaming(out, reason=PWNED)
    path = records(out)[f"{_stamp(base)}/0"]
    record = LedgerRecord.from_json(path.read_text())
    path.write_text(dataclasses.replace(record, messages_in=record.messages_in + 1,
                                        run_id=PWNED).to_json())
    return out, base


@pytest.fixture(scope="module")
def urls(healthy, unbalanced) -> Iterator[dict[str, str]]:  # noqa: F811  # healthy: imported
    """The service over each output, without a key: {"healthy": its base URL, "unbalanced": its
    base URL}. Both outputs are written before either service starts (a process that forks while
    uvloop runs in a thread has children that crash: ``tests.serve.conftest.server``)."""
    need("fastapi")
    from pipeline.serve.app import create_app

    apps = {name: create_app(streaming_config(out), StatusEngine(), api_key=None)
            for name, (out, _) in (("healthy", healthy), ("unbalanced", unbalanced))}
    with serving(apps["healthy"]) as healthy_url, serving(apps["unbalanced"]) as unbalanced_url:
        yield {"healthy": healthy_url, "unbalanced": unbalanced_url}


def _open(driver, url: str) -> dict[str, Any]:
    """``url``'s ``/status`` in the browser; its windows' rows, by start."""
    from selenium.webdriver.common.by import By

    driver.get(f"{url}/status")
    wait_for(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#windows tr.window"),
             "the windows' rows")
    return {row.get_attribute("data-window"): row
            for row in driver.find_elements(By.CSS_SELECTOR, "#windows tr.window")}


def _colours(driver, row) -> set[tuple[str, str]]:
    """The computed (background colour, colour) of each cell of ``row``."""
    return {tuple(pair) for pair in driver.execute_script(
        "return [...arguments[0].querySelectorAll('td')].map((td) => {"
        " const s = getComputedStyle(td); return [s.backgroundColor, s.color]; })", row)}


def test_a_healthy_output_shows_its_windows_and_charts_and_no_red_row(browser, urls,
                                                                      healthy):  # noqa: F811
    from selenium.webdriver.common.by import By

    _, base = healthy
    rows = _open(browser, urls["healthy"])
    starts = [_stamp(base + dt.timedelta(minutes=i)) for i in range(3)]
    assert list(rows) == starts[::-1]  # the newest first
    assert browser.find_elements(By.CSS_SELECTOR, "tr.unbalanced") == []
    assert browser.find_element(By.ID, "verdict").text == "nothing wrong found"
    cells = [td.text for td in rows[starts[1]].find_elements(By.TAG_NAME, "td")]
    # window, micro-batches, in, rows, rows / min, dead letters, by reason, duplicates
    assert cells[:8] == [starts[1], "2", "5", "3", "3.0", "1", "invalid_json: 1", "1"]
    assert cells[-1] == "balanced"
    assert [td.text for td in rows[starts[0]].find_elements(By.TAG_NAME, "td")][1:4] == \
        ["1", "3", "2"]
    assert all(bg != RED_BACKGROUND and fg != RED_TEXT
               for row in rows.values() for bg, fg in _colours(browser, row))
    for chart in ("rate-chart", "dead-letters-chart"):
        svg = browser.find_element(By.ID, chart)
        assert svg.is_displayed() and svg.rect["width"] > 0 and svg.rect["height"] > 0, chart
        lines = svg.find_elements(By.TAG_NAME, "polyline")
        assert lines and all(line.rect["width"] > 0 for line in lines), chart
    assert not page_errors(browser, NO_ICON)


def test_an_unbalanced_window_is_red_with_its_reason_and_the_outputs_script_is_text(
        browser, urls, unbalanced, tmp_path):
    from selenium.webdriver.common.by import By

    _, base = unbalanced
    rows = _open(browser, urls["unbalanced"])
    first, second, _ = (_stamp(base + dt.timedelta(minutes=i)) for i in range(3))
    red = browser.find_elements(By.CSS_SELECTOR, "#windows tr.window.unbalanced")
    assert [row.get_attribute("data-window") for row in red] == [first]
    assert _colours(browser, rows[first]) == {(RED_BACKGROUND, RED_TEXT)}
    healthy_colours = _colours(browser, rows[second])
    assert all(bg != RED_BACKGROUND and fg != RED_TEXT for bg, fg in healthy_colours), \
        healthy_colours
    reason = rows[first].find_element(By.CSS_SELECTOR, "td.reason")
    assert reason.is_displayed()
    assert "does not balance: messages_in 4 != rows 2 + dead letters 1" in reason.text
    assert f"run {PWNED})" in reason.text  # the run id, as text
    assert rows[second].find_element(By.CSS_SELECTOR, "td.reason").text == "balanced"
    assert f"{PWNED}: 1" in rows[second].text  # the dead-letter reason, as text
    assert "problems found" in browser.find_element(By.ID, "verdict").text
    flagged = browser.find_element(By.ID, "flagged")
    assert first in flagged.text and "does not balance" in flagged.text
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    assert browser.execute_script("return document.scripts.length") == 0
    # Desktop width, as tall as the page (up to 2,000 px): the red row is in the picture.
    height = browser.execute_script("return document.documentElement.scrollHeight")
    resize(browser, DESKTOP[0], min(max(height, DESKTOP[1]), 2000))
    try:
        screenshot(browser, tmp_path, "status-page.png")
    finally:
        resize(browser, *DESKTOP)
    assert not page_errors(browser, NO_ICON)

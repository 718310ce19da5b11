"""The search page of ``newsvec serve`` (``GET /``: ``pipeline.serve.search_page``) in a real
browser (headless Chromium through Selenium: ``tests.browser``), against the service over a real
output: the local pipeline's run over a few articles of the sample, a copy of one of them from
another source (one story, two copies), its Japanese articles, and an article whose fields hold
markup and script.

Driven with the keyboard alone: a query typed and sent with Enter, the API key asked for and given
the same way, a story's copies opened with Enter. What an article holds shows as text (the
script never runs), the page fits 320 px, the footer names the model ``/info`` names, the filters
reach the search, and the store's refusal of filters shows as a message. Without the page (no
``GET /``) every test here fails."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Iterator

import pyarrow.parquet as pq
import pytest

from pipeline.config import Config
from tests.browser import (
    browser_fixture,  # noqa: F401  # the browser fixture
    page_errors,
    resize,
    screenshot,
    wait_for,
)
from tests.common import REPO, SAMPLE_EVENTS, make_config
from tests.serve.conftest import API_KEY, headers, need, serving

BATTERY = "sample-0007"  # "Vantor Cells breaks ground on solid-state battery plant..."
COPY_TITLE = "Greyhaven: Vantor Cells starts building its solid-state battery plant"
COPY_SOURCE = "newsvec-demo-greyhaven-post"
# What an HTML page that trusts the data would run: the title's tags are stripped and its escaped
# ones defused by the pipeline (transforms.text.markup.defuse_markup), so the title reaches the
# page as "< script>..." text; the identifying fields (source, url) are kept as sent.
HOSTILE_TITLE = ('<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">'
                 "Harbour board &lt;script&gt;window.__pwned=1&lt;/script&gt; publishes dredging "
                 "plan &lt;img src=x onerror=window.__pwned=2&gt;")
HOSTILE_SOURCE = "<img src=x onerror=window.__pwned=2>wire"
HOSTILE_URL = "javascript:window.__pwned=3"
EXPECTED_FAILURES = ("status of 401", "status of 400")  # the refusals the tests provoke


def _articles() -> list[dict]:
    """Sample articles (English of two days, French, the Japanese), a copy of ``BATTERY`` from
    another source, and the hostile article."""
    events = {}
    for line in SAMPLE_EVENTS.read_bytes().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("id"), str):
            events.setdefault(event["id"], event)
    kept = [f"sample-{n:04d}" for n in (*range(1, 21), 26, *range(48, 54))]
    chosen = [events[i] for i in kept]
    copy = {**events[BATTERY], "id": "page-copy-0007", "title": COPY_TITLE,
            "source": COPY_SOURCE, "url": "https://greyhaven-post.example.org/vantor-plant",
            "published_at": "2026-11-28T11:45:00Z"}
    hostile = {"id": "page-hostile", "title": HOSTILE_TITLE, "source": HOSTILE_SOURCE,
               "url": HOSTILE_URL, "language": "en", "published_at": "2026-11-29T16:00:00Z",
               "body": "The harbour board published its plan to dredge the inner harbour this "
                       "winter, so that larger ferries can berth at low tide. The work will "
                       "close the north quay for six weeks and costs about four million."}
    return [*chosen, copy, hostile]


@pytest.fixture(scope="module")
def page_config(tmp_path_factory) -> Config:
    """The articles' output, written by the local batch pipeline (FnApiRunner, float32). The
    English model cannot read Japanese (its articles would be dead-lettered
    ``unreadable_for_model``): this output embeds them anyway, for the page to show them."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch

    folder = tmp_path_factory.mktemp("page-output")
    source = folder / "articles.jsonl"
    source.write_text("".join(json.dumps(a, ensure_ascii=False) + "\n" for a in _articles()),
                      encoding="utf-8")
    base = make_config()
    config = make_config(input=str(source), output=str(folder / "out"),
                         text=base.text.model_copy(update={"max_unknown_token_ratio": 1.0}))
    run_batch(config, PipelineOptions(["--runner=FnApiRunner"]))
    return config


@pytest.fixture(scope="module")
def titles(page_config) -> dict[str, str]:
    """Each article's title as the output holds it, by id."""
    table = pq.read_table(sorted(Path(page_config.output, "vectors").glob("*.parquet")),
                          columns=["id", "title"])
    return dict(zip(table["id"].to_pylist(), table["title"].to_pylist(), strict=True))


@pytest.fixture(scope="module")
def service(page_config) -> Iterator[tuple[str, Any]]:
    """The service over the output, with the API key ``API_KEY``, on the process's one engine
    (``load_engine``: the one the pipeline's run and the other serve tests use); (its base URL,
    the app)."""
    need("fastapi")
    from pipeline.serve.app import create_app
    from transforms.engines.registry import load_engine

    app = create_app(page_config, load_engine(page_config.model), api_key=API_KEY)
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def url(service) -> str:
    return service[0]


def _active_id(driver) -> str:
    return driver.execute_script("return document.activeElement && document.activeElement.id")


def _type(driver, *keys) -> None:
    """Keys typed into whatever has the focus, as a person types them."""
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(*keys).perform()


def _stories(driver) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, "#results > li.story")


def _search(driver, text: str) -> list[Any]:
    """``text`` typed into the query box (emptied first) and sent with Enter; the stories once
    the answer shows."""
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "q")
    box.clear()
    box.send_keys(text, Keys.ENTER)
    wait_for(driver, lambda d: (not d.find_element("id", "results").get_attribute("aria-busy")
                                and d.find_element("id", "status").text not in ("", "Searching…"))
             or not d.find_element("id", "error").get_attribute("hidden"), f"the answer to {text}")
    return _stories(driver)


def _no_overflow(driver) -> int:
    return driver.execute_script("return document.documentElement.scrollWidth")


def test_the_page_ships_in_the_wheel(tmp_path):
    """The page's files are package data: in the wheel (and so in the worker image, which installs
    newsvec with pip). First in the file: it forks before the service's thread starts."""
    for part in ("setup.py", "setup.cfg", "pipeline", "transforms"):
        source = REPO / part
        if source.is_dir():
            subprocess.run(["cp", "-r", str(source), str(tmp_path / part)], check=True)
        else:
            (tmp_path / part).write_bytes(source.read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "dist"), str(tmp_path)], check=True,
                   timeout=300)
    (wheel,) = (tmp_path / "dist").glob("newsvec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("search.html", "search.js", "search.css"):
        assert f"pipeline/serve/static/{name}" in names


def test_the_page_is_served_without_the_key_under_a_strict_policy(url):
    """``GET /`` and its files answer without the API key (they hold no data; ``/info`` and
    ``/v1/search`` still need it), as UTF-8, with a Content-Security-Policy that runs the page's
    own script file alone and loads nothing from elsewhere; the HTML holds no inline script,
    handler or style, and the script writes no markup."""
    httpx = need("httpx")
    page = httpx.get(f"{url}/", timeout=30)
    assert page.status_code == 200, page.text[:300]
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    policy = dict(part.strip().split(" ", 1) for part in
                  page.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'" and policy["script-src"] == "'self'"
    assert policy["style-src"] == "'self'" and policy["connect-src"] == "'self'"
    assert page.headers["x-content-type-options"] == "nosniff"
    for path in ("/info", "/v1/models"):
        assert httpx.get(f"{url}{path}", timeout=30).status_code == 401
    assert httpx.post(f"{url}/v1/search", json={"query": "x"}, timeout=30).status_code == 401

    class Tags(HTMLParser):
        def __init__(self):
            super().__init__()
            self.found: list[tuple[str, dict]] = []
            self.inline = ""

        def handle_starttag(self, tag, attrs):
            self.found.append((tag, dict(attrs)))

        def handle_data(self, data):
            if self.found and self.found[-1][0] in ("script", "style"):
                self.inline += data.strip()

    tags = Tags()
    tags.feed(page.text)
    assert tags.found[0] == ("html", {"lang": "en"})
    assert ("meta", {"charset": "utf-8"}) in tags.found
    assert not tags.inline
    assert not [(t, a) for t, a in tags.found if any(k.startswith("on") or k == "style"
                                                      for k in a)]
    loaded = [a.get("src") or a.get("href") for t, a in tags.found if t in ("script", "link")]
    assert loaded == ["static/search.css", "static/search.js"]
    for asset, kind in (("search.js", "text/javascript"), ("search.css", "text/css")):
        answer = httpx.get(f"{url}/static/{asset}", timeout=30)
        assert answer.status_code == 200
        assert answer.headers["content-type"] == f"{kind}; charset=utf-8"
        assert "http://" not in answer.text and "https://" not in answer.text
    script = httpx.get(f"{url}/static/search.js", timeout=30).text
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function"):
        assert sink not in script, sink


def test_a_query_typed_and_sent_with_enter_shows_its_story_and_copies(browser, url, titles,
                                                                      tmp_path):
    """Keyboard alone: the query box has the focus, Enter sends the query; the service wants its
    key, so the page asks for it and moves the focus there; the key and Enter run the search. The
    story of the battery plant comes first, with its other copy behind Enter on its summary, each
    with its source and link; the focus is visible."""
    from selenium.webdriver.common.keys import Keys

    browser.get(f"{url}/")
    wait_for(browser, lambda d: "API key" in d.find_element("id", "about").text,
             "the footer's request for the key")
    assert _active_id(browser) == "q"
    assert browser.execute_script(
        "return getComputedStyle(document.activeElement).outlineStyle") == "solid"
    _type(browser, "a new battery factory in an old steel town", Keys.ENTER)
    wait_for(browser, lambda d: _active_id(d) == "key", "the focus on the key's field")
    assert "needs an API key" in browser.find_element("id", "error").text
    _type(browser, API_KEY, Keys.ENTER)
    wait_for(browser, _stories, "the stories")
    assert _active_id(browser) == "q"
    assert browser.execute_script("return sessionStorage.getItem('newsvec.apiKey')") == API_KEY

    first = _stories(browser)[0]
    pair = {titles[BATTERY], titles["page-copy-0007"]}
    shown = first.find_element("css selector", "h2").text
    assert shown in pair
    summary = first.find_element("css selector", "details > summary")
    assert summary.text == "1 other copy"
    copy = first.find_element("css selector", "details li")
    assert not copy.is_displayed()
    summary.send_keys(Keys.ENTER)
    wait_for(browser, lambda d: copy.is_displayed(), "the copy, once opened")
    assert browser.execute_script(
        "return getComputedStyle(document.activeElement).outlineStyle") == "solid"
    assert {shown, copy.find_element("css selector", "h3").text} == pair
    sources = {first.find_element("css selector", ".meta .source").text,
               copy.find_element("css selector", ".source").text}
    assert sources == {"newsvec-demo-wire", COPY_SOURCE}
    links = {a.get_attribute("href") for a in first.find_elements("css selector", "a")}
    assert "https://greyhaven-post.example.org/vantor-plant" in links
    screenshot(browser, tmp_path, "search-page.png")
    assert not page_errors(browser, EXPECTED_FAILURES)


def test_what_an_article_holds_shows_as_text_never_as_markup(browser, url, titles):
    """The hostile article: its title (the pipeline's defused text) shows exactly as the output
    holds it, its source's ``<img onerror>`` as text, its ``javascript:`` address as no link; no
    element came of it (the page writes text), and nothing ran or was refused (the
    Content-Security-Policy would have refused an inline handler, and said so in the console)."""
    stories = _search(browser, "harbour board publishes dredging plan")
    hostile = [s for s in stories if "window.__pwned=1" in s.text]
    assert len(hostile) == 1, [s.text for s in stories]
    assert hostile[0].find_element("css selector", "h2").text == titles["page-hostile"]
    assert "< script>window.__pwned=1< /script>" in titles["page-hostile"]
    meta = hostile[0].find_element("css selector", ".meta").text
    assert HOSTILE_SOURCE in meta and f"address (not a link): {HOSTILE_URL}" in meta
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    assert browser.execute_script(
        "return document.querySelectorAll('#results img, #results script').length") == 0
    protocols = browser.execute_script(
        "return [...document.querySelectorAll('a')].map((a) => a.protocol)")
    assert set(protocols) <= {"http:", "https:"}
    assert not page_errors(browser, EXPECTED_FAILURES)


def test_japanese_and_the_filters(browser, url, titles):
    """A language filter typed into its field keeps the Japanese articles, shown as the output
    holds them (UTF-8, marked ``lang="ja"``); a time range from the address keeps its days."""
    assert browser.execute_script("return [document.characterSet, document.documentElement.lang]"
                                  ) == ["UTF-8", "en"]
    language = browser.find_element("id", "language")
    language.send_keys("ja")
    stories = _search(browser, "紅葉のライトアップ")
    japanese = {titles[f"sample-{n:04d}"] for n in range(48, 54)}
    shown = [s.find_element("css selector", "h2 > *") for s in stories]
    assert len(shown) == len(japanese)
    assert {s.text for s in shown} == japanese
    assert {s.get_attribute("lang") for s in shown} == {"ja"}
    language.clear()

    browser.get(f"{url}/?q=battery+factory&from=2026-11-29&to=2026-11-29")
    wait_for(browser, _stories, "the stories of the 29th")
    assert browser.find_element("id", "from").get_attribute("value") == "2026-11-29"
    days = browser.execute_script(
        "return [...document.querySelectorAll('#results time')].map((t) => t.dateTime)")
    assert days and all(d.startswith("2026-11-29") for d in days), days
    assert titles[BATTERY] not in browser.find_element("id", "results").text
    assert not page_errors(browser, EXPECTED_FAILURES)


def test_the_stores_refusal_of_filters_shows_as_a_message(browser, url, service):
    """With the store's search (its own refusal: ``StoreCorpus.nearest`` takes no filters), a
    filtered search shows the refusal and a button that clears the filters; once the Parquet
    search is back, that button (Enter) searches again without them."""
    from selenium.webdriver.common.keys import Keys

    from pipeline.serve.corpus import StoreCorpus

    state = service[1].state.service
    parquet = state.corpus
    state.corpus = object.__new__(StoreCorpus)  # no store behind it: the filters are refused first
    try:
        browser.get(f"{url}/")
        browser.find_element("id", "source").send_keys("newsvec-demo-wire")
        assert _search(browser, "a new battery factory") == []
        error = browser.find_element("id", "error")
        assert error.is_displayed() and "takes no filters" in error.text
        assert "not taken by the store's search" in error.text
        assert "whose search takes no filters" in browser.find_element("id", "filters-note").text
    finally:
        state.corpus = parquet
    error.find_element("css selector", "button").send_keys(Keys.ENTER)
    wait_for(browser, _stories, "the stories without the filters")
    assert browser.find_element("id", "source").get_attribute("value") == ""
    assert not browser.find_element("id", "error").is_displayed()
    assert not page_errors(browser, EXPECTED_FAILURES)


def test_320_px_wide_nothing_overflows(browser, url, tmp_path):
    """At 320 CSS pixels (a small phone) with the copies open, the key's field open and the
    footer's long model label: nothing is wider than the screen."""
    resize(browser, 320, 720)
    try:
        browser.get(f"{url}/?q=a+new+battery+factory+in+an+old+steel+town")
        first = wait_for(browser, _stories, "the stories")[0]
        assert not browser.find_element("id", "filters-box").get_attribute("open")
        assert first.rect["y"] < 720  # the filters folded: the first story on the first screen
        assert _no_overflow(browser) <= 320
        screenshot(browser, tmp_path, "search-page-320.png")
        browser.execute_script(
            "document.querySelectorAll('details').forEach((d) => { d.open = true; })")
        assert _no_overflow(browser) <= 320
    finally:
        resize(browser, 1280, 900)


def test_the_footer_names_the_model_and_output(browser, url):
    httpx = need("httpx")
    info = httpx.get(f"{url}/info", headers=headers(), timeout=30).json()
    browser.get(f"{url}/")
    about = wait_for(browser, lambda d: info["model"]["label"] in d.find_element("id", "about").text
                     and d.find_element("id", "about").text, "the model's label")
    assert info["output"] in about and "(parquet)" in about
    assert info["output_run"]["run_id"] in about
    assert not page_errors(browser, EXPECTED_FAILURES)

"""The operator's page of ``newsvec serve`` (``GET /status``) and its JSON twin
(``/status.json``), over real outputs:

- streaming outputs written by the streaming sink (``WriteStreaming``, as the streaming tests build
  them: micro-batches of rows and dead letters, windows of the last hour), one healthy, one
  broken as the ledger tests break one (a record whose counts do not add up, a vectors file
  deleted, a record that is not JSON, a reason and a run id holding ``<script>``);
- a batch output written by the local batch pipeline with the FAKE engine (tests/fakes.py: the
  vectors do not matter here, the summary and manifest do), and the same with its summary's
  counts altered.

The service is made by ``create_app`` with a FAKE engine (the routes under test embed nothing)
and answered in-process (Starlette's TestClient). What is asserted: the JSON flags each broken
window with the reason ``newsvec ledger`` gives, the page draws it as a row of class
``unbalanced``, text from the output is escaped, the healthy output has no flag, the routes need
the API key and are counted in the metrics, the page forbids scripts and remote assets, and the
status is read once per few seconds however often it is asked.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime as dt
import hashlib
import json
import re
import threading
from pathlib import Path

import pytest

from pipeline.serve import status as status_lib
from tests.common import SAMPLE_EVENTS, make_config
from tests.fakes import FakeEngine
from tests.serve.conftest import API_KEY, headers, need
from transforms.settings import ServeSettings, StreamingSettings
from transforms.types import LedgerRecord

SUBSCRIPTION = "projects/newsvec-test/subscriptions/news"
HOSTILE = "<script>alert(1)</script>"


class StatusEngine(FakeEngine):
    """FAKE: nothing is embedded by the routes under test; ``create_app`` only asks its label."""

    def label(self) -> str:  # type: ignore[override]
        return "fake@0"


def _window_base() -> dt.datetime:
    """The start of the first window: 40 minutes ago, on a minute (settled: past the default
    allowed lateness of 10 minutes plus the 5 minutes' margin)."""
    now = dt.datetime.now(dt.timezone.utc).replace(second=0, microsecond=0)
    return now - dt.timedelta(minutes=40)


def _micro_batch(start: dt.datetime, shard: int, rows=(), letters=(), duplicates=0):
    from apache_beam.utils.timestamp import Timestamp

    from transforms.types import MicroBatch

    begin = Timestamp.from_utc_datetime(start)
    return MicroBatch(window_start_us=begin.micros, window_end_us=(begin + 60).micros, pane=0,
                      shard=shard, shards=2, rows=tuple(rows), dead_letters=tuple(letters),
                      duplicates=duplicates,
                      messages_in=len(rows) + len(letters) + duplicates)


def write_streaming(out: Path, reason: str = "invalid_json") -> dt.datetime:
    """Three windows a minute apart, from ``_window_base``: rows, dead letters (of ``reason`` in
    the second window) and a duplicate, written by the streaming sink. Returns the first start."""
    import apache_beam as beam
    from apache_beam.testing.test_pipeline import TestPipeline

    from tests.streaming.test_sinks_streaming import letter, row
    from transforms.sinks import WriteStreaming

    base = _window_base()
    minute = dt.timedelta(minutes=1)
    batches = [
        _micro_batch(base, 0, rows=[row("a"), row("b")], letters=[letter("bad")]),
        _micro_batch(base + minute, 0, rows=[row("c")], letters=[letter("x", reason)],
                     duplicates=1),
        _micro_batch(base + minute, 1, rows=[row("d"), row("e")]),
        _micro_batch(base + 2 * minute, 0, rows=[row("f")]),
    ]
    p = TestPipeline(runner="BundleBasedDirectRunner")
    _ = p | beam.Create(batches) | WriteStreaming(str(out), "20261201T093000Z-1a2b3c4d", dim=384)
    p.run().wait_until_finish()
    return base


def _stamp(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def streaming_config(out: Path, **changes):
    return make_config(output=str(out), streaming=StreamingSettings(subscription=SUBSCRIPTION),
                       serve=ServeSettings(search="off"), **changes)


def client_of(config, api_key=API_KEY):
    need("fastapi")
    need("httpx")
    from fastapi.testclient import TestClient

    from pipeline.serve.app import create_app

    return TestClient(create_app(config, StatusEngine(), api_key=api_key),
                      base_url="http://127.0.0.1")  # a keyless service answers loopback names


def records(out: Path) -> dict[str, Path]:
    """{window start and shard: its ledger record's path}."""
    found = {}
    for path in sorted((out / "ledger").rglob("*.json")):
        record = LedgerRecord.from_json(path.read_text())
        found[f"{record.window_start}/{record.shard}"] = path
    return found


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> tuple[Path, dt.datetime]:
    out = tmp_path_factory.mktemp("status-healthy")
    return out, write_streaming(out)


def test_a_healthy_streaming_output_has_no_flag(healthy):
    out, base = healthy
    with client_of(streaming_config(out)) as client:
        answer = client.get("/status.json", headers=headers())
        page = client.get("/status", headers=headers())
    assert answer.status_code == 200 and page.status_code == 200
    status = answer.json()
    assert status["kind"] == "streaming" and status["ok"] and not status["problems"]
    streaming = status["streaming"]
    assert streaming["flagged"] == []
    windows = {w["window_start"]: w for w in streaming["windows"]}
    assert list(windows) == [_stamp(base + dt.timedelta(minutes=i)) for i in range(3)]
    second = windows[_stamp(base + dt.timedelta(minutes=1))]
    assert (second["micro_batches"], second["messages_in"], second["rows_written"],
            second["dead_lettered"], second["duplicates"]) == (2, 5, 3, 1, 1)
    assert second["dead_lettered_by_reason"] == {"invalid_json": 1}
    assert second["rows_per_minute"] == 3.0 and second["balanced"] and second["settled"]
    assert second["written_after_end_s"] is not None and second["store_loaded"] is None
    assert streaming["totals"]["messages_in"] == 9 and streaming["totals"]["balanced"]
    hour = base.strftime("dt=%Y-%m-%d/hour=%H")
    compaction = {h["partition"]: h for h in streaming["compaction"]}
    assert compaction[hour]["compacted"] == 0 and compaction[hour]["micro_batches"] >= 1
    assert streaming["store"] is None
    html = page.text
    assert 'class="window unbalanced' not in html and "nothing wrong found" in html
    assert html.count('class="window') == 3 and 'id="rate-chart"' in html
    assert 'id="dead-letters-chart"' in html and "<polyline" in html


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> tuple[Path, dt.datetime]:
    """The three windows, broken: the first's record counts a message more than it wrote (its
    run id ``<script>``), the second's shard 1 lost its vectors file, the third's record is
    not JSON; and a dead-letter reason of the second window is ``<script>``."""
    out = tmp_path_factory.mktemp("status-broken")
    base = write_streaming(out, reason=HOSTILE)
    found = records(out)
    first = found[f"{_stamp(base)}/0"]
    record = LedgerRecord.from_json(first.read_text())
    first.write_text(dataclasses.replace(record, messages_in=record.messages_in + 1,
                                         run_id=HOSTILE).to_json())
    second = LedgerRecord.from_json(found[f"{_stamp(base + dt.timedelta(minutes=1))}/1"]
                                    .read_text())
    (out / second.vectors_file).unlink()
    found[f"{_stamp(base + dt.timedelta(minutes=2))}/0"].write_text('{"torn": ')
    return out, base


def test_an_unbalanced_window_is_flagged_with_its_reason(broken):
    out, base = broken
    with client_of(streaming_config(out)) as client:
        answer = client.get("/status.json", headers=headers())
    assert answer.status_code == 200
    status = answer.json()
    streaming = status["streaming"]
    assert not status["ok"]
    first, second, third = (_stamp(base + dt.timedelta(minutes=i)) for i in range(3))
    assert streaming["flagged"] == [first, second, third]
    windows = {w["window_start"]: w for w in streaming["windows"]}
    assert not windows[first]["balanced"]
    assert any("does not balance" in p for p in windows[first]["problems"])
    assert any("is missing" in p for p in windows[second]["problems"])
    # The record that is no JSON is a problem of no window; its window's files have no record.
    assert any("is not a ledger record" in p for p in status["problems"])
    assert any("has no ledger record" in p for p in windows[third]["problems"])
    assert windows[second]["dead_lettered_by_reason"] == {HOSTILE: 1}


def test_the_page_draws_a_flagged_window_red_and_escapes_the_outputs_text(broken):
    out, base = broken
    with client_of(streaming_config(out)) as client:
        page = client.get("/status", headers=headers())
    assert page.status_code == 200
    html = page.text
    first = _stamp(base)
    row = re.search(rf'<tr class="([^"]*)" id="[^"]*" data-window="{first}">(.*?)</tr>', html, re.S)
    assert row and "unbalanced" in row.group(1).split(), html
    assert "does not balance" in row.group(2) and 'class="reason"' in row.group(2)
    assert "<script" not in html.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # the reason and the run id
    assert 'class="problem"' in html and "is not a ledger record" in html
    flagged = re.search(r'<ul id="flagged">(.*?)</ul>', html, re.S).group(1)
    assert f'href="#window-{first}"' in flagged and "does not balance" in flagged
    # Red: the style sheet colours the unbalanced rows, and the policy allows it by its hash.
    css = re.search(r"<style>(.*?)</style>", html, re.S).group(1)
    assert re.search(r"tr\.unbalanced td[^{]*\{[^}]*background", css)
    digest = base64.b64encode(hashlib.sha256(css.encode("utf-8")).digest()).decode("ascii")
    policy = page.headers["content-security-policy"]
    assert f"style-src 'sha256-{digest}'" in policy and "default-src 'none'" in policy
    assert "unsafe-inline" not in policy and "script-src" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"


def test_the_routes_need_the_api_key_and_are_counted(healthy):
    out, _ = healthy
    with client_of(streaming_config(out)) as client:
        for path in ("/status", "/status.json"):
            refused = client.get(path)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert client.get(path, headers=headers("another")).status_code == 401
            assert client.get(path, headers=headers()).status_code == 200
        for bad in ("0", "49", "two", "1.5", "٣"):
            answer = client.get(f"/status.json?hours={bad}", headers=headers())
            assert answer.status_code == 400, bad
            assert answer.json()["error"]["param"] == "hours"
        assert client.get("/status.json?hours=1", headers=headers()).json()["hours"] == 1
        metrics = client.get("/metrics", headers=headers()).text
    assert re.search(r'newsvec_serve_requests_total\{route="/status",status="200"\} 1', metrics)
    assert re.search(r'newsvec_serve_requests_total\{route="/status.json",status="401"\} 2',
                     metrics)


def test_without_a_key_on_loopback_the_page_opens(healthy):
    out, _ = healthy
    with client_of(streaming_config(out), api_key=None) as client:
        assert client.get("/status").status_code == 200


def test_the_status_is_read_once_per_few_seconds():
    """Kept ``ttl_s`` (a fake clock), or twice its collection's time where that is longer."""
    ticks = [0.0]
    calls = []

    def collector(config, hours):
        calls.append(hours)
        return {"hours": hours, "read": len(calls)}

    def get(cache, hours):
        return asyncio.run(cache.get(hours))

    cache = status_lib.StatusCache(None, ttl_s=5, clock=lambda: ticks[0], collector=collector)
    assert get(cache, 3) == get(cache, 3) == {"hours": 3, "read": 1}
    ticks[0] = 4.9
    assert get(cache, 3)["read"] == 1 and get(cache, 1)["read"] == 2
    ticks[0] = 5.1
    assert get(cache, 3)["read"] == 3 and calls == [3, 1, 3]

    def slow(config, hours):  # takes 4 s to read: kept 8 s from its end
        ticks[0] += 4
        return collector(config, hours)

    cache = status_lib.StatusCache(None, ttl_s=5, clock=lambda: ticks[0], collector=slow)
    ticks[0] = 100.0
    assert get(cache, 3)["read"] == 4
    ticks[0] = 111.9
    assert get(cache, 3)["read"] == 4
    ticks[0] = 112.0
    assert get(cache, 3)["read"] == 5


def test_requests_that_come_during_a_collection_share_it():
    """Ten requests at once while the output is slow to read: one collection, in one thread;
    the others wait on the event loop."""
    started = threading.Event()
    release = threading.Event()
    threads = set()

    def collector(config, hours):
        threads.add(threading.get_ident())
        started.set()
        release.wait(10)
        return {"read": len(threads)}

    async def burst():
        cache = status_lib.StatusCache(None, collector=collector)
        waiting = [asyncio.ensure_future(cache.get(3)) for _ in range(10)]
        await asyncio.to_thread(started.wait, 10)
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(*waiting)

    assert asyncio.run(burst()) == [{"read": 1}] * 10 and len(threads) == 1


def test_a_reload_loop_reads_the_output_once(healthy, monkeypatch):
    out, _ = healthy
    read = []
    collect = status_lib.collect
    monkeypatch.setattr(status_lib, "collect",
                        lambda config, hours: read.append(hours) or collect(config, hours))
    with client_of(streaming_config(out)) as client:
        answers = [client.get("/status.json", headers=headers()).json() for _ in range(5)]
    assert len(read) == 1 and len({a["generated_at"] for a in answers}) == 1


def test_an_output_that_cannot_be_read_is_a_problem_not_a_500(tmp_path):
    out = tmp_path / "out"
    write_streaming(out)
    partition = next((out / "ledger").iterdir())
    manifest = out / "_compaction" / partition.name / next(partition.iterdir()).name
    manifest.mkdir(parents=True)
    (manifest / "manifest.json").write_text('{"partition": "elsewhere"}')
    status = status_lib.collect(streaming_config(out))
    assert not status["ok"] and status["streaming"]["windows"] == []
    assert any("could not be read" in p and "refused" in p for p in status["problems"]), \
        status["problems"]


# Batch.

@pytest.fixture(scope="module")
def batch_output(tmp_path_factory):
    """The sample, run through the local batch pipeline with the FAKE engine into
    ``out/dt=<yesterday>``; (the filled config, the output)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline import config as config_lib
    from pipeline.run import run_batch

    root = tmp_path_factory.mktemp("status-batch")
    config = config_lib.fill_date(make_config(
        input=str(SAMPLE_EVENTS), output=f"{root}/out/dt={{date}}",
        serve=ServeSettings(search="off")), "yesterday")
    run_batch(config, PipelineOptions(["--runner=FnApiRunner"]), engine_factory=FakeEngine)
    return config, Path(config.output)


def test_a_batch_run_shows_its_counts_and_duration(batch_output):
    config, out = batch_output
    summary = json.loads((out / "_summary.json").read_text())
    with client_of(config) as client:
        status = client.get("/status.json", headers=headers()).json()
        page = client.get("/status", headers=headers()).text
    assert status["kind"] == "batch" and status["ok"] and status["streaming"] is None
    [run] = status["runs"]  # the other days' outputs hold nothing
    assert (run["run_id"], run["state"], run["published"]) == (summary["run_id"], "committed",
                                                               True)
    assert run["counts"]["in"] == summary["counts"]["in"] and run["balanced"]
    assert run["counts"]["dead_lettered_by_reason"] == summary["counts"]["dead_lettered_by_reason"]
    assert run["duration_s"] is not None and run["duration_s"] >= 0
    assert run["day"] == config.filled_day.isoformat() and run["store_loaded"] is None
    assert f'data-run="{run["run_id"]}"' in page and 'class="run unbalanced' not in page


def test_a_batch_run_that_does_not_balance_is_flagged(batch_output, tmp_path):
    import shutil

    config, out = batch_output
    copy = tmp_path / out.name
    shutil.copytree(out, copy)
    summary = json.loads((copy / "_summary.json").read_text())
    summary["counts"]["written"] += 1
    (copy / "_summary.json").write_text(json.dumps(summary))
    status = status_lib.collect(config.model_copy(update={"output": str(copy)}))
    [run] = status["runs"]
    assert not status["ok"] and not run["balanced"]
    assert any("does not balance" in p for p in run["problems"])
    from pipeline.serve.pages import render

    assert 'class="run unbalanced"' in render(status)


# The store.

def test_a_micro_batch_the_store_lacks_is_flagged(tmp_path, store_settings):
    """Every micro-batch's record says it loaded its rows; the store holds the loads of all
    but the last: that one's window is flagged (``newsvec ledger --store``'s reason), and the
    store's lag counts three of four."""
    from tests.store.test_store import vectors
    from transforms.stores.base import LoadRows
    from transforms.stores.pgvector import Store

    out = tmp_path / "out"
    base = write_streaming(out)
    lost = _stamp(base + dt.timedelta(minutes=2))
    store = Store(store_settings)
    for name, path in records(out).items():
        record = LedgerRecord.from_json(path.read_text())
        key = f"mb:{name}"
        path.write_text(dataclasses.replace(
            record, store_rows=record.rows_written, store_load_key=key).to_json())
        if not name.startswith(lost):
            ids = [f"{name}/{i}" for i in range(record.rows_written)]
            store.load(LoadRows(vectors(ids), None, base.date()), key)
    status = status_lib.collect(streaming_config(out, store=store_settings))
    streaming = status["streaming"]
    assert streaming["flagged"] == [lost]
    windows = {w["window_start"]: w for w in streaming["windows"]}
    assert any(f"store load mb:{lost}/0 is not in the store" in p
               for p in windows[lost]["problems"]), windows[lost]["problems"]
    assert windows[_stamp(base)]["store_loaded"] is True and windows[lost]["store_loaded"] is False
    lag = streaming["store"]
    assert (lag["micro_batches"], lag["loaded"], lag["error"]) == (4, 3, None)
    assert lag["lag_s"] is not None and lag["lag_s"] >= 0


def test_a_store_that_cannot_be_read_is_a_problem_and_the_ledger_is_still_shown(healthy,
                                                                               monkeypatch):
    from transforms.stores.pgvector import StoreSettings

    out, _ = healthy
    monkeypatch.delenv("NEWSVEC_TEST_STATUS_DSN", raising=False)
    settings = StoreSettings(enabled=True, dsn_env="NEWSVEC_TEST_STATUS_DSN")
    status = status_lib.collect(streaming_config(out, store=settings))
    assert not status["ok"] and len(status["streaming"]["windows"]) == 3
    assert status["streaming"]["flagged"] == []
    lag = status["streaming"]["store"]
    assert lag["loaded"] is None and "the store could not be read" in lag["error"]
    assert any("the store could not be read" in p for p in status["problems"])

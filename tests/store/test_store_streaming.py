"""The streaming job with the store on, the database killed mid-run: Google's Pub/Sub emulator ->
newsvec (BundleBasedDirectRunner, real vLLM) -> per-micro-batch Parquet on local disk and the
store (PostgreSQL + pgvector, ``postgres_server``). PostgreSQL is killed (SIGKILL) while articles
flow and started again a few seconds later: the micro-batches that meet it down wait (retrying
with backoff) and load once it is back. Afterwards every article is in the store exactly once, its
vector equal to the Parquet's, and ``newsvec ledger --store`` passes."""
from __future__ import annotations

import datetime as dt
import logging
import threading
import time

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline import ledger
from tests.common import SAMPLE_EVENTS, STORE_DSN_ENV, make_config
from tests.emulators import pubsub_emulator
from tests.store.test_store import vectors
from tools.emulators import local_streaming_job
from tools.publish import publish_file
from transforms.stores.base import LoadRows
from transforms.stores.pgvector import Store, StoreSettings
from transforms.types import LedgerRecord

PROJECT = "newsvec-store-test"
TOPIC, SUBSCRIPTION = f"projects/{PROJECT}/topics/news", f"projects/{PROJECT}/subscriptions/news"
VALID_ARTICLES = 40  # of the sample: its valid, distinct articles in English


def _store_rows(dsn: str) -> int:
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            return conn.execute("SELECT count(*) FROM news_vectors").fetchone()[0]
    except psycopg.Error:  # down, or the table not created yet
        return -1


def _file_rows(out) -> pa.Table | None:
    files = sorted(out.glob("vectors/**/*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]) if files else None


def test_every_article_is_stored_once_although_the_database_was_killed_mid_run(
        tmp_path, monkeypatch, postgres_server, pg, caplog):
    caplog.set_level(logging.WARNING, logger="newsvec.store")
    monkeypatch.setenv(STORE_DSN_ENV, pg)
    out = tmp_path / "out"
    config = make_config(output=str(out), store=StoreSettings(
        enabled=True, dsn_env=STORE_DSN_ENV, retry_s=120))
    config = config.model_copy(update={"streaming": config.streaming.model_copy(update={
        "subscription": SUBSCRIPTION, "window_s": 5, "max_wait_s": 1, "batch_shards": 2})})
    killed_at = restarted_at = None
    with pubsub_emulator(PROJECT, tmp_path) as host:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", host)
        from google.cloud import pubsub_v1

        pubsub_v1.PublisherClient().create_topic(name=TOPIC)
        pubsub_v1.SubscriberClient().create_subscription(name=SUBSCRIPTION, topic=TOPIC)
        with local_streaming_job(config, TOPIC):
            sent: dict = {}
            publisher = threading.Thread(target=lambda: sent.update(
                publish_file(TOPIC, SAMPLE_EVENTS, rate=3)))
            publisher.start()
            deadline = time.monotonic() + 300
            while _store_rows(pg) <= 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert _store_rows(pg) > 0, "the first micro-batches reach the store"
            postgres_server.kill()
            killed_at = time.monotonic()
            time.sleep(8)  # micro-batches meet the database down meanwhile
            postgres_server.start()
            restarted_at = time.monotonic()
            publisher.join()
            while _store_rows(pg) < VALID_ARTICLES and time.monotonic() < deadline:
                time.sleep(1)
            time.sleep(config.streaming.max_wait_s + 3)  # a row stored twice would show by now
    assert killed_at is not None and restarted_at is not None
    assert "retrying" in caplog.text, "micro-batches met the database down and waited for it"
    assert pg not in caplog.text
    table = _file_rows(out)
    assert table is not None
    ids = table["id"].to_pylist()
    assert len(ids) == len(set(ids)) == VALID_ARTICLES
    with psycopg.connect(pg) as conn:
        stored = dict(conn.execute("SELECT id, embedding::text FROM news_vectors").fetchall())
        load_keys = [k for (k,) in conn.execute("SELECT load_key FROM news_vectors_loads")]
    assert sorted(stored) == sorted(ids), "every article in the store, exactly once"
    emb = table["embedding"].combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    for doc_id, vector in zip(ids, emb, strict=True):
        np.testing.assert_allclose(np.array(eval(stored[doc_id])), vector, rtol=1e-6)  # noqa: S307
    assert all(k.startswith("mb:") for k in load_keys) and len(load_keys) == len(set(load_keys))
    report = ledger.check(str(out), store=config.store)
    assert report.ok, report.problems
    assert report.totals["rows_written"] == VALID_ARTICLES
    assert report.totals["store_articles"] == VALID_ARTICLES
    assert report.totals["store_loads"] == len(load_keys)
    # The same through the command line: newsvec ledger --store --config C (the output its own).
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert ledger.main(["--config", str(config_file), "--store"]) == 0
    with pytest.raises(SystemExit):
        ledger.main(["--output", str(out), "--store"])  # --store needs the config's store:


def test_the_ledger_store_check_finds_a_micro_batch_missing_from_the_store(
        tmp_path, monkeypatch, pg):
    """``newsvec ledger --store`` fails when a record's load is not in the store: the rows of one
    load deleted by hand."""

    monkeypatch.setenv(STORE_DSN_ENV, pg)
    settings = StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV)


    Store(settings).load(LoadRows(vectors(["a", "b"]), None, dt.date(2026, 12, 1)), "mb:x")
    folder = tmp_path / "ledger" / "dt=2026-12-01" / "hour=09"
    folder.mkdir(parents=True)
    record = LedgerRecord(
        run_id="r", window_start="2026-12-01T09:00:00Z", window_end="2026-12-01T09:00:05Z",
        pane=0, shard=0, shards=1, messages_in=2, rows_written=2, dead_lettered=0,
        dead_lettered_by_reason={}, duplicates=0, late_reassigned=0, vectors_file=None,
        dead_letter_file=None, written_at="2026-12-01T09:00:06Z", store_rows=2,
        store_load_key="mb:x")
    (folder / "part-20261201T090000Z-000-00000-of-00001-0123456789abcdef.json").write_text(
        record.to_json())
    report = ledger.check(str(tmp_path), verify=False, store=settings)
    assert not any("store" in p for p in report.problems), report.problems
    with psycopg.connect(pg) as conn:
        conn.execute("DELETE FROM news_vectors_loads")
    report = ledger.check(str(tmp_path), verify=False, store=settings)
    assert any("store load mb:x is not in the store" in p for p in report.problems)


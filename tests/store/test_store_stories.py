"""The store keeps every row's story (``story_id``, ``near_duplicate_of``, ``similarity``) with
``story_id`` indexed, upgrades a table of a release before 0.4 in place (two loads starting at
once), and ``newsvec search --store`` shows each story once, collapsed in SQL, as the Parquet
search does (docs/store.md, "The same story, once")."""
from __future__ import annotations

import datetime as dt
import threading

import numpy as np
import psycopg
import pyarrow as pa
import pytest

from tests.store.test_store import DIM, T0, chunks, stored, vectors
from transforms.stores.base import LoadRows
from transforms.stores.pgvector import Store

DAY = dt.date(2026, 12, 1)
QUERY = np.eye(DIM, dtype=np.float32)[0]
STORY_COLUMNS = ("story_id", "near_duplicate_of", "similarity")
TABLES = ("news_vectors", "news_vectors_chunks", "news_vectors_superseded",
          "news_vectors_chunks_superseded")


def with_scores(table: pa.Table, scores: list[float]) -> pa.Table:
    """``table`` with embeddings whose cosine similarity with ``QUERY`` are ``scores``."""
    emb = np.zeros((len(scores), DIM), np.float32)
    emb[:, 0] = scores
    emb[:, 1] = np.sqrt(1 - np.square(scores))
    return table.set_column(table.schema.get_field_index("embedding"), "embedding",
                            pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), DIM))


def columns(pg: str, table: str) -> set[str]:
    with psycopg.connect(pg) as conn:
        return {r[0] for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped", (table,)).fetchall()}


def story_index(pg: str) -> str | None:
    with psycopg.connect(pg) as conn:
        row = conn.execute("SELECT indexdef FROM pg_indexes "
                           "WHERE indexname = 'news_vectors_story_id'").fetchone()
    return row[0] if row else None


def test_a_load_stores_each_rows_story_and_indexes_story_id(store_settings, pg):
    """Old code: the table could not be made (similarity, a float32, had no SQL type)."""
    stories = {"a": "a", "b": "a"}
    Store(store_settings).load(LoadRows(vectors(["a", "b", "c"], stories=stories),
                                        chunks({"a": 1, "b": 2}, stories=stories), DAY), "run:1")
    assert stored(pg, "id, story_id, near_duplicate_of, similarity") == [
        ("a", "a", None, None), ("b", "a", "a", pytest.approx(0.9)), ("c", None, None, None)]
    assert stored(pg, "id, chunk_index, story_id, near_duplicate_of",
                  "news_vectors_chunks") == [("a", 0, "a", None), ("b", 0, "a", "a"),
                                             ("b", 1, "a", "a")]
    assert "(story_id)" in (story_index(pg) or "")


def _as_before_0_4(pg: str) -> None:
    """The store's tables as a release before 0.4 left them: no story columns, no index."""
    with psycopg.connect(pg) as conn:
        conn.execute("DROP INDEX IF EXISTS news_vectors_story_id")
        for table in TABLES:
            for column in STORY_COLUMNS:
                conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")


def test_a_table_of_0_3_is_upgraded_in_place_by_two_loads_starting_at_once(store_settings, pg):
    """Both loads succeed (the second finds the columns the first added), rows loaded before
    keep a null story, and a later load issues no DDL. Old code: the first load failed."""
    from transforms.stores.pgvector.catalog import missing_ddl, read_catalog

    store = Store(store_settings)
    store.load(LoadRows(vectors(["old"]), None, DAY), "run:0")
    _as_before_0_4(pg)
    assert not columns(pg, "news_vectors") & set(STORY_COLUMNS)
    barrier, failures = threading.Barrier(2), []

    def load(n: int) -> None:
        ids = [f"w{n}-orig", f"w{n}-copy"]
        try:
            barrier.wait()
            Store(store_settings).load(LoadRows(
                vectors(ids, seed=n, embedded_at=T0 + dt.timedelta(hours=1),
                        stories={i: ids[0] for i in ids}),
                chunks({ids[1]: 1}, stories={ids[1]: ids[0]}), DAY), f"run:{n}")
        except BaseException as exc:  # noqa: BLE001  # reported below
            failures.append(exc)

    workers = [threading.Thread(target=load, args=(n,)) for n in (1, 2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []
    for table in TABLES:
        assert set(STORY_COLUMNS) <= columns(pg, table), table
    assert "(story_id)" in (story_index(pg) or "")
    assert stored(pg, "id, story_id") == [("old", None), ("w1-copy", "w1-orig"),
                                          ("w1-orig", "w1-orig"), ("w2-copy", "w2-orig"),
                                          ("w2-orig", "w2-orig")]
    with psycopg.connect(pg) as conn:
        assert missing_ddl(store_settings, read_catalog(conn, store_settings), DIM) == []


def test_search_store_returns_one_hit_per_story_with_its_copies_as_the_parquet_search(
        store_settings, pg, tmp_path, monkeypatch):
    """Twelve copies of one story nearer the query than anything else (more than
    ``ef_search``'s ten candidates), a story of its own, an article of a load without stories:
    k counts stories, each its best article with its copies counted in the whole table.
    Old code: the copies filled the k places, and no hit named its story or copies."""
    import pyarrow.parquet as pq

    from pipeline.search import search
    from tests.common import make_config

    settings = store_settings.model_copy(update={"ef_search": 10})
    store = Store(settings)
    wire = [f"wire-{n:02d}" for n in range(12)]
    ids = [*wire, "local", "plain"]
    scores = [0.99 - n * 0.001 for n in range(12)] + [0.5, 0.4]
    table = with_scores(vectors(ids, stories={**{i: "wire-00" for i in wire},
                                              "local": "local"}), scores)
    store.load(LoadRows(table, None, DAY), "run:1")
    hits = store.search(QUERY, 3)
    assert [(h["id"], h["story_id"], h["copies"]) for h in hits] == [
        ("wire-00", "wire-00", 11), ("local", "local", 0), ("plain", "plain", 0)]
    every = store.search(QUERY, 3, all_copies=True)
    assert [h["id"] for h in every] == wire[:3]
    # The same rows as a Parquet output: the same hits (scores to 4 places).
    (tmp_path / "vectors").mkdir()
    pq.write_table(table, tmp_path / "vectors" / "part-0.parquet")
    monkeypatch.setattr("pipeline.search.embed_query", lambda config, query: QUERY)
    config = make_config()
    config = config.model_copy(update={"model": config.model.model_copy(
        update={"dimensions": DIM})})
    assert search(config, "q", 3, output=str(tmp_path)) == hits


def test_search_store_collapses_chunks_by_story(store_settings, pg):
    stories = {"wire": "wire", "copy": "wire"}
    rows = with_scores(chunks({"wire": 2, "copy": 2, "other": 1}, stories=stories),
                       [0.8, 0.3, 0.1, 0.9, 0.6])
    Store(store_settings).load(LoadRows(vectors(["wire", "copy", "other"], stories=stories),
                                        rows, DAY), "run:1")
    hits = Store(store_settings).search(QUERY, 10)
    assert [(h["id"], h["chunk_index"], h["story_id"], h["copies"]) for h in hits] == [
        ("copy", 1, "wire", 1), ("other", 0, "other", 0)]


def test_search_store_on_a_table_no_load_has_upgraded_yet(store_settings, pg):
    """A 0.3 table (no story_id) is searched, each article its own story."""
    store = Store(store_settings)
    store.load(LoadRows(with_scores(vectors(["a", "b"]), [0.9, 0.8]), None, DAY), "run:1")
    _as_before_0_4(pg)
    assert [(h["id"], h["story_id"], h["copies"]) for h in store.search(QUERY, 5)] == [
        ("a", "a", 0), ("b", "b", 0)]

"""The store (PostgreSQL + pgvector, transforms/stores/) on a real server (``postgres_server``):
loads, their idempotence, the current-vector rule, the HNSW index, the connection string kept out
of every message, and a real batch run whose load fails and is redone with ``newsvec load``."""
from __future__ import annotations

import datetime as dt
import logging

import numpy as np
import psycopg
import pyarrow as pa
import pydantic
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import config as config_lib
from tests.common import SAMPLE_EVENTS, STORE_DSN_ENV, make_config
from transforms.output.parquet import chunk_schema, vector_schema
from transforms.stores.base import LoadRows, StoreLoadFailed
from transforms.stores.pgvector import Store, StoreSettings, resolve_dsn, scrub, vector_sql_type

DIM = 8
T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)


def vectors(ids, text="a", embedded_at=T0, dim=DIM, seed=0, published_at=T0, updated_at=None,
            publish_time=None, stories=None) -> pa.Table:
    """``stories``: {id: story_id} of the articles that have one (a copy: also its
    ``near_duplicate_of`` and a similarity); the others' story columns are null."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((len(ids), dim)).astype(np.float32)
    schema = vector_schema(dim)
    n = len(ids)
    return pa.table({
        "id": ids, "url": [f"https://x/{i}" for i in ids], "source": ["s"] * n,
        "title": [f"{text} {i}" for i in ids], "published_at": [published_at] * n,
        "language": ["en"] * n,
        "model": ["m"] * n, "dim": [dim] * n,
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), dim),
        "text_sha256": [text] * n, "token_count": [3] * n, "truncated": [False] * n,
        "embedded_at": [embedded_at] * n, "pubsub_message_id": [None] * n,
        "pubsub_publish_time": [publish_time] * n, "pubsub_attributes": [None] * n,
        "doc_vector": ["head"] * n, "chunk_count": [0] * n, "updated_at": [updated_at] * n,
        **_stories(ids, stories or {})}, schema=schema)


def _stories(ids, stories: dict) -> dict:
    story = [stories.get(i) for i in ids]
    copy_of = [s if s is not None and s != i else None for i, s in zip(ids, story, strict=True)]
    return {"story_id": story, "near_duplicate_of": copy_of,
            "similarity": [None if c is None else 0.9 for c in copy_of]}


def chunks(counts: dict, text="a", embedded_at=T0, stories=None) -> pa.Table:
    rows = [(i, c, n) for i, n in counts.items() for c in range(n)]
    emb = np.ones((len(rows), DIM), np.float32)
    return pa.table({
        "id": [r[0] for r in rows], "chunk_id": [f"{r[0]}-{r[1]}" for r in rows],
        "chunk_index": [r[1] for r in rows], "chunk_count": [r[2] for r in rows],
        "token_start": [0] * len(rows), "token_end": [1] * len(rows),
        "char_start": [0] * len(rows), "char_end": [1] * len(rows),
        "chunk_sha256": [text] * len(rows), "text_sha256": [text] * len(rows),
        "model": ["m"] * len(rows), "dim": [DIM] * len(rows),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), DIM),
        "embedded_at": [embedded_at] * len(rows), "chunk_text": [None] * len(rows),
        **_stories([r[0] for r in rows], stories or {})}, schema=chunk_schema(DIM))


def stored(dsn: str, what="id, title, dt", table="news_vectors") -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT {what} FROM {table} ORDER BY 1, 2").fetchall()


def test_a_load_writes_every_row_and_a_rerun_changes_nothing(store_settings, pg):
    store = Store(store_settings)
    day = dt.date(2026, 12, 1)
    first = store.load(LoadRows(vectors(["a", "b", "c"]), None, day), "run:1")
    assert (first.rows, first.articles_current, first.already_loaded) == (3, 3, False)
    with psycopg.connect(pg) as conn:
        embedding = conn.execute("SELECT embedding::text FROM news_vectors WHERE id = 'b'") \
            .fetchone()[0]
    expected = vectors(["a", "b", "c"])["embedding"].combine_chunks().flatten() \
        .to_numpy().reshape(3, DIM)[1]
    np.testing.assert_allclose(np.array(eval(embedding)), expected, rtol=1e-6)  # noqa: S307
    before = stored(pg, "*")
    again = store.load(LoadRows(vectors(["a", "b", "c"]), None, day), "run:1")
    assert again.already_loaded and stored(pg, "*") == before
    with psycopg.connect(pg) as conn:
        assert conn.execute("SELECT load_key, rows FROM news_vectors_loads").fetchall() == [
            ("run:1", 3)]


def test_the_current_vector_wins_and_an_older_day_never_overwrites(store_settings, pg):
    store = Store(store_settings)
    day1, day2 = dt.date(2026, 12, 1), dt.date(2026, 12, 2)
    store.load(LoadRows(vectors(["a", "b"], "day2", T0), None, day2), "run:day2")
    # A rerun of day 1, embedded later: its older text must not come back.
    late = T0 + dt.timedelta(hours=5)
    result = store.load(LoadRows(vectors(["a", "b", "c"], "day1", late), None, day1), "run:day1")
    assert result.articles_current == 1  # only "c", new
    assert stored(pg) == [("a", "day2 a", day2), ("b", "day2 b", day2), ("c", "day1 c", day1)]
    # The same day embedded again later (corrected text) wins; embedded earlier, it does not.
    store.load(LoadRows(vectors(["a"], "fixed", late), None, day2), "run:day2-again")
    store.load(LoadRows(vectors(["b"], "stale", T0 - dt.timedelta(hours=1)), None, day2),
               "run:day2-older")
    assert stored(pg)[:2] == [("a", "fixed a", day2), ("b", "day2 b", day2)]


def test_chunks_follow_their_article_and_fewer_chunks_leave_none_behind(store_settings, pg):
    store = Store(store_settings)
    day = dt.date(2026, 12, 1)
    store.load(LoadRows(vectors(["a", "b"]), chunks({"a": 3, "b": 2}), day), "run:1")
    late = T0 + dt.timedelta(hours=1)
    store.load(LoadRows(vectors(["a"], "v2", late), chunks({"a": 1}, "v2", late), day), "run:2")
    assert stored(pg, "id, chunk_index, text_sha256", "news_vectors_chunks") == [
        ("a", 0, "v2"), ("b", 0, "a"), ("b", 1, "a")]
    # An older day's chunks are not loaded over the current article's.
    store.load(LoadRows(vectors(["b"], "old", late), chunks({"b": 4}, "old", late),
                        dt.date(2026, 11, 1)), "run:old")
    assert stored(pg, "id, chunk_index, text_sha256", "news_vectors_chunks")[1:] == [
        ("b", 0, "a"), ("b", 1, "a")]


def test_the_hnsw_index_is_built_once_and_after_a_large_first_load(store_settings, pg):
    settings = store_settings.model_copy(update={"hnsw_m": 8, "hnsw_ef_construction": 32,
                                                 "index_build_memory_mb": 128})
    store = Store(settings)
    ids = [f"id-{i}" for i in range(10_000)]
    store.load(LoadRows(vectors(ids, dim=4), None, dt.date(2026, 12, 1)), "run:big")
    store.load(LoadRows(vectors(["x"], dim=4), None, dt.date(2026, 12, 1)), "run:small")
    with psycopg.connect(pg) as conn:
        indexes = conn.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = "
                               "'news_vectors' AND indexdef LIKE '%hnsw%'").fetchall()
        assert conn.execute("SELECT count(*) FROM news_vectors").fetchone()[0] == 10_001
    assert len(indexes) == 1
    assert "vector_cosine_ops" in indexes[0][1] and "m='8'" in indexes[0][1]


@pytest.mark.parametrize("field,value", [("table", "news; DROP TABLE x"), ("table", "News"),
                                         ("schema_name", 'a"b'), ("table", "x" * 41),
                                         ("schema_name", "")])
def test_identifiers_that_are_not_plain_sql_names_are_rejected(field, value):
    with pytest.raises(pydantic.ValidationError, match="not a plain SQL identifier"):
        StoreSettings(**{field: value})


def test_a_config_rejects_a_bad_table_name_and_has_no_key_for_the_dsn():
    raw = {**config_lib.load(config_lib.DEFAULT_CONFIG).model_dump(), "store": {"table": "a-b"}}
    with pytest.raises(config_lib.ConfigError, match="store.table"):
        config_lib.validate(raw)
    raw["store"] = {"dsn": "postgresql://u:p@h/db"}
    with pytest.raises(config_lib.ConfigError, match="store.dsn"):
        config_lib.validate(raw)


SECRET_DSN = ("host=127.0.0.1 port={port} user=newsvec_secret_user "
              "password=hunter2-s3cret dbname=postgres connect_timeout=2")


def test_the_connection_string_is_never_logged_or_raised(monkeypatch, caplog, tmp_path):
    from tools.emulators import free_port

    dsn = SECRET_DSN.format(port=free_port())  # nothing listens there
    monkeypatch.setenv(STORE_DSN_ENV, dsn)
    settings = StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, retry_s=1.5)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StoreLoadFailed) as failed:
        Store(settings).load(LoadRows(vectors(["a"]), None, dt.date(2026, 12, 1)), "run:x")
    text = str(failed.value) + caplog.text
    assert "retrying" in caplog.text  # it did retry while the database was down
    for secret in ("hunter2-s3cret", "newsvec_secret_user", dsn):
        assert secret not in text
    # Nothing chained: not even as __context__ (only hidden from display by `from None`).
    assert failed.value.__cause__ is None and failed.value.__context__ is None
    # From a secret file as well; the env var is not needed then.
    secret_file = tmp_path / "dsn"
    secret_file.write_text(dsn + "\n")
    monkeypatch.delenv(STORE_DSN_ENV)
    assert resolve_dsn(StoreSettings(dsn_file=str(secret_file))) == dsn
    with pytest.raises(Exception, match=STORE_DSN_ENV) as missing:
        resolve_dsn(settings)
    assert "hunter2" not in str(missing.value)


def test_scrub_removes_password_user_and_host():
    dsn = "postgresql://alice_user:pa55word@db.internal.example:5432/news"
    text = f"could not connect to {dsn}: password pa55word for alice_user at db.internal.example"
    cleaned = scrub(text, dsn)
    assert "pa55word" not in cleaned and "alice_user" not in cleaned
    assert "db.internal.example" not in cleaned


def test_the_vector_type_is_sized_in_one_place():
    assert vector_sql_type(384) == "vector(384)"
    assert vector_sql_type(128, "float16") == "halfvec(128)"


# --- a real batch run (vLLM, the sample events) -----------------------------------------------

def test_a_batch_run_whose_load_fails_stays_committed_and_newsvec_load_loads_it(
        tmp_path, monkeypatch, pg, caplog):
    """The run's load fails (the database cannot be reached): the Parquet is committed, the run
    raises StoreLoadFailed without the DSN; ``newsvec load`` then loads it, every vector equal to
    the Parquet's, and a second ``newsvec load`` changes nothing."""
    import pyarrow.parquet as pq

    from pipeline.cli import main as cli
    from pipeline.run import run_batch
    from tools.emulators import free_port
    from transforms.output.manifest import read_manifest

    out = tmp_path / "out"
    config = make_config(input=str(SAMPLE_EVENTS), output=str(out),
                         store=StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, retry_s=1))
    monkeypatch.setenv(STORE_DSN_ENV, SECRET_DSN.format(port=free_port()))
    caplog.set_level(logging.INFO)
    with pytest.raises(StoreLoadFailed):
        run_batch(config, PipelineOptions(["--runner=FnApiRunner"]))
    assert "hunter2" not in caplog.text and "newsvec load" in caplog.text
    manifest = read_manifest(str(out))
    assert manifest is not None and manifest.state == "committed"

    monkeypatch.setenv(STORE_DSN_ENV, pg)
    config_file = tmp_path / "config.yaml"
    import yaml

    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert cli(["load", "--config", str(config_file), "--run-id", manifest.run_id]) == 0
    parquet = pq.read_table(sorted((out / "vectors").glob("*.parquet")))
    with psycopg.connect(pg) as conn:
        rows = dict(conn.execute("SELECT id, embedding::text FROM news_vectors").fetchall())
        assert conn.execute("SELECT load_key FROM news_vectors_loads").fetchall() == [
            (f"run:{manifest.run_id}",)]
    assert sorted(rows) == sorted(parquet["id"].to_pylist()) and len(rows) > 10
    emb = parquet["embedding"].combine_chunks().flatten().to_numpy().reshape(parquet.num_rows, -1)
    for doc_id, vector in zip(parquet["id"].to_pylist(), emb, strict=True):
        np.testing.assert_allclose(np.array(eval(rows[doc_id])), vector, rtol=1e-6)  # noqa: S307
    before = stored(pg, "*")
    assert cli(["load", "--config", str(config_file), "--run-id", manifest.run_id]) == 0
    assert stored(pg, "*") == before
    # newsvec search --store finds what the Parquet search finds, in the same form.
    from pipeline.search import search, search_store

    for query in ("stock markets and interest rates", "football match"):
        assert search_store(config, query, 5) == search(config, query, 5)
    # Another run id than the one the output holds is refused.
    assert cli(["load", "--config", str(config_file), "--run-id", "20260101T000000Z-00000000"]) \
        == 1


def test_search_groups_chunks_by_their_best_chunk_per_article(store_settings, pg):
    """The store's search over chunk rows: one hit per article, at its best chunk, titles from the
    articles' table, best first; over articles alone without chunks."""
    store = Store(store_settings)
    day = dt.date(2026, 12, 1)
    store.load(LoadRows(vectors(["a", "b", "c"]), None, day), "run:head")
    table = vectors(["a", "b", "c"])
    query = table["embedding"].combine_chunks().flatten().to_numpy().reshape(3, DIM)[1]
    hits = store.search(query, 2)
    assert [h["id"] for h in hits] == ["b", hits[1]["id"]] and hits[0]["score"] == 1.0
    assert hits[0]["chunk_index"] is None and hits[0]["title"] == "a b"
    # Chunks: article "a" has a chunk equal to the query (index 2), "b" one less near.
    rows = chunks({"a": 3, "b": 2}, "v2")  # the chunks of the version loaded with them
    emb = np.zeros((5, DIM), np.float32)
    emb[:, 0] = 1  # far from the query
    q = np.zeros(DIM, np.float32)
    q[1] = 1
    emb[2] = q  # a, chunk 2
    emb[4] = np.array([0, 1, 1] + [0] * (DIM - 3), np.float32)  # b, chunk 1
    rows = rows.set_column(rows.schema.get_field_index("embedding"), "embedding",
                           pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), DIM))
    later = T0 + dt.timedelta(hours=1)
    store.load(LoadRows(vectors(["a", "b"], "v2", later), rows.set_column(
        rows.schema.get_field_index("embedded_at"), "embedded_at",
        pa.array([later] * 5, pa.timestamp("us", tz="UTC"))), day), "run:chunks")
    hits = store.search(q, 10)
    assert [(h["id"], h["chunk_index"]) for h in hits] == [("a", 2), ("b", 1)]
    assert hits[0]["score"] == 1.0 and hits[0]["title"] == "v2 a"


def test_a_chunks_mode_run_loads_its_chunks_and_search_store_matches_the_parquet_search(
        tmp_path, store_settings, pg):
    """A real chunks-mode run (16 BBC articles, vLLM) with the store on: every chunk row of
    ``chunks/`` in the store, and ``newsvec search --store`` ranks articles by their best chunk as
    the Parquet search does."""
    import json

    import pyarrow.parquet as pq

    from pipeline.run import run_batch
    from pipeline.search import search, search_store
    from tests.engines.test_chunks import CHUNKING, bbc_events

    events = tmp_path / "in.jsonl"
    events.write_text("".join(json.dumps(e) + "\n" for e in bbc_events(16)))
    config = make_config(input=str(events), output=str(tmp_path / "out"), chunking=CHUNKING,
                         store=store_settings)
    summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]))
    parquet = pq.read_table(sorted((tmp_path / "out" / "chunks").glob("*.parquet")))
    assert summary["counts"]["chunks_written"] == parquet.num_rows > 16
    assert sorted(stored(pg, "id, chunk_index", "news_vectors_chunks")) == sorted(
        zip(parquet["id"].to_pylist(), parquet["chunk_index"].to_pylist(), strict=True))
    for query in ("the price of oil", "a film award ceremony", "mobile phones"):
        assert search_store(config, query, 5) == search(config, query, 5)


def test_float16_rows_are_stored_as_halfvec_and_searched_through_its_index(store_settings, pg):
    """``sink.vector_dtype: float16`` (issue 24): pgvector's ``halfvec``, half the bytes. The table
    keeps the type it was created with; rows of the other dtype are converted on their way in, and
    rows of another dimension are refused with the reason."""
    store = Store(store_settings)
    day = dt.date(2026, 12, 1)
    half = vectors(["a", "b", "c"]).cast(vector_schema(DIM, "float16"))
    store.load(LoadRows(half, None, day), "run:half")
    with psycopg.connect(pg) as conn:
        assert conn.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE "
                            "attrelid = 'news_vectors'::regclass AND attname = 'embedding'"
                            ).fetchone()[0] == f"halfvec({DIM})"
        index = conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'news_vectors' "
                             "AND indexname LIKE '%hnsw'").fetchone()[0]
        assert "halfvec_cosine_ops" in index
        b = conn.execute("SELECT embedding::text FROM news_vectors WHERE id = 'b'").fetchone()[0]
    expected = half["embedding"].combine_chunks().flatten().to_numpy().reshape(3, DIM)[1]
    np.testing.assert_array_equal(np.array(eval(b), np.float16), expected)  # noqa: S307
    # float32 rows into the halfvec table: converted, and found by search through the index.
    late = T0 + dt.timedelta(hours=1)
    store.load(LoadRows(vectors(["d"], "f32", late, seed=7), None, day), "run:f32")
    d = vectors(["d"], seed=7)["embedding"].combine_chunks().flatten().to_numpy()
    assert store.search(d, 1)[0]["id"] == "d"
    with pytest.raises(StoreLoadFailed, match=rf"halfvec\({DIM}\) vectors, these rows have 4 "):
        store.load(LoadRows(vectors(["e"], dim=4), None, day), "run:dim4")

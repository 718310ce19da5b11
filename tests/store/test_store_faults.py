"""The store never stalls and never refuses a whole load for one row (transforms/stores/), on the
test PostgreSQL (``pg``, ``store_settings``):

- rows the store cannot take (a NUL character, a non-finite vector, a timestamp outside years
  1-9999, or any row the server refuses) are set aside with their reason and the rest commits;
- transient errors (a read-only failover, a lost connection, a lock timeout) are retried, data
  errors are not;
- a load waits for the table no longer than ``lock_timeout_s``, a loader stalled inside its
  transaction loses the table, and every connection keeps TCP alive on both ends;
- the ids a load wrote come from its upsert, not from reading the table;
- two versions of one article in one load keep the chunks of the version kept;
- the article's own order (``updated_at``, ``published_at``, the day, the publish time) decides
  its current version, in the store and in ``transforms.output.current_vectors``;
- the connection string never shows, even when libpq cannot parse it;
- a batch load that races a newer publish says what to run.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import threading

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.common import STORE_DSN_ENV
from transforms.output.parquet import chunk_schema, vector_schema
from transforms.stores.base import LoadRows, StoreLoadFailed
from transforms.stores.pgvector import Store, StoreSettings, scrub
from transforms.types import STORY_FIELDS

DIM = 8
T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)
DAY = dt.date(2026, 12, 1)
TS = pa.timestamp("us", tz="UTC")
YEAR_0 = -62135596860000000  # 0001-01-01T00:00:00+00:01 in UTC: the year 0, which Python lacks


def rows(ids, *, text="a", embedded_at=T0, published_at=T0, updated_at=None, publish_time=None,
         seed=0, **columns) -> pa.Table:
    """Vector rows of ``ids`` (``columns`` replace whole columns); ``updated_at`` is added as a
    column where the schema lacks it."""
    n = len(ids)
    emb = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    data = {
        "id": ids, "url": [f"https://x/{i}" for i in ids], "source": ["s"] * n,
        "title": [f"{text} {i}" for i in ids], "published_at": pa.array([published_at] * n, TS),
        "language": ["en"] * n, "model": ["m"] * n, "dim": [DIM] * n,
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), DIM),
        "text_sha256": [text] * n, "token_count": [3] * n, "truncated": [False] * n,
        "embedded_at": pa.array([embedded_at] * n, TS), "pubsub_message_id": [None] * n,
        "pubsub_publish_time": pa.array([publish_time] * n, TS),
        "pubsub_attributes": [None] * n, "doc_vector": ["head"] * n, "chunk_count": [0] * n,
        "updated_at": pa.array([updated_at] * n, TS)}
    data.update(columns)
    schema = vector_schema(DIM)
    if "updated_at" not in schema.names:  # a release before the column (the base code)
        schema = schema.append(pa.field("updated_at", TS))
    return pa.table({f.name: data.get(f.name, [None] * n) for f in schema}, schema=schema)


def chunks(versions: dict, embedded_at=T0) -> pa.Table:
    """Chunk rows: {(id, text_sha256): number of chunks}."""
    items = [(i, sha, c, n) for (i, sha), n in versions.items() for c in range(n)]
    m = len(items)
    return pa.table({
        "id": [r[0] for r in items], "chunk_id": [f"{r[0]}-{r[1]}-{r[2]}" for r in items],
        "chunk_index": [r[2] for r in items], "chunk_count": [r[3] for r in items],
        "token_start": [0] * m, "token_end": [1] * m, "char_start": [0] * m, "char_end": [1] * m,
        "chunk_sha256": ["c"] * m, "text_sha256": [r[1] for r in items], "model": ["m"] * m,
        "dim": [DIM] * m,
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(np.ones(m * DIM, np.float32)),
                                                       DIM),
        "embedded_at": pa.array([embedded_at] * m, TS), "chunk_text": [None] * m,
        **dict.fromkeys(STORY_FIELDS, [None] * m)},
        schema=chunk_schema(DIM))


def at(minutes: int) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def stored(dsn: str, what="id, text_sha256", table="news_vectors") -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT {what} FROM {table} ORDER BY 1, 2").fetchall()


def with_column(table: pa.Table, name: str, values) -> pa.Table:
    index = table.schema.get_field_index(name)
    return table.set_column(index, table.schema.field(index), pa.array(values,
                                                                       table.schema.field(index).type))


def settings_with(settings: StoreSettings, **changes) -> StoreSettings:
    # model_copy does not validate: the base code, which lacks these settings, runs the test too
    return settings.model_copy(update=changes)


# --- rows the store cannot take ------------------------------------------------------------------

def _poisoned(kind: str) -> pa.Table:
    table = rows(["a", "b", "c"])
    emb = np.random.default_rng(0).standard_normal((3, DIM)).astype(np.float32)
    if kind in ("id", "url", "source", "language", "title"):
        values = table.column(kind).to_pylist()
        values[1] = values[1] + "\x00"
        return with_column(table, kind, values)
    if kind in ("attribute key", "attribute value"):
        pair = ("k\x00", "v") if kind == "attribute key" else ("k", "v\x00")
        return with_column(table, "pubsub_attributes", [None, [pair], [("k", "v")]])
    if kind in ("NaN", "infinity"):
        emb[1, 3] = np.nan if kind == "NaN" else np.inf
        return with_column(table, "embedding", list(emb))
    if kind in ("published_at", "updated_at"):
        return with_column(table, kind, [T0, YEAR_0, None])
    raise ValueError(kind)


@pytest.mark.parametrize("kind,reason", [
    ("id", "nul_character"), ("url", "nul_character"), ("source", "nul_character"),
    ("language", "nul_character"), ("title", "nul_character"),
    ("attribute key", "nul_character"), ("attribute value", "nul_character"),
    ("NaN", "non_finite_vector"), ("infinity", "non_finite_vector"),
    ("published_at", "timestamp_out_of_range"), ("updated_at", "timestamp_out_of_range")])
def test_a_row_the_store_cannot_take_is_set_aside_and_the_rest_is_stored(
        store_settings, pg, kind, reason):
    """Before: the whole load failed with a DataError (or an OverflowError reading the year-0
    timestamp), for ever: a streaming micro-batch retried without end, a batch run never loaded."""
    store = Store(store_settings)
    loaded = store.load(LoadRows(_poisoned(kind), None, DAY), "mb:poison")
    assert [i for i, _ in stored(pg)] == ["a", "c"]
    assert loaded.rows == 2 and not loaded.already_loaded
    assert len(loaded.rejected) == 1 and loaded.rejected[0]["reason"] == reason, loaded.rejected
    assert loaded.rejected[0]["id"].startswith("b")
    assert kind.split()[-1] in loaded.rejected[0]["detail"] or kind in ("NaN", "infinity") \
        or kind.startswith("attribute")
    with psycopg.connect(pg) as conn:
        assert conn.execute("SELECT rows, jsonb_array_length(rejected) FROM news_vectors_loads") \
            .fetchall() == [(2, 1)]
    again = store.load(LoadRows(_poisoned(kind), None, DAY), "mb:poison")
    assert again.already_loaded and list(again.rejected) == list(loaded.rejected)


def test_an_article_whose_chunk_cannot_be_stored_is_set_aside_whole(store_settings, pg):
    vectors = rows(["a", "b"], chunk_count=[2, 2])
    chunk_rows = chunks({("a", "a"): 2, ("b", "a"): 2})
    chunk_rows = with_column(chunk_rows, "chunk_text", [None, None, "fine", "bad\x00"])
    loaded = Store(store_settings).load(LoadRows(vectors, chunk_rows, DAY), "run:1")
    assert [r["id"] for r in loaded.rejected] == ["b"]
    assert "chunk 1" in loaded.rejected[0]["detail"]
    assert stored(pg, "id, chunk_index", "news_vectors_chunks") == [("a", 0), ("a", 1)]
    assert [i for i, _ in stored(pg)] == ["a"]


def test_rows_the_server_refuses_are_found_by_halving_and_the_rest_is_stored(store_settings, pg):
    """A row the table refuses that no local check can know of (here a CHECK constraint the
    database's owner added): the load is halved down to the refused rows, which are set aside with
    the server's reason; before, the load failed as a whole."""
    store = Store(store_settings)
    store.load(LoadRows(rows(["first"]), None, DAY), "run:0")  # creates the tables
    with psycopg.connect(pg) as conn:
        conn.execute("ALTER TABLE news_vectors ADD CONSTRAINT no_wire "
                     "CHECK (source IS DISTINCT FROM 'refused')")
    ids = [f"id-{i:02d}" for i in range(16)]
    refused = {"id-03", "id-04", "id-13"}
    table = with_column(rows(ids), "source", ["refused" if i in refused else "s" for i in ids])
    loaded = store.load(LoadRows(table, None, DAY), "run:1")
    assert sorted(r["id"] for r in loaded.rejected) == sorted(refused)
    assert {r["reason"] for r in loaded.rejected} == {"refused_by_store"}
    assert all("23514" in r["detail"] and "CheckViolation" in r["detail"]
               for r in loaded.rejected)
    assert [i for i, _ in stored(pg)] == sorted({"first", *ids} - refused)
    assert loaded.rows == 13


# --- transient errors are retried ----------------------------------------------------------------

def test_a_read_only_failover_is_retried_until_the_database_takes_writes(store_settings, pg,
                                                                         caplog):
    """A failover can leave connections on a server that is read-only for a while (25006
    read_only_sql_transaction): a new connection later reaches the primary. Here the database is
    read-only until the load's first retry; before, the load failed at once."""
    name = psycopg.conninfo.conninfo_to_dict(pg)["dbname"]
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')

    class PrimaryBack(logging.Handler):
        def emit(self, record):
            if "retrying" in record.getMessage():
                with psycopg.connect(pg, autocommit=True) as conn:
                    conn.execute("SET default_transaction_read_only = off")
                    conn.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')

    handler = PrimaryBack()
    logging.getLogger("newsvec.store").addHandler(handler)
    try:
        loaded = Store(store_settings).load(LoadRows(rows(["a"]), None, DAY), "run:1")
    finally:
        logging.getLogger("newsvec.store").removeHandler(handler)
    assert loaded.rows == 1 and stored(pg) == [("a", "a")]


def test_a_connection_lost_under_the_client_is_retried(store_settings, pg, monkeypatch):
    """psycopg raises InterfaceError when the connection is closed or lost under it; before, only
    OperationalError was retried."""
    real = psycopg.connect
    calls = []

    def connect(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise psycopg.InterfaceError("the connection is lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(psycopg, "connect", connect)
    loaded = Store(store_settings).load(LoadRows(rows(["a"]), None, DAY), "run:1")
    assert loaded.rows == 1 and len(calls) >= 2


@pytest.mark.parametrize("sqlstate,transient", [
    ("25006", True), ("57P01", True), ("57P03", True), ("40001", True), ("40P01", True),
    ("57014", True), ("55P03", True), ("25P03", True), ("08006", True),
    ("22021", False), ("23514", False), ("54000", False), ("42501", False)])
def test_which_server_errors_are_transient(sqlstate, transient):
    from psycopg import errors

    from transforms.stores import pgvector as store

    exc = errors.lookup(sqlstate)("x")
    assert store.is_transient(exc) is transient
    assert store.is_data_error(exc) is (sqlstate[:2] in ("22", "23", "54"))


# --- bounded waits -------------------------------------------------------------------------------

def _lock_statement() -> str:
    return "SELECT pg_advisory_xact_lock(hashtext('newsvec-store:public.news_vectors'))"


def _in_thread(fn) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001  # reported by the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_load_gives_up_waiting_for_a_table_another_connection_holds(store_settings, pg):
    """Another session holds the table's lock and never lets go (a loader whose machine vanished
    mid-load, as the database sees it until its keepalives fail). Before, the load blocked inside
    pg_advisory_xact_lock for ever; now each try gives up after lock_timeout_s (a transient error,
    retried), and the load fails after retry_s; once the lock is free, it loads."""
    settings = settings_with(store_settings, lock_timeout_s=0.3, retry_s=1.0)
    Store(settings).load(LoadRows(rows(["first"]), None, DAY), "run:0")
    holder = psycopg.connect(pg)
    try:
        holder.execute(_lock_statement())
        thread, out = _in_thread(
            lambda: Store(settings).load(LoadRows(rows(["a"]), None, DAY), "run:1"))
        thread.join(60)
        assert not thread.is_alive(), "the load is still waiting for the table's lock"
        assert isinstance(out.get("error"), StoreLoadFailed), out
        assert "LockNotAvailable" in str(out["error"]) or "lock timeout" in str(out["error"])
    finally:
        holder.close()
    assert Store(settings).load(LoadRows(rows(["a"]), None, DAY), "run:1").rows == 1


def test_a_loader_stalled_inside_its_transaction_loses_the_table_to_the_next(store_settings, pg,
                                                                             monkeypatch):
    """Loader A takes the table's lock and stalls (a frozen process: its connection stays open,
    nothing is sent). The server ends A's session once it has been idle in its transaction for
    lock_timeout_s, so loader B gets the table. When A wakes, its connection is gone: a transient
    error, so A tries again and loads. Before, B waited for A for ever."""
    from transforms.stores.pgvector import upsert

    settings = settings_with(store_settings, lock_timeout_s=1.0, retry_s=60)
    Store(settings).load(LoadRows(rows(["first"]), None, DAY), "run:0")
    stalled, wake = threading.Event(), threading.Event()
    a = Store(settings)
    real_upsert = upsert._upsert

    def stall(*args, **kwargs):
        if not stalled.is_set():
            stalled.set()
            wake.wait(120)
        return real_upsert(*args, **kwargs)

    monkeypatch.setattr(upsert, "_upsert", stall)  # the first upsert (loader A's) stalls
    thread_a, out_a = _in_thread(lambda: a.load(LoadRows(rows(["a"]), None, DAY), "run:a"))
    try:
        assert stalled.wait(60), "loader A took the lock"
        thread_b, out_b = _in_thread(
            lambda: Store(settings).load(LoadRows(rows(["b"]), None, DAY), "run:b"))
        thread_b.join(60)
        assert not thread_b.is_alive(), "loader B still waits for the stalled loader A"
        assert out_b.get("result") is not None and out_b["result"].rows == 1, out_b
    finally:
        wake.set()
    thread_a.join(60)
    assert out_a.get("result") is not None and out_a["result"].rows == 1, out_a
    assert [i for i, _ in stored(pg)] == ["a", "b", "first"]


def test_every_store_connection_keeps_tcp_alive_on_both_ends(store_settings):
    """A peer that vanished without a word (its machine gone, the network cut) is found in about
    25 s by TCP keepalives, on the client's side and on the server's, instead of the kernel's
    default of over two hours."""
    with Store(store_settings).connect() as conn:
        assert conn.info.get_parameters().get("keepalives") == "1"
        assert conn.info.get_parameters().get("keepalives_idle") == "10"
        assert conn.execute("SHOW tcp_keepalives_idle").fetchone()[0].rstrip("s") == "10"
        assert conn.execute("SHOW tcp_keepalives_count").fetchone()[0] == "3"


def test_a_micro_batch_load_reads_none_of_the_table_it_loads_into(store_settings, pg,
                                                                  postgres_server):
    """The articles a load wrote come from its upsert (RETURNING), not from reading the whole
    table for its load key (no index: a sequential scan under the table's lock, per micro-batch).
    Counted by PostgreSQL's statistics: tuples read by sequential scans of the table."""
    store = Store(store_settings)
    ids = [f"id-{i:05d}" for i in range(3000)]
    store.load(LoadRows(rows(ids), None, DAY), "run:fill")

    def seq_read() -> int:
        with psycopg.connect(pg, autocommit=True) as conn:
            # Every other session has ended: their statistics are flushed when they end.
            for _ in range(600):
                if not conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                                    "current_database() AND pid <> pg_backend_pid()"
                                    ).fetchone()[0]:
                    break
                conn.execute("SELECT pg_sleep(0.05)")
            conn.execute("SELECT pg_stat_force_next_flush()")
            conn.execute("SELECT pg_stat_clear_snapshot()")
            return conn.execute("SELECT coalesce(seq_tup_read, 0) FROM pg_stat_user_tables "
                                "WHERE relname = 'news_vectors'").fetchone()[0]

    before = seq_read()
    store.load(LoadRows(rows(["new-1", "new-2", ids[7]], text="b"), None, DAY), "mb:x")
    read = seq_read() - before
    assert read < 100, f"one micro-batch's load read {read} rows of a {len(ids)}-row table"


# --- versions of one article ---------------------------------------------------------------------

def test_two_versions_of_one_article_in_one_load_keep_the_chunks_of_the_version_kept(
        store_settings, pg):
    """A load with two versions of X (``dedup.key: text_sha256``): v1 with 3 chunks, v2 (later)
    with 2. The row kept is v2's, and so must be its chunks. Before, chunk 2 of v1 stayed beside
    v2's chunks 0 and 1."""
    later = T0 + dt.timedelta(minutes=5)
    vectors = pa.concat_tables([rows(["x"], text="v1", chunk_count=[3]),
                                rows(["x"], text="v2", embedded_at=later, chunk_count=[2],
                                     updated_at=later)])
    chunk_rows = pa.concat_tables([chunks({("x", "v1"): 3}), chunks({("x", "v2"): 2}, later)])
    Store(store_settings).load(LoadRows(vectors, chunk_rows, DAY), "run:1")
    assert stored(pg, "id, text_sha256, chunk_count") == [("x", "v2", 2)]
    assert stored(pg, "chunk_index, text_sha256", "news_vectors_chunks") == [(0, "v2"), (1, "v2")]


def test_the_articles_own_order_decides_which_version_the_store_keeps(store_settings, pg):
    """``updated_at``, then ``published_at``, then the day, then the Pub/Sub publish time; the
    embedding time breaks ties only. Before, the later *embedded* copy won within a day."""
    store = Store(store_settings)
    late = T0 + dt.timedelta(hours=3)
    # A correction with a later updated_at, embedded before the original (a slower shard).
    store.load(LoadRows(rows(["a"], text="corrected", updated_at=T0 + dt.timedelta(hours=1)),
                        None, DAY), "mb:1")
    store.load(LoadRows(rows(["a"], text="original", embedded_at=late), None, DAY), "mb:2")
    # No updated_at: the later publish time wins over the later embedding.
    store.load(LoadRows(rows(["b"], text="second", publish_time=T0 + dt.timedelta(minutes=2)),
                        None, DAY), "mb:3")
    store.load(LoadRows(rows(["b"], text="first", publish_time=T0 + dt.timedelta(minutes=1),
                             embedded_at=late), None, DAY), "mb:4")
    # A later published_at wins; a null one is lower than any.
    store.load(LoadRows(rows(["c"], text="new", published_at=T0 + dt.timedelta(days=1)), None,
                        DAY), "mb:5")
    store.load(LoadRows(rows(["c"], text="no date", published_at=None, embedded_at=late), None,
                        DAY), "mb:6")
    assert stored(pg) == [("a", "corrected"), ("b", "second"), ("c", "new")]


def test_a_table_created_before_updated_at_gets_the_column(store_settings, pg):
    store = Store(store_settings)
    store.load(LoadRows(rows(["a"]), None, DAY), "run:0")
    with psycopg.connect(pg) as conn:  # as the first release created them
        conn.execute("ALTER TABLE news_vectors DROP COLUMN updated_at")
        conn.execute("ALTER TABLE news_vectors_loads DROP COLUMN outcome, DROP COLUMN rejected")
    store.load(LoadRows(rows(["a"], text="fixed", updated_at=T0), None, DAY), "run:1")
    assert stored(pg, "id, text_sha256, updated_at") == [("a", "fixed", T0)]


def test_current_vectors_orders_by_the_articles_own_times(tmp_path):
    """``transforms.output.current_vectors`` (pyarrow and its DuckDB query) picks the version the
    store keeps: a correction with a later ``updated_at`` wins over an original embedded later on a
    later day."""
    duckdb = pytest.importorskip("duckdb")
    from transforms.output.current_vectors import CURRENT_VECTORS_SQL, current_vectors

    for day, table in (("2026-12-01", rows(["a", "b"], text="corrected",
                                          updated_at=T0 + dt.timedelta(hours=1))),
                       ("2026-12-02", rows(["a"], text="original",
                                           embedded_at=T0 + dt.timedelta(days=1)))):
        folder = tmp_path / f"dt={day}" / "vectors"
        folder.mkdir(parents=True)
        pq.write_table(table, folder / "part.parquet")
    table = current_vectors(str(tmp_path)).sort_by("id")
    assert table["text_sha256"].to_pylist() == ["corrected", "corrected"]
    sql = CURRENT_VECTORS_SQL.format(files=f"'{tmp_path}/dt=*/vectors/*.parquet'")
    got = duckdb.connect().execute(f"SELECT id, text_sha256 FROM ({sql}) ORDER BY id").fetchall()
    assert got == [("a", "corrected"), ("b", "corrected")]


def test_updated_at_is_read_as_rfc_3339_and_carried_to_the_row():
    from transforms.sinks import to_table
    from transforms.types import EmbeddedDoc, NewsEvent, PreparedDoc

    event = NewsEvent.model_validate_json(
        '{"id": "x", "body": "b", "updated_at": "2026-12-01T10:00:00+01:00"}')
    assert event.updated_at == T0
    with pytest.raises(Exception, match="RFC 3339"):
        NewsEvent.model_validate_json('{"id": "x", "body": "b", "updated_at": "2026-12-01 09:00Z"}')
    doc = PreparedDoc(event=event, text="b", text_sha256="s", token_ids=(1,), truncated=False)
    row = EmbeddedDoc.of(doc, np.ones(384, np.float32), "m", T0)
    assert to_table([row], vector_schema(384)).column("updated_at").to_pylist() == [T0]


# --- the connection string -----------------------------------------------------------------------

def test_a_dsn_libpq_cannot_parse_never_appears_in_a_message(monkeypatch, caplog):
    """A URL whose password holds a % not followed by two hex digits: libpq's error quotes the
    password, which the scrubbing could not find without parsing the DSN. Now such a DSN gives a
    fixed message."""
    dsn = "postgresql://newsvec:Tr0ub4dor%3&horse@10.9.8.7/news"
    monkeypatch.setenv(STORE_DSN_ENV, dsn)
    settings = StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, retry_s=0.1)
    caplog.set_level(logging.DEBUG)
    with pytest.raises(StoreLoadFailed) as failed:
        from transforms.stores.pgvector import store_of

        store_of(settings).load(LoadRows(rows(["a"]), None, DAY), "run:x")
    text = str(failed.value) + caplog.text
    for secret in ("Tr0ub4dor", "horse", "10.9.8.7"):
        assert secret not in text
    assert "could not be parsed" in str(failed.value)
    assert failed.value.__context__ is None and failed.value.__cause__ is None


@pytest.mark.parametrize("dsn,secrets", [
    ("postgresql://newsvec:p%40ss%21w0rd@db.internal/news", ["p%40ss%21w0rd", "p@ss!w0rd"]),
    ("host=db user=newsvec password=ab dbname=news", ["ab", "db", "newsvec"]),
    ("host=db password=x sslpassword=KeyPassphrase1 sslkey=/k", ["KeyPassphrase1"]),
    ("host=db1.internal,db2.internal user=newsvec password=pw dbname=n",
     ["db1.internal", "db2.internal"]),
    ("postgresql://u:secretpw@h1.example,h2.example:5433/news", ["secretpw", "h2.example"])])
def test_scrub_removes_every_secret_bearing_part(dsn, secrets):
    text = "error: " + " / ".join(secrets) + " / done"
    cleaned = scrub(text, dsn)
    for secret in secrets:
        assert secret not in cleaned, cleaned
    assert cleaned.startswith("error: ") and cleaned.endswith(" / done")


def test_a_dsn_file_others_can_read_is_warned_of(tmp_path, caplog):
    from transforms.stores.pgvector import resolve_dsn

    secret = tmp_path / "dsn"
    secret.write_text("host=db password=pw\n")
    secret.chmod(0o644)
    caplog.set_level(logging.WARNING, logger="newsvec.store")
    assert resolve_dsn(StoreSettings(dsn_file=str(secret))) == "host=db password=pw"
    assert "can be read by others" in caplog.text and "pw" not in caplog.text.replace(
        str(tmp_path), "")
    caplog.clear()
    secret.chmod(0o600)
    resolve_dsn(StoreSettings(dsn_file=str(secret)))
    assert "can be read by others" not in caplog.text


# --- the batch load of a run ---------------------------------------------------------------------

def test_a_batch_load_that_races_a_newer_publish_says_what_to_run(tmp_path, store_settings,
                                                                  monkeypatch, capsys):
    """The output holds run A committed; while ``newsvec load`` reads A's files, run B publishes
    (A's files deleted, B's manifest written). Before: a FileNotFoundError traceback."""
    from pipeline.load import main as load_main
    from transforms.output.manifest import COMMITTED, Manifest, write_manifest
    from transforms.stores import batch as load_module

    out = tmp_path / "out"
    (out / "vectors").mkdir(parents=True)
    pq.write_table(rows(["a", "b"]), out / "vectors" / "part-a.parquet")
    run_a, run_b = "20261201T090000Z-aaaaaaaa", "20261202T090000Z-bbbbbbbb"
    manifest = Manifest(run_id=run_a, state=COMMITTED, started_at=0.0,
                        vectors=["vectors/part-a.parquet"], dead_letter=[],
                        summary="_summary.json", counts={})
    write_manifest(str(out), manifest)
    real_read = load_module._read

    def read_while_b_publishes(output, relative):
        if relative == manifest.vectors:
            (out / "vectors" / "part-a.parquet").unlink()
            write_manifest(str(out), dataclasses.replace(manifest, run_id=run_b, vectors=[]))
        return real_read(output, relative)

    monkeypatch.setattr(load_module, "_read", read_while_b_publishes)
    with pytest.raises(StoreLoadFailed) as failed:
        load_module.run_rows(str(out), run_a)
    assert f"it holds run {run_b} (committed)" in str(failed.value)
    assert "published into it while this one was read" in str(failed.value)
    # A file that cannot be read, the output unchanged (a storage error): what to run.
    monkeypatch.setattr(load_module, "_read", real_read)
    write_manifest(str(out), manifest)
    (out / "vectors" / "part-a.parquet").write_bytes(b"not parquet")
    with pytest.raises(StoreLoadFailed,
                       match=f"newsvec load --config CONFIG --output .* --run-id {run_a}"):
        load_module.run_rows(str(out), run_a)
    # Through the command: exit 1 and the message, no traceback.
    from tests.common import make_config

    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(make_config(output=str(out), store=store_settings)
                                 .model_dump(mode="json")))
    assert load_main(["--config", str(config), "--run-id", run_a]) == 1
    err = capsys.readouterr().err
    assert err.startswith("newsvec load: cannot read run") and "Traceback" not in err


# --- isolating the rows the server refuses -------------------------------------------------------

def _check_constraint(dsn: str, check: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(f"ALTER TABLE news_vectors ADD CONSTRAINT dba_rule CHECK ({check})")


def test_rows_the_server_refuses_are_isolated_without_a_table_or_lock_per_part(store_settings,
                                                                              pg):
    """400 rows of which the server refuses 30: the parts of the halving are ranges of one
    staging table, so the load's transaction holds a few locks however many parts it tried.
    Before, each part created and dropped a staging table inside its savepoint: every one of
    them held its locks until the commit (20,762 for 8,000 rows with 10% refused; a server with
    a small max_locks_per_transaction failed with "out of shared memory", retried for ever).
    The locks are counted by a trigger on ``<table>_loads``, whose row is the load's last
    write."""
    store = Store(store_settings)
    store.load(LoadRows(rows(["first"]), None, DAY), "run:0")  # creates the tables
    _check_constraint(pg, "source IS DISTINCT FROM 'refused'")
    with psycopg.connect(pg) as conn:
        conn.execute("CREATE TABLE lock_count (n bigint)")
        conn.execute("CREATE FUNCTION count_locks() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                     "INSERT INTO public.lock_count SELECT count(*) FROM pg_locks "
                     "WHERE pid = pg_backend_pid(); RETURN NULL; END $$")
        conn.execute("CREATE TRIGGER count_locks AFTER INSERT OR UPDATE ON news_vectors_loads "
                     "FOR EACH ROW EXECUTE FUNCTION count_locks()")
    ids = [f"id-{i:03d}" for i in range(400)]
    refused = set(ids[7::13][:30])
    table = with_column(rows(ids), "source", ["refused" if i in refused else "s" for i in ids])
    loaded = store.load(LoadRows(table, None, DAY), "run:1")
    assert sorted(r["id"] for r in loaded.rejected) == sorted(refused)
    assert loaded.rows == 370 and len(stored(pg)) == 371
    with psycopg.connect(pg) as conn:
        (locks,) = conn.execute("SELECT max(n) FROM lock_count").fetchone()
    assert locks < 64, f"the load held {locks} locks until its commit"


def test_a_load_whose_rows_the_server_all_refuses_fails_naming_the_first(store_settings, pg,
                                                                        caplog):
    """A constraint every row fails (a problem of the table, not of the rows): more than
    max(3, 10%) of a load's rows refused fail the load at once, not transient (no retry),
    naming the first refusal, and nothing of it is stored. Before, every row was set aside and
    the load (and the ledger) went through as if the rows were bad."""
    store = Store(store_settings)
    store.load(LoadRows(rows(["first"]), None, DAY), "run:0")
    _check_constraint(pg, "source <> 's' OR id = 'first'")  # every row of this load fails
    caplog.set_level(logging.WARNING, logger="newsvec.store")
    with pytest.raises(StoreLoadFailed) as failed:
        store.load(LoadRows(rows([f"id-{i:02d}" for i in range(40)]), None, DAY), "run:1")
    message = str(failed.value)
    assert "refused more than 4 of the load's 40 rows" in message, message
    assert "the first: article id-00" in message and "23514" in message, message
    assert "retrying" not in caplog.text
    assert stored(pg) == [("first", "a")]
    with psycopg.connect(pg) as conn:
        assert conn.execute("SELECT load_key FROM news_vectors_loads").fetchall() == [("run:0",)]


def test_finding_the_rows_the_server_refuses_has_a_deadline(store_settings, pg, monkeypatch):
    """The halving's total time is bounded by ``statement_timeout_s`` (here a clock that jumps
    20 minutes at each look, and 2 refused rows of 64: under the cap on refusals). Before,
    nothing bounded it (81 s for 8,000 rows, growing with the refusals)."""
    from transforms.stores import retry

    store = Store(store_settings)
    store.load(LoadRows(rows(["first"]), None, DAY), "run:0")
    _check_constraint(pg, "source IS DISTINCT FROM 'refused'")
    now = [0.0]

    def clock() -> float:
        now[0] += 1200
        return now[0]

    monkeypatch.setattr(retry, "_clock", clock, raising=False)
    ids = [f"id-{i:02d}" for i in range(64)]
    table = with_column(rows(ids), "source", ["refused" if i in (3, 40) else "s"
                                              for i in range(64)])
    with pytest.raises(StoreLoadFailed, match="took over 1800 s"):
        store.load(LoadRows(table, None, DAY), "run:1")
    assert stored(pg) == [("first", "a")]


def test_a_database_whose_encoding_is_not_utf8_is_refused_at_connect(postgres_server, monkeypatch,
                                                                     caplog):
    """A LATIN1 database cannot hold Chinese or Cyrillic text: before, every such article was
    set aside one by one (refused_by_store) and the ledger balanced. Now the load fails at once
    (not transient: no retry), saying why."""
    name = "t_latin1_" + __import__("os").urandom(3).hex()
    postgres_server.execute(f"CREATE DATABASE \"{name}\" ENCODING 'LATIN1' LC_COLLATE 'C' "
                            "LC_CTYPE 'C' TEMPLATE template0")
    try:
        postgres_server.execute("CREATE EXTENSION IF NOT EXISTS vector", dbname=name)
        monkeypatch.setenv(STORE_DSN_ENV, postgres_server.dsn(name))
        settings = StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, retry_s=5)
        caplog.set_level(logging.WARNING, logger="newsvec.store")
        table = with_column(rows(["en", "zh"]), "title", ["news", "北京新闻"])
        with pytest.raises(StoreLoadFailed, match="encoding LATIN1, not UTF8"):
            Store(settings).load(LoadRows(table, None, DAY), "run:1")
        assert "retrying" not in caplog.text
    finally:
        postgres_server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# --- the load's transactions ---------------------------------------------------------------------

def test_a_load_commits_before_it_logs_the_rows_it_set_aside(store_settings, pg):
    """A log sink that is slow (or stalls) must not hold the table. When the rejection's warning
    is logged, the load is committed (its row in ``<table>_loads`` is visible to another
    session) and no session holds the table's lock. Before, the type lookups had opened an
    implicit transaction, the load's transactions were savepoints of it, and the COMMIT came
    after the warnings: a sink slower than lock_timeout_s got the session ended, on every
    retry."""
    seen: list[tuple] = []

    class Probe(logging.Handler):
        def emit(self, record):
            if "not stored" in record.getMessage():
                with psycopg.connect(pg, autocommit=True) as conn:
                    seen.append((
                        conn.execute("SELECT count(*) FROM news_vectors_loads "
                                     "WHERE load_key = 'run:1'").fetchone()[0],
                        conn.execute("SELECT count(*) FROM pg_locks "
                                     "WHERE locktype = 'advisory'").fetchone()[0]))

    handler = Probe()
    logging.getLogger("newsvec.store").addHandler(handler)
    try:
        loaded = Store(store_settings).load(LoadRows(_poisoned("NaN"), None, DAY), "run:1")
    finally:
        logging.getLogger("newsvec.store").removeHandler(handler)
    assert len(loaded.rejected) == 1
    assert seen == [(1, 0)], "the load's row committed, the table's lock free, when it logs"


def test_a_loader_frozen_in_its_copy_holds_nothing_another_load_waits_for(store_settings, pg,
                                                                          monkeypatch):
    """Loader A freezes in the middle of its COPY (a paused VM, a stopped process: its kernel
    still acknowledges, so keepalives do not end it). Loader B must get through: the COPY fills
    a temporary table before the table's lock is taken. Before, A held the lock through its COPY
    until statement_timeout_s (30 minutes by default): B failed after retry_s."""
    settings = settings_with(store_settings, lock_timeout_s=1, retry_s=3)
    Store(settings).load(LoadRows(rows(["first"]), None, DAY), "run:0")
    frozen, thaw = threading.Event(), threading.Event()
    real_write_row = psycopg.Copy.write_row
    a_thread: list[threading.Thread] = []

    def write_row(self, row):
        if a_thread and threading.current_thread() is a_thread[0] and not frozen.is_set():
            frozen.set()
            thaw.wait(60)
        return real_write_row(self, row)

    monkeypatch.setattr(psycopg.Copy, "write_row", write_row)
    thread_a, out_a = _in_thread(
        lambda: Store(settings).load(LoadRows(rows(["a", "a2"]), None, DAY), "run:a"))
    a_thread.append(thread_a)
    try:
        assert frozen.wait(60), "loader A is in its COPY"
        thread_b, out_b = _in_thread(
            lambda: Store(settings).load(LoadRows(rows(["b"]), None, DAY), "run:b"))
        thread_b.join(60)
        assert out_b.get("result") is not None and out_b["result"].rows == 1, out_b
    finally:
        thaw.set()
    thread_a.join(60)
    assert out_a.get("result") is not None and out_a["result"].rows == 2, out_a
    assert [i for i, _ in stored(pg)] == ["a", "a2", "b", "first"]


# --- connections and settings --------------------------------------------------------------------

def test_a_connection_gives_up_on_data_its_peer_does_not_acknowledge(store_settings, pg,
                                                                     monkeypatch):
    """Keepalives are not sent while sent data is unacknowledged (a COPY's rows, a result):
    ``tcp_user_timeout`` (30 s) ends such a connection on both ends, unless the connection
    string sets its own. Before, neither end set it (the kernel retries for about 15 minutes)."""
    with Store(store_settings).connect() as conn:
        assert conn.info.get_parameters().get("tcp_user_timeout") == "30000"
        assert conn.execute("SHOW tcp_user_timeout").fetchone()[0] == "30000"
    monkeypatch.setenv(STORE_DSN_ENV, pg + " tcp_user_timeout=5000")
    with Store(store_settings).connect() as conn:
        assert conn.info.get_parameters().get("tcp_user_timeout") == "5000"


@pytest.mark.parametrize("field", ["lock_timeout_s", "statement_timeout_s"])
def test_a_timeout_under_one_second_is_refused(field):
    """0.0005 s was taken as 0 ms: no timeout at all."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        StoreSettings(**{field: 0.0005})
    with pytest.raises(ValidationError, match=field):
        StoreSettings(**{field: 0.5})
    assert getattr(StoreSettings(**{field: 1}), field) == 1


# --- what a refusal says, and what a load waits for ----------------------------------------------

def test_a_refusal_never_quotes_the_refused_row(store_settings, pg, caplog):
    """The server's DETAIL of a CHECK violation quotes the whole row (the article's title, url,
    vector...): neither a rejection (logged, stored in ``<table>_loads``, in the ledger) nor the
    failure of a load refused wholesale carries it, only the SQLSTATE and the primary message.
    Before, both ended in "DETAIL: Failing row contains (...)"."""
    store = Store(store_settings)
    store.load(LoadRows(rows(["first"]), None, DAY), "run:0")
    _check_constraint(pg, "title NOT LIKE 'secret%'")
    caplog.set_level(logging.WARNING, logger="newsvec.store")
    table = with_column(rows(["a", "b", "c", "d"]), "title", ["t", "secret b", "t", "t"])
    details = [r["detail"] for r in store.load(LoadRows(table, None, DAY), "run:1").rejected]
    assert len(details) == 1
    with pytest.raises(StoreLoadFailed) as failed:
        store.load(LoadRows(rows([f"id-{i:02d}" for i in range(40)], text="secret"), None, DAY),
                   "run:2")
    for text in (*details, str(failed.value), caplog.text):
        assert "23514" in text and "Failing row" not in text and "https://x/" not in text, text


def test_a_load_waits_for_nothing_a_vacuum_holds(store_settings, pg):
    """A VACUUM, an ANALYZE or a ``CREATE INDEX CONCURRENTLY`` (and an anti-wraparound
    autovacuum, which does not give way) holds SHARE UPDATE EXCLUSIVE on its table for as long
    as it runs. With another session holding it on every table of the store, a micro-batch's
    load and a batch run's load still go through within their 1 s ``lock_timeout_s``: the load
    reads the catalog and creates only what is missing. Before, each load's ``CREATE INDEX IF
    NOT EXISTS`` took the table's SHARE lock before finding the index there, and every load
    failed after ``lock_timeout_s`` for as long as the VACUUM ran."""
    settings = settings_with(store_settings, lock_timeout_s=1, retry_s=0)
    store = Store(settings)
    store.load(LoadRows(rows(["a"]), chunks({("a", "a"): 1}), DAY), "mb:1", ids=["a"])
    with psycopg.connect(pg) as holder:
        for table in ("news_vectors", "news_vectors_chunks", "news_vectors_loads",
                      "news_vectors_superseded", "news_vectors_chunks_superseded"):
            holder.execute(f"LOCK TABLE {table} IN SHARE UPDATE EXCLUSIVE MODE")
        later = T0 + dt.timedelta(minutes=1)
        store.load(LoadRows(rows(["a", "b"], text="v2", embedded_at=later, chunk_count=[1, 1]),
                            chunks({("a", "v2"): 1, ("b", "v2"): 1}, later), DAY), "mb:2",
                   ids=["a", "b"])
        from transforms.stores.base import BatchOutput

        store.load(LoadRows(rows(["a"], text="v3", updated_at=later, chunk_count=[1]),
                            chunks({("a", "v3"): 1}), DAY), "run:R",
                   output=BatchOutput("gs://b/out", "R"))
        holder.rollback()
    assert stored(pg) == [("a", "v3"), ("b", "v2")]


def test_an_isolation_never_splits_the_versions_of_one_article(store_settings, pg):
    """Micro-batch K holds x v1 (older than the stored H:v2), x v3 (later) and a row the table
    refuses. The halving tried ranges of staged rows: v1 alone in one (it lost to v2, kept
    under H), v3 in another (it replaced v2). H redone without x then handed K's own v1 to K,
    and K redone without x brought back its own stale v1, though no file holds x. Now both
    versions of x are one article of the staged rows, never split: after both redos, x has no
    row. And when the latest version of an article is the refused one, its earlier version in
    the same load is stored."""
    store = Store(store_settings)
    store.load(LoadRows(rows(["first"]), None, DAY), "mb:0", ids=["first"])
    _check_constraint(pg, "title NOT LIKE '%!'")
    store.load(LoadRows(rows(["x"], text="H:v2", updated_at=at(2)), None, DAY), "mb:H",
               ids=["x"])
    k = pa.concat_tables([rows(["x"], text="K:v1", updated_at=at(1)),
                          rows(["x"], text="K:v3", updated_at=at(3)),
                          with_column(rows(["p"], text="K:p"), "title", ["p!"])])
    loaded = store.load(LoadRows(k, None, DAY), "mb:K", ids=["x", "p"])
    assert [r["id"] for r in loaded.rejected] == ["p"]
    assert stored(pg) == [("first", "a"), ("x", "K:v3")]
    store.load(LoadRows(rows([]), None, DAY), "mb:H", ids=["x"])  # H redone: x a dead letter
    assert stored(pg) == [("first", "a"), ("x", "K:v3")]
    store.load(LoadRows(rows([]), None, DAY), "mb:K", ids=["x", "p"])  # K redone: all dead
    assert stored(pg) == [("first", "a")], "no file holds x"
    # y's latest version is refused: its earlier one, in the same load, is stored
    y = pa.concat_tables([rows(["y"], text="old", updated_at=at(1)),
                          with_column(rows(["y"], text="new", updated_at=at(2)), "title",
                                      ["new!"])])
    loaded = store.load(LoadRows(y, None, DAY), "mb:Y", ids=["y"])
    assert [(r["id"], r["text_sha256"]) for r in loaded.rejected] == [("y", "new")]
    assert stored(pg) == [("first", "a"), ("y", "old")]


def test_a_first_large_load_leaves_its_tables_with_planner_statistics(store_settings, pg):
    """A first load of 2,000 rows into new tables analyzes them (autovacuum's ANALYZE comes a
    minute later, or never while it is off): without statistics, the planner of the next load's
    joins on ``id`` takes every id for a match of the whole table, and scans it. Before,
    ``reltuples`` stayed -1 (never analyzed)."""
    from transforms.stores.pgvector import StoreSettings
    from transforms.stores.pgvector.schema import _create_statements

    with psycopg.connect(pg, autocommit=True) as conn:
        for statement in _create_statements(StoreSettings(), DIM):
            conn.execute(statement)
        for table in ("news_vectors", "news_vectors_chunks"):
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    ids = [f"id-{i:05d}" for i in range(2000)]
    Store(store_settings).load(LoadRows(rows(ids, chunk_count=[1] * 2000),
                                        chunks({(i, "a"): 1 for i in ids}), DAY), "run:fill")
    with psycopg.connect(pg) as conn:
        assert dict(conn.execute("SELECT relname, reltuples FROM pg_class WHERE relname IN "
                                 "('news_vectors', 'news_vectors_chunks')").fetchall()) == {
            "news_vectors": 2000, "news_vectors_chunks": 2000}

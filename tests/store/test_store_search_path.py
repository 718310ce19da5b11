"""The store never resolves a name through the session's ``search_path`` (docs/store.md, "Roles and
privileges"): pgvector's type, its operators and its operator classes are qualified with the
extension's own schema (read from ``pg_extension`` at each connection), and each connection sets
``search_path = pg_catalog, pg_temp``. So an object that another role created under the same name
in a schema earlier on the path (``public`` writable by others, a ``"$user"`` schema someone else
owns) is never called, and a load and a search work with pgvector in a schema of its own that is
not on the path at all. And a loader needs no DDL right once the store's tables exist: a second
load works as a role with only the privileges docs/store.md lists, and a search as a role that can
only SELECT."""
from __future__ import annotations

import datetime as dt

import numpy as np
import psycopg
import pyarrow as pa
import pytest

from tests.store.test_store import DIM, chunks, vectors
from transforms.output.parquet import chunk_schema, vector_schema
from transforms.stores.base import LoadRows
from transforms.stores.pgvector import Store, StoreSettings

DAY = dt.date(2026, 12, 1)
T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)
PGVECTOR_TYPES = {"float32": "vector", "float16": "halfvec"}


def _dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def _execute(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def _pgvector_in(dsn: str, schema: str) -> None:
    """pgvector moved into a schema of its own (the ``pg`` fixture created it in ``public``)."""
    _execute(dsn, "DROP EXTENSION vector", f"CREATE SCHEMA {schema}",
             f"GRANT USAGE ON SCHEMA {schema} TO PUBLIC",
             f"CREATE EXTENSION vector SCHEMA {schema}")


def _rows(ids: list[str], dtype: str = "float32", text: str = "a", at=T0, seed: int = 0
          ) -> LoadRows:
    """Articles and one chunk each, the chunk's vector the article's own: a search through
    either table ranks the articles alike."""
    table = vectors(ids, text, at, seed=seed)
    table = table.set_column(table.schema.get_field_index("chunk_count"), "chunk_count",
                             pa.array([1] * len(ids), pa.int32()))
    parts = chunks(dict.fromkeys(ids, 1), text, at)
    parts = parts.set_column(parts.schema.get_field_index("embedding"), "embedding",
                             table.column("embedding"))
    if dtype == "float16":
        table = table.cast(vector_schema(DIM, "float16"))
        parts = parts.cast(chunk_schema(DIM, "float16"))
    return LoadRows(table, parts, DAY)


def _expected(stored: list[LoadRows], query: np.ndarray, k: int) -> list[tuple[str, float]]:
    """The ``k`` nearest articles of ``stored`` by cosine, computed here."""
    table = pa.concat_tables([rows.vectors for rows in stored])
    ids = table.column("id").to_pylist()
    emb = np.asarray(table.column("embedding").combine_chunks().flatten()
                     .to_numpy(zero_copy_only=False), np.float64).reshape(len(ids), DIM)
    scores = emb @ query / (np.linalg.norm(emb, axis=1) * np.linalg.norm(query))
    order = np.argsort(-scores)[:k]
    return [(ids[i], float(scores[i])) for i in order]


def _assert_search(store: Store, stored: list[LoadRows], k: int = 3) -> None:
    """A search for the second article of ``stored`` finds what ``_expected`` computes."""
    query = np.asarray(stored[0].vectors.column("embedding")[1].values.to_numpy(
        zero_copy_only=False), np.float64)
    got = store.search(query, k)
    want = _expected(stored, query, k)
    assert [g["id"] for g in got] == [w[0] for w in want]
    for g, (_, score) in zip(got, want, strict=True):
        assert g["score"] == pytest.approx(score, abs=2e-3)


def _hostile_objects(dsn: str, owner: str, where: str, dtype: str) -> str:
    """``owner``, a role that is not the loader, puts into ``where`` (a schema earlier on the
    database's ``search_path`` than pgvector's ``ext``) a ``<=>`` operator on pgvector's own type,
    a domain named like that type, and a ``pg_advisory_xact_lock(integer)`` (a better match for
    ``hashtext``'s integer than the built-in one's bigint: the CVE-2018-1058 pattern), each
    recording its call in ``public.hostile_calls`` before doing the real thing. Returns the
    schema's name as created."""
    type_ = f"ext.{PGVECTOR_TYPES[dtype]}"
    statements = ["CREATE TABLE public.hostile_calls (what text)",
                  "GRANT INSERT, SELECT ON public.hostile_calls TO PUBLIC"]
    if where == "$user":  # the loader's own name (the test server's superuser), owned by another
        schema = str(psycopg.conninfo.conninfo_to_dict(dsn)["user"])
        statements.append(f'CREATE SCHEMA "{schema}" AUTHORIZATION {owner}')
    else:  # a public schema others may create in (PostgreSQL before 15, or a careless GRANT)
        schema = "public"
        statements.append(f"GRANT CREATE ON SCHEMA public TO {owner}")
    statements += [
        f"SET ROLE {owner}",
        f'CREATE FUNCTION "{schema}".hostile_distance(a {type_}, b {type_}) RETURNS float8 '
        "LANGUAGE plpgsql AS $$ BEGIN INSERT INTO public.hostile_calls VALUES ('<=>'); "
        "RETURN ext.cosine_distance(a, b); END $$",
        f'CREATE OPERATOR "{schema}".<=> (LEFTARG = {type_}, RIGHTARG = {type_}, '
        f'FUNCTION = "{schema}".hostile_distance)',
        f'CREATE FUNCTION "{schema}".hostile_check(v {type_}) RETURNS boolean '
        "LANGUAGE plpgsql AS $$ BEGIN INSERT INTO public.hostile_calls VALUES ('domain'); "
        "RETURN true; END $$",
        f'CREATE DOMAIN "{schema}".{PGVECTOR_TYPES[dtype]} AS {type_} '
        f'CHECK ("{schema}".hostile_check(VALUE))',
        f'CREATE FUNCTION "{schema}".pg_advisory_xact_lock(integer) RETURNS void '
        "LANGUAGE plpgsql AS $$ BEGIN INSERT INTO public.hostile_calls "
        "VALUES ('pg_advisory_xact_lock'); END $$",
        "RESET ROLE",
        # pgvector on the path, after the hostile schema: how a database is set up to use it
        f'ALTER DATABASE "{_dbname(dsn)}" SET search_path = "$user", public, ext']
    _execute(dsn, *statements)
    return schema


def _hostile_calls(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT what FROM public.hostile_calls")]


def test_pgvector_in_a_schema_of_its_own_not_on_the_path(store_settings, pg):
    """pgvector in ``ext``, which the session's ``search_path`` does not name: the tables are
    created with ``ext.vector``, its operator class and its operator, and loads and searches
    (both tables) work."""
    _pgvector_in(pg, "ext")
    store = Store(store_settings)
    rows = _rows(["a", "b", "c", "d"])
    loaded = store.load(rows, "run:1")
    assert (loaded.rows, loaded.chunk_rows) == (4, 4)
    _assert_search(store, [rows])
    with psycopg.connect(pg) as conn:
        assert conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
            "'public.news_vectors'::regclass AND attname = 'embedding'").fetchone()[0] == \
            f"ext.vector({DIM})"
        assert {r[0] for r in conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname LIKE '%hnsw'")} == {
            f"CREATE INDEX {t}_embedding_hnsw ON public.{t} USING hnsw (embedding "
            "ext.vector_cosine_ops) WITH (m='16', ef_construction='64')"
            for t in ("news_vectors", "news_vectors_chunks")}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("where", ["public", "$user"])
def test_hostile_objects_earlier_on_the_path_are_never_called(store_settings, pg, roles, where,
                                                              dtype):
    """Another role's ``<=>`` operator, ``vector`` (``halfvec``) domain and
    ``pg_advisory_xact_lock(integer)``, in a schema the
    database's ``search_path`` names before pgvector's: a load (articles and chunks; then a
    later version and a redo, under the lock) and a search (by chunks, then by articles) give
    the right results, and neither hostile object is ever called."""
    _pgvector_in(pg, "ext")
    _hostile_objects(pg, roles("mallory"), where, dtype)
    store = Store(store_settings)
    rows = _rows(["a", "b", "c", "d"], dtype)
    assert store.load(rows, "run:1").rows == 4
    later = _rows(["b"], dtype, "b2", T0 + dt.timedelta(hours=1), seed=3)
    assert store.load(later, "mb:1").articles_current == 1
    redo = _rows(["e"], dtype, "e", seed=4)
    assert store.load(redo, "mb:1").withdrawn == ("b",)
    _assert_search(store, [rows, redo])  # b back at its first version
    with psycopg.connect(pg, autocommit=True) as conn:
        conn.execute("TRUNCATE news_vectors_chunks")
    _assert_search(store, [rows, redo])  # by the articles' own rows
    assert _hostile_calls(pg) == []


def test_a_second_load_needs_no_ddl_and_a_search_only_select(postgres_server, pg, roles):
    """The privileges docs/store.md lists: once a first load (as the owner) has created the
    tables, a load runs as a role with USAGE on the two schemas and only SELECT, INSERT, UPDATE,
    DELETE on the tables as listed (no CREATE anywhere, owner of nothing): new rows, a later
    version (the upsert, a version kept), a redo of a micro-batch (a withdrawal), a batch rerun
    (its previous run withdrawn), 1,000 rows into tables with no planner statistics (the ANALYZE
    only an owner may run, skipped). A search runs as a role with SELECT on the two vector tables
    only."""
    _pgvector_in(pg, "ext")
    _execute(pg, "CREATE SCHEMA news", "REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    settings = StoreSettings(enabled=True, schema_name="news", retry_s=0)
    Store(settings, pg).load(_rows(["a", "b", "c", "d"]), "run:1")
    loader, searcher = roles("loader"), roles("searcher")
    _execute(pg,
             f"GRANT USAGE ON SCHEMA news, ext TO {loader}, {searcher}",
             f"GRANT SELECT, INSERT, UPDATE, DELETE ON news.news_vectors TO {loader}",
             f"GRANT SELECT, INSERT, DELETE ON news.news_vectors_chunks, "
             f"news.news_vectors_superseded, news.news_vectors_chunks_superseded TO {loader}",
             f"GRANT SELECT, INSERT, UPDATE ON news.news_vectors_loads TO {loader}",
             f"GRANT SELECT ON news.news_vectors, news.news_vectors_chunks TO {searcher}")
    as_loader = Store(settings, f"{pg} user={loader}")
    with as_loader.connect() as conn:  # no CREATE (TEMPORARY is PUBLIC's, by default)
        assert conn.execute(
            "SELECT has_schema_privilege('news', 'CREATE'), has_schema_privilege('public', "
            "'CREATE'), has_database_privilege(current_database(), 'CREATE')").fetchone() == (
            False, False, False)
    later = _rows(["b", "e"], text="2", at=T0 + dt.timedelta(hours=1), seed=5)
    assert as_loader.load(later, "mb:1").articles_current == 2
    assert as_loader.load(_rows(["f"], seed=6), "mb:1").withdrawn == ("b", "e")
    from transforms.stores.base import BatchOutput

    batch = _rows(["g", "h"], seed=7)
    as_loader.load(batch, "run:20261201T000000Z-1", output=BatchOutput("o", "20261201T000000Z-1"))
    assert as_loader.load(_rows(["g"], seed=7), "run:20261201T000001Z-2",
                          output=BatchOutput("o", "20261201T000001Z-2")).withdrawn == ("h",)
    with psycopg.connect(pg) as conn:
        assert [r[0] for r in conn.execute("SELECT id FROM news.news_vectors ORDER BY id")] == [
            "a", "b", "c", "d", "f", "g"]
    # 1,000 rows into tables with no planner statistics yet: the ANALYZE a non-owner cannot run
    # is skipped by the server (a warning), and the load goes on.
    many = [f"m{i:04d}" for i in range(1000)]
    assert as_loader.load(_rows(many, seed=8), "mb:many").rows == 1000
    as_searcher = Store(settings, f"{pg} user={searcher}")
    assert as_searcher.search(np.ones(DIM), 2) == Store(settings, pg).search(np.ones(DIM), 2)

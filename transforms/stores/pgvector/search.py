"""Reading the pgvector store: the nearest stories to a query vector through the HNSW index
(``search``, ``newsvec search --store``), and the reads ``newsvec ledger --store`` checks the
ledger against (``Reader``: the record of given loads, the stored rows of given articles)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from transforms.stores.base import ROW_FIELDS, StoreError, StoreLoad
from transforms.stores.pgvector.catalog import pgvector_schema, stored_embedding_type
from transforms.stores.pgvector.schema import ident, store_tables
from transforms.stores.pgvector.settings import StoreSettings


def search(connect: Callable[[], Any], settings: StoreSettings, vector, k: int,
           all_copies: bool = False) -> list[dict]:
    """The ``k`` nearest stories to ``vector`` through the HNSW index (``hnsw.ef_search`` from
    the settings): each article by its best chunk when the store holds chunks, else by its
    own row; then each story (``COALESCE(story_id, id)``) by its best article, with
    ``copies``, how many other articles of the story the store holds (through the
    ``story_id`` index). ``all_copies``: every article, ``k`` of them. ``{"id", "title",
    "score", "chunk_index", "story_id", "copies"}``, best first: what ``pipeline.search``
    gives. HNSW yields at most ``ef_search`` candidates: while they hold fewer than ``k``
    stories (copies crowd them), the search asks for four times as many. ``connect``: a checked
    connection (``Store.connect``)."""
    from psycopg import sql

    query = "[" + ",".join(repr(float(x)) for x in np.asarray(vector).ravel()) + "]"
    # HNSW returns at most ef_search rows: enough of them to group chunks into k articles.
    candidates = max(settings.ef_search, k)
    with connect() as conn:
        pgvector = pgvector_schema(conn)
        if pgvector is None:
            raise StoreError("the store's database has no pgvector (CREATE EXTENSION vector)")
        # The query vector as the column's type, so that the HNSW index serves the ORDER BY;
        # the type and its operator are pgvector's, named with its schema.
        cast = ident(pgvector, stored_embedding_type(conn, settings, pgvector)[0])
        distance = sql.SQL("OPERATOR({}.<=>)").format(ident(pgvector))
        statement = _statement(conn, settings, _near(conn, settings, cast, distance), all_copies)
        while True:
            with conn.transaction():
                conn.execute(sql.SQL("SET LOCAL hnsw.ef_search = {}").format(
                    sql.Literal(min(candidates, 1000))))  # pgvector's greatest
                found = conn.execute(statement, {"q": query, "n": candidates,
                                                 "k": k}).fetchall()
            if len(found) >= k or not found or found[0][6] < candidates:
                break  # k stories, or every row the index yields
            candidates *= 4
    return [{"id": doc_id, "title": title, "score": round(float(score), 4),
             "chunk_index": chunk_index, "story_id": story_id, "copies": int(copies)}
            for doc_id, title, score, chunk_index, story_id, copies, _ in found]


def _near(conn, settings: StoreSettings, cast, distance):
    """The candidates' query, to be ordered by distance ``d``: the chunks where the store holds
    chunks, else the articles."""
    from psycopg import sql

    vectors_table, chunks_table = store_tables(settings)
    schema = settings.schema_name
    has_chunks = conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(
        ident(schema, chunks_table.name))).fetchone()
    if has_chunks and has_chunks[0]:
        return sql.SQL("SELECT id, chunk_index, embedding {distance} %(q)s::{cast} AS d "
                       "FROM {chunks}").format(
            chunks=ident(schema, chunks_table.name), cast=cast, distance=distance)
    return sql.SQL("SELECT id, NULL::integer AS chunk_index, "
                   "embedding {distance} %(q)s::{cast} AS d FROM {vectors}").format(
        vectors=ident(schema, vectors_table.name), cast=cast, distance=distance)


def _stories(conn, settings: StoreSettings) -> tuple[Any, Any]:
    """(each hit's story, how many copies of it the store holds) as SQL."""
    from psycopg import sql

    vectors_table = store_tables(settings)[0]
    schema = settings.schema_name
    vectors = ident(schema, vectors_table.name)
    # A table of a release before 0.4 that no load has upgraded yet has no story_id:
    # each article is its own story.
    stories = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = "
        "%s::pg_catalog.regclass AND attname = 'story_id' AND NOT attisdropped)",
        (f'"{schema}"."{vectors_table.name}"',)).fetchone()
    if not (stories and stories[0]):
        return sql.SQL("a.id"), sql.SQL("0")
    # The story's rows: those naming it, and its first article if it names none.
    return sql.SQL("COALESCE(v.story_id, a.id)"), sql.SQL(
        "GREATEST((SELECT count(*) FROM {vectors} c WHERE c.story_id = b.story) + "
        "(SELECT count(*) FROM {vectors} c WHERE c.id = b.story "
        "AND c.story_id IS NULL) - 1, 0)").format(vectors=vectors)


def _statement(conn, settings: StoreSettings, near, all_copies: bool):
    """The search: the ``%(n)s`` nearest candidates, each article by its best one, each story
    by its best article (unless ``all_copies``), ``%(k)s`` of them, with the candidates'
    count."""
    from psycopg import sql

    story, copies = _stories(conn, settings)
    each = sql.SQL("hits" if all_copies else  # else the best article of each story
                   "(SELECT DISTINCT ON (story) * FROM hits ORDER BY story, score DESC, "
                   "id) s")
    return sql.SQL(
        "WITH near AS ({near} ORDER BY d LIMIT %(n)s), "
        "a AS (SELECT DISTINCT ON (id) id, chunk_index, 1 - d AS score FROM near "
        "ORDER BY id, d, chunk_index), "
        "hits AS (SELECT a.id, v.title, a.score, a.chunk_index, {story} AS story "
        "FROM a LEFT JOIN {vectors} v USING (id)), "
        "b AS (SELECT * FROM {each} ORDER BY score DESC, id LIMIT %(k)s) "
        "SELECT b.id, b.title, b.score, b.chunk_index, b.story, {copies}, "
        "(SELECT count(*) FROM near) FROM b ORDER BY b.score DESC, b.id").format(
            near=near, story=story, vectors=ident(settings.schema_name, settings.table),
            each=each, copies=copies)


class Reader:
    """``base.StoreReader`` on a connection: ``<table>_loads`` by load key, the articles' table by
    id (its primary key), ``READ_CHUNK`` keys or ids per query. A table created by an earlier
    release lacks some columns: they read as None (``rejected``: none)."""

    READ_CHUNK = 5000

    def __init__(self, conn, settings: StoreSettings):
        from psycopg import sql

        self._conn = conn
        schema = settings.schema_name
        loads_name = f"{settings.table}_loads"
        there = self._columns(schema, loads_name)
        fields = ("load_key", "rows", "chunk_rows", "articles_current", "rejected", "withdrawn",
                  "output", "run_id")
        self._loads = sql.SQL("SELECT {} FROM {} WHERE load_key = ANY(%s)").format(
            sql.SQL(", ").join(sql.Identifier(n) if n in there else sql.SQL("NULL")
                               for n in fields), ident(schema, loads_name))
        # The load a batch run's load replaced: the output's previous run's
        # (``withdraw.previous_load``).
        self._replaced = sql.SQL(
            "SELECT load_key FROM {} WHERE output = %s AND load_key <> %s AND run_id < %s "
            "ORDER BY run_id DESC LIMIT 1").format(ident(schema, loads_name))
        self._without_row = sql.SQL(
            "SELECT w.id FROM unnest(%s::text[]) AS w(id) WHERE NOT EXISTS "
            "(SELECT 1 FROM {} v WHERE v.id = w.id) ORDER BY 1").format(
                ident(schema, settings.table))
        there = self._columns(schema, settings.table)
        self._rows = sql.SQL("SELECT {} FROM {} WHERE id = ANY(%s)").format(
            sql.SQL(", ").join(sql.Identifier(n) if n in there else sql.SQL("NULL")
                               for n in ROW_FIELDS), ident(schema, settings.table))

    def _columns(self, schema: str, table: str) -> set[str]:
        return {name for (name,) in self._conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped", (f'"{schema}"."{table}"',)).fetchall()}

    def loads(self, keys: Sequence[str]) -> dict[str, StoreLoad]:
        found: dict[str, StoreLoad] = {}
        keys = sorted(set(keys))
        for start in range(0, len(keys), self.READ_CHUNK):
            for (key, rows, chunk_rows, current, rejected, withdrawn, output,
                 run_id) in self._conn.execute(
                    self._loads, (keys[start:start + self.READ_CHUNK],)).fetchall():
                withdrawn = tuple(withdrawn or ())
                not_restored = tuple(r[0] for r in self._conn.execute(
                    self._without_row, (list(withdrawn),)).fetchall()) if withdrawn else ()
                replaced = self._conn.execute(self._replaced, (output, key, run_id)).fetchone() \
                    if output is not None and run_id is not None else None
                found[key] = StoreLoad(key, rows, chunk_rows or 0, current or 0, True, 0.0,
                                       tuple(rejected or ()), withdrawn, not_restored,
                                       replaced[0] if replaced else None)
        return found

    def rows(self, ids: Sequence[Any]) -> dict[str, dict]:
        # text cannot hold NUL: such an id is never stored
        sendable = sorted({i for i in ids if isinstance(i, str) and "\x00" not in i})
        found: dict[str, dict] = {}
        for start in range(0, len(sendable), self.READ_CHUNK):
            for values in self._conn.execute(
                    self._rows, (sendable[start:start + self.READ_CHUNK],)).fetchall():
                found[values[0]] = dict(zip(ROW_FIELDS, values, strict=True))
        return found

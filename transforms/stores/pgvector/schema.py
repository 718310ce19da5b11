"""The pgvector backend's tables as SQL: their columns and types (the Parquet columns, pgvector's
``vector`` or ``halfvec`` for the embedding), the statements that create them, their kept
versions' tables and their indexes, the columns later releases added (``ADDED_COLUMNS``, for the
in-place upgrade: ``catalog._missing_ddl``), and the SQL of the current-version rule
(``version_order``). pgvector's names are qualified with the extension's schema, the tables with
theirs: nothing resolves through the session's ``search_path`` (``sql.SEARCH_PATH``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import pyarrow as pa

from transforms.output.parquet import (
    CHUNK_COLUMNS,
    NULLABLE_IN_ORDER,
    STORY_COLUMNS,
    VECTOR_COLUMNS,
    VERSION_ORDER,
    Column,
)
from transforms.settings import VectorDtype
from transforms.stores.pgvector.settings import StoreSettings

PGVECTOR_TYPES = {"float32": "vector", "float16": "halfvec"}
"""pgvector's type for each ``sink.vector_dtype``: ``halfvec`` stores float16 in half the bytes."""


def vector_sql_type(dim: int, vector_dtype: VectorDtype = "float32") -> str:
    """The embedding column's type for new tables: ``vector(dim)``, or ``halfvec(dim)`` when the
    rows are float16 (``sink.vector_dtype``). A table keeps the type it was created with: rows of
    the other dtype are converted on their way in (``catalog.embedding_type``)."""
    return f"{PGVECTOR_TYPES[vector_dtype]}({int(dim)})"


def type_sql(type_: str, pgvector_schema: str):
    """``type_`` (``_sql_type``'s) as SQL: pgvector's ``vector(dim)`` and ``halfvec(dim)`` named
    with the extension's schema (``"ext"."vector"(8)``), the built-in types as they are (the
    search path is ``pg_catalog`` only: ``sql.SEARCH_PATH``)."""
    from psycopg import sql

    name, paren, size = type_.partition("(")
    if paren and name in PGVECTOR_TYPES.values():
        return sql.SQL("{}({})").format(sql.Identifier(pgvector_schema, name),
                                        sql.SQL(str(int(size.rstrip(")")))))
    return sql.SQL(type_)  # ours (_sql_type, ADDED_COLUMNS), never input


# An Arrow type's test -> the column's SQL type, in this order (the embedding aside).
_SQL_TYPES = ((pa.types.is_string, "text"), (pa.types.is_timestamp, "timestamptz"),
              (pa.types.is_int32, "integer"), (pa.types.is_float32, "real"),
              (pa.types.is_boolean, "boolean"), (pa.types.is_map, "jsonb"))


def _sql_type(column: Column, dim: int, vector_dtype: VectorDtype = "float32") -> str:
    type_ = column.field(dim).type
    if column.name == "embedding":
        return vector_sql_type(dim, vector_dtype)
    for is_type, sql_type in _SQL_TYPES:
        if is_type(type_):
            return sql_type
    raise TypeError(f"no SQL type for column {column.name} ({type_})")


@dataclasses.dataclass(frozen=True)
class StoreTable:
    """One store table: the Parquet columns of its folder, plus ``dt`` (the day partition, an
    order of the current-version rule) and ``load_key`` (the load that wrote the row)."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]

    def column_types(self, dim: int, vector_dtype: VectorDtype = "float32"
                     ) -> list[tuple[str, str]]:
        return ([(c.name, _sql_type(c, dim, vector_dtype)) for c in self.columns]
                + [("dt", "date"), ("load_key", "text")])

    @property
    def not_null(self) -> set[str]:
        return {*self.key, "embedding", "embedded_at"}


def store_tables(settings: StoreSettings) -> tuple[StoreTable, StoreTable]:
    """The articles' table and the chunks' table."""
    return (StoreTable(settings.table, VECTOR_COLUMNS, ("id",)),
            StoreTable(f"{settings.table}_chunks", CHUNK_COLUMNS, ("id", "chunk_index")))


def ident(*names: str):
    """An identifier, quoted (``sql.Identifier``): ``ident(schema, table)``."""
    from psycopg import sql

    return sql.Identifier(*names)


def _create_statements(settings: StoreSettings, dim: int,
                       vector_dtype: VectorDtype = "float32",
                       pgvector_schema: str = "public") -> list:
    """Every statement that creates the store's schema and main tables, in order, pgvector being
    (or to be created) in ``pgvector_schema`` (tests use them; a load issues only those the
    catalog lacks: ``missing_ddl``)."""
    return [statement for _, statement in main_ddl(settings, dim, vector_dtype,
                                                   pgvector_schema)]


def main_ddl(settings: StoreSettings, dim: int, vector_dtype: VectorDtype = "float32",
             pgvector_schema: Optional[str] = None) -> list[tuple[str, Any]]:
    """(what the catalog must hold, the statement that creates it): ``schema:<name>``,
    ``extension:vector`` (created, where it is missing, in ``pgvector_schema``, by default the
    store's schema: the search path names no schema to create it in), then a table's name, for
    the three main tables, their ``embedding`` of pgvector's type in ``pgvector_schema``."""
    from psycopg import sql

    schema = settings.schema_name
    pgvector_schema = pgvector_schema or schema
    out: list[tuple[str, Any]] = [
        (f"schema:{schema}", sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident(schema))),
        ("extension:vector", sql.SQL("CREATE EXTENSION IF NOT EXISTS vector SCHEMA {}").format(
            ident(pgvector_schema)))]
    for table in store_tables(settings):
        columns = [sql.SQL("{} {}{}").format(
            ident(name), type_sql(type_, pgvector_schema),
            sql.SQL(" NOT NULL") if name in table.key or name in ("dt", "embedding", "load_key",
                                                                  "embedded_at") else sql.SQL(""))
            for name, type_ in table.column_types(dim, vector_dtype)]
        columns.append(sql.SQL("PRIMARY KEY ({})").format(
            sql.SQL(", ").join(ident(k) for k in table.key)))
        out.append((table.name, sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            ident(schema, table.name), sql.SQL(", ").join(columns))))
    out.append((f"{settings.table}_loads", sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (load_key text PRIMARY KEY, loaded_at timestamptz NOT NULL "
        "DEFAULT now(), rows integer NOT NULL, chunk_rows integer NOT NULL, "
        "articles_current integer NOT NULL, outcome text, "
        "rejected jsonb NOT NULL DEFAULT '[]', withdrawn jsonb NOT NULL DEFAULT '[]', "
        "output text, run_id text)").format(
            ident(schema, f"{settings.table}_loads"))))
    return out


def kept_ddl(settings: StoreSettings) -> list[tuple[str, Any]]:
    """``<table>_superseded`` and ``<table>_chunks_superseded``: the versions of articles (and
    their chunks) that a load replaced, or that lost to another load's row, keyed by the load
    that would bring them back if it were withdrawn (``withdrawn_with``: the load that replaced
    them, or the one whose row they lost to), the article and the version's own load key
    (``withdraw.withdraw``). Pruned by ``saved_at`` (``store.superseded_keep_days``). Created like
    the tables they keep rows of, after those have every column (``missing_ddl``)."""
    from psycopg import sql

    schema = settings.schema_name
    out: list[tuple[str, Any]] = []
    for table in store_tables(settings):
        kept = ident(schema, f"{table.name}_superseded")
        key = ["withdrawn_with", "id", "load_key", *table.key[1:]]
        out.append((f"{table.name}_superseded", sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (LIKE {}, withdrawn_with text NOT NULL, "
            "saved_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY ({}))").format(
                kept, ident(schema, table.name), sql.SQL(", ").join(map(ident, key)))))
    return out


def index_ddl(settings: StoreSettings) -> list[tuple[str, Any]]:
    """The B-tree indexes (the HNSW ones: ``index_statement``): the kept versions by article,
    by age (pruning) and by their own load (a rerun withdrawing a replaced run's versions);
    ``<table>_loads`` by age and by batch output; the articles' table by load (a rerun finding
    the rows of the run it replaces)."""
    from psycopg import sql

    schema, name = settings.schema_name, settings.table
    out: list[tuple[str, Any]] = []

    def index(index_name: str, table: str, columns: str, where: str = "") -> None:
        out.append((index_name, sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} ({}){}").format(
            ident(index_name), ident(schema, table), sql.SQL(columns),  # ours, never input
            sql.SQL(where))))

    for table, short in ((f"{name}_superseded", "sup"), (f"{name}_chunks_superseded",
                                                         "chunks_sup")):
        index(f"{name}_{short}_id", table, "id")
        index(f"{name}_{short}_saved_at", table, "saved_at")
    index(f"{name}_sup_load_key", f"{name}_superseded", "load_key")
    index(f"{name}_loads_loaded_at", f"{name}_loads", "loaded_at")
    index(f"{name}_loads_output", f"{name}_loads", "output, run_id",
          " WHERE output IS NOT NULL")
    index(f"{name}_load_key", name, "load_key")
    index(f"{name}_story_id", name, "story_id")  # the copies of a story (search, docs/store.md)
    return out


# Columns added since the first release: a table created before gets them (ALTER TABLE, once:
# only when the catalog lacks them, since ALTER TABLE takes the table's strongest lock). A column
# added to the articles' table must be added to ``<table>_superseded`` too (suffix
# ``_superseded``; that table was created with every column up to ``updated_at``), and one added
# to the chunks' table to ``<table>_chunks_superseded``.
ADDED_COLUMNS = (("", "updated_at", "timestamptz"), ("_loads", "outcome", "text"),
                 ("_loads", "rejected", "jsonb NOT NULL DEFAULT '[]'"),
                 ("_loads", "withdrawn", "jsonb NOT NULL DEFAULT '[]'"),
                 ("_loads", "output", "text"), ("_loads", "run_id", "text"),
                 # 0.4: every row's story (``schema.STORY_COLUMNS``), null in rows loaded before
                 *((suffix, column.name, _sql_type(column, 0))
                   for suffix in ("", "_chunks", "_superseded", "_chunks_superseded")
                   for column in STORY_COLUMNS))


def index_statement(settings: StoreSettings, table: StoreTable, pgvector_type: str,
                    pgvector_schema: str):
    """The HNSW index of ``table``, with pgvector's operator class in its own schema."""
    from psycopg import sql

    if pgvector_type not in PGVECTOR_TYPES.values():  # ours, never input
        raise ValueError(pgvector_type)
    return sql.SQL(
        "CREATE INDEX IF NOT EXISTS {} ON {} USING hnsw (embedding {}) "
        "WITH (m = {}, ef_construction = {})").format(
            ident(f"{table.name}_embedding_hnsw"), ident(settings.schema_name, table.name),
            ident(pgvector_schema, f"{pgvector_type}_cosine_ops"),
            sql.Literal(settings.hnsw_m), sql.Literal(settings.hnsw_ef_construction))


def version_order(alias: str = "") -> "Any":
    """``schema.VERSION_ORDER`` as an SQL row value of ``alias``'s columns, a null lowest
    (``-infinity``): ``version_order("excluded") > version_order("t")`` is "later"."""
    from psycopg import sql

    if alias not in ("", "t", "s", "f", "excluded"):  # ours, never input
        raise ValueError(alias)
    prefix = f"{alias}." if alias else ""
    parts = [sql.SQL("COALESCE({}{}, '-infinity'::timestamptz)").format(sql.SQL(prefix),
                                                                        ident(name))
             if name in NULLABLE_IN_ORDER else sql.SQL("{}{}").format(sql.SQL(prefix),
                                                                      ident(name))
             for name in VERSION_ORDER]
    return sql.SQL("({})").format(sql.SQL(", ").join(parts))


def latest_first():
    """``ORDER BY`` terms: ``schema.VERSION_ORDER``, the latest version first, nulls last."""
    from psycopg import sql

    return sql.SQL(", ").join(
        sql.SQL("{} DESC NULLS LAST").format(ident(name)) for name in VERSION_ORDER)


def table_names(settings: StoreSettings) -> dict[str, Any]:
    """Identifiers of the tables: ``vectors``, ``chunks``, ``loads`` and the two kept versions'
    tables ``sup``, ``chunks_sup``."""
    vectors_table, chunks_table = store_tables(settings)
    schema = settings.schema_name
    return {"vectors": ident(schema, vectors_table.name),
            "chunks": ident(schema, chunks_table.name),
            "loads": ident(schema, f"{settings.table}_loads"),
            "sup": ident(schema, f"{vectors_table.name}_superseded"),
            "chunks_sup": ident(schema, f"{chunks_table.name}_superseded")}

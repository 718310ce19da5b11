"""The vector store beside the Parquet: PostgreSQL with pgvector (docs/store.md).

A batch run that has committed its Parquet, and each streaming micro-batch once its files are
written, is loaded into ``<schema>.<table>`` (one row per article, the ``vectors/`` columns) and, in
chunks mode, ``<table>_chunks`` (one row per chunk), both with an HNSW index (cosine). A load is
one transaction: binary COPY into a temporary staging table, an upsert that keeps each article's
current vector (the rule of ``pipeline.current``: the later ``dt``, then the later ``embedded_at``,
wins, so a rerun of an older day never brings back older text), and a row under its load key in
``<table>_loads``: a load whose key is there already changes nothing, so a retried or repeated
load is a no-op.

The connection string (DSN) never comes from the config file: it is read from the environment
variable ``store.dsn_env`` or the secret file ``store.dsn_file``, and it is scrubbed from every
message this module logs or raises.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import re
import struct
import time
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from transforms.schema import CHUNK_COLUMNS, VECTOR_COLUMNS, Column, VectorDtype

if TYPE_CHECKING:
    import psycopg

_LOG = logging.getLogger("newsvec.store")

# A PostgreSQL identifier that needs no quoting (quoted all the same, with sql.Identifier), short
# enough that the names derived from the table (``_chunks_embedding_hnsw``...) fit in 63 bytes.
IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,39}")
BUILD_INDEX_AFTER_ROWS = 10_000  # a first load this large into an empty table indexes after
_EPOCH_2000 = dt.date(2000, 1, 1)


class StoreError(RuntimeError):
    """A store failure, its message scrubbed of the connection string."""


class StoreLoadFailed(StoreError):
    """A load into the store failed; the Parquet it was loading from stays as committed."""


def _identifier(value: str) -> str:
    if not IDENTIFIER.fullmatch(value):
        raise ValueError(f"{value!r} is not a plain SQL identifier ({IDENTIFIER.pattern})")
    return value


class StoreSettings(BaseModel):
    """The ``store:`` section of a config: where vectors are also loaded, and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="load every committed batch run and every streaming "
                                             "micro-batch into PostgreSQL + pgvector "
                                             "(docs/store.md)")
    dsn_env: str = Field("NEWSVEC_STORE_DSN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                         description="the environment variable that holds the connection string "
                                     "(never the config file)")
    dsn_file: Optional[str] = Field(
        None, description="a file that holds the connection string instead (a mounted secret); "
                          "wins over `dsn_env`")
    schema_name: str = Field("public", description="the schema of the tables (an SQL identifier: "
                                                   "`[a-z_][a-z0-9_]*`)")
    table: str = Field("news_vectors", description="the articles' table; `<table>_chunks` and "
                                                   "`<table>_loads` beside it (an SQL identifier, "
                                                   "at most 40 characters)")
    hnsw_m: int = Field(16, ge=2, le=100, description="HNSW index: links per node (`m`)")
    hnsw_ef_construction: int = Field(64, ge=4, le=1000,
                                      description="HNSW index: `ef_construction`")
    index_build_memory_mb: Optional[int] = Field(
        None, ge=64, le=65536,
        description="`maintenance_work_mem` of the load that builds the HNSW index after a first "
                    "large load (an index whose graph does not fit in it builds several times "
                    "slower); null: the server's setting")
    ef_search: int = Field(100, ge=1, le=1000, description="`hnsw.ef_search` of "
                                                           "`newsvec search --store`")
    retry_s: float = Field(300, ge=0, description="how long a load retries, with backoff, while "
                                                  "the database cannot be reached")

    @field_validator("schema_name", "table")
    @classmethod
    def _plain_identifier(cls, value: str) -> str:
        return _identifier(value)

    @model_validator(mode="after")
    def _ef_construction_holds_m(self):
        if self.hnsw_ef_construction < 2 * self.hnsw_m:
            raise ValueError(f"hnsw_ef_construction ({self.hnsw_ef_construction}) must be at "
                             f"least 2 x hnsw_m ({self.hnsw_m}), as pgvector requires")
        return self


# --- the connection string, and keeping it out of messages ---------------------------------------

def resolve_dsn(settings: StoreSettings) -> str:
    """The connection string, from ``dsn_file`` or the environment variable ``dsn_env``."""
    if settings.dsn_file:
        try:
            with open(settings.dsn_file, encoding="utf-8") as f:
                dsn = f.read().strip()
        except OSError as exc:
            raise StoreError(f"store.dsn_file: cannot read the connection string "
                             f"({exc.strerror})") from None
        if not dsn:
            raise StoreError("store.dsn_file: the file is empty")
        return dsn
    dsn = os.environ.get(settings.dsn_env, "").strip()
    if not dsn:
        raise StoreError(f"store: set the environment variable {settings.dsn_env} to the "
                         "connection string (or store.dsn_file)")
    return dsn


def scrub(text: str, dsn: str) -> str:
    """``text`` without the connection string or any of its secret-bearing parts (password, user,
    host, the whole string)."""
    secrets = {dsn}
    try:
        from psycopg.conninfo import conninfo_to_dict

        parts = conninfo_to_dict(dsn)
    except Exception:  # pylint: disable=broad-except  # an unparsable DSN: the whole one only
        parts = {}
    for key in ("password", "user", "host", "hostaddr"):
        value = parts.get(key)
        if value is not None and len(str(value)) >= 3:
            secrets.add(str(value))
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def _failure(exc: BaseException, dsn: str, what: str) -> StoreLoadFailed:
    return StoreLoadFailed(f"{what}: {type(exc).__name__}: {scrub(str(exc), dsn)}")


# --- the tables ----------------------------------------------------------------------------------

_PGVECTOR_TYPES = {"float32": "vector", "float16": "halfvec"}
"""pgvector's type for each ``sink.vector_dtype``: ``halfvec`` stores float16 in half the bytes."""


def vector_sql_type(dim: int, vector_dtype: VectorDtype = "float32") -> str:
    """The embedding column's type for new tables: ``vector(dim)``, or ``halfvec(dim)`` when the
    rows are float16 (``sink.vector_dtype``). A table keeps the type it was created with: rows of
    the other dtype are converted on their way in (``Store._embedding_type``)."""
    return f"{_PGVECTOR_TYPES[vector_dtype]}({int(dim)})"


def _sql_type(column: Column, dim: int, vector_dtype: VectorDtype = "float32") -> str:
    type_ = column.field(dim).type
    if column.name == "embedding":
        return vector_sql_type(dim, vector_dtype)
    if pa.types.is_string(type_):
        return "text"
    if pa.types.is_timestamp(type_):
        return "timestamptz"
    if pa.types.is_int32(type_):
        return "integer"
    if pa.types.is_boolean(type_):
        return "boolean"
    if pa.types.is_map(type_):
        return "jsonb"
    raise TypeError(f"no SQL type for column {column.name} ({type_})")


@dataclasses.dataclass(frozen=True)
class _Table:
    """One store table: the Parquet columns of its folder, plus ``dt`` (the day partition, the
    first order of the current-vector rule) and ``load_key`` (the load that wrote the row)."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]

    def column_types(self, dim: int, vector_dtype: VectorDtype = "float32"
                     ) -> list[tuple[str, str]]:
        return ([(c.name, _sql_type(c, dim, vector_dtype)) for c in self.columns]
                + [("dt", "date"), ("load_key", "text")])


def _tables(settings: StoreSettings) -> tuple[_Table, _Table]:
    return (_Table(settings.table, VECTOR_COLUMNS, ("id",)),
            _Table(f"{settings.table}_chunks", CHUNK_COLUMNS, ("id", "chunk_index")))


def _ident(*names: str):
    from psycopg import sql

    return sql.Identifier(*names)


def _create_statements(settings: StoreSettings, dim: int,
                       vector_dtype: VectorDtype = "float32") -> list:
    from psycopg import sql

    schema = settings.schema_name
    statements = [sql.SQL("CREATE EXTENSION IF NOT EXISTS vector"),
                  sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_ident(schema))]
    for table in _tables(settings):
        columns = [sql.SQL("{} {}{}").format(
            _ident(name), sql.SQL(type_),  # type_ is ours (_sql_type), never input
            sql.SQL(" NOT NULL") if name in table.key or name in ("dt", "embedding", "load_key",
                                                                  "embedded_at") else sql.SQL(""))
            for name, type_ in table.column_types(dim, vector_dtype)]
        columns.append(sql.SQL("PRIMARY KEY ({})").format(
            sql.SQL(", ").join(_ident(k) for k in table.key)))
        statements.append(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            _ident(schema, table.name), sql.SQL(", ").join(columns)))
    statements.append(sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (load_key text PRIMARY KEY, loaded_at timestamptz NOT NULL "
        "DEFAULT now(), rows integer NOT NULL, chunk_rows integer NOT NULL, "
        "articles_current integer NOT NULL)").format(
            _ident(schema, f"{settings.table}_loads")))
    return statements


def _index_statement(settings: StoreSettings, table: _Table, pgvector_type: str = "vector"):
    from psycopg import sql

    return sql.SQL(
        "CREATE INDEX IF NOT EXISTS {} ON {} USING hnsw (embedding {}) "
        "WITH (m = {}, ef_construction = {})").format(
            _ident(f"{table.name}_embedding_hnsw"), _ident(settings.schema_name, table.name),
            sql.SQL(f"{pgvector_type}_cosine_ops"),  # one of _PGVECTOR_TYPES' values, never input
            sql.Literal(settings.hnsw_m), sql.Literal(settings.hnsw_ef_construction))


# --- rows ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoadRows:
    """What one load writes: Arrow tables of ``vectors/`` and ``chunks/`` rows (any subset of
    their columns that holds the keys, ``embedded_at`` and ``embedding``), and their day."""

    vectors: pa.Table
    chunks: Optional[pa.Table]
    dt: dt.date

    @property
    def dim(self) -> int:
        return self.vectors.schema.field("embedding").type.list_size

    @property
    def vector_dtype(self) -> VectorDtype:
        value_type = self.vectors.schema.field("embedding").type.value_type
        return "float16" if pa.types.is_float16(value_type) else "float32"


@dataclasses.dataclass(frozen=True)
class StoreLoad:
    """What a load did: ``already_loaded`` when its key was in ``<table>_loads`` (nothing
    changed); ``articles_current``: the articles whose stored row it wrote (the others already had
    a later one)."""

    load_key: str
    rows: int
    chunk_rows: int
    articles_current: int
    already_loaded: bool
    seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _vector_dumper(oid: int, pgvector_type: str = "vector"):
    """psycopg's binary dumper for pgvector's ``vector`` (or ``halfvec``): int16 dimension, int16
    0, then float4 (float2) big-endian (pgvector's ``vector_recv``, ``halfvec_recv``)."""
    from psycopg.adapt import Dumper
    from psycopg.pq import Format

    element = ">f2" if pgvector_type == "halfvec" else ">f4"

    class VectorBinaryDumper(Dumper):
        format = Format.BINARY

        def dump(self, obj):
            values = np.asarray(obj, dtype=element)
            return struct.pack(">HH", values.shape[0], 0) + values.tobytes()

    VectorBinaryDumper.oid = oid
    return VectorBinaryDumper


def _rows(table: pa.Table, names: Sequence[str], day: dt.date, load_key: str) -> Iterator[tuple]:
    from psycopg.types.json import Jsonb

    columns: list[Iterable] = []
    for name in names:
        if name == "dt":
            columns.append(_repeat(day, table.num_rows))
        elif name == "load_key":
            columns.append(_repeat(load_key, table.num_rows))
        elif name not in table.column_names:
            columns.append(_repeat(None, table.num_rows))
        elif name == "embedding":
            values = table.column(name).combine_chunks()
            dim = values.type.list_size
            columns.append(np.asarray(values.flatten().to_numpy(zero_copy_only=False),
                                      dtype=np.float32).reshape(-1, dim))
        elif pa.types.is_map(table.schema.field(name).type):
            columns.append([None if v is None else Jsonb(dict(v))
                            for v in table.column(name).to_pylist()])
        else:
            columns.append(table.column(name).to_pylist())
    return zip(*columns, strict=True)


def _repeat(value, n: int) -> list:
    return [value] * n


# --- loading -------------------------------------------------------------------------------------

class Store:
    """A connection to the store and the loads into it. ``retry_s`` of the settings bounds how long
    a load retries while the database cannot be reached (or the connection drops mid-load)."""

    def __init__(self, settings: StoreSettings, dsn: Optional[str] = None):
        self.settings = settings
        self._dsn = dsn if dsn is not None else resolve_dsn(settings)

    def scrub(self, text: str) -> str:
        return scrub(text, self._dsn)

    def connect(self) -> "psycopg.Connection":
        import psycopg

        try:
            return psycopg.connect(self._dsn, connect_timeout=10)
        except psycopg.Error as exc:
            raise _failure(exc, self._dsn, "cannot connect to the store") from None

    def load(self, rows: LoadRows, load_key: str) -> StoreLoad:
        """Load ``rows`` under ``load_key``, once (see the module docstring); retried with backoff
        while the database cannot be reached, for up to ``retry_s``. Raises ``StoreLoadFailed``
        (scrubbed) when it gives up or on any other error; nothing of the load is then stored."""
        import psycopg
        import tenacity

        def retryable(exc: BaseException) -> bool:  # the database down, or the connection lost
            return isinstance(exc, psycopg.OperationalError)

        def log_retry(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            _LOG.warning("store load %s: attempt %d failed (%s), retrying", load_key,
                         state.attempt_number, self.scrub(f"{type(exc).__name__}: {exc}"))

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(retryable),
            stop=tenacity.stop_after_delay(self.settings.retry_s),
            wait=tenacity.wait_exponential(multiplier=0.5, max=10),
            before_sleep=log_retry, reraise=True)
        try:
            return retrying(self._load_once, rows, load_key)
        except StoreLoadFailed:
            raise
        except Exception as exc:  # pylint: disable=broad-except  # scrubbed, never chained
            raise _failure(exc, self._dsn, f"store load {load_key} failed") from None

    def _load_once(self, rows: LoadRows, load_key: str) -> StoreLoad:
        import psycopg
        from psycopg import sql
        from psycopg.types import TypeInfo

        started = time.perf_counter()
        vectors_table, chunks_table = _tables(self.settings)
        schema = self.settings.schema_name
        loads = _ident(schema, f"{self.settings.table}_loads")
        try:
            conn = psycopg.connect(self._dsn, connect_timeout=10)
        except psycopg.OperationalError as exc:
            raise psycopg.OperationalError(self.scrub(str(exc))) from None
        with conn:
            # One load at a time per table: concurrent upserts of the same articles would
            # deadlock, and concurrent CREATE ... IF NOT EXISTS can collide.
            lock = sql.SQL("SELECT pg_advisory_xact_lock(hashtext({}))").format(
                sql.Literal(f"newsvec-store:{schema}.{self.settings.table}"))
            with conn.transaction():
                conn.execute(lock)
                for statement in _create_statements(self.settings, rows.dim, rows.vector_dtype):
                    conn.execute(statement)
            pgvector_type = self._embedding_type(conn, rows)
            info = TypeInfo.fetch(conn, pgvector_type)
            if info is None:
                raise StoreLoadFailed("the store's database has no pgvector (CREATE EXTENSION "
                                      "vector)")
            info.register(conn)
            conn.adapters.register_dumper(np.ndarray, _vector_dumper(info.oid, pgvector_type))
            with conn.transaction():
                conn.execute(lock)
                done = conn.execute(sql.SQL("SELECT 1 FROM {} WHERE load_key = %s").format(loads),
                                    (load_key,)).fetchone()
                if done:
                    return StoreLoad(load_key, rows.vectors.num_rows, _n(rows.chunks), 0, True,
                                     time.perf_counter() - started)
                empty = conn.execute(sql.SQL("SELECT NOT EXISTS (SELECT 1 FROM {})").format(
                    _ident(schema, vectors_table.name))).fetchone()
                index_after = bool(empty and empty[0]) and (
                    rows.vectors.num_rows >= BUILD_INDEX_AFTER_ROWS)
                if not index_after:
                    for table in (vectors_table, chunks_table):
                        conn.execute(_index_statement(self.settings, table, pgvector_type))
                current = self._upsert(conn, vectors_table, rows.vectors, rows, load_key,
                                       pgvector_type)
                conn.execute("CREATE TEMP TABLE newsvec_won (id text PRIMARY KEY) ON COMMIT DROP")
                conn.execute(sql.SQL("INSERT INTO newsvec_won SELECT id FROM {} WHERE "
                                     "load_key = %s").format(_ident(schema, vectors_table.name)),
                             (load_key,))
                # An article whose row this load wrote gets this load's chunks, and only them.
                conn.execute(sql.SQL("DELETE FROM {} c USING newsvec_won w WHERE c.id = w.id")
                             .format(_ident(schema, chunks_table.name)))
                chunk_rows = 0
                if rows.chunks is not None and rows.chunks.num_rows:
                    chunk_rows = self._copy_in(conn, chunks_table, rows.chunks, rows, load_key,
                                               pgvector_type,
                                               only_won=True)
                if index_after:
                    if self.settings.index_build_memory_mb is not None:
                        conn.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(
                            sql.Literal(f"{self.settings.index_build_memory_mb}MB")))
                    for table in (vectors_table, chunks_table):
                        conn.execute(_index_statement(self.settings, table, pgvector_type))
                conn.execute(sql.SQL("INSERT INTO {} (load_key, rows, chunk_rows, "
                                     "articles_current) VALUES (%s, %s, %s, %s)").format(loads),
                             (load_key, rows.vectors.num_rows, chunk_rows, current))
            return StoreLoad(load_key, rows.vectors.num_rows, _n(rows.chunks), current, False,
                             time.perf_counter() - started)

    def _embedding_type(self, conn, rows: LoadRows) -> str:
        """``vector`` or ``halfvec``: the type the store's table was created with, whatever the
        rows' dtype (``sink.vector_dtype`` may change; rows are converted to the table's type). A
        table of another dimension (``model.dimensions`` or the model changed) is refused."""
        stored = self._stored_embedding_type(conn)
        pgvector_type, _, size = stored.partition("(")
        if pgvector_type not in _PGVECTOR_TYPES.values() or int(size.rstrip(")")) != rows.dim:
            raise StoreLoadFailed(
                f"the store's table {self.settings.schema_name}.{self.settings.table} holds "
                f"{stored} vectors, these rows have {rows.dim} dimensions: a model or "
                "model.dimensions change needs a table of its own (store.table)")
        return pgvector_type

    def _stored_embedding_type(self, conn) -> str:
        row = conn.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
            "%s::regclass AND attname = 'embedding'",
            (f'"{self.settings.schema_name}"."{self.settings.table}"',)).fetchone()
        if row is None:
            raise StoreLoadFailed(f"the store's table {self.settings.table} has no embedding")
        return str(row[0])

    def _stage(self, conn, table: _Table, data: pa.Table, rows: LoadRows, load_key: str,
               pgvector_type: str) -> str:
        """COPY (binary) ``data`` into a temporary table like ``table``; returns its name."""
        from psycopg import sql

        stage = f"newsvec_stage_{table.name}"
        conn.execute(sql.SQL("CREATE TEMP TABLE {} (LIKE {}) ON COMMIT DROP").format(
            _ident(stage), _ident(self.settings.schema_name, table.name)))
        names = [name for name, _ in table.column_types(rows.dim)]
        types = [type_ if name != "embedding" else pgvector_type
                 for name, type_ in table.column_types(rows.dim)]
        with conn.cursor().copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
                _ident(stage), sql.SQL(", ").join(_ident(n) for n in names))) as copy:
            copy.set_types(types)
            for row in _rows(data, names, rows.dt, load_key):
                copy.write_row(row)
        return stage

    def _upsert(self, conn, table: _Table, data: pa.Table, rows: LoadRows, load_key: str,
                pgvector_type: str) -> int:
        """Stage the articles' rows and upsert them: a row replaces the stored one only if it is
        current (a later ``dt``, or the same ``dt`` and a later ``embedded_at``). Returns the rows
        written."""
        from psycopg import sql

        stage = self._stage(conn, table, data, rows, load_key, pgvector_type)
        names = [name for name, _ in table.column_types(rows.dim)]
        target = _ident(self.settings.schema_name, table.name)
        statement = sql.SQL(
            "INSERT INTO {target} AS t ({cols}) SELECT DISTINCT ON ({key}) {cols} FROM {stage} "
            "ORDER BY {key}, dt DESC, embedded_at DESC "
            "ON CONFLICT ({key}) DO UPDATE SET {updates} "
            "WHERE (EXCLUDED.dt, EXCLUDED.embedded_at) > (t.dt, t.embedded_at)").format(
                target=target, stage=_ident(stage),
                cols=sql.SQL(", ").join(_ident(n) for n in names),
                key=sql.SQL(", ").join(_ident(k) for k in table.key),
                updates=sql.SQL(", ").join(sql.SQL("{} = EXCLUDED.{}").format(_ident(n), _ident(n))
                                           for n in names if n not in table.key))
        return conn.execute(statement).rowcount

    def _copy_in(self, conn, table: _Table, data: pa.Table, rows: LoadRows, load_key: str,
                 pgvector_type: str,
                 only_won: bool) -> int:
        from psycopg import sql

        stage = self._stage(conn, table, data, rows, load_key, pgvector_type)
        names = sql.SQL(", ").join(_ident(n) for n, _ in table.column_types(rows.dim))
        return conn.execute(sql.SQL(
            "INSERT INTO {} ({}) SELECT DISTINCT ON ({}) {} FROM {} s "
            "WHERE s.id IN (SELECT id FROM newsvec_won)").format(
                _ident(self.settings.schema_name, table.name), names,
                sql.SQL(", ").join(_ident(k) for k in table.key), names,
                _ident(stage))).rowcount


    def search(self, vector, k: int) -> list[dict]:
        """The ``k`` nearest articles to ``vector`` through the HNSW index (``hnsw.ef_search`` from
        the settings): by their best chunk when the store holds chunks, else by their own row.
        ``{"id", "title", "score", "chunk_index"}``, best first: what ``pipeline.search`` gives."""
        from psycopg import sql

        vectors_table, chunks_table = _tables(self.settings)
        schema = self.settings.schema_name
        query = "[" + ",".join(repr(float(x)) for x in np.asarray(vector).ravel()) + "]"
        # HNSW returns at most ef_search rows: enough of them to group chunks into k articles.
        ef_search = max(self.settings.ef_search, k)
        with self.connect() as conn, conn.transaction():
            conn.execute(sql.SQL("SET LOCAL hnsw.ef_search = {}").format(sql.Literal(ef_search)))
            # The query vector as the column's type, so that the HNSW index serves the ORDER BY.
            stored = self._stored_embedding_type(conn).partition("(")[0]
            cast = sql.SQL("halfvec" if stored == "halfvec" else "vector")
            has_chunks = conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(
                _ident(schema, chunks_table.name))).fetchone()
            if has_chunks and has_chunks[0]:
                nearest = conn.execute(sql.SQL(
                    "SELECT c.id, v.title, 1 - (c.embedding <=> %s::{cast}), c.chunk_index "
                    "FROM (SELECT id, chunk_index, embedding FROM {chunks} ORDER BY embedding <=> "
                    "%s::{cast} LIMIT %s) c LEFT JOIN {vectors} v USING (id)").format(
                        chunks=_ident(schema, chunks_table.name),
                        vectors=_ident(schema, vectors_table.name), cast=cast),
                    (query, query, ef_search)).fetchall()
            else:
                nearest = conn.execute(sql.SQL(
                    "SELECT id, title, 1 - (embedding <=> %s::{cast}), NULL::integer "
                    "FROM {vectors} ORDER BY embedding <=> %s::{cast} LIMIT %s").format(
                        vectors=_ident(schema, vectors_table.name), cast=cast),
                    (query, query, k)).fetchall()
        best: dict[str, tuple] = {}
        for doc_id, title, score, chunk_index in nearest:
            if doc_id not in best or score > best[doc_id][1]:
                best[doc_id] = (title, score, chunk_index)
        ranked = sorted(best.items(), key=lambda item: -item[1][1])[:k]
        return [{"id": doc_id, "title": title, "score": round(float(score), 4),
                 "chunk_index": chunk_index} for doc_id, (title, score, chunk_index) in ranked]


def _n(table: Optional[pa.Table]) -> int:
    return 0 if table is None else table.num_rows


def store_of(settings: StoreSettings) -> Store:
    """The store of a config's ``store:`` section; ``StoreLoadFailed`` when its connection string
    is not set."""
    try:
        return Store(settings)
    except StoreError as exc:
        raise StoreLoadFailed(str(exc)) from None

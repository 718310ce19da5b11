"""The vector store beside the Parquet: PostgreSQL with pgvector (docs/store.md).

A batch run that has committed its Parquet, and each streaming micro-batch once its files are
written, is loaded into ``<schema>.<table>`` (one row per article, the ``vectors/`` columns) and, in
chunks mode, ``<table>_chunks`` (one row per chunk), both with an HNSW index (cosine). A load is
one transaction: binary COPY into a temporary staging table, an upsert that keeps each article's
current version (``schema.VERSION_ORDER``: ``updated_at``, ``published_at``, the day ``dt``, the
Pub/Sub publish time, then ``embedded_at``, each later wins), and a row under its load key in
``<table>_loads`` with the load's outcome (a digest of the article versions it was given): a load
whose key is there with the same outcome changes nothing, so a retried or repeated load is a
no-op; one with another outcome (a streaming micro-batch redone, a row this time where it was a
dead letter) first withdraws the rows the earlier load wrote, then loads its own.

Errors are of two kinds. Transient ones (the database down, failing over or read-only for a
moment, a lock or statement timeout, a serialization failure) are retried with backoff for
``retry_s``. Data errors never succeed on retry: rows that cannot be stored (a NUL character, a
non-finite vector, a timestamp out of range, or any row the server refuses) are set aside with
their reason (``StoreLoad.rejected``), the rest of the load commits.

Every load bounds its waits: ``lock_timeout_s`` for the table's lock, ``statement_timeout_s`` for
each statement, the server ends a session idle in its transaction, and TCP keepalives on both ends
end a connection whose other end vanished.

The connection string (DSN) never comes from the config file: it is read from the environment
variable ``store.dsn_env`` or the secret file ``store.dsn_file``, and it is scrubbed from every
message this module logs or raises.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import logging
import os
import re
import struct
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from transforms.schema import (
    CHUNK_COLUMNS,
    NULLABLE_IN_ORDER,
    VECTOR_COLUMNS,
    VERSION_ORDER,
    Column,
    VectorDtype,
)

if TYPE_CHECKING:
    import psycopg

_LOG = logging.getLogger("newsvec.store")

# A PostgreSQL identifier that needs no quoting (quoted all the same, with sql.Identifier), short
# enough that the names derived from the table (``_chunks_embedding_hnsw``...) fit in 63 bytes.
IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,39}")
BUILD_INDEX_AFTER_ROWS = 10_000  # a first load this large into an empty table indexes after

# TCP keepalives on both ends of a load's connection: a peer that vanished (its machine gone, the
# network cut, no FIN) is found within about idle + interval x count = 25 s, instead of the
# kernel's default of over two hours, and its session ends, releasing the table's lock.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
# PostgreSQL 14+: a running statement checks this often that its client is still there.
CLIENT_CHECK_INTERVAL_MS = 5000


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
    retry_s: float = Field(300, ge=0, description="how long a load retries, with backoff, on "
                                                  "transient errors (the database down or failing "
                                                  "over, a lock or statement timeout)")
    lock_timeout_s: float = Field(
        60, gt=0, le=86400,
        description="how long one try of a load waits for the table's lock (another load holds "
                    "it) or any other lock; then the try fails and is retried within `retry_s`. "
                    "Also how long a load's session may sit idle inside its transaction before the "
                    "server ends it (a loader that stalled or vanished releases the table)")
    statement_timeout_s: float = Field(
        1800, gt=0, le=86400,
        description="the longest one statement of a load may run (the COPY, the upsert); then the "
                    "try fails and is retried within `retry_s`. Raise it for batch loads of "
                    "millions of rows into an indexed table. The HNSW index build after a first "
                    "large load is not bounded by it")

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

UNPARSABLE_DSN = ("the connection string could not be parsed (check its quoting; in a "
                  "postgresql:// URL, write a % in the password as %25)")


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
        try:
            mode = os.stat(settings.dsn_file).st_mode
        except OSError:
            mode = 0
        if mode & 0o077:
            _LOG.warning("store.dsn_file %s can be read by others than its owner (mode %o): "
                         "chmod 600 it", settings.dsn_file, mode & 0o777)
        return dsn
    dsn = os.environ.get(settings.dsn_env, "").strip()
    if not dsn:
        raise StoreError(f"store: set the environment variable {settings.dsn_env} to the "
                         "connection string (or store.dsn_file)")
    return dsn


def _parsed(dsn: str) -> Optional[dict]:
    """libpq's reading of the DSN, or None when it cannot be parsed."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        return conninfo_to_dict(dsn)
    except Exception:  # pylint: disable=broad-except  # its message may quote the DSN
        return None


def _url_secrets(dsn: str) -> set[str]:
    """The raw (and decoded) user, password and hosts of a ``postgresql://`` DSN, found without
    libpq: a URL it cannot parse (a stray ``%``) still has them scrubbed."""
    if "://" not in dsn:
        return set()
    found: set[str] = set()
    rest = dsn.split("://", 1)[1]
    netloc = re.split(r"[/?]", rest, maxsplit=1)[0]
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        found.add(userinfo)
        found.update(userinfo.split(":", 1))
    for host in hosts.split(","):
        found.add(host)
        found.add(host.rsplit(":", 1)[0] if not host.endswith("]") else host)
    query = rest.partition("?")[2]
    for pair in query.split("&"):
        key, _, value = pair.partition("=")
        if key in ("password", "sslpassword", "user", "host", "hostaddr"):
            found.add(value)
    decoded = set()
    for value in found:
        try:
            decoded.add(urllib.parse.unquote(value, errors="strict"))
        except UnicodeDecodeError:
            pass
    return found | decoded


def _secrets(dsn: str) -> list[str]:
    """Every piece of ``dsn`` a message must not show, longest first: the whole string; the
    password and ``sslpassword`` however short; the user and each host and host address (of two
    characters or more: a one-letter name would blank out every message)."""
    secrets: set[str] = {dsn} | {s for s in _url_secrets(dsn) if len(s) >= 2}
    for key, value in (_parsed(dsn) or {}).items():
        if value is None or value == "":
            continue
        if key in ("password", "sslpassword"):
            secrets.add(str(value))
        elif key in ("user", "host", "hostaddr"):
            secrets.update(v for v in str(value).split(",") if len(v) >= 2)
    secrets.discard("")
    return sorted(secrets, key=len, reverse=True)


def scrub(text: str, dsn: str) -> str:
    """``text`` without the connection string or any of its secret-bearing parts (password,
    ``sslpassword``, user, hosts: ``_secrets``)."""
    for secret in _secrets(dsn):
        text = text.replace(secret, "***")
    return text


def _failure(exc: BaseException, dsn: str, what: str) -> StoreLoadFailed:
    """A ``StoreLoadFailed`` for ``exc``, its message scrubbed; to be raised outside the
    ``except`` block, so that it carries no ``__context__`` (the driver's exception, whose message
    may quote the DSN). A DSN that libpq cannot parse gives a fixed message."""
    if _parsed(dsn) is None:
        return StoreLoadFailed(f"{what}: {UNPARSABLE_DSN}")
    return StoreLoadFailed(f"{what}: {type(exc).__name__}: {scrub(str(exc), dsn)}")


# --- which errors are worth retrying ------------------------------------------------------------

def is_transient(exc: BaseException) -> bool:
    """An error a later try can get past, so a load retries it (for ``retry_s``):
    - ``OperationalError``: the connection failed or was lost (08xxx), the server shutting down or
      starting (57P01 admin_shutdown, 57P02, 57P03 cannot_connect_now), a statement or lock
      timeout (57014 query_canceled, 55P03 lock_not_available), a serialization failure or a
      deadlock with another session (40001, 40P01: the transaction was rolled back and succeeds
      when run again), out of resources (53xxx: connections, memory, disk), an I/O error (58030);
      but not 54xxx (program_limit_exceeded: a value too large for an index row), which is the
      row's own and never passes;
    - ``InterfaceError``: the client's connection was closed or broken under it;
    - ``ReadOnlySqlTransaction`` (25006): a failover left the connection on a server that is a
      replica now; a new connection reaches the new primary;
    - ``IdleInTransactionSessionTimeout`` (25P03): the server ended this load's own session for
      idling inside its transaction (this process stalled)."""
    import psycopg
    from psycopg import errors

    if isinstance(exc, errors.ProgramLimitExceeded):
        return False
    return isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError,
                            errors.ReadOnlySqlTransaction,
                            errors.IdleInTransactionSessionTimeout))


def is_data_error(exc: BaseException) -> bool:
    """An error caused by the rows themselves, which no retry gets past: the server refused a
    value (22xxx data_exception, 23xxx integrity_constraint_violation, 54xxx a value too large),
    or one could not be converted to send (``ValueError``, ``OverflowError``). The rows that cause
    it are found by halving the load (``Store._load_parts``) and set aside."""
    import psycopg
    from psycopg import errors

    return isinstance(exc, (psycopg.DataError, psycopg.IntegrityError,
                            errors.ProgramLimitExceeded, ValueError, OverflowError))


# --- the tables ----------------------------------------------------------------------------------

_PGVECTOR_TYPES = {"float32": "vector", "float16": "halfvec"}
"""pgvector's type for each ``sink.vector_dtype``: ``halfvec`` stores float16 in half the bytes."""
_HALF_MAX = 65504.0  # the largest finite float16: a larger float32 is infinite as halfvec


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
        "articles_current integer NOT NULL, outcome text, "
        "rejected jsonb NOT NULL DEFAULT '[]')").format(
            _ident(schema, f"{settings.table}_loads")))
    return statements


# Columns added since the first release: a table created before gets them (ALTER TABLE, once:
# only when the catalog lacks them, since ALTER TABLE takes the table's strongest lock).
_ADDED_COLUMNS = (("", "updated_at", "timestamptz"), ("_loads", "outcome", "text"),
                  ("_loads", "rejected", "jsonb NOT NULL DEFAULT '[]'"))


def _index_statement(settings: StoreSettings, table: _Table, pgvector_type: str = "vector"):
    from psycopg import sql

    return sql.SQL(
        "CREATE INDEX IF NOT EXISTS {} ON {} USING hnsw (embedding {}) "
        "WITH (m = {}, ef_construction = {})").format(
            _ident(f"{table.name}_embedding_hnsw"), _ident(settings.schema_name, table.name),
            sql.SQL(f"{pgvector_type}_cosine_ops"),  # one of _PGVECTOR_TYPES' values, never input
            sql.Literal(settings.hnsw_m), sql.Literal(settings.hnsw_ef_construction))


def version_order(alias: str = "") -> "Any":
    """``schema.VERSION_ORDER`` as an SQL row value of ``alias``'s columns, a null lowest
    (``-infinity``): ``version_order("excluded") > version_order("t")`` is "later"."""
    from psycopg import sql

    if alias not in ("", "t", "s", "f", "excluded"):  # ours, never input
        raise ValueError(alias)
    prefix = f"{alias}." if alias else ""
    parts = [sql.SQL("COALESCE({}{}, '-infinity'::timestamptz)").format(sql.SQL(prefix),
                                                                         _ident(name))
             if name in NULLABLE_IN_ORDER else sql.SQL("{}{}").format(sql.SQL(prefix),
                                                                       _ident(name))
             for name in VERSION_ORDER]
    return sql.SQL("({})").format(sql.SQL(", ").join(parts))


def _latest_first():
    """``ORDER BY`` terms: ``schema.VERSION_ORDER``, the latest version first, nulls last."""
    from psycopg import sql

    return sql.SQL(", ").join(
        sql.SQL("{} DESC NULLS LAST").format(_ident(name)) for name in VERSION_ORDER)


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

    def outcome(self) -> str:
        """A digest of the article versions of the load (id, ``text_sha256``, ``embedded_at``):
        the same for every try of one load; another for a micro-batch redone with another
        result."""
        table = self.vectors
        lines = sorted(f"{i}\0{t}\0{e}" for i, t, e in zip(
            table.column("id").to_pylist(), table.column("text_sha256").to_pylist(),
            table.column("embedded_at").cast(pa.int64()).to_pylist(), strict=True))
        return hashlib.sha256("\n".join(lines).encode("utf-8", "surrogatepass")).hexdigest()[:32]


REJECTED_FIELDS = ("id", "text_sha256", "reason", "detail")
"""A row the store refused: ``StoreLoad.rejected``, ``LedgerRecord.store_rejected``, the
``rejected`` column of ``<table>_loads``, each one a dict of these."""


class Refusal:
    """Why a row cannot be stored (``reason`` of a rejected row): stable codes."""

    NUL = "nul_character"  # PostgreSQL text and jsonb cannot hold U+0000
    NON_FINITE = "non_finite_vector"  # pgvector refuses NaN and infinity (float16: over 65504)
    TIMESTAMP = "timestamp_out_of_range"  # outside years 1-9999 UTC
    MISSING = "missing_value"  # null where the table needs a value
    REFUSED = "refused_by_store"  # the server refused it: detail holds its SQLSTATE and message


def _printable(text: Any) -> Any:
    """``text`` with control characters written as ``\\xNN``: ids in a rejection are shown and
    stored (jsonb cannot hold U+0000) in this form."""
    if not isinstance(text, str):
        return text
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\x{ord(m.group()):02x}", text)


def rejection(doc_id: Any, text_sha256: Any, reason: str, detail: str) -> dict:
    return {"id": _printable(doc_id), "text_sha256": _printable(text_sha256), "reason": reason,
            "detail": _printable(detail)[:300]}


_PY_MIN_US = -62135596800 * 10**6  # 0001-01-01T00:00:00Z, the first instant Python can hold
_PY_MAX_US = 253402300799 * 10**6 + 999999  # 9999-12-31T23:59:59.999999Z


def _problems(table: pa.Table, not_null: set[str], halfvec: bool) -> list[Optional[tuple]]:
    """For each row of ``table``: None, or (reason, detail) of the first thing about it the store
    cannot take: a null where the table needs a value, a NUL character in a text or in an
    attribute's key or value, a timestamp outside years 1-9999 UTC (what psycopg, Python and
    every reader can represent), a non-finite vector (or, into a ``halfvec`` table, one with an
    element beyond float16's range)."""
    n = table.num_rows
    found: list[Optional[tuple]] = [None] * n

    def mark(rows: Iterable[int], reason: str, detail: str) -> None:
        for i in rows:
            if found[i] is None:
                found[i] = (reason, detail)

    def where(mask) -> np.ndarray:
        return np.flatnonzero(np.asarray(mask, dtype=bool))

    for name in table.column_names:
        column = table.column(name).combine_chunks()
        type_ = column.type
        if name in not_null and column.null_count:
            mark(where(column.is_null().to_numpy(zero_copy_only=False)), Refusal.MISSING,
                 f"{name} is null")
        if pa.types.is_string(type_) or pa.types.is_large_string(type_):
            nul = pc.fill_null(pc.match_substring(column, "\x00"), False)
            mark(where(nul.to_numpy(zero_copy_only=False)), Refusal.NUL,
                 f"{name} holds a NUL character")
        elif pa.types.is_timestamp(type_):
            if type_.unit != "us":
                column = column.cast(pa.timestamp("us", type_.tz), safe=False)
            micros = pc.fill_null(column.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
            mark(where((micros < _PY_MIN_US) | (micros > _PY_MAX_US)), Refusal.TIMESTAMP,
                 f"{name} is outside years 1-9999 UTC")
        elif pa.types.is_map(type_):
            # As a list of (key, value) structs: Arrow's list kernels do not take a map.
            pairs = pa.ListArray.from_arrays(column.offsets, column.values)
            flat = pc.list_flatten(pairs)
            if not len(flat):
                continue
            entries = pc.or_(pc.fill_null(pc.match_substring(flat.field(0), "\x00"), False),
                             pc.fill_null(pc.match_substring(flat.field(1), "\x00"), False))
            parents = pc.list_parent_indices(pairs).to_numpy(zero_copy_only=False)
            mark(parents[where(entries.to_numpy(zero_copy_only=False))], Refusal.NUL,
                 f"{name} holds a NUL character in a key or value")
        elif pa.types.is_fixed_size_list(type_) and name == "embedding":
            valid = where(column.is_valid().to_numpy(zero_copy_only=False))
            if not len(valid):
                continue
            present = column.take(pa.array(valid))
            values = np.asarray(present.flatten().to_numpy(zero_copy_only=False),
                                dtype=np.float32).reshape(len(valid), type_.list_size)
            bad = ~np.isfinite(values).all(axis=1)
            if halfvec:
                bad |= (np.abs(np.nan_to_num(values)) > _HALF_MAX).any(axis=1)
            mark(valid[bad], Refusal.NON_FINITE,
                 "embedding holds NaN or infinity" + (" (as float16)" if halfvec else ""))
    return found


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


def _chunk_groups(rows: LoadRows) -> dict[tuple, list[int]]:
    """{(id, text_sha256): the indices of its chunk rows}: the chunks of each article version."""
    groups: dict[tuple, list[int]] = {}
    if rows.chunks is None:
        return groups
    keys = zip(rows.chunks.column("id").to_pylist(),
               rows.chunks.column("text_sha256").to_pylist(), strict=True)
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return groups


@dataclasses.dataclass(frozen=True)
class StoreLoad:
    """What a load did: ``already_loaded`` when its key was in ``<table>_loads`` with the same
    outcome (nothing changed); ``rows``: the articles' rows it stored (the rows given, less
    ``rejected``); ``articles_current``: the articles whose stored row it wrote (the others
    already had a later version); ``rejected``: the rows the store cannot take, each a dict of
    ``REJECTED_FIELDS``; ``withdrawn``: rows of an earlier load under the same key with another
    outcome, deleted first."""

    load_key: str
    rows: int
    chunk_rows: int
    articles_current: int
    already_loaded: bool
    seconds: float
    rejected: tuple = ()
    withdrawn: int = 0

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["rejected"] = list(self.rejected)
        return out


# --- loading -------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Part:
    """What the parts of one load did, summed."""

    rows: int = 0
    chunk_rows: int = 0
    current: int = 0


class Store:
    """A connection to the store and the loads into it. ``retry_s`` of the settings bounds how long
    a load retries on transient errors (``is_transient``)."""

    def __init__(self, settings: StoreSettings, dsn: Optional[str] = None):
        self.settings = settings
        self._dsn = dsn if dsn is not None else resolve_dsn(settings)
        if _parsed(self._dsn) is None:
            raise StoreError(f"store: {UNPARSABLE_DSN}")

    def scrub(self, text: str) -> str:
        return scrub(text, self._dsn)

    def _connect_kwargs(self) -> dict:
        """``connect_timeout`` and client-side TCP keepalives, where the DSN sets none itself."""
        given = _parsed(self._dsn) or {}
        wanted = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": KEEPALIVE_IDLE_S,
                  "keepalives_interval": KEEPALIVE_INTERVAL_S,
                  "keepalives_count": KEEPALIVE_COUNT}
        return {k: v for k, v in wanted.items() if k not in given}

    def _open(self) -> "psycopg.Connection":
        """A connection with keepalives on both ends; ``OperationalError`` (scrubbed) when the
        database cannot be reached."""
        import psycopg

        error = None
        try:
            conn = psycopg.connect(self._dsn, **self._connect_kwargs())
        except psycopg.OperationalError as exc:
            error = psycopg.OperationalError(self.scrub(str(exc)))
        if error is not None:
            raise error  # outside the except: no __context__ that quotes the DSN
        try:
            settings = {"tcp_keepalives_idle": KEEPALIVE_IDLE_S,
                        "tcp_keepalives_interval": KEEPALIVE_INTERVAL_S,
                        "tcp_keepalives_count": KEEPALIVE_COUNT}
            if conn.info.server_version >= 140000:
                settings["client_connection_check_interval"] = CLIENT_CHECK_INTERVAL_MS
            conn.execute("SELECT " + ", ".join("set_config(%s, %s, false)" for _ in settings),
                         [x for k, v in settings.items() for x in (k, str(v))])
            conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    def connect(self) -> "psycopg.Connection":
        import psycopg

        failure = None
        try:
            return self._open()
        except psycopg.Error as exc:
            failure = _failure(exc, self._dsn, "cannot connect to the store")
        raise failure

    def _bound(self, conn, statement_timeout_s: Optional[float] = None) -> None:
        """This transaction's waits: ``lock_timeout``, ``statement_timeout``, and
        ``idle_in_transaction_session_timeout`` (= the lock timeout: a load that stalls in its
        transaction holds others no longer than they would wait for it)."""
        statement = self.settings.statement_timeout_s if statement_timeout_s is None \
            else statement_timeout_s
        lock_ms = str(max(1, int(self.settings.lock_timeout_s * 1000)))
        conn.execute("SELECT set_config('lock_timeout', %s, true), "
                     "set_config('statement_timeout', %s, true), "
                     "set_config('idle_in_transaction_session_timeout', %s, true)",
                     (lock_ms, str(int(statement * 1000)), lock_ms))

    def load(self, rows: LoadRows, load_key: str, ids: Optional[Sequence[str]] = None
             ) -> StoreLoad:
        """Load ``rows`` under ``load_key`` (see the module docstring); retried with backoff on
        transient errors for up to ``retry_s``. Rows the store cannot take are left out and named
        in ``StoreLoad.rejected``; the rest is stored. ``ids``: every article id this load's key
        may have written before (a streaming micro-batch's rows and dead letters; default: the
        rows' ids): a load under the same key with another outcome withdraws its rows among them.
        Raises ``StoreLoadFailed`` (scrubbed, with no chained exception) when it gives up or on
        any error that is neither transient nor a data error; nothing of the load is then
        stored."""
        import tenacity

        # An id with a NUL cannot be in the table (nor be sent as a parameter).
        withdraw = sorted({i for i in (rows.vectors.column("id").to_pylist() if ids is None
                                       else ids) if isinstance(i, str) and "\x00" not in i})
        outcome = rows.outcome()

        def log_retry(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            _LOG.warning("store load %s: attempt %d failed (%s), retrying", load_key,
                         state.attempt_number, self.scrub(f"{type(exc).__name__}: {exc}"))

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=tenacity.stop_after_delay(self.settings.retry_s),
            wait=tenacity.wait_exponential(multiplier=0.5, max=10),
            before_sleep=log_retry, reraise=True)
        failure: Optional[StoreLoadFailed] = None
        try:
            return retrying(self._load_once, rows, load_key, outcome, withdraw)
        except StoreLoadFailed as exc:
            failure = StoreLoadFailed(self.scrub(str(exc)))
        except Exception as exc:  # pylint: disable=broad-except  # scrubbed, never chained
            failure = _failure(exc, self._dsn, f"store load {load_key} failed")
        raise failure

    def _load_once(self, rows: LoadRows, load_key: str, outcome: str,
                   withdraw: list[str]) -> StoreLoad:
        from psycopg import sql
        from psycopg.types import TypeInfo
        from psycopg.types.json import Jsonb

        started = time.perf_counter()
        vectors_table, chunks_table = _tables(self.settings)
        schema = self.settings.schema_name
        loads = _ident(schema, f"{self.settings.table}_loads")
        conn = self._open()
        with conn:
            # One load at a time per table: concurrent upserts of the same articles would
            # deadlock, and concurrent CREATE ... IF NOT EXISTS can collide.
            lock = sql.SQL("SELECT pg_advisory_xact_lock(hashtext({}))").format(
                sql.Literal(f"newsvec-store:{schema}.{self.settings.table}"))
            with conn.transaction():
                self._bound(conn)
                conn.execute(lock)
                for statement in _create_statements(self.settings, rows.dim, rows.vector_dtype):
                    conn.execute(statement)
                self._add_columns(conn)
            pgvector_type = self._embedding_type(conn, rows)
            info = TypeInfo.fetch(conn, pgvector_type)
            if info is None:
                raise StoreLoadFailed("the store's database has no pgvector (CREATE EXTENSION "
                                      "vector)")
            info.register(conn)
            conn.adapters.register_dumper(np.ndarray, _vector_dumper(info.oid, pgvector_type))
            keep, rejected = self._check(rows, pgvector_type == "halfvec")  # before the lock
            groups = _chunk_groups(rows)
            with conn.transaction():
                self._bound(conn)
                conn.execute(lock)
                prior = conn.execute(sql.SQL(
                    "SELECT rows, chunk_rows, outcome, rejected FROM {} WHERE load_key = %s")
                    .format(loads), (load_key,)).fetchone()
                if prior is not None and prior[2] == outcome:
                    return StoreLoad(load_key, prior[0], prior[1], 0, True,
                                     time.perf_counter() - started, tuple(prior[3] or ()))
                withdrawn = 0
                if prior is not None:  # the same load with another outcome: a redo
                    withdrawn = self._withdraw(conn, load_key, withdraw)
                empty = conn.execute(sql.SQL("SELECT NOT EXISTS (SELECT 1 FROM {})").format(
                    _ident(schema, vectors_table.name))).fetchone()
                index_after = bool(empty and empty[0]) and (
                    rows.vectors.num_rows >= BUILD_INDEX_AFTER_ROWS)
                if not index_after:
                    for table in (vectors_table, chunks_table):
                        conn.execute(_index_statement(self.settings, table, pgvector_type))
                done = _Part()
                self._load_parts(conn, rows, keep, groups, load_key, pgvector_type, done,
                                 rejected)
                if index_after:
                    self._bound(conn, statement_timeout_s=0)  # bounded by the keepalives only
                    if self.settings.index_build_memory_mb is not None:
                        conn.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(
                            sql.Literal(f"{self.settings.index_build_memory_mb}MB")))
                    for table in (vectors_table, chunks_table):
                        conn.execute(_index_statement(self.settings, table, pgvector_type))
                conn.execute(sql.SQL(
                    "INSERT INTO {} (load_key, rows, chunk_rows, articles_current, outcome, "
                    "rejected) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (load_key) DO UPDATE "
                    "SET loaded_at = now(), rows = EXCLUDED.rows, "
                    "chunk_rows = EXCLUDED.chunk_rows, "
                    "articles_current = EXCLUDED.articles_current, "
                    "outcome = EXCLUDED.outcome, rejected = EXCLUDED.rejected").format(loads),
                    (load_key, done.rows, done.chunk_rows, done.current, outcome,
                     Jsonb(rejected)))
            for item in rejected:
                _LOG.warning("store load %s: row %s (text %s) not stored: %s (%s)", load_key,
                             item["id"], item["text_sha256"], item["reason"],
                             self.scrub(item["detail"]))
            return StoreLoad(load_key, done.rows, done.chunk_rows, done.current, False,
                             time.perf_counter() - started, tuple(rejected), withdrawn)

    def _add_columns(self, conn) -> None:
        from psycopg import sql

        for suffix, column, type_ in _ADDED_COLUMNS:
            table = f"{self.settings.table}{suffix}"
            there = conn.execute(
                "SELECT 1 FROM pg_attribute WHERE attrelid = %s::regclass AND attname = %s "
                "AND NOT attisdropped",
                (f'"{self.settings.schema_name}"."{table}"', column)).fetchone()
            if there is None:
                conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                    _ident(self.settings.schema_name, table), _ident(column),
                    sql.SQL(type_)))  # ours (_ADDED_COLUMNS), never input

    def _withdraw(self, conn, load_key: str, ids: list[str]) -> int:
        """Delete the rows (and their chunks) that an earlier load under ``load_key`` wrote and
        that are still current, among ``ids``: found through the primary key, never a scan."""
        from psycopg import sql

        vectors_table, chunks_table = _tables(self.settings)
        schema = self.settings.schema_name
        conn.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s) AND load_key = %s").format(
            _ident(schema, chunks_table.name)), (ids, load_key))
        return conn.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s) AND load_key = %s").format(
            _ident(schema, vectors_table.name)), (ids, load_key)).rowcount

    def _check(self, rows: LoadRows, halfvec: bool) -> tuple[list[int], list[dict]]:
        """The rows that can be sent (indices of ``rows.vectors``), and a rejection for each one
        that cannot (``_problems``), its chunks' problems counted as its own."""
        vectors_table, chunks_table = _tables(self.settings)
        found = _problems(rows.vectors, vectors_table.not_null, halfvec)
        ids = rows.vectors.column("id").to_pylist()
        shas = rows.vectors.column("text_sha256").to_pylist()
        if rows.chunks is not None and rows.chunks.num_rows:
            chunk_found = _problems(rows.chunks, chunks_table.not_null, halfvec)
            bad: dict[tuple, tuple[str, str]] = {}
            chunk_keys = zip(rows.chunks.column("id").to_pylist(),
                             rows.chunks.column("text_sha256").to_pylist(),
                             rows.chunks.column("chunk_index").to_pylist(), strict=True)
            for problem, (doc_id, sha, index) in zip(chunk_found, chunk_keys, strict=True):
                if problem is not None:
                    bad.setdefault((doc_id, sha), (problem[0], f"chunk {index}: {problem[1]}"))
            for i, key in enumerate(zip(ids, shas, strict=True)):
                if found[i] is None and key in bad:
                    found[i] = bad[key]
        keep = [i for i, problem in enumerate(found) if problem is None]
        rejected = [rejection(ids[i], shas[i], *problem) for i, problem in enumerate(found)
                    if problem is not None]
        return keep, rejected

    def _load_parts(self, conn, rows: LoadRows, keep: list[int], groups: dict, load_key: str,
                    pgvector_type: str, done: _Part, rejected: list[dict]) -> None:
        """Load the rows ``keep`` (and their chunks), each part in a savepoint: when the server
        refuses a part for its data (``is_data_error``), the part is rolled back and halved, down
        to the single rows it refuses, which are set aside in ``rejected``."""
        if not keep:
            return
        failure = None
        try:
            with conn.transaction():  # a savepoint
                part = self._load_part(conn, rows, keep, groups, load_key, pgvector_type)
            done.rows += part.rows
            done.chunk_rows += part.chunk_rows
            done.current += part.current
            return
        except Exception as exc:  # pylint: disable=broad-except  # sorted just below
            if not is_data_error(exc) or is_transient(exc):
                raise
            failure = exc
        if len(keep) == 1:
            i = keep[0]
            sqlstate = getattr(getattr(failure, "diag", None), "sqlstate", None)
            rejected.append(rejection(
                rows.vectors.column("id")[i].as_py(), rows.vectors.column("text_sha256")[i].as_py(),
                Refusal.REFUSED, self.scrub(f"{sqlstate or ''} {type(failure).__name__}: "
                                            f"{failure}".strip())))
            return
        middle = len(keep) // 2
        for half in (keep[:middle], keep[middle:]):
            self._load_parts(conn, rows, half, groups, load_key, pgvector_type, done, rejected)

    def _load_part(self, conn, rows: LoadRows, keep: list[int], groups: dict, load_key: str,
                   pgvector_type: str) -> _Part:
        """Stage and upsert the rows ``keep``; the articles whose row it wrote (the upsert's
        ``RETURNING``: no scan of the table) get these rows' chunks of the same version, and only
        them."""
        from psycopg import sql

        vectors_table, chunks_table = _tables(self.settings)
        schema = self.settings.schema_name
        every = len(keep) == rows.vectors.num_rows
        vectors = rows.vectors if every else rows.vectors.take(pa.array(keep, pa.int64()))
        won = self._upsert(conn, vectors_table, vectors, rows, load_key, pgvector_type)
        part = _Part(rows=vectors.num_rows, current=len(won))
        if not won:
            return part
        won_ids = sorted({doc_id for doc_id, _ in won})
        conn.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(
            _ident(schema, chunks_table.name)), (won_ids,))
        if rows.chunks is not None and rows.chunks.num_rows:
            wanted = set(won)
            chunk_indices = sorted({c for key in wanted for c in groups.get(key, ())})
            if chunk_indices:
                chunks = rows.chunks.take(pa.array(chunk_indices, pa.int64()))
                part.chunk_rows = self._copy_chunks(conn, chunks_table, chunks, rows, load_key,
                                                    pgvector_type, sorted(wanted))
        return part

    def _stage(self, conn, table: _Table, data: pa.Table, rows: LoadRows, load_key: str,
               pgvector_type: str) -> str:
        """COPY (binary) ``data`` into a temporary table like ``table``; returns its name (dropped
        by the caller's part, or at commit)."""
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
                pgvector_type: str) -> list[tuple[str, str]]:
        """Stage the articles' rows and upsert them: a row replaces the stored one only if it is a
        later version (``version_order``); of two versions of one article in the rows, the later
        one. Returns (id, text_sha256) of the rows written."""
        from psycopg import sql

        stage = self._stage(conn, table, data, rows, load_key, pgvector_type)
        names = [name for name, _ in table.column_types(rows.dim)]
        target = _ident(self.settings.schema_name, table.name)
        statement = sql.SQL(
            "INSERT INTO {target} AS t ({cols}) SELECT DISTINCT ON ({key}) {cols} FROM {stage} "
            "ORDER BY {key}, {latest} "
            "ON CONFLICT ({key}) DO UPDATE SET {updates} "
            "WHERE {excluded} > {stored} RETURNING t.id, t.text_sha256").format(
                target=target, stage=_ident(stage),
                cols=sql.SQL(", ").join(_ident(n) for n in names),
                key=sql.SQL(", ").join(_ident(k) for k in table.key),
                latest=_latest_first(),
                excluded=version_order("excluded"), stored=version_order("t"),
                updates=sql.SQL(", ").join(sql.SQL("{} = EXCLUDED.{}").format(_ident(n), _ident(n))
                                           for n in names if n not in table.key))
        won = [(r[0], r[1]) for r in conn.execute(statement).fetchall()]
        conn.execute(sql.SQL("DROP TABLE {}").format(_ident(stage)))
        return won

    def _copy_chunks(self, conn, table: _Table, data: pa.Table, rows: LoadRows, load_key: str,
                     pgvector_type: str, versions: list[tuple[str, str]]) -> int:
        """Insert the chunks of the article versions ``versions`` (id, text_sha256): the chunks
        of the version kept, never another version's."""
        from psycopg import sql

        stage = self._stage(conn, table, data, rows, load_key, pgvector_type)
        names = sql.SQL(", ").join(_ident(n) for n, _ in table.column_types(rows.dim))
        written = conn.execute(sql.SQL(
            "INSERT INTO {} ({}) SELECT DISTINCT ON (s.id, s.chunk_index) {} FROM {} s "
            "JOIN unnest(%s::text[], %s::text[]) AS v(id, text_sha256) "
            "ON s.id = v.id AND s.text_sha256 = v.text_sha256 "
            "ORDER BY s.id, s.chunk_index, s.embedded_at DESC").format(
                _ident(self.settings.schema_name, table.name), names,
                sql.SQL(", ").join(sql.SQL("s.{}").format(_ident(n))
                                   for n, _ in table.column_types(rows.dim)),
                _ident(stage)),
            ([v[0] for v in versions], [v[1] for v in versions])).rowcount
        conn.execute(sql.SQL("DROP TABLE {}").format(_ident(stage)))
        return written

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
    failure = None
    try:
        return Store(settings)
    except StoreError as exc:
        failure = StoreLoadFailed(str(exc))
    raise failure  # outside the except: nothing chained

"""The vector store beside the Parquet: PostgreSQL with pgvector (docs/store.md).

A batch run that has committed its Parquet, and each streaming micro-batch once its files are
written, is loaded into ``<schema>.<table>`` (one row per article, the ``vectors/`` columns) and, in
chunks mode, ``<table>_chunks`` (one row per chunk), both with an HNSW index (cosine). A load
stages its rows by binary COPY into temporary tables of its session (before it takes the table's
lock), then, in one transaction under that lock: an upsert that keeps each article's current
version (``schema.VERSION_ORDER``: ``updated_at``, ``published_at``, the day ``dt``, the Pub/Sub
publish time, then ``embedded_at``, each later wins), and a row under its load key in
``<table>_loads`` with the load's outcome (a digest of the article versions it was given): a load
whose key is there with the same outcome changes nothing, so a retried or repeated load is a
no-op; one with another outcome (a streaming micro-batch redone, a row this time where it was a
dead letter) first withdraws the rows the earlier load wrote, bringing back the versions they
had replaced, then loads its own. A batch run's load (``BatchOutput``) likewise first withdraws
the rows of the previous run's load of the same output, whose files the run replaced. To that
end every load keeps what it replaces (and the versions that lose to its rows) in
``<table>_superseded`` and ``<table>_chunks_superseded`` for ``superseded_keep_days``.

Errors are of two kinds. Transient ones (the database down, failing over or read-only for a
moment, a lock or statement timeout, a serialization failure) are retried with backoff for
``retry_s``. Data errors never succeed on retry: rows that cannot be stored (a NUL character, a
non-finite vector, a timestamp out of range, or any row the server refuses) are set aside with
their reason (``StoreLoad.rejected``), the rest of the load commits; but a load the server
refuses more than ``max(3, 10%)`` of the rows of fails (the table's or the database's problem),
as does a load into a database whose encoding is not UTF8.

Every load bounds its waits: ``lock_timeout_s`` for the table's lock, ``statement_timeout_s`` for
each statement (and for finding the rows the server refuses), ``lock_timeout_s`` again for a
session idle inside its transaction (the server ends it), and TCP keepalives and
``tcp_user_timeout`` on both ends end a connection whose other end vanished. The rows are sent
before the table's lock is taken; under it, each statement runs on the server from the staged
rows, so a client that freezes there holds the table for at most ``lock_timeout_s``.

Nothing resolves through the session's ``search_path``: each connection sets ``SEARCH_PATH``
(``pg_catalog, pg_temp``), the tables are named with their schema, and pgvector's type, operator
and operator classes with the extension's schema (``pgvector_schema``), so that no object another
role named like one of them, in a schema earlier on the path, is ever picked.

Every load and every read (``Store.connect``) first checks that each table and index of the
store, and each trigger's function on them, is owned by a role the connection trusts (itself, a
role it is a member of, a superuser, or ``table_owner``), and refuses the store otherwise: a role
that may create in the store's schema could have made the tables before the owner's first load
(``CREATE TABLE IF NOT EXISTS`` would find them there), and their triggers would run with the
loader's rights (``_refuse_foreign``).

The connection string (DSN) never comes from the config file: it is read at run time from the
Secret Manager secret ``store.dsn_secret``, the secret file ``store.dsn_file`` or the environment
variable ``store.dsn_env``, and it is scrubbed from every message this module logs or raises (and
from psycopg's own log records).
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime as dt
import functools
import logging
import math
import os
import re
import struct
import threading
import time
import urllib.parse
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    Iterable,
    Iterator,
    Literal,
    Optional,
    Sequence,
)

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from transforms.output.parquet import (
    CHUNK_COLUMNS,
    NULLABLE_IN_ORDER,
    STORY_COLUMNS,
    VECTOR_COLUMNS,
    VERSION_ORDER,
    Column,
)
from transforms.settings import VectorDtype
from transforms.stores.base import (  # noqa: F401  # the contract's values, also named from here
    REJECTED_FIELDS,
    ROW_FIELDS,
    BatchOutput,
    LoadRows,
    StoreError,
    StoreLoad,
    StoreLoadFailed,
)
from transforms.stores.base import printable as _printable

if TYPE_CHECKING:
    import psycopg

_LOG = logging.getLogger("newsvec.store")

# A PostgreSQL identifier that needs no quoting (quoted all the same, with sql.Identifier), short
# enough that the names derived from the table (``_chunks_embedding_hnsw``...) fit in 63 bytes.
IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,39}")
BUILD_INDEX_AFTER_ROWS = 10_000  # a first load this large into an empty table indexes after
# A load of this many rows into a table that has no planner statistics yet (a first load; the
# autovacuum's ANALYZE comes later) analyzes it: without them, the planner of the next loads'
# joins on ``id`` cannot tell a few index lookups from a scan of the whole table.
ANALYZE_AFTER_ROWS = 1000

# TCP keepalives on both ends of a load's connection: a peer that vanished (its machine gone, the
# network cut, no FIN) is found within about idle + interval x count = 25 s, instead of the
# kernel's default of over two hours, and its session ends, releasing the table's lock.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
# Keepalives are not sent while data the peer has not acknowledged is outstanding (a COPY's rows, a
# result), and the kernel retransmits such data for about 15 minutes: ``tcp_user_timeout`` (both
# ends) ends the connection once sent data has gone unacknowledged this long.
TCP_USER_TIMEOUT_MS = 30_000
# PostgreSQL 14+: a running statement checks this often that its client is still there.
CLIENT_CHECK_INTERVAL_MS = 5000
# Every store connection's search_path: the built-in catalog, then the session's own temporary
# tables (never searched for functions or operators). No schema another role can create in is on
# it, so no object someone else names like a built-in (``public.<=>``, a ``"$user".vector``, a
# ``pg_advisory_xact_lock(integer)`` that matches better than the built-in's ``bigint``) is ever
# picked (CVE-2018-1058). The store's tables are named with their schema, pgvector's type,
# operators and operator classes with the extension's schema (``pgvector_schema``).
SEARCH_PATH = "pg_catalog, pg_temp"


REFUSED_SHARE, REFUSED_AT_LEAST = 0.10, 3
"""A load the server refuses more than ``max(REFUSED_AT_LEAST, REFUSED_SHARE x its rows)`` rows of
fails (``StoreLoadFailed``): so many refusals are the table's or the database's problem (a
constraint or trigger every row fails), not the rows'."""

_clock = time.monotonic  # the isolation's deadline (tests replace it)


def _identifier(value: str) -> str:
    if not IDENTIFIER.fullmatch(value):
        raise ValueError(f"{value!r} is not a plain SQL identifier ({IDENTIFIER.pattern})")
    return value


class StoreSettings(BaseModel):
    """The ``store:`` section of a config: where vectors are also loaded, and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    DSN_SOURCES: ClassVar[tuple[str, ...]] = ("dsn_secret", "dsn_file", "dsn_env")
    """The keys that name where the connection string is read: a config that ``extends:``
    another and names one of them replaces all of the parent's (``pipeline.config``)."""

    kind: Literal["pgvector"] = Field(
        "pgvector", description="the store's backend (`transforms/stores/`): `pgvector`, "
                                "PostgreSQL with pgvector")
    enabled: bool = Field(False, description="load every committed batch run and every streaming "
                                             "micro-batch into PostgreSQL + pgvector "
                                             "(docs/store.md)")
    dsn_env: str = Field("NEWSVEC_STORE_DSN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                         description="the environment variable that holds the connection string "
                                     "(never the config file)")
    dsn_file: Optional[str] = Field(
        None, description="a file that holds the connection string instead (a mounted secret); "
                          "wins over `dsn_env`")
    dsn_secret: Optional[str] = Field(
        None, pattern=r"^projects/[^/\s]+/secrets/[A-Za-z0-9_-]{1,255}/versions/(latest|[0-9]+)$",
        description="a Secret Manager secret version that holds the connection string instead "
                    "(`projects/P/secrets/S/versions/latest`), read at run time with the "
                    "machine's credentials (on Dataflow: the worker service account, which needs "
                    "`roles/secretmanager.secretAccessor` on it); wins over `dsn_file` and "
                    "`dsn_env`")
    schema_name: str = Field("public", description="the schema of the tables (an SQL identifier: "
                                                   "`[a-z_][a-z0-9_]*`)")
    table: str = Field("news_vectors", description="the articles' table; `<table>_chunks` and "
                                                   "`<table>_loads` beside it (an SQL identifier, "
                                                   "at most 40 characters)")
    table_owner: Optional[str] = Field(
        None, min_length=1, max_length=63, pattern=r"^[^\x00-\x1f\x7f]+$",
        description="the role that owns the store's tables, where the connection's role (the "
                    "DSN's user) neither is it nor is a member of it: a loader that owns nothing "
                    "(docs/store.md, \"Roles and privileges\"). A table or index of the store, "
                    "or a trigger's function on one, owned by any role but this one, the "
                    "connection's role, a role it is a member of or a superuser is refused (a "
                    "role that may create in the schema could have made them first)")
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
        60, ge=1, le=86400,
        description="how long (1 s at least) one try of a load waits for the table's lock "
                    "(another load holds it) or any other lock; then the try fails and is retried "
                    "within `retry_s`. "
                    "Also how long a load's session may sit idle inside its transaction before the "
                    "server ends it (a loader that stalled or vanished releases the table)")
    statement_timeout_s: float = Field(
        1800, ge=1, le=86400,
        description="the longest (1 s at least) one statement of a load may run (the COPY, the "
                    "upsert); then the try fails and is retried within `retry_s`. Raise it for "
                    "batch loads of "
                    "millions of rows into an indexed table. Also how long a load may spend "
                    "finding the rows the server refuses. The HNSW index build after a first "
                    "large load is not bounded by it")
    superseded_keep_days: float = Field(
        7, gt=0, le=3650,
        description="how long the store keeps an article's version that a load replaced (or "
                    "that lost to a load's row), so that a redo of a streaming micro-batch with "
                    "another outcome, or a rerun of a batch output that no longer holds the "
                    "article, can bring it back; later than this, the article is left without a "
                    "row (docs/store.md says what reports it)")

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
                  "postgresql:// URL, write a % in the password as %25, a / as %2F and an @ as "
                  "%40)")


SECRET_MANAGER_URL = "https://secretmanager.googleapis.com/v1/{name}:access"
SECRET_ACCESS_TIMEOUT_S = 30


def _access_secret(name: str) -> str:
    """The payload of the Secret Manager secret version ``name`` (its REST API, with the
    application default credentials); ``StoreError`` when it cannot be read. Nothing of the
    payload is in a message, and no exception is chained."""
    import base64

    failure: Optional[str] = None
    try:
        import google.auth
        from google.auth.transport.requests import AuthorizedSession

        credentials, _ = google.auth.default(
            scopes=["https://www.googleapis.com/auth/cloud-platform"])
        response = AuthorizedSession(credentials).get(SECRET_MANAGER_URL.format(name=name),
                                                      timeout=SECRET_ACCESS_TIMEOUT_S)
    except Exception as exc:  # pylint: disable=broad-except  # no credentials, no route
        failure = f"{type(exc).__name__}: {exc}"
    if failure is not None:
        raise StoreError(f"store.dsn_secret: cannot read {name} ({failure})")
    if response.status_code != 200:
        try:  # Google's error body: its message names the missing permission, never the payload
            reason = str(response.json()["error"]["message"])[:300]
        except Exception:  # pylint: disable=broad-except  # not JSON
            reason = response.reason or ""
        raise StoreError(f"store.dsn_secret: cannot read {name} (HTTP {response.status_code}: "
                         f"{reason})")
    dsn = None
    try:
        dsn = base64.b64decode(response.json()["payload"]["data"]).decode("utf-8").strip()
    except Exception:  # pylint: disable=broad-except  # the body is the secret: never quoted
        pass
    if dsn is None:
        raise StoreError(f"store.dsn_secret: {name} is not a UTF-8 secret payload")
    if not dsn:
        raise StoreError(f"store.dsn_secret: {name} is empty")
    return dsn


def resolve_dsn(settings: StoreSettings) -> str:
    """The connection string, from the Secret Manager secret ``dsn_secret``, the file
    ``dsn_file`` or the environment variable ``dsn_env`` (the first one set)."""
    if settings.dsn_secret:
        return _access_secret(settings.dsn_secret)
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


_URL = re.compile(r"postgres(?:ql)?://", re.IGNORECASE)


def _misread_url(dsn: str) -> bool:
    """A ``postgresql://`` URL whose user and password libpq would not read as written: an ``@``
    after a ``/``, or two ``@``, before the query (a ``/`` or ``@`` of the password not
    percent-encoded). libpq then takes the user for the host, the password's parts for the port
    and the database name, or part of it for a host: the password would show where a port or a
    database name is named, and nothing would scrub it."""
    if not _URL.match(dsn):
        return False
    before_query = dsn.split("://", 1)[1].split("?", 1)[0]
    authority, _, path = before_query.partition("/")
    return "@" in path or authority.count("@") > 1


def _parsed(dsn: str) -> Optional[dict]:
    """libpq's reading of the DSN, or None when it cannot be parsed, or when it is a URL libpq
    would misread (``_misread_url``)."""
    from psycopg.conninfo import conninfo_to_dict

    if _misread_url(dsn):
        return None
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


@functools.lru_cache(maxsize=64)
def _secrets(dsn: str) -> tuple[str, ...]:
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
    return tuple(sorted(secrets, key=len, reverse=True))


def scrub(text: str, dsn: str) -> str:
    """``text`` without the connection string or any of its secret-bearing parts (password,
    ``sslpassword``, user, hosts: ``_secrets``)."""
    for secret in _secrets(dsn):
        text = text.replace(secret, "***")
    return text


class _ScrubbedDriverLog(logging.Filter):
    """On the ``psycopg`` logger: its records scrubbed (``scrub``) of every connection string a
    ``Store`` of this process holds. At DEBUG psycopg names each host (and port) it tries and each
    it cannot resolve, a second host of a multi-host DSN included, and quotes libpq's messages;
    its warnings name a connection (its host, user and database)."""

    def __init__(self) -> None:
        super().__init__()
        self._dsns: tuple[str, ...] = ()  # replaced whole: a thread reads a consistent tuple
        self._lock = threading.Lock()

    def add(self, dsn: str) -> None:
        with self._lock:
            if dsn not in self._dsns:
                self._dsns = (*self._dsns, dsn)

    def filter(self, record: logging.LogRecord) -> bool:
        dsns = self._dsns
        if not dsns:
            return True
        try:
            text = record.getMessage()
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
        except Exception:  # pylint: disable=broad-except  # never raise into psycopg's call
            record.msg, record.args, record.exc_info, record.exc_text = (
                "(a psycopg log record that could not be formatted)", (), None, None)
            return True
        exc_text = record.exc_text
        for dsn in dsns:
            text = scrub(text, dsn)
            exc_text = scrub(exc_text, dsn) if exc_text else exc_text
        record.msg, record.args, record.exc_text = text, (), exc_text
        return True


_DRIVER_LOG = _ScrubbedDriverLog()
logging.getLogger("psycopg").addFilter(_DRIVER_LOG)


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


def _type_sql(type_: str, pgvector_schema: str):
    """``type_`` (``_sql_type``'s) as SQL: pgvector's ``vector(dim)`` and ``halfvec(dim)`` named
    with the extension's schema (``"ext"."vector"(8)``), the built-in types as they are (the
    search path is ``pg_catalog`` only: ``SEARCH_PATH``)."""
    from psycopg import sql

    name, paren, size = type_.partition("(")
    if paren and name in _PGVECTOR_TYPES.values():
        return sql.SQL("{}({})").format(sql.Identifier(pgvector_schema, name),
                                        sql.SQL(str(int(size.rstrip(")")))))
    return sql.SQL(type_)  # ours (_sql_type, _ADDED_COLUMNS), never input


def pgvector_schema(conn) -> Optional[str]:
    """The schema pgvector is installed in (``pg_extension.extnamespace``), None when it is not
    installed in the connection's database: every name of pgvector is qualified with it."""
    row = conn.execute(
        "SELECT n.nspname::text FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace n "
        "ON n.oid = e.extnamespace WHERE e.extname = 'vector'").fetchone()
    return None if row is None else str(row[0])


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
    if pa.types.is_float32(type_):
        return "real"
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
                       vector_dtype: VectorDtype = "float32",
                       pgvector_schema: str = "public") -> list:
    """Every statement that creates the store's schema and main tables, in order, pgvector being
    (or to be created) in ``pgvector_schema`` (tests use them; a load issues only those the
    catalog lacks: ``_missing_ddl``)."""
    return [statement for _, statement in _main_ddl(settings, dim, vector_dtype,
                                                    pgvector_schema)]


def _main_ddl(settings: StoreSettings, dim: int, vector_dtype: VectorDtype = "float32",
              pgvector_schema: Optional[str] = None) -> list[tuple[str, Any]]:
    """(what the catalog must hold, the statement that creates it): ``schema:<name>``,
    ``extension:vector`` (created, where it is missing, in ``pgvector_schema``, by default the
    store's schema: the search path names no schema to create it in), then a table's name, for
    the three main tables, their ``embedding`` of pgvector's type in ``pgvector_schema``."""
    from psycopg import sql

    schema = settings.schema_name
    pgvector_schema = pgvector_schema or schema
    out: list[tuple[str, Any]] = [
        (f"schema:{schema}", sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(_ident(schema))),
        ("extension:vector", sql.SQL("CREATE EXTENSION IF NOT EXISTS vector SCHEMA {}").format(
            _ident(pgvector_schema)))]
    for table in _tables(settings):
        columns = [sql.SQL("{} {}{}").format(
            _ident(name), _type_sql(type_, pgvector_schema),
            sql.SQL(" NOT NULL") if name in table.key or name in ("dt", "embedding", "load_key",
                                                                  "embedded_at") else sql.SQL(""))
            for name, type_ in table.column_types(dim, vector_dtype)]
        columns.append(sql.SQL("PRIMARY KEY ({})").format(
            sql.SQL(", ").join(_ident(k) for k in table.key)))
        out.append((table.name, sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
            _ident(schema, table.name), sql.SQL(", ").join(columns))))
    out.append((f"{settings.table}_loads", sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (load_key text PRIMARY KEY, loaded_at timestamptz NOT NULL "
        "DEFAULT now(), rows integer NOT NULL, chunk_rows integer NOT NULL, "
        "articles_current integer NOT NULL, outcome text, "
        "rejected jsonb NOT NULL DEFAULT '[]', withdrawn jsonb NOT NULL DEFAULT '[]', "
        "output text, run_id text)").format(
            _ident(schema, f"{settings.table}_loads"))))
    return out


def _kept_ddl(settings: StoreSettings) -> list[tuple[str, Any]]:
    """``<table>_superseded`` and ``<table>_chunks_superseded``: the versions of articles (and
    their chunks) that a load replaced, or that lost to another load's row, keyed by the load
    that would bring them back if it were withdrawn (``withdrawn_with``: the load that replaced
    them, or the one whose row they lost to), the article and the version's own load key
    (``Store._withdraw``). Pruned by ``saved_at`` (``store.superseded_keep_days``). Created like
    the tables they keep rows of, after those have every column (``_missing_ddl``)."""
    from psycopg import sql

    schema = settings.schema_name
    out: list[tuple[str, Any]] = []
    for table in _tables(settings):
        kept = _ident(schema, f"{table.name}_superseded")
        key = ["withdrawn_with", "id", "load_key", *table.key[1:]]
        out.append((f"{table.name}_superseded", sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (LIKE {}, withdrawn_with text NOT NULL, "
            "saved_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY ({}))").format(
                kept, _ident(schema, table.name), sql.SQL(", ").join(map(_ident, key)))))
    return out


def _index_ddl(settings: StoreSettings) -> list[tuple[str, Any]]:
    """The B-tree indexes (the HNSW ones: ``_index_statement``): the kept versions by article,
    by age (pruning) and by their own load (a rerun withdrawing a replaced run's versions);
    ``<table>_loads`` by age and by batch output; the articles' table by load (a rerun finding
    the rows of the run it replaces)."""
    from psycopg import sql

    schema, name = settings.schema_name, settings.table
    out: list[tuple[str, Any]] = []

    def index(index_name: str, table: str, columns: str, where: str = "") -> None:
        out.append((index_name, sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} ({}){}").format(
            _ident(index_name), _ident(schema, table), sql.SQL(columns),  # ours, never input
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
_ADDED_COLUMNS = (("", "updated_at", "timestamptz"), ("_loads", "outcome", "text"),
                  ("_loads", "rejected", "jsonb NOT NULL DEFAULT '[]'"),
                  ("_loads", "withdrawn", "jsonb NOT NULL DEFAULT '[]'"),
                  ("_loads", "output", "text"), ("_loads", "run_id", "text"),
                  # 0.4: every row's story (``schema.STORY_COLUMNS``), null in rows loaded before
                  *((suffix, column.name, _sql_type(column, 0))
                    for suffix in ("", "_chunks", "_superseded", "_chunks_superseded")
                    for column in STORY_COLUMNS))


@dataclasses.dataclass(frozen=True)
class _Catalog:
    """What the store's catalog holds of ours, read in one query: the schema pgvector is in (None:
    not installed), whether the store's schema is there, the tables and indexes (by name, in the
    schema), and the columns of the tables (``table.column``)."""

    pgvector_schema: Optional[str]
    schema: bool
    relations: frozenset
    columns: frozenset
    unanalyzed: frozenset = frozenset()  # main tables with no planner statistics (reltuples <= 0)
    # (name, owner) of the tables and indexes of ours whose owner the load does not trust, and
    # (table, trigger, function's owner) of the triggers on them that run an untrusted role's
    # function (``_TRUSTED``)
    foreign: tuple = ()
    foreign_triggers: tuple = ()

    def has(self, what: str) -> bool:
        if what == "extension:vector":
            return self.pgvector_schema is not None
        if what.startswith("schema:"):
            return self.schema
        return what in self.relations


# Whether the role of oid ``{x}`` may own the store's objects, in the eyes of the load's role
# (``me``: current_user): that role itself, a role it is a member of (``pg_has_role``; for a
# superuser it is true of every role, so it is not asked for one), a superuser (who can
# run anything as anyone already), or the role ``store.table_owner`` names. Anyone else who may
# create in the store's schema could have made a table under one of its names before the owner
# did: its triggers, rules, policies, defaults and indexes run with the rights of whoever writes
# to it, and its owner reads every row (CVE-2018-1058's kind, with the table itself as bait).
_TRUSTED = (
    "EXISTS (SELECT 1 FROM pg_catalog.pg_roles o, me WHERE o.oid = {x} AND (o.oid = me.oid "
    "OR o.rolsuper OR (NOT me.rolsuper AND pg_catalog.pg_has_role(me.oid, o.oid, 'MEMBER')) "
    "OR o.rolname = %(table_owner)s))")


def _read_catalog(conn, settings: StoreSettings) -> _Catalog:
    """The catalog's view of the store's objects (``pg_extension``, ``pg_namespace``,
    ``pg_class``, ``pg_attribute``): no lock of any table is taken, so a load that finds
    everything in place issues no DDL, and waits for nothing a VACUUM, an ANALYZE or a
    ``CREATE INDEX CONCURRENTLY`` holds (a ``CREATE INDEX IF NOT EXISTS`` takes the table's SHARE
    lock before it finds the index there). It also lists what of the store another role owns
    (``_Catalog.foreign``: ``_refuse_foreign``)."""
    name = settings.table
    tables = [table.name for table in _tables(settings)] + [
        f"{name}_loads", f"{name}_superseded", f"{name}_chunks_superseded"]
    relations = tables + [n for n, _ in _index_ddl(settings)] + [
        f"{table.name}_embedding_hnsw" for table in _tables(settings)]
    row = conn.execute(
        "WITH me AS (SELECT oid, rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) "
        "SELECT (SELECT n.nspname::text FROM pg_catalog.pg_extension e "
        "JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'vector'), "
        "EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s), "
        "ARRAY(SELECT c.relname::text FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s "
        "AND c.relname = ANY(%(relations)s)), "
        "ARRAY(SELECT c.relname || '.' || a.attname FROM pg_catalog.pg_attribute a "
        "JOIN pg_catalog.pg_class c ON c.oid = a.attrelid "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %(schema)s AND c.relname = ANY(%(tables)s) AND a.attnum > 0 "
        "AND NOT a.attisdropped), "
        "ARRAY(SELECT c.relname::text FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s "
        "AND c.relname = ANY(%(main)s) AND c.reltuples <= 0), "
        "ARRAY(SELECT ARRAY[c.relname::text, pg_catalog.pg_get_userbyid(c.relowner)::text] "
        "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %(schema)s AND c.relname = ANY(%(relations)s) "
        "AND NOT " + _TRUSTED.format(x="c.relowner") + " ORDER BY c.relname), "
        "ARRAY(SELECT ARRAY[c.relname::text, t.tgname::text, CASE WHEN " +
        _TRUSTED.format(x="p.proowner") + " THEN 'a WHEN clause, which may call any role''s "
        "function' ELSE 'its function owned by the role ' || "
        "pg_catalog.pg_get_userbyid(p.proowner)::text END] FROM pg_catalog.pg_trigger t "
        "JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid "
        "WHERE n.nspname = %(schema)s AND c.relname = ANY(%(tables)s) AND NOT t.tgisinternal "
        "AND (t.tgqual IS NOT NULL OR NOT " + _TRUSTED.format(x="p.proowner") + ") "
        "ORDER BY c.relname, t.tgname)",
        {"schema": settings.schema_name, "relations": relations, "tables": tables,
         "main": tables[:2], "table_owner": settings.table_owner}).fetchone()
    return _Catalog(row[0], bool(row[1]), frozenset(row[2]),
                    frozenset(tuple(c.split(".", 1)) for c in row[3]), frozenset(row[4]),
                    tuple(tuple(r) for r in row[5]), tuple(tuple(r) for r in row[6]))


def _refuse_foreign(settings: StoreSettings, catalog: _Catalog,
                    error: type[StoreError] = StoreLoadFailed) -> None:
    """``error`` (never retried: no later try gets past it) naming the first table or index of
    the store that a role the load does not trust owns (``_TRUSTED``), or the first trigger on a
    table of the store that runs such a role's function; nothing when there is none. Called on
    each reading of the catalog, before anything is written to or read from the store's tables:
    a table someone else made under one of its names before the owner's first load (``CREATE
    TABLE IF NOT EXISTS`` finds it there) would run its owner's code with this role's rights at
    the first write (a trigger, a default) or read (a policy, a view); a trigger another role
    added (the owner granted it ``TRIGGER``, or ``ALL``) likewise."""
    schema = settings.schema_name
    named = ("store.table_owner" if settings.table_owner is None
             else f"store.table_owner ({_printable(settings.table_owner)})")
    if catalog.foreign:
        name, owner = (_printable(x) for x in catalog.foreign[0])
        more = (f" (and {len(catalog.foreign) - 1} more of its tables and indexes)"
                if len(catalog.foreign) > 1 else "")
        raise error(
            f"the store's {schema}.{name}{more} is owned by the role {owner}, which is neither "
            f"this connection's role, a role it is a member of, a superuser nor {named}: "
            "refused before anything is written to or read from it (a role that may create in "
            "the schema can make the store's tables before its owner does; their triggers would "
            "run with this role's rights, and their owner reads every row). If "
            f"{owner} is the store's owner, set store.table_owner to it; else have it (or a "
            "superuser) drop them, and let the owner's next load create them (docs/store.md, "
            "\"Roles and privileges\")")
    if catalog.foreign_triggers:
        table, trigger, why = (_printable(x) for x in catalog.foreign_triggers[0])
        raise error(
            f"the store's table {schema}.{table} has the trigger {trigger}, with {why}: neither "
            f"this connection's role, a role it is a member of, a superuser nor {named} is known "
            "to have written what it runs, so it is refused before anything is written (the "
            "trigger would run with this role's rights; a role granted TRIGGER on the table can "
            "add one). Drop the trigger (a condition belongs inside a trusted role's trigger "
            "function, not in WHEN), and revoke TRIGGER on the store's tables from every role "
            "but their owner (docs/store.md, \"Roles and privileges\")")


def _missing_ddl(settings: StoreSettings, catalog: _Catalog, dim: int,
                 vector_dtype: VectorDtype = "float32") -> list:
    """The statements that create what ``catalog`` lacks, in order: the schema, pgvector (in the
    store's schema), the main tables (pgvector's type named with its schema), the columns a newer
    release added to tables that are there, the kept versions' tables (like the main ones, with
    every column by then), the B-tree indexes. Empty when everything is there: nothing to lock."""
    from psycopg import sql

    schema, name = settings.schema_name, settings.table
    out = [s for what, s in _main_ddl(settings, dim, vector_dtype, catalog.pgvector_schema)
           if not catalog.has(what)]

    def columns(suffixes: Sequence[str]) -> None:
        for suffix, column, type_ in _ADDED_COLUMNS:
            table = f"{name}{suffix}"
            if suffix in suffixes and catalog.has(table) and (table, column) not in \
                    catalog.columns:
                out.append(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                    _ident(schema, table), _ident(column),
                    sql.SQL(type_)))  # ours (_ADDED_COLUMNS), never input

    columns(("", "_chunks", "_loads"))
    out += [s for what, s in _kept_ddl(settings) if not catalog.has(what)]
    columns(("_superseded", "_chunks_superseded"))
    out += [s for what, s in _index_ddl(settings) if not catalog.has(what)]
    return out


def _index_statement(settings: StoreSettings, table: _Table, pgvector_type: str,
                     pgvector_schema: str):
    """The HNSW index of ``table``, with pgvector's operator class in its own schema."""
    from psycopg import sql

    if pgvector_type not in _PGVECTOR_TYPES.values():  # ours, never input
        raise ValueError(pgvector_type)
    return sql.SQL(
        "CREATE INDEX IF NOT EXISTS {} ON {} USING hnsw (embedding {}) "
        "WITH (m = {}, ef_construction = {})").format(
            _ident(f"{table.name}_embedding_hnsw"), _ident(settings.schema_name, table.name),
            _ident(pgvector_schema, f"{pgvector_type}_cosine_ops"),
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

class Refusal:
    """Why a row cannot be stored (``reason`` of a rejected row): stable codes."""

    NUL = "nul_character"  # PostgreSQL text and jsonb cannot hold U+0000
    NON_FINITE = "non_finite_vector"  # pgvector refuses NaN and infinity (float16: over 65504)
    TIMESTAMP = "timestamp_out_of_range"  # outside years 1-9999 UTC
    MISSING = "missing_value"  # null where the table needs a value
    REFUSED = "refused_by_store"  # the server refused it: detail holds its SQLSTATE and message


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


# --- loading -------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Part:
    """What the parts of one load did, summed."""

    rows: int = 0
    chunk_rows: int = 0
    current: int = 0

    def add(self, other: "_Part") -> None:
        self.rows += other.rows
        self.chunk_rows += other.chunk_rows
        self.current += other.current


@dataclasses.dataclass
class _Staged:
    """A load's rows in temporary tables of its session, staged before the table's lock is
    taken: ``vectors`` (the columns of the articles' table, ``rn`` and ``position``) and
    ``chunks`` (the chunks of those rows), both built from ``LoadRows``. The rows are staged in
    the order of their ids, at ``position`` 0, 1, ...; ``rn`` numbers the articles, not the rows
    (a dense rank of the id): every version of one article has the same ``rn``, so no range of
    ``rn`` an isolation tries splits an article's versions (a range with only an older one would
    store it, then lose it to the later one, and a withdrawal could later bring that older one
    back as if it were another load's)."""

    keep: list[int]  # indices in rows.vectors of the rows staged, by id: positions 0, 1, ...
    rank: list[int]  # rn of each position: the dense rank of its id
    names: list[str]  # the articles' table's columns
    chunk_names: list[str]
    vectors: str = "newsvec_stage_vectors"
    chunks: Optional[str] = None  # None: no chunks
    missing: set[int] = dataclasses.field(default_factory=set)  # positions the staging set aside

    @classmethod
    def of(cls, ids: list, keep: list[int], names: list[str], chunk_names: list[str]
           ) -> "_Staged":
        ordered = sorted(keep, key=lambda i: (ids[i], i))
        rank: list[int] = []
        for position, i in enumerate(ordered):
            same = position and ids[ordered[position - 1]] == ids[i]
            rank.append(rank[-1] if same else (rank[-1] + 1 if rank else 0))
        return cls(keep=ordered, rank=rank, names=names, chunk_names=chunk_names)

    @property
    def articles(self) -> int:
        """How many ``rn`` there are: ``rn`` goes from 0 to this (excluded)."""
        return self.rank[-1] + 1 if self.rank else 0

    def positions(self, lo: int, hi: int) -> list[int]:
        """The positions staged (not set aside) with ``lo <= rn < hi``."""
        first = bisect.bisect_left(self.rank, lo)
        last = bisect.bisect_left(self.rank, hi)
        return [p for p in range(first, last) if p not in self.missing]

    def rows_between(self, lo: int, hi: int) -> int:
        return len(self.positions(lo, hi))

    def set_aside(self, conn, rn: int) -> int:
        """Set aside the version of article ``rn`` that the upsert tries (the latest, as its
        ``DISTINCT ON`` orders them), which the server refused: out of the staged rows, so that
        the next try of ``rn`` tries its earlier version, if any. Returns its position."""
        from psycopg import sql

        row = conn.execute(sql.SQL(
            "DELETE FROM {stage} WHERE position = (SELECT position FROM {stage} WHERE rn = %s "
            "ORDER BY {latest}, position LIMIT 1) RETURNING position").format(
                stage=_ident("pg_temp", self.vectors), latest=_latest_first()),
            (rn,)).fetchone()
        position = int(row[0])
        self.missing.add(position)
        return position


class _Isolation:
    """The rows the server refuses of one load, found by halving (``Store._isolate``), and the
    bounds on finding them: more than ``cap`` refusals, or longer than ``budget_s`` from the
    first, fail the load (``StoreLoadFailed``, not transient)."""

    def __init__(self, rows: int, budget_s: float):
        self.rows = rows
        self.cap = max(REFUSED_AT_LEAST, math.ceil(REFUSED_SHARE * rows))
        self.budget_s = budget_s
        self.deadline: Optional[float] = None
        self.refused: list[dict] = []

    def started(self) -> None:
        if self.deadline is None:
            self.deadline = _clock() + self.budget_s

    def check_time(self) -> None:
        if self.deadline is not None and _clock() > self.deadline:
            raise StoreLoadFailed(
                f"finding the rows the store refuses of a load of {self.rows} rows took over "
                f"{self.budget_s:g} s (store.statement_timeout_s; {len(self.refused)} refused "
                f"so far{self._first()}): nothing of this load was stored; a table or database "
                "that refuses this many rows needs fixing")

    def refuse(self, items: Sequence[dict]) -> None:
        """Rejections for what the server refused: none (counted already: another chunk of the
        same article), one row, or every version of one article."""
        if not items:
            return
        self.refused.extend(items)
        if len(self.refused) > self.cap:
            raise StoreLoadFailed(
                f"the store refused more than {self.cap} of the load's {self.rows} rows "
                f"(max({REFUSED_AT_LEAST}, {REFUSED_SHARE:.0%}){self._first()}): that many "
                "refusals are a problem of the table or the database (a constraint or trigger "
                "every row fails), not of the rows; nothing of this load was stored")

    def _first(self) -> str:
        if not self.refused:
            return ""
        first = self.refused[0]
        return f"; the first: article {first['id']}: {first['detail']}"


class Store:
    """A connection to the store and the loads into it. ``retry_s`` of the settings bounds how long
    a load retries on transient errors (``is_transient``)."""

    def __init__(self, settings: StoreSettings, dsn: Optional[str] = None):
        self.settings = settings
        self._dsn = dsn if dsn is not None else resolve_dsn(settings)
        if _parsed(self._dsn) is None:
            raise StoreError(f"store: {UNPARSABLE_DSN}")
        _DRIVER_LOG.add(self._dsn)  # before any connection: psycopg logs the hosts it tries

    def scrub(self, text: str) -> str:
        return scrub(text, self._dsn)

    def _connect_kwargs(self) -> dict:
        """``connect_timeout``, client-side TCP keepalives and ``tcp_user_timeout``, where the
        DSN sets none itself."""
        given = _parsed(self._dsn) or {}
        wanted = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": KEEPALIVE_IDLE_S,
                  "keepalives_interval": KEEPALIVE_INTERVAL_S,
                  "keepalives_count": KEEPALIVE_COUNT, "tcp_user_timeout": TCP_USER_TIMEOUT_MS}
        return {k: v for k, v in wanted.items() if k not in given}

    def _open(self, load: bool = False) -> "psycopg.Connection":
        """A connection with keepalives on both ends, to a database whose encoding is UTF8;
        ``OperationalError`` (scrubbed) when the database cannot be reached. ``load``: an
        autocommit connection (each transaction of a load is explicit: ``conn.transaction()``)
        whose session bounds its waits: ``lock_timeout``, ``statement_timeout``, and
        ``idle_in_transaction_session_timeout`` (= the lock timeout: a load that stalls inside
        its transaction holds others no longer than they would wait for it). Every connection's
        ``search_path`` is ``SEARCH_PATH``, set before anything else runs on it."""
        import psycopg

        error = None
        try:
            conn = psycopg.connect(self._dsn, autocommit=load, **self._connect_kwargs())
        except psycopg.OperationalError as exc:
            error = psycopg.OperationalError(self.scrub(str(exc)))
        if error is not None:
            raise error  # outside the except: no __context__ that quotes the DSN
        try:
            encoding = conn.info.parameter_status("server_encoding")
            if encoding != "UTF8":
                raise StoreLoadFailed(
                    f"the store's database has the encoding {encoding}, not UTF8: it cannot hold "
                    "every article's text (any character outside its encoding would be refused, "
                    "row by row); create the database with ENCODING 'UTF8'")
            settings: dict[str, Any] = {"search_path": SEARCH_PATH,
                                        "tcp_keepalives_idle": KEEPALIVE_IDLE_S,
                                        "tcp_keepalives_interval": KEEPALIVE_INTERVAL_S,
                                        "tcp_keepalives_count": KEEPALIVE_COUNT,
                                        "tcp_user_timeout": TCP_USER_TIMEOUT_MS}
            if conn.info.server_version >= 140000:
                settings["client_connection_check_interval"] = CLIENT_CHECK_INTERVAL_MS
            if load:
                lock_ms = max(1, int(self.settings.lock_timeout_s * 1000))
                settings.update({
                    "lock_timeout": lock_ms, "idle_in_transaction_session_timeout": lock_ms,
                    "statement_timeout": max(1, int(self.settings.statement_timeout_s * 1000))})
            # pg_catalog's own set_config: the session's path is not the safe one yet.
            conn.execute("SELECT " + ", ".join("pg_catalog.set_config(%s, %s, false)"
                                               for _ in settings),
                         [x for k, v in settings.items() for x in (k, str(v))])
            if not load:
                conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    def connect(self) -> "psycopg.Connection":
        """A connection to read the store (a search, the ledger's check against it), once the
        catalog shows no table, index or trigger function of the store that another role owns
        (``_refuse_foreign``: ``StoreError``): a read of such a table would run its owner's code
        (a row security policy, a view) as this connection's role."""
        import psycopg

        failure: Optional[StoreError] = None
        try:
            conn = self._open()
        except psycopg.Error as exc:
            failure = _failure(exc, self._dsn, "cannot connect to the store")
        if failure is not None:
            raise failure
        try:
            _refuse_foreign(self.settings, _read_catalog(conn, self.settings), StoreError)
            conn.commit()
        except StoreError as exc:
            failure = StoreError(self.scrub(str(exc)))
        except psycopg.Error as exc:
            failure = _failure(exc, self._dsn, "cannot read the store's catalog")
        except BaseException:
            conn.close()
            raise
        if failure is not None:
            conn.close()
            raise failure
        return conn

    def load(self, rows: LoadRows, load_key: str, ids: Optional[Sequence[str]] = None, *,
             output: Optional["BatchOutput"] = None, reload: bool = False) -> StoreLoad:
        """Load ``rows`` under ``load_key`` (see the module docstring); retried with backoff on
        transient errors for up to ``retry_s``. Rows the store cannot take are left out and named
        in ``StoreLoad.rejected``; the rest is stored. ``ids``: every article id this load's key
        may have written before (a streaming micro-batch's rows and dead letters; default: the
        rows' ids): a load under the same key with another outcome withdraws its rows among them
        (and those the store finds under the key). ``output``: a batch run's output and when the
        run began publishing into it: the load replaces the previous run's load of that output
        (``BatchOutput``). ``reload``: load again although the key is loaded with the same
        outcome (the rows the store refused then, once the table is fixed; rows withdrawn since).
        Raises ``StoreLoadFailed`` (scrubbed, with no chained exception) when it gives up or on
        any error that is neither transient nor a data error, or when the server refuses too
        many rows (``REFUSED_SHARE``); nothing of the load is then stored."""
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
            loaded = retrying(self._load_once, rows, load_key, outcome, withdraw, output, reload)
        except StoreLoadFailed as exc:
            failure = StoreLoadFailed(self.scrub(str(exc)))
        except Exception as exc:  # pylint: disable=broad-except  # scrubbed, never chained
            failure = _failure(exc, self._dsn, f"store load {load_key} failed")
        if failure is not None:
            raise failure
        if not loaded.already_loaded:  # logged once committed: a slow log holds no lock
            for item in loaded.rejected:
                _LOG.warning("store load %s: row %s (text %s) not stored: %s (%s)", load_key,
                             item["id"], item["text_sha256"], item["reason"],
                             self.scrub(item["detail"]))
            if loaded.not_restored:
                _LOG.warning("store load %s: %d articles withdrawn with no earlier version to "
                             "bring back have no row now (first: %s); each is in the store "
                             "again only when a load of an output that holds it stores it",
                             load_key, len(loaded.not_restored),
                             _printable(loaded.not_restored[0]))
        return loaded

    def _load_once(self, rows: LoadRows, load_key: str, outcome: str, withdraw: list[str],
                   output: Optional["BatchOutput"] = None, reload: bool = False) -> StoreLoad:
        """One try of a load, on its own autocommit connection, in up to three transactions: the
        tables (created or upgraded under the table's lock, only when the catalog lacks one);
        the rows staged in temporary tables (no lock of the store's tables: a loader that stalls
        here holds nothing another load waits for); then, under the table's lock, everything
        that changes the tables, each statement run by the server from the staged rows."""
        from psycopg import sql
        from psycopg.types.json import Jsonb

        started = time.perf_counter()
        vectors_table, chunks_table = _tables(self.settings)
        schema = self.settings.schema_name
        names = self._names()
        loads = names["loads"]
        conn = self._open(load=True)
        with conn:
            # One load at a time per table: concurrent upserts of the same articles would
            # deadlock, and concurrent CREATE ... IF NOT EXISTS can collide.
            lock = sql.SQL(
                "SELECT pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext({}))").format(
                sql.Literal(f"newsvec-store:{schema}.{self.settings.table}"))
            # Each reading of the catalog refuses a table, an index or a trigger of the store
            # that another role owns (``_refuse_foreign``): before any DDL on it, and after the
            # DDL (which skips a name another role took meanwhile), before any row is written.
            catalog = _read_catalog(conn, self.settings)
            _refuse_foreign(self.settings, catalog)
            if _missing_ddl(self.settings, catalog, rows.dim, rows.vector_dtype):
                with conn.transaction():
                    conn.execute(lock)
                    catalog = _read_catalog(conn, self.settings)  # another load may have
                    _refuse_foreign(self.settings, catalog)
                    for statement in _missing_ddl(self.settings, catalog, rows.dim,
                                                  rows.vector_dtype):
                        conn.execute(statement)
                catalog = _read_catalog(conn, self.settings)
                _refuse_foreign(self.settings, catalog)

            def loaded_before():
                return conn.execute(sql.SQL(
                    "SELECT rows, chunk_rows, outcome, rejected, withdrawn FROM {} "
                    "WHERE load_key = %s").format(loads), (load_key,)).fetchone()

            def no_op(prior) -> StoreLoad:
                withdrawn = tuple(prior[4] or ())
                return StoreLoad(load_key, prior[0], prior[1], 0, True,
                                 time.perf_counter() - started, tuple(prior[3] or ()),
                                 withdrawn, tuple(self._without_row(conn, list(withdrawn))))

            quick = None if reload else loaded_before()  # no lock: a retried load stages nothing
            if quick is not None and quick[2] == outcome:
                with conn.transaction():
                    conn.execute(lock)
                    prior = loaded_before()
                    if prior is not None and prior[2] == outcome:
                        return no_op(prior)
            pgvector = catalog.pgvector_schema
            if pgvector is None:
                raise StoreLoadFailed("the store's database has no pgvector (CREATE EXTENSION "
                                      "vector)")
            pgvector_type, oid = self._embedding_type(conn, rows, pgvector)
            conn.adapters.register_dumper(np.ndarray, _vector_dumper(oid, pgvector_type))
            keep, rejected = self._check(rows, pgvector_type == "halfvec")
            isolation = _Isolation(rows.vectors.num_rows, self.settings.statement_timeout_s)
            staged = self._stage(conn, rows, keep, pgvector_type, oid, pgvector, load_key,
                                 isolation)
            ids_given = set(rows.vectors.column("id").to_pylist())
            with conn.transaction():
                conn.execute(lock)
                prior = loaded_before()
                if prior is not None and prior[2] == outcome and not reload:
                    return no_op(prior)
                self._prune(conn)
                withdrawn = set(prior[4] or ()) if prior is not None else set()
                if prior is not None and prior[2] != outcome:  # the same load, another outcome
                    withdrawn.update(self._withdraw(
                        conn, load_key, sorted(set(withdraw) | self._ids_of(conn, load_key))))
                replaces = None
                if output is not None:
                    replaces = self._previous_load(conn, output, load_key)
                    if replaces is not None:
                        withdrawn.update(self._withdraw(
                            conn, replaces, sorted(self._ids_of(conn, replaces))))
                withdrawn -= ids_given
                hnsw = [table for table in (vectors_table, chunks_table)
                        if f"{table.name}_embedding_hnsw" not in catalog.relations]
                if hnsw:  # read again under the lock: another load may have built them
                    again = _read_catalog(conn, self.settings)
                    _refuse_foreign(self.settings, again)
                    hnsw = [t for t in hnsw
                            if f"{t.name}_embedding_hnsw" not in again.relations]
                index_after = False
                if hnsw:
                    empty = conn.execute(sql.SQL("SELECT NOT EXISTS (SELECT 1 FROM {})").format(
                        names["vectors"])).fetchone()
                    index_after = bool(empty and empty[0]) and (
                        rows.vectors.num_rows >= BUILD_INDEX_AFTER_ROWS)
                    if not index_after:
                        for table in hnsw:
                            conn.execute(_index_statement(self.settings, table,
                                                          pgvector_type, pgvector))
                done = _Part()
                for part in self._isolate(
                        conn, staged.articles,
                        lambda lo, hi: self._load_part(conn, staged, lo, hi, load_key),
                        lambda rn, exc: [self._refusal(
                            rows, staged.keep[staged.set_aside(conn, rn)], exc)], isolation,
                        again=lambda rn: bool(staged.positions(rn, rn + 1))):
                    done.add(part)
                rejected += isolation.refused
                if catalog.unanalyzed and done.rows >= ANALYZE_AFTER_ROWS:
                    for table in (vectors_table, chunks_table):
                        if table.name in catalog.unanalyzed:
                            conn.execute(sql.SQL("ANALYZE {}").format(
                                _ident(schema, table.name)))
                if index_after:
                    conn.execute("SET LOCAL statement_timeout = 0")  # the keepalives bound it
                    if self.settings.index_build_memory_mb is not None:
                        conn.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(
                            sql.Literal(f"{self.settings.index_build_memory_mb}MB")))
                    for table in hnsw:
                        conn.execute(_index_statement(self.settings, table, pgvector_type,
                                                      pgvector))
                conn.execute(sql.SQL(
                    "INSERT INTO {} (load_key, rows, chunk_rows, articles_current, outcome, "
                    "rejected, withdrawn, output, run_id) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (load_key) DO UPDATE SET loaded_at = now(), "
                    "rows = EXCLUDED.rows, chunk_rows = EXCLUDED.chunk_rows, "
                    "articles_current = EXCLUDED.articles_current, "
                    "outcome = EXCLUDED.outcome, rejected = EXCLUDED.rejected, "
                    "withdrawn = EXCLUDED.withdrawn, output = EXCLUDED.output, "
                    "run_id = EXCLUDED.run_id").format(loads),
                    (load_key, done.rows, done.chunk_rows, done.current, outcome,
                     Jsonb(rejected), Jsonb(sorted(withdrawn)),
                     None if output is None else output.prefix,
                     None if output is None else output.run_id))
                not_restored = self._without_row(conn, sorted(withdrawn))
            return StoreLoad(load_key, done.rows, done.chunk_rows, done.current, False,
                             time.perf_counter() - started, tuple(rejected),
                             tuple(sorted(withdrawn)), tuple(not_restored), replaces)

    def _names(self) -> dict[str, "Any"]:
        """Identifiers of the tables: ``vectors``, ``chunks``, ``loads`` and the two kept
        versions' tables ``sup``, ``chunks_sup``."""
        vectors_table, chunks_table = _tables(self.settings)
        schema = self.settings.schema_name
        return {"vectors": _ident(schema, vectors_table.name),
                "chunks": _ident(schema, chunks_table.name),
                "loads": _ident(schema, f"{self.settings.table}_loads"),
                "sup": _ident(schema, f"{vectors_table.name}_superseded"),
                "chunks_sup": _ident(schema, f"{chunks_table.name}_superseded")}

    def _prune(self, conn) -> None:
        """Forget the kept versions older than ``superseded_keep_days`` (through their
        ``saved_at`` index: nothing is read when none is that old)."""
        from psycopg import sql

        names = self._names()
        for table in ("sup", "chunks_sup"):
            conn.execute(sql.SQL("DELETE FROM {} WHERE saved_at < now() - make_interval("
                                 "secs => %s)").format(names[table]),
                         (self.settings.superseded_keep_days * 86400,))

    def _previous_load(self, conn, output: "BatchOutput", load_key: str) -> Optional[str]:
        """The load of the run ``output.prefix`` held before this one (the newest other run whose
        load of it is recorded, through the ``output`` index), whose rows this load replaces;
        None when there is none. A newer run's load there means this run is one the output
        replaced (its load came late: it read its files before the newer run published), so it
        is refused: it would withdraw the newer run's rows."""
        from psycopg import sql

        row = conn.execute(sql.SQL(
            "SELECT load_key, run_id FROM {} WHERE output = %s AND load_key <> %s "
            "ORDER BY run_id DESC NULLS LAST LIMIT 1").format(self._names()["loads"]),
            (output.prefix, load_key)).fetchone()
        if row is None:
            return None
        if row[1] is not None and row[1] > output.run_id:
            raise StoreLoadFailed(
                f"run {output.run_id} is older than run {row[1]}, whose load of {output.prefix} "
                "the store holds: the newer run replaced it there, and the older one is not "
                "loaded (it would withdraw the newer run's rows)")
        return str(row[0])

    def _ids_of(self, conn, load_key: str) -> set[str]:
        """Every article ``load_key`` left a trace of: its rows, the versions kept under it
        (it replaced them, or they lost to it), and its own versions kept under other loads,
        through the indexes on ``load_key`` and the kept versions' primary key."""
        from psycopg import sql

        names = self._names()
        return {r[0] for r in conn.execute(sql.SQL(
            "SELECT id FROM {vectors} WHERE load_key = %(k)s UNION "
            "SELECT id FROM {sup} WHERE withdrawn_with = %(k)s UNION "
            "SELECT id FROM {sup} WHERE load_key = %(k)s UNION "
            "SELECT id FROM {chunks_sup} WHERE withdrawn_with = %(k)s").format(**names),
            {"k": load_key}).fetchall()}

    def _without_row(self, conn, ids: list[str]) -> list[str]:
        """Those of ``ids`` the articles' table has no row of."""
        from psycopg import sql

        if not ids:
            return []
        return sorted(r[0] for r in conn.execute(sql.SQL(
            "SELECT w.id FROM unnest(%s::text[]) AS w(id) WHERE NOT EXISTS "
            "(SELECT 1 FROM {} v WHERE v.id = w.id)").format(self._names()["vectors"]),
            (ids,)).fetchall())

    def _withdraw(self, conn, load_key: str, ids: list[str]) -> list[str]:
        """Undo what the load ``load_key`` did to the articles ``ids`` (found through the primary
        keys, never a scan): an earlier try of a load redone with another outcome, or the load
        of the run a batch run replaced in its output:
        - an article whose row is that load's: the row and its chunks are deleted, and the
          latest of the versions kept under ``load_key`` (the one it replaced, or one that lost
          to it since) comes back, with its chunks; the other versions kept under it are now
          kept under the version brought back;
        - an article whose row is another's (a later load replaced this load's version): this
          load's version, if kept under that load, is forgotten, and the versions kept under
          ``load_key`` are kept under that load instead (they lost to it, through this one),
          except that load's own versions (a load never brings back its own earlier attempt);
        Returns the ids of the first kind."""
        from psycopg import sql

        if not ids:
            return []
        names = self._names()
        vector_cols, chunk_cols = (
            [n for n, _ in table.column_types(1)] for table in _tables(self.settings))

        def cols(which: list[str], alias: str = ""):
            return sql.SQL(", ").join(sql.SQL(alias + "{}").format(_ident(n)) for n in which)

        def each(statement: str, kind: str, params: tuple, **extra) -> None:
            table, columns = ("sup", vector_cols) if kind == "" else ("chunks_sup", chunk_cols)
            conn.execute(sql.SQL(statement).format(
                kept=names[table], main=names["vectors" if kind == "" else "chunks"],
                cols=cols(columns), s_cols=cols(columns, "s."), **extra), params)

        def set_aside_for(pairs: tuple[list, list]) -> None:
            """Keep, set aside for each (id, holder) of ``pairs``, the versions this load set
            aside that are not the holder's own, so that they come back when the holder is
            withdrawn in turn."""
            for kind in ("", "chunks"):
                each("INSERT INTO {kept} ({cols}, withdrawn_with) SELECT {s_cols}, h.holder "
                     "FROM {kept} s JOIN unnest(%s::text[], %s::text[]) AS h(id, holder) "
                     "ON s.id = h.id AND s.load_key <> h.holder "
                     "WHERE s.withdrawn_with = %s ON CONFLICT DO NOTHING", kind,
                     (*pairs, load_key))

        mine = sorted(r[0] for r in conn.execute(sql.SQL(
            "DELETE FROM {} v USING unnest(%s::text[]) AS w(id) WHERE v.id = w.id "
            "AND v.load_key = %s RETURNING v.id").format(names["vectors"]),
            (ids, load_key)).fetchall())
        if mine:
            conn.execute(sql.SQL("DELETE FROM {} c USING unnest(%s::text[]) AS w(id) "
                                 "WHERE c.id = w.id").format(names["chunks"]), (mine,))
            best = conn.execute(sql.SQL(
                "SELECT DISTINCT ON (s.id) s.id, s.load_key FROM {} s "
                "JOIN unnest(%s::text[]) AS w(id) ON s.id = w.id WHERE s.withdrawn_with = %s "
                "ORDER BY s.id, {}").format(names["sup"], _latest_first()),
                (mine, load_key)).fetchall()
            if best:
                back = ([b[0] for b in best], [b[1] for b in best])
                for kind in ("", "chunks"):
                    each("INSERT INTO {main} ({cols}) SELECT {s_cols} FROM {kept} s "
                         "JOIN unnest(%s::text[], %s::text[]) AS b(id, load_key) "
                         "ON s.id = b.id AND s.load_key = b.load_key "
                         "WHERE s.withdrawn_with = %s", kind, (*back, load_key))
                set_aside_for(back)
        others = sorted(set(ids) - set(mine))
        if others:
            held = conn.execute(sql.SQL(
                "SELECT DISTINCT ON (s.id) s.id, s.withdrawn_with FROM {} s "
                "JOIN unnest(%s::text[]) AS w(id) ON s.id = w.id WHERE s.load_key = %s "
                "ORDER BY s.id, s.saved_at DESC").format(names["sup"]),
                (others, load_key)).fetchall()
            if held:
                set_aside_for(([h[0] for h in held], [h[1] for h in held]))
        for kind in ("", "chunks"):
            each("DELETE FROM {kept} k USING unnest(%s::text[]) AS w(id) WHERE k.id = w.id "
                 "AND (k.withdrawn_with = %s OR k.load_key = %s)", kind,
                 (ids, load_key, load_key))
        return mine

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

    def _refusal(self, rows: LoadRows, i: int, failure: BaseException) -> dict:
        """The rejection of row ``i`` of ``rows.vectors``, which the store refused with
        ``failure``: its SQLSTATE and the server's primary message, never its DETAIL (which
        quotes the row: the article's text in every log and in ``<table>_loads``)."""
        diag = getattr(failure, "diag", None)
        sqlstate = getattr(diag, "sqlstate", None)
        message = getattr(diag, "message_primary", None) or str(failure).split("\n", 1)[0]
        return rejection(rows.vectors.column("id")[i].as_py(),
                         rows.vectors.column("text_sha256")[i].as_py(), Refusal.REFUSED,
                         self.scrub(f"{sqlstate or ''} {type(failure).__name__}: "
                                    f"{message}".strip()))

    def _isolate(self, conn, n: int, attempt: Callable[[int, int], Any],
                 refusal: Callable[[int, BaseException], list[dict]],
                 isolation: _Isolation, again: Optional[Callable[[int], bool]] = None) -> list:
        """``attempt(0, n)`` in a savepoint; when the server refuses it for its data
        (``is_data_error``), it is rolled back and halved, each half in a savepoint of its own,
        down to the single positions it refuses (``refusal``: their rejections, into
        ``isolation``, which bounds how many there may be and for how long they are sought); a
        position refused is tried again while ``again`` says something of it is left (an
        article's earlier version, once its latest is set aside). Returns what the attempts that
        passed returned."""
        done = []
        pending = [(0, n)] if n else []
        while pending:
            lo, hi = pending.pop()
            isolation.check_time()
            failure = None
            try:
                with conn.transaction():  # a savepoint
                    done.append(attempt(lo, hi))
                continue
            except Exception as exc:  # pylint: disable=broad-except  # sorted just below
                if not is_data_error(exc) or is_transient(exc):
                    raise
                failure = exc
            isolation.started()
            if hi - lo == 1:
                isolation.refuse(refusal(lo, failure))
                if again is not None and again(lo):
                    pending.append((lo, hi))
                continue
            middle = (lo + hi) // 2
            pending += [(middle, hi), (lo, middle)]  # the first half first
        return done

    def _stage(self, conn, rows: LoadRows, keep: list[int], pgvector_type: str,
               pgvector_oid: int, pgvector_schema: str, load_key: str,
               isolation: _Isolation) -> _Staged:
        """The rows ``keep`` (and their chunks) into temporary tables (``_Staged``), in a
        transaction of their own before the table's lock: no lock of the store's tables is
        taken (the staging tables' types are written out, not copied with LIKE). The rows are
        built before each COPY starts, so a COPY only sends. A row that cannot be sent or that
        the server refuses as its COPY's input is set aside (``_isolate``), with its chunks."""
        from psycopg import sql

        vectors_table, chunks_table = _tables(self.settings)
        dtype: VectorDtype = "float16" if pgvector_type == "halfvec" else "float32"
        vector_types = vectors_table.column_types(rows.dim, dtype)
        chunk_types = chunks_table.column_types(rows.dim, dtype)
        ids = rows.vectors.column("id").to_pylist()
        shas = rows.vectors.column("text_sha256").to_pylist()
        staged = _Staged.of(ids, keep, [n for n, _ in vector_types],
                            [n for n, _ in chunk_types])
        order = staged.keep
        kept = rows.vectors if order == list(range(rows.vectors.num_rows)) else \
            rows.vectors.take(pa.array(order, pa.int64()))
        data = [(*row, rn, position) for position, (rn, row) in enumerate(zip(
            staged.rank, _rows(kept, staged.names, rows.dt, load_key), strict=True))]
        chunks = None
        if rows.chunks is not None and rows.chunks.num_rows:
            groups = _chunk_groups(rows)
            versions = zip(kept.column("id").to_pylist(), kept.column("text_sha256").to_pylist(),
                           strict=True)
            indices = sorted({c for key in versions for c in groups.get(key, ())})
            if indices:
                chunks = rows.chunks.take(pa.array(indices, pa.int64()))
                staged.chunks = "newsvec_stage_chunks"

        def create(name: str, types: list[tuple[str, str]], extra: str = ""):
            return sql.SQL("CREATE TEMP TABLE {} ({}{})").format(
                _ident("pg_temp", name), sql.SQL(", ").join(
                    sql.SQL("{} {}").format(_ident(n), _type_sql(t, pgvector_schema))
                    for n, t in types), sql.SQL(extra))

        def copy(name: str, names: list[str], types: list[int | str], batch: list) -> None:
            with conn.cursor().copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
                    _ident("pg_temp", name), sql.SQL(", ").join(map(_ident, names)))) as out:
                out.set_types(types)
                for row in batch:
                    out.write_row(row)

        def sql_types(types: list[tuple[str, str]]) -> list[int | str]:
            # pgvector's type by its oid (in its own schema), psycopg's built-in ones by name
            return [pgvector_oid if n == "embedding" else t for n, t in types]

        def refused_row(position: int, exc: BaseException) -> list[dict]:
            staged.missing.add(position)
            return [self._refusal(rows, order[position], exc)]

        with conn.transaction():
            conn.execute(create(staged.vectors, vector_types,
                                ", rn integer NOT NULL, position integer NOT NULL"))
            self._isolate(conn, len(data), lambda lo, hi: copy(
                staged.vectors, [*staged.names, "rn", "position"],
                [*sql_types(vector_types), "integer", "integer"],
                data[lo:hi]), refused_row, isolation)
            chunk_stage = staged.chunks
            if chunks is not None and chunk_stage is not None:
                conn.execute(create(chunk_stage, chunk_types))
                chunk_data = list(_rows(chunks, staged.chunk_names, rows.dt, load_key))
                chunk_keys = list(zip(chunks.column("id").to_pylist(),
                                      chunks.column("text_sha256").to_pylist(), strict=True))
                positions: dict[tuple, list[int]] = {}
                for p, i in enumerate(order):
                    positions.setdefault((ids[i], shas[i]), []).append(p)
                gone: list[tuple] = []

                def refused_chunk(i: int, exc: BaseException) -> list[dict]:
                    version = [p for p in positions[chunk_keys[i]] if p not in staged.missing]
                    if not version:
                        return []  # its article is set aside already
                    staged.missing.update(version)
                    gone.append(chunk_keys[i])
                    items = [self._refusal(rows, order[p], exc) for p in version]
                    for item in items:
                        item["detail"] = f"a chunk: {item['detail']}"[:300]
                    return items

                self._isolate(conn, len(chunk_data), lambda lo, hi: copy(
                    chunk_stage, staged.chunk_names, sql_types(chunk_types),
                    chunk_data[lo:hi]), refused_chunk, isolation)
                if gone:  # the articles of the chunks refused: out of the staged rows
                    conn.execute(sql.SQL(
                        "DELETE FROM {} s USING unnest(%s::text[], %s::text[]) AS g(id, sha) "
                        "WHERE s.id = g.id AND s.text_sha256 = g.sha").format(
                            _ident("pg_temp", staged.vectors)),
                        ([g[0] for g in gone], [g[1] for g in gone]))
        return staged

    def _load_part(self, conn, staged: _Staged, lo: int, hi: int, load_key: str) -> _Part:
        """Upsert the staged rows ``lo <= rn < hi``; the articles whose row it wrote (the
        upsert's ``RETURNING``: no scan of the table) get these rows' chunks of the same version,
        and only them. Each row it replaces (and its chunks) is kept under ``load_key``, and each
        of its rows that loses to another load's row is kept under that load's key: what a
        withdrawal of either load brings back (``_withdraw``)."""
        from psycopg import sql

        names = self._names()
        won, lost = self._upsert(conn, staged, lo, hi, load_key)
        part = _Part(rows=staged.rows_between(lo, hi), current=len(won))
        chunk_names = sql.SQL(", ").join(map(_ident, staged.chunk_names))
        s_chunk_names = sql.SQL(", ").join(sql.SQL("s.{}").format(_ident(n))
                                           for n in staged.chunk_names)
        if won:
            won_ids = sorted({doc_id for doc_id, _ in won})
            conn.execute(sql.SQL(
                "WITH gone AS (DELETE FROM {chunks} c USING unnest(%s::text[]) AS w(id) "
                "WHERE c.id = w.id RETURNING {c_cols}) "
                "INSERT INTO {kept} ({cols}, withdrawn_with) SELECT {cols}, %s FROM gone "
                "WHERE load_key <> %s ON CONFLICT DO NOTHING").format(
                    chunks=names["chunks"], kept=names["chunks_sup"], cols=chunk_names,
                    c_cols=sql.SQL(", ").join(sql.SQL("c.{}").format(_ident(n))
                                              for n in staged.chunk_names)),
                (won_ids, load_key, load_key))
        if staged.chunks is None:
            return part
        if won:
            part.chunk_rows = conn.execute(sql.SQL(
                "INSERT INTO {} ({}) SELECT DISTINCT ON (s.id, s.chunk_index) {} FROM {} s "
                "JOIN unnest(%s::text[], %s::text[]) AS v(id, text_sha256) "
                "ON s.id = v.id AND s.text_sha256 = v.text_sha256 "
                "ORDER BY s.id, s.chunk_index, s.embedded_at DESC").format(
                    names["chunks"], chunk_names, s_chunk_names, _ident("pg_temp", staged.chunks)),
                ([v[0] for v in won], [v[1] for v in won])).rowcount
        if lost:
            conn.execute(sql.SQL(
                "INSERT INTO {} ({}, withdrawn_with) SELECT DISTINCT ON (s.id, s.chunk_index) "
                "{}, v.holder FROM {} s "
                "JOIN unnest(%s::text[], %s::text[], %s::text[]) AS v(id, text_sha256, holder) "
                "ON s.id = v.id AND s.text_sha256 = v.text_sha256 "
                "ORDER BY s.id, s.chunk_index, s.embedded_at DESC ON CONFLICT DO NOTHING").format(
                    names["chunks_sup"], chunk_names, s_chunk_names,
                    _ident("pg_temp", staged.chunks)),
                ([v[0] for v in lost], [v[1] for v in lost], [v[2] for v in lost]))
        return part

    def _upsert(self, conn, staged: _Staged, lo: int, hi: int, load_key: str
                ) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
        """Upsert the staged rows ``lo <= rn < hi``: a row replaces the stored one only if it is
        a later version (``version_order``); of two versions of one article in the rows (one
        ``rn``: never split by a range), the later one. One statement, whose parts all see the
        table as it was before it: each row replaced is kept under ``load_key``, each row that
        lost under its winner's load key (``_load_part``). Returns (id, text_sha256) of the rows
        written, and (id, text_sha256, holder's load key) of the rows kept because they lost."""
        from psycopg import sql

        names = self._names()
        cols = staged.names
        t = {alias: sql.SQL(", ").join(sql.SQL(alias + "{}").format(_ident(n)) for n in cols)
             for alias in ("", "o.", "s.", "v.")}
        statement = sql.SQL(
            "WITH src AS (SELECT DISTINCT ON (id) {cols} FROM {stage} "
            "WHERE rn >= %(lo)s AND rn < %(hi)s ORDER BY id, {latest}, position), "
            "old AS (SELECT {v_cols} FROM {target} v JOIN src ON src.id = v.id), "
            "up AS (INSERT INTO {target} AS t ({cols}) SELECT {cols} FROM src "
            "ON CONFLICT (id) DO UPDATE SET {updates} WHERE {excluded} > {stored} "
            "RETURNING t.id, t.text_sha256), "
            "replaced AS (INSERT INTO {kept} ({cols}, withdrawn_with) "
            "SELECT {o_cols}, %(key)s FROM old o JOIN up ON up.id = o.id "
            "WHERE o.load_key <> %(key)s ON CONFLICT DO NOTHING), "
            "lost AS (INSERT INTO {kept} ({cols}, withdrawn_with) "
            "SELECT {s_cols}, o.load_key FROM src s JOIN old o ON o.id = s.id "
            "WHERE NOT EXISTS (SELECT 1 FROM up WHERE up.id = s.id) AND o.load_key <> %(key)s "
            "ON CONFLICT DO NOTHING RETURNING id, text_sha256, withdrawn_with) "
            "SELECT true, id, text_sha256, NULL FROM up UNION ALL "
            "SELECT false, id, text_sha256, withdrawn_with FROM lost").format(
                cols=t[""], v_cols=t["v."], o_cols=t["o."], s_cols=t["s."],
                stage=_ident("pg_temp", staged.vectors), latest=_latest_first(),
                target=names["vectors"],
                kept=names["sup"],
                updates=sql.SQL(", ").join(sql.SQL("{} = EXCLUDED.{}").format(_ident(n), _ident(n))
                                           for n in cols if n != "id"),
                excluded=version_order("excluded"), stored=version_order("t"))
        result = conn.execute(statement, {"lo": lo, "hi": hi, "key": load_key}).fetchall()
        return ([(r[1], r[2]) for r in result if r[0]],
                [(r[1], r[2], r[3]) for r in result if not r[0]])

    def _embedding_type(self, conn, rows: LoadRows, pgvector: str) -> tuple[str, int]:
        """``vector`` or ``halfvec``, and its oid: the type the store's table was created with,
        whatever the rows' dtype (``sink.vector_dtype`` may change; rows are converted to the
        table's type). A table of another dimension (``model.dimensions`` or the model changed)
        is refused."""
        pgvector_type, oid, dims = self._stored_embedding_type(conn, pgvector)
        if dims != rows.dim:
            raise StoreLoadFailed(
                f"the store's table {self.settings.schema_name}.{self.settings.table} holds "
                f"{pgvector_type}({dims}) vectors, these rows have {rows.dim} dimensions: a "
                "model or model.dimensions change needs a table of its own (store.table)")
        return pgvector_type, oid

    def _stored_embedding_type(self, conn, pgvector: str) -> tuple[str, int, int]:
        """The articles' table's ``embedding`` type: (``vector`` or ``halfvec``, its oid, its
        dimension); ``StoreLoadFailed`` when it is not one of pgvector's, in ``pgvector``, the
        extension's schema (a type of that name in another schema is someone else's)."""
        row = conn.execute(
            "SELECT t.typname::text, n.nspname::text, t.oid, a.atttypmod "
            "FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON t.oid = a.atttypid "
            "JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace "
            "WHERE a.attrelid = %s::pg_catalog.regclass AND a.attname = 'embedding' "
            "AND NOT a.attisdropped",
            (f'"{self.settings.schema_name}"."{self.settings.table}"',)).fetchone()
        if row is None:
            raise StoreLoadFailed(f"the store's table {self.settings.table} has no embedding")
        name, schema, oid, dims = str(row[0]), str(row[1]), int(row[2]), int(row[3])
        if name not in _PGVECTOR_TYPES.values() or schema != pgvector:
            raise StoreLoadFailed(
                f"the store's table {self.settings.schema_name}.{self.settings.table} holds "
                f"{_printable(schema)}.{_printable(name)} embeddings, not pgvector's vector or "
                f"halfvec (pgvector is in the schema {_printable(pgvector)})")
        return name, oid, dims

    @contextlib.contextmanager
    def reader(self) -> Iterator["_Reader"]:
        """A read of the store for ``newsvec ledger --store`` (``base.StoreReader``), on one
        connection (``connect``: the catalog checked first)."""
        with self.connect() as conn:
            yield _Reader(conn, self.settings)

    def search(self, vector, k: int, all_copies: bool = False) -> list[dict]:
        """The ``k`` nearest stories to ``vector`` through the HNSW index (``hnsw.ef_search`` from
        the settings): each article by its best chunk when the store holds chunks, else by its
        own row; then each story (``COALESCE(story_id, id)``) by its best article, with
        ``copies``, how many other articles of the story the store holds (through the
        ``story_id`` index). ``all_copies``: every article, ``k`` of them. ``{"id", "title",
        "score", "chunk_index", "story_id", "copies"}``, best first: what ``pipeline.search``
        gives. HNSW yields at most ``ef_search`` candidates: while they hold fewer than ``k``
        stories (copies crowd them), the search asks for four times as many."""
        from psycopg import sql

        vectors_table, chunks_table = _tables(self.settings)
        schema = self.settings.schema_name
        query = "[" + ",".join(repr(float(x)) for x in np.asarray(vector).ravel()) + "]"
        # HNSW returns at most ef_search rows: enough of them to group chunks into k articles.
        candidates = max(self.settings.ef_search, k)
        vectors = _ident(schema, vectors_table.name)
        with self.connect() as conn:
            pgvector = pgvector_schema(conn)
            if pgvector is None:
                raise StoreError("the store's database has no pgvector (CREATE EXTENSION vector)")
            # The query vector as the column's type, so that the HNSW index serves the ORDER BY;
            # the type and its operator are pgvector's, named with its schema.
            cast = _ident(pgvector, self._stored_embedding_type(conn, pgvector)[0])
            distance = sql.SQL("OPERATOR({}.<=>)").format(_ident(pgvector))
            has_chunks = conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(
                _ident(schema, chunks_table.name))).fetchone()
            if has_chunks and has_chunks[0]:
                near = sql.SQL("SELECT id, chunk_index, embedding {distance} %(q)s::{cast} AS d "
                               "FROM {chunks}").format(
                    chunks=_ident(schema, chunks_table.name), cast=cast, distance=distance)
            else:
                near = sql.SQL("SELECT id, NULL::integer AS chunk_index, "
                               "embedding {distance} %(q)s::{cast} AS d FROM {vectors}").format(
                    vectors=vectors, cast=cast, distance=distance)
            # A table of a release before 0.4 that no load has upgraded yet has no story_id:
            # each article is its own story.
            stories = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = "
                "%s::pg_catalog.regclass AND attname = 'story_id' AND NOT attisdropped)",
                (f'"{schema}"."{vectors_table.name}"',)).fetchone()
            story: Any
            copies: Any
            if stories and stories[0]:
                story = sql.SQL("COALESCE(v.story_id, a.id)")
                # The story's rows: those naming it, and its first article if it names none.
                copies = sql.SQL(
                    "GREATEST((SELECT count(*) FROM {vectors} c WHERE c.story_id = b.story) + "
                    "(SELECT count(*) FROM {vectors} c WHERE c.id = b.story "
                    "AND c.story_id IS NULL) - 1, 0)").format(vectors=vectors)
            else:
                story, copies = sql.SQL("a.id"), sql.SQL("0")
            each = sql.SQL("hits" if all_copies else  # else the best article of each story
                           "(SELECT DISTINCT ON (story) * FROM hits ORDER BY story, score DESC, "
                           "id) s")
            statement = sql.SQL(
                "WITH near AS ({near} ORDER BY d LIMIT %(n)s), "
                "a AS (SELECT DISTINCT ON (id) id, chunk_index, 1 - d AS score FROM near "
                "ORDER BY id, d, chunk_index), "
                "hits AS (SELECT a.id, v.title, a.score, a.chunk_index, {story} AS story "
                "FROM a LEFT JOIN {vectors} v USING (id)), "
                "b AS (SELECT * FROM {each} ORDER BY score DESC, id LIMIT %(k)s) "
                "SELECT b.id, b.title, b.score, b.chunk_index, b.story, {copies}, "
                "(SELECT count(*) FROM near) FROM b ORDER BY b.score DESC, b.id").format(
                    near=near, story=story, vectors=vectors, each=each, copies=copies)
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


class _Reader:
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
                               for n in fields), _ident(schema, loads_name))
        # The load a batch run's load replaced: the output's previous run's (``_previous_load``).
        self._replaced = sql.SQL(
            "SELECT load_key FROM {} WHERE output = %s AND load_key <> %s AND run_id < %s "
            "ORDER BY run_id DESC LIMIT 1").format(_ident(schema, loads_name))
        self._without_row = sql.SQL(
            "SELECT w.id FROM unnest(%s::text[]) AS w(id) WHERE NOT EXISTS "
            "(SELECT 1 FROM {} v WHERE v.id = w.id) ORDER BY 1").format(
                _ident(schema, settings.table))
        there = self._columns(schema, settings.table)
        self._rows = sql.SQL("SELECT {} FROM {} WHERE id = ANY(%s)").format(
            sql.SQL(", ").join(sql.Identifier(n) if n in there else sql.SQL("NULL")
                               for n in ROW_FIELDS), _ident(schema, settings.table))

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

"""A load into the pgvector store (``load``): retried on transient errors for ``retry_s``, each
try (``load_once``) on its own autocommit connection, in up to three transactions. First the
tables, created or upgraded under the table's lock only when the catalog lacks one; then the
rows staged in temporary tables (``stage``: no lock of the store's tables); then, under the
table's lock (one load at a time per table), everything that changes the tables, each statement
run by the server from the staged rows: the withdrawal of what an earlier try with another
outcome, or the run this one replaces, stored (``withdraw``), the upsert (``upsert``), the HNSW
indexes, and the load's record under its key in ``<table>_loads``. A key recorded with the same
outcome is a no-op."""
from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import numpy as np

from transforms.stores.base import BatchOutput, LoadRows, StoreLoad, StoreLoadFailed
from transforms.stores.base import printable as _printable
from transforms.stores.pgvector.catalog import (
    Catalog,
    embedding_type,
    missing_ddl,
    read_catalog,
    refuse_foreign,
)
from transforms.stores.pgvector.rows import check, refusal, vector_dumper
from transforms.stores.pgvector.schema import ident, index_statement, store_tables, table_names
from transforms.stores.pgvector.sql import Client, is_data_error, is_transient
from transforms.stores.pgvector.stage import Staged, stage
from transforms.stores.pgvector.upsert import Part, load_part
from transforms.stores.pgvector.withdraw import ids_of, previous_load, prune, withdraw, without_row
from transforms.stores.retry import Isolation, retrying

_LOG = logging.getLogger("newsvec.store")

BUILD_INDEX_AFTER_ROWS = 10_000  # a first load this large into an empty table indexes after
# A load of this many rows into a table that has no planner statistics yet (a first load; the
# autovacuum's ANALYZE comes later) analyzes it: without them, the planner of the next loads'
# joins on ``id`` cannot tell a few index lookups from a scan of the whole table.
ANALYZE_AFTER_ROWS = 1000


def load(client: Client, rows: LoadRows, load_key: str, ids: Optional[Sequence[str]] = None, *,
         output: Optional[BatchOutput] = None, reload: bool = False) -> StoreLoad:
    """``Store.load``: ``load_once`` retried on transient errors (``is_transient``) for up to
    ``retry_s``; a failure raised scrubbed, with no chained exception; the rows not stored
    logged once the load committed."""
    # An id with a NUL cannot be in the table (nor be sent as a parameter).
    withdraw_ids = sorted({i for i in (rows.vectors.column("id").to_pylist() if ids is None
                                       else ids) if isinstance(i, str) and "\x00" not in i})
    outcome = rows.outcome()

    def log_retry(attempt: int, exc: Optional[BaseException]) -> None:
        _LOG.warning("store load %s: attempt %d failed (%s), retrying", load_key, attempt,
                     client.scrub(f"{type(exc).__name__}: {exc}"))

    retried = retrying(client.settings.retry_s, is_transient, log_retry)
    failure: Optional[StoreLoadFailed] = None
    try:
        loaded = retried(load_once, client, rows, load_key, outcome, withdraw_ids, output, reload)
    except StoreLoadFailed as exc:
        failure = StoreLoadFailed(client.scrub(str(exc)))
    except Exception as exc:  # pylint: disable=broad-except  # scrubbed, never chained
        failure = client.failure(exc, f"store load {load_key} failed")
    if failure is not None:
        raise failure
    if not loaded.already_loaded:  # logged once committed: a slow log holds no lock
        _log_left_out(client, loaded)
    return loaded


def _log_left_out(client: Client, loaded: StoreLoad) -> None:
    """The rows a load did not store, and the articles it withdrew that have no row now."""
    for item in loaded.rejected:
        _LOG.warning("store load %s: row %s (text %s) not stored: %s (%s)", loaded.load_key,
                     item["id"], item["text_sha256"], item["reason"],
                     client.scrub(item["detail"]))
    if loaded.not_restored:
        _LOG.warning("store load %s: %d articles withdrawn with no earlier version to "
                     "bring back have no row now (first: %s); each is in the store "
                     "again only when a load of an output that holds it stores it",
                     loaded.load_key, len(loaded.not_restored),
                     _printable(loaded.not_restored[0]))


def load_once(client: Client, rows: LoadRows, load_key: str, outcome: str, withdraw: list[str],
              output: Optional[BatchOutput] = None, reload: bool = False) -> StoreLoad:
    """One try of a load, on its own autocommit connection, in up to three transactions: the
    tables (created or upgraded under the table's lock, only when the catalog lacks one);
    the rows staged in temporary tables (no lock of the store's tables: a loader that stalls
    here holds nothing another load waits for); then, under the table's lock, everything
    that changes the tables, each statement run by the server from the staged rows."""
    started = time.perf_counter()
    conn = client.open(load=True)
    with conn:
        attempt = _Try(client, conn, rows, load_key, outcome, started)
        catalog = attempt.tables()
        quick = None if reload else attempt.already_loaded()  # no lock: stages nothing
        if quick is not None:
            return quick
        attempt.stage(catalog)
        with conn.transaction():
            conn.execute(attempt.lock)
            prior = attempt.loaded_before()
            if prior is not None and prior[2] == outcome and not reload:
                return attempt.no_op(prior)
            prune(conn, client.settings)
            withdrawn, replaces = attempt.withdraw_earlier(prior, withdraw, output)
            done = attempt.write(catalog)
            attempt.record(done, withdrawn, output)
            not_restored = without_row(conn, client.settings, sorted(withdrawn))
        return StoreLoad(load_key, done.rows, done.chunk_rows, done.current, False,
                         time.perf_counter() - started, tuple(attempt.rejected),
                         tuple(sorted(withdrawn)), tuple(not_restored), replaces)


class _Try:
    """One try of a load (``load_once``) on its connection ``conn``, in the order it runs: the
    tables, the quick no-op, the staging, then under the table's lock (``lock``) the withdrawals,
    the writes and the record."""

    def __init__(self, client: Client, conn, rows: LoadRows, load_key: str, outcome: str,
                 started: float):
        from psycopg import sql

        self.client, self.settings, self.conn = client, client.settings, conn
        self.rows, self.load_key, self.outcome, self.started = rows, load_key, outcome, started
        self.names = table_names(self.settings)
        # One load at a time per table: concurrent upserts of the same articles would
        # deadlock, and concurrent CREATE ... IF NOT EXISTS can collide.
        self.lock = sql.SQL(
            "SELECT pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext({}))").format(
            sql.Literal(f"newsvec-store:{self.settings.schema_name}.{self.settings.table}"))
        # set by ``stage``
        self.pgvector, self.pgvector_type = "", ""
        self.staged: Optional[Staged] = None
        self.isolation: Optional[Isolation] = None
        self.rejected: list[dict] = []
        self.ids_given: set = set()

    def catalog(self) -> Catalog:
        """The catalog read, refused where another role owns a table, an index or a trigger of
        the store (``refuse_foreign``): before any DDL on it, and after the DDL (which skips a
        name another role took meanwhile), before any row is written."""
        catalog = read_catalog(self.conn, self.settings)
        refuse_foreign(self.settings, catalog)
        return catalog

    def tables(self) -> Catalog:
        """The catalog, once what it lacks of the store is created (under the table's lock)."""
        rows, conn = self.rows, self.conn
        catalog = self.catalog()
        if missing_ddl(self.settings, catalog, rows.dim, rows.vector_dtype):
            with conn.transaction():
                conn.execute(self.lock)
                catalog = self.catalog()  # another load may have
                for statement in missing_ddl(self.settings, catalog, rows.dim,
                                             rows.vector_dtype):
                    conn.execute(statement)
            catalog = self.catalog()
        return catalog

    def loaded_before(self):
        from psycopg import sql

        return self.conn.execute(sql.SQL(
            "SELECT rows, chunk_rows, outcome, rejected, withdrawn FROM {} "
            "WHERE load_key = %s").format(self.names["loads"]), (self.load_key,)).fetchone()

    def no_op(self, prior) -> StoreLoad:
        withdrawn = tuple(prior[4] or ())
        return StoreLoad(self.load_key, prior[0], prior[1], 0, True,
                         time.perf_counter() - self.started, tuple(prior[3] or ()),
                         withdrawn, tuple(without_row(self.conn, self.settings, list(withdrawn))))

    def already_loaded(self) -> Optional[StoreLoad]:
        """The no-op of a load whose key is recorded with the same outcome, found before any
        lock is taken (then checked under it): a retried load stages nothing."""
        quick = self.loaded_before()
        if quick is not None and quick[2] == self.outcome:
            with self.conn.transaction():
                self.conn.execute(self.lock)
                prior = self.loaded_before()
                if prior is not None and prior[2] == self.outcome:
                    return self.no_op(prior)
        return None

    def stage(self, catalog: Catalog) -> None:
        """The rows checked (``check``) and staged (``stage``) as the table's embedding type
        (``embedding_type``), before the table's lock."""
        rows = self.rows
        pgvector = catalog.pgvector_schema
        if pgvector is None:
            raise StoreLoadFailed("the store's database has no pgvector (CREATE EXTENSION "
                                  "vector)")
        pgvector_type, oid = embedding_type(self.conn, self.settings, rows, pgvector)
        self.conn.adapters.register_dumper(np.ndarray, vector_dumper(oid, pgvector_type))
        keep, self.rejected = check(rows, self.settings, pgvector_type == "halfvec")
        self.isolation = Isolation(rows.vectors.num_rows, self.settings.statement_timeout_s,
                                   is_data_error, is_transient)
        self.staged = stage(self.conn, self.settings, rows, keep, pgvector_type, oid, pgvector,
                            self.load_key, self.isolation, self.client.scrub)
        self.pgvector, self.pgvector_type = pgvector, pgvector_type
        self.ids_given = set(rows.vectors.column("id").to_pylist())

    def withdraw_earlier(self, prior, withdraw_ids: list[str], output: Optional[BatchOutput]
                         ) -> tuple[set, Optional[str]]:
        """The articles withdrawn (those of an earlier try with another outcome, those of the
        load this one replaces) that this load does not hold, and the load it replaces."""
        conn, settings, load_key = self.conn, self.settings, self.load_key
        withdrawn = set(prior[4] or ()) if prior is not None else set()
        if prior is not None and prior[2] != self.outcome:  # the same load, another outcome
            withdrawn.update(withdraw(
                conn, settings, load_key,
                sorted(set(withdraw_ids) | ids_of(conn, settings, load_key))))
        replaces = None
        if output is not None:
            replaces = previous_load(conn, settings, output, load_key)
            if replaces is not None:
                withdrawn.update(withdraw(conn, settings, replaces,
                                          sorted(ids_of(conn, settings, replaces))))
        withdrawn -= self.ids_given
        return withdrawn, replaces

    def write(self, catalog: Catalog) -> Part:
        """Under the lock: the HNSW indexes a table lacks (after the rows, for a first large
        load into an empty table), the staged rows upserted, range by range of articles (a range
        the server refuses halved down to the article it refuses, ``Isolation``), and a first
        load's tables analyzed."""
        assert self.staged is not None and self.isolation is not None
        staged, isolation = self.staged, self.isolation
        hnsw, index_after = self._indexes_first(catalog)
        done = Part()
        for part in isolation.halve(
                self.conn.transaction, staged.articles,
                lambda lo, hi: load_part(self.conn, self.settings, staged, lo, hi, self.load_key),
                lambda rn, exc: [refusal(self.rows, staged.keep[staged.set_aside(self.conn, rn)],
                                         exc, self.client.scrub)],
                again=lambda rn: bool(staged.positions(rn, rn + 1))):
            done.add(part)
        self.rejected += isolation.refused
        self._analyze(catalog, done)
        if index_after:
            self._build_indexes(hnsw)
        return done

    def _indexes_first(self, catalog: Catalog) -> tuple[list, bool]:
        """The tables without their HNSW index, and whether it is built after the rows (a
        first load of ``BUILD_INDEX_AFTER_ROWS`` or more into an empty table); else it is built
        now."""
        from psycopg import sql

        hnsw = [table for table in store_tables(self.settings)
                if f"{table.name}_embedding_hnsw" not in catalog.relations]
        if hnsw:  # read again under the lock: another load may have built them
            again = self.catalog()
            hnsw = [t for t in hnsw if f"{t.name}_embedding_hnsw" not in again.relations]
        index_after = False
        if hnsw:
            empty = self.conn.execute(sql.SQL("SELECT NOT EXISTS (SELECT 1 FROM {})").format(
                self.names["vectors"])).fetchone()
            index_after = bool(empty and empty[0]) and (
                self.rows.vectors.num_rows >= BUILD_INDEX_AFTER_ROWS)
            if not index_after:
                self._build_indexes(hnsw, bounded=True)
        return hnsw, index_after

    def _build_indexes(self, hnsw: list, bounded: bool = False) -> None:
        """The HNSW indexes of the tables ``hnsw``; unless ``bounded``, with no statement
        timeout (the keepalives bound it) and ``index_build_memory_mb``."""
        from psycopg import sql

        if not bounded:
            self.conn.execute("SET LOCAL statement_timeout = 0")  # the keepalives bound it
            if self.settings.index_build_memory_mb is not None:
                self.conn.execute(sql.SQL("SET LOCAL maintenance_work_mem = {}").format(
                    sql.Literal(f"{self.settings.index_build_memory_mb}MB")))
        for table in hnsw:
            self.conn.execute(index_statement(self.settings, table, self.pgvector_type,
                                              self.pgvector))

    def _analyze(self, catalog: Catalog, done: Part) -> None:
        """A first load's tables (no planner statistics yet) analyzed, when it wrote
        ``ANALYZE_AFTER_ROWS`` rows or more."""
        from psycopg import sql

        if catalog.unanalyzed and done.rows >= ANALYZE_AFTER_ROWS:
            for table in store_tables(self.settings):
                if table.name in catalog.unanalyzed:
                    self.conn.execute(sql.SQL("ANALYZE {}").format(
                        ident(self.settings.schema_name, table.name)))

    def record(self, done: Part, withdrawn: set, output: Optional[BatchOutput]) -> None:
        """The load's row in ``<table>_loads``: what it stored, its outcome, what it refused
        and withdrew, and the batch output it is of."""
        from psycopg import sql
        from psycopg.types.json import Jsonb

        self.conn.execute(sql.SQL(
            "INSERT INTO {} (load_key, rows, chunk_rows, articles_current, outcome, "
            "rejected, withdrawn, output, run_id) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (load_key) DO UPDATE SET loaded_at = now(), "
            "rows = EXCLUDED.rows, chunk_rows = EXCLUDED.chunk_rows, "
            "articles_current = EXCLUDED.articles_current, "
            "outcome = EXCLUDED.outcome, rejected = EXCLUDED.rejected, "
            "withdrawn = EXCLUDED.withdrawn, output = EXCLUDED.output, "
            "run_id = EXCLUDED.run_id").format(self.names["loads"]),
            (self.load_key, done.rows, done.chunk_rows, done.current, self.outcome,
             Jsonb(self.rejected), Jsonb(sorted(withdrawn)),
             None if output is None else output.prefix,
             None if output is None else output.run_id))

"""The pgvector backend's ``VectorStore`` (``Store``: its loads, searches and reads, each in a
room of its own beside this one) and its factory for the registry (``store_of``,
``transforms.stores.BACKENDS``)."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from transforms.stores.base import BatchOutput, LoadRows, StoreError, StoreLoad, StoreLoadFailed
from transforms.stores.pgvector.catalog import read_catalog, refuse_foreign
from transforms.stores.pgvector.load import load as load_rows
from transforms.stores.pgvector.search import Reader
from transforms.stores.pgvector.search import search as search_store
from transforms.stores.pgvector.settings import StoreSettings, resolve_dsn
from transforms.stores.pgvector.sql import Client

if TYPE_CHECKING:
    import psycopg


class Store:
    """A connection to the store and the loads into it. ``retry_s`` of the settings bounds how long
    a load retries on transient errors (``is_transient``)."""

    def __init__(self, settings: StoreSettings, dsn: Optional[str] = None):
        self.settings = settings
        self._client = Client(settings, dsn if dsn is not None else resolve_dsn(settings))

    def scrub(self, text: str) -> str:
        return self._client.scrub(text)

    def connect(self) -> "psycopg.Connection":
        """A connection to read the store (a search, the ledger's check against it), once the
        catalog shows no table, index or trigger function of the store that another role owns
        (``refuse_foreign``: ``StoreError``): a read of such a table would run its owner's code
        (a row security policy, a view) as this connection's role."""
        import psycopg

        failure: Optional[StoreError] = None
        try:
            conn = self._client.open()
        except psycopg.Error as exc:
            failure = self._client.failure(exc, "cannot connect to the store")
        if failure is not None:
            raise failure
        try:
            refuse_foreign(self.settings, read_catalog(conn, self.settings), StoreError)
            conn.commit()
        except StoreError as exc:
            failure = StoreError(self.scrub(str(exc)))
        except psycopg.Error as exc:
            failure = self._client.failure(exc, "cannot read the store's catalog")
        except BaseException:
            conn.close()
            raise
        if failure is not None:
            conn.close()
            raise failure
        return conn

    def load(self, rows: LoadRows, load_key: str, ids: Optional[Sequence[str]] = None, *,
             output: Optional[BatchOutput] = None, reload: bool = False) -> StoreLoad:
        """Load ``rows`` under ``load_key`` (``transforms.stores.pgvector``'s docstring,
        ``load``); retried with backoff on transient errors for up to ``retry_s``. Rows the store
        cannot take are left out and named in ``StoreLoad.rejected``; the rest is stored.
        ``ids``: every article id this load's key may have written before (a streaming
        micro-batch's rows and dead letters; default: the rows' ids): a load under the same key
        with another outcome withdraws its rows among them (and those the store finds under the
        key). ``output``: a batch run's output and when the run began publishing into it: the
        load replaces the previous run's load of that output (``BatchOutput``). ``reload``: load
        again although the key is loaded with the same outcome (the rows the store refused then,
        once the table is fixed; rows withdrawn since). Raises ``StoreLoadFailed`` (scrubbed,
        with no chained exception) when it gives up or on any error that is neither transient
        nor a data error, or when the server refuses too many rows (``retry.REFUSED_SHARE``);
        nothing of the load is then stored."""
        return load_rows(self._client, rows, load_key, ids, output=output, reload=reload)

    @contextlib.contextmanager
    def reader(self) -> Iterator[Reader]:
        """A read of the store for ``newsvec ledger --store`` (``base.StoreReader``), on one
        connection (``connect``: the catalog checked first)."""
        with self.connect() as conn:
            yield Reader(conn, self.settings)

    def search(self, vector, k: int, all_copies: bool = False) -> list[dict]:
        """The ``k`` nearest stories to ``vector`` (``search.search``), on one connection
        (``connect``: the catalog checked first)."""
        return search_store(self.connect, self.settings, vector, k, all_copies)


def store_of(settings: StoreSettings) -> Store:
    """The store of a config's ``store:`` section; ``StoreLoadFailed`` when its connection string
    is not set."""
    failure = None
    try:
        return Store(settings)
    except StoreError as exc:
        failure = StoreLoadFailed(str(exc))
    raise failure  # outside the except: nothing chained

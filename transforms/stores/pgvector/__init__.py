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
loader's rights (``refuse_foreign``).

The connection string (DSN) never comes from the config file: it is read at run time from the
Secret Manager secret ``store.dsn_secret``, the secret file ``store.dsn_file`` or the environment
variable ``store.dsn_env``, and it is scrubbed from every message this backend logs or raises (and
from psycopg's own log records).

The backend's rooms: ``settings`` (the ``store:`` section, the DSN's source), ``sql`` (connections,
scrubbing, which errors are transient or the rows'), ``schema`` (the tables as SQL), ``catalog``
(what the database holds of them: ownership, in-place upgrade, the embedding's type), ``rows``
(checks and COPY rows), ``stage``, ``upsert``, ``withdraw`` (and pruning the kept versions),
``load`` (a load and its tries), ``search`` (search and the ledger's reads), and ``store`` (the
``Store`` and its factory). What is not PostgreSQL's is in ``transforms.stores``: ``secret``,
``scrub``, ``retry``.
"""
from transforms.stores.pgvector.catalog import pgvector_schema
from transforms.stores.pgvector.schema import vector_sql_type
from transforms.stores.pgvector.settings import StoreSettings, resolve_dsn
from transforms.stores.pgvector.sql import UNPARSABLE_DSN, is_data_error, is_transient, scrub
from transforms.stores.pgvector.store import Store, store_of

__all__ = ["UNPARSABLE_DSN", "Store", "StoreSettings", "is_data_error", "is_transient",
           "pgvector_schema", "resolve_dsn", "scrub", "store_of", "vector_sql_type"]

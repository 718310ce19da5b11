"""The pgvector backend's SQL client: connections to PostgreSQL (``Client``: keepalives on both
ends, bounded waits, a ``search_path`` no other role can put objects on), the connection string
kept out of every message this backend logs or raises and out of psycopg's own log records
(``scrub``), and which of psycopg's errors a load retries or sets rows aside for
(``is_transient``, ``is_data_error``: the policy itself is ``transforms.stores.retry``'s)."""
from __future__ import annotations

import functools
import logging
import re
from typing import TYPE_CHECKING, Any, Optional

from transforms.stores.base import StoreError, StoreLoadFailed
from transforms.stores.pgvector.settings import StoreSettings
from transforms.stores.scrub import ScrubbedLog, secrets_of, without

if TYPE_CHECKING:
    import psycopg

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


UNPARSABLE_DSN = ("the connection string could not be parsed (check its quoting; in a "
                  "postgresql:// URL, write a % in the password as %25, a / as %2F and an @ as "
                  "%40)")


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


@functools.lru_cache(maxsize=64)
def _secrets(dsn: str) -> tuple[str, ...]:
    """Every piece of ``dsn`` a message must not show (``scrub.secrets_of``), with libpq's
    reading of it (``_parsed``)."""
    return secrets_of(dsn, _parsed(dsn))


def scrub(text: str, dsn: str) -> str:
    """``text`` without the connection string or any of its secret-bearing parts (password,
    ``sslpassword``, user, hosts: ``_secrets``)."""
    return without(text, _secrets(dsn))


# On the ``psycopg`` logger: at DEBUG psycopg names each host (and port) it tries and each it
# cannot resolve, a second host of a multi-host DSN included, and quotes libpq's messages; its
# warnings name a connection (its host, user and database). Every ``Client`` adds its DSN.
_DRIVER_LOG = ScrubbedLog("psycopg", scrub)
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
    it are found by halving the load (``retry.Isolation``) and set aside."""
    import psycopg
    from psycopg import errors

    return isinstance(exc, (psycopg.DataError, psycopg.IntegrityError,
                            errors.ProgramLimitExceeded, ValueError, OverflowError))


class Client:
    """The connections of one store: its settings and its connection string (``dsn``), which
    psycopg must be able to parse (``StoreError`` otherwise, a fixed message)."""

    def __init__(self, settings: StoreSettings, dsn: str):
        self.settings = settings
        self._dsn = dsn
        if _parsed(self._dsn) is None:
            raise StoreError(f"store: {UNPARSABLE_DSN}")
        _DRIVER_LOG.add(self._dsn)  # before any connection: psycopg logs the hosts it tries

    def scrub(self, text: str) -> str:
        return scrub(text, self._dsn)

    def failure(self, exc: BaseException, what: str) -> StoreLoadFailed:
        """``_failure`` of ``exc`` with this store's connection string."""
        return _failure(exc, self._dsn, what)

    def _connect_kwargs(self) -> dict:
        """``connect_timeout``, client-side TCP keepalives and ``tcp_user_timeout``, where the
        DSN sets none itself."""
        given = _parsed(self._dsn) or {}
        wanted = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": KEEPALIVE_IDLE_S,
                  "keepalives_interval": KEEPALIVE_INTERVAL_S,
                  "keepalives_count": KEEPALIVE_COUNT, "tcp_user_timeout": TCP_USER_TIMEOUT_MS}
        return {k: v for k, v in wanted.items() if k not in given}

    def open(self, load: bool = False) -> "psycopg.Connection":
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

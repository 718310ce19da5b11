"""Keeping a connection string out of messages, whatever the backend: the pieces of a DSN that no
message may show (the whole string, its password, user and hosts, raw and percent-decoded), their
removal from a text, and a ``logging.Filter`` that removes them from a driver's own log records.
The backend adds its driver's reading of the DSN (``secrets_of``'s ``parsed``) and names the
driver's logger (``transforms.stores.pgvector.sql``)."""
from __future__ import annotations

import logging
import re
import threading
import urllib.parse
from typing import Any, Callable, Mapping, Optional


def url_secrets(dsn: str) -> set[str]:
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


def secrets_of(dsn: str, parsed: Optional[Mapping[str, Any]]) -> tuple[str, ...]:
    """Every piece of ``dsn`` a message must not show, longest first: the whole string; the
    password and ``sslpassword`` however short; the user and each host and host address (of two
    characters or more: a one-letter name would blank out every message). ``parsed``: the
    driver's reading of the DSN (its keys and values), None where it cannot read it."""
    secrets: set[str] = {dsn} | {s for s in url_secrets(dsn) if len(s) >= 2}
    for key, value in (parsed or {}).items():
        if value is None or value == "":
            continue
        if key in ("password", "sslpassword"):
            secrets.add(str(value))
        elif key in ("user", "host", "hostaddr"):
            secrets.update(v for v in str(value).split(",") if len(v) >= 2)
    secrets.discard("")
    return tuple(sorted(secrets, key=len, reverse=True))


def without(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with each of ``secrets`` (``secrets_of``) written as ``***``."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


class ScrubbedLog(logging.Filter):
    """On the logger of the driver ``driver``: its records scrubbed (``scrub(text, dsn)``) of
    every connection string a store of this process holds (``add``). A driver's debug records
    name each host (and port) it tries, and its warnings name a connection (its host, user and
    database)."""

    def __init__(self, driver: str, scrub: Callable[[str, str], str]) -> None:
        super().__init__()
        self._driver, self._scrub = driver, scrub
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
        except Exception:  # pylint: disable=broad-except  # never raise into the driver's call
            record.msg, record.args, record.exc_info, record.exc_text = (
                f"(a {self._driver} log record that could not be formatted)", (), None, None)
            return True
        exc_text = record.exc_text
        for dsn in dsns:
            text = self._scrub(text, dsn)
            exc_text = self._scrub(exc_text, dsn) if exc_text else exc_text
        record.msg, record.args, record.exc_text = text, (), exc_text
        return True

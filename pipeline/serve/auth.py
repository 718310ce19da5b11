"""Who may call the service: with an API key configured (``serve.api_key_secret``,
``serve.api_key_file`` or ``serve.api_key_env``, read as the store's connection string is, never
from the config file), every route but ``/healthz`` and ``/readyz`` (the probes) and the search
page's files (no data) needs ``Authorization: Bearer KEY``, compared in constant time. Without
one, the service listens on a loopback address only: binding any other refuses to start
(``ServeRefused``); and it answers only requests addressed to a loopback name (``Host``): a web
page the user opens elsewhere can reach 127.0.0.1 too, under its own name rebound to it (DNS
rebinding), and read the answers.
(A cross-site form post cannot send JSON: ``limits.read_json`` takes only
``application/json``.)"""
from __future__ import annotations

import functools
import hmac
import ipaddress
from typing import Optional

from pipeline.serve import search_page
from pipeline.serve.limits import ApiError
from transforms.settings import ServeSettings
from transforms.stores.secret import read_secret

OPEN_PATHS = frozenset({"/healthz", "/readyz", *search_page.PATHS})
"""The routes called without a key: the probes, and the search page's files (which hold no data:
what the page fetches needs the key)."""


class ServeRefused(RuntimeError):
    """The service cannot start as configured (the message says why)."""


def api_key(settings: ServeSettings) -> Optional[str]:
    """The API key, from ``serve.api_key_secret``, ``serve.api_key_file`` or the environment
    variable ``serve.api_key_env`` (the first one set); None when none is set. ``ServeRefused``
    when a named secret or file cannot be read."""
    return read_secret(settings.api_key_secret, settings.api_key_file, settings.api_key_env,
                       key="serve.api_key", what="the API key", error=ServeRefused)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def check_binding(host: str, key: Optional[str]) -> None:
    """``ServeRefused`` for a host other than a loopback one with no API key configured."""
    if key is None and not is_loopback(host):
        raise ServeRefused(
            f"serve.host {host} is not a loopback address, and no API key is configured: anyone "
            "who can reach it could use the model and read the corpus. Set the environment "
            "variable serve.api_key_env names (NEWSVEC_API_KEY by default), serve.api_key_file "
            "or serve.api_key_secret, or bind 127.0.0.1")


def check_host(host: Optional[str], key: Optional[str]) -> None:
    """``ApiError`` 403 for a keyless service called by a ``Host`` other than a loopback one."""
    if key is not None:
        return
    if not _loopback_host(host or ""):
        raise ApiError(403, "a service with no API key answers requests addressed to a loopback "
                            "name only (Host: 127.0.0.1, localhost or [::1]), not to "
                            f"{(host or '(none)')[:100]!r}: configure an API key to serve "
                            "under another name", "forbidden_host", type_="permission_error")


@functools.lru_cache(maxsize=64)  # a few names, each request: ipaddress parses slowly
def _loopback_host(host: str) -> bool:
    name = host.strip()
    if name.startswith("["):  # [::1]:8080
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    return is_loopback(name.lower())


def check_request(path: str, authorization: Optional[str], key: Optional[str]) -> None:
    """``ApiError`` 401 unless the route is open, no key is configured, or the request carries
    ``Authorization: Bearer KEY`` with the key (compared in constant time)."""
    if key is None or path in OPEN_PATHS:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode("utf-8", "surrogateescape"), key.encode("utf-8")):
        raise ApiError(401, "a valid API key is needed: send Authorization: Bearer KEY",
                       "invalid_api_key", type_="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})

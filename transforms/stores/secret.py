"""Reading a store's connection string (DSN) at run time, whatever the backend: from a Secret
Manager secret version, a secret file or an environment variable (``store.dsn_secret``,
``store.dsn_file``, ``store.dsn_env``), never from the config file; ``newsvec serve``'s API key
is read the same way (``read_secret``: ``serve.api_key_secret``, ``_file``, ``_env``). Nothing of
the secret is in a message (``transforms.stores.scrub`` keeps it out of the backend's)."""
from __future__ import annotations

import logging
import os
from typing import Optional

from transforms.stores.base import StoreError

_LOG = logging.getLogger("newsvec.store")

SECRET_MANAGER_URL = "https://secretmanager.googleapis.com/v1/{name}:access"
SECRET_ACCESS_TIMEOUT_S = 30


def access_secret(name: str, setting: str = "store.dsn_secret",
                  error: type[Exception] = StoreError) -> str:
    """The payload of the Secret Manager secret version ``name`` (its REST API, with the
    application default credentials); ``error`` (``StoreError``) when it cannot be read, its
    message starting with the config key ``setting``. Nothing of the payload is in a message, and
    no exception is chained."""
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
        raise error(f"{setting}: cannot read {name} ({failure})")
    if response.status_code != 200:
        try:  # Google's error body: its message names the missing permission, never the payload
            reason = str(response.json()["error"]["message"])[:300]
        except Exception:  # pylint: disable=broad-except  # not JSON
            reason = response.reason or ""
        raise error(f"{setting}: cannot read {name} (HTTP {response.status_code}: {reason})")
    payload = None
    try:
        payload = base64.b64decode(response.json()["payload"]["data"]).decode("utf-8").strip()
    except Exception:  # pylint: disable=broad-except  # the body is the secret: never quoted
        pass
    if payload is None:
        raise error(f"{setting}: {name} is not a UTF-8 secret payload")
    if not payload:
        raise error(f"{setting}: {name} is empty")
    return payload


def read_dsn(dsn_secret: Optional[str], dsn_file: Optional[str], dsn_env: str) -> str:
    """The connection string, from the Secret Manager secret ``dsn_secret``, the file
    ``dsn_file`` or the environment variable ``dsn_env`` (the first one set)."""
    dsn = read_secret(dsn_secret, dsn_file, dsn_env)
    if dsn is None:
        raise StoreError(f"store: set the environment variable {dsn_env} to the "
                         "connection string (or store.dsn_file)")
    return dsn


def read_secret(secret: Optional[str], file: Optional[str], env: str, *, key: str = "store.dsn",
                what: str = "the connection string",
                error: type[Exception] = StoreError) -> Optional[str]:
    """A secret (the store's connection string, ``newsvec serve``'s API key) from the Secret
    Manager secret version ``secret``, the file ``file`` or the environment variable ``env``, the
    first one set; None when only ``env`` is given and it is unset or empty. ``error`` when a
    secret or a file is named and cannot be read, its message naming the config key
    (``{key}_secret``, ``{key}_file``) and ``what`` it holds, never the secret."""
    if secret:
        return access_secret(secret, f"{key}_secret", error)
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                value = f.read().strip()
        except OSError as exc:
            raise error(f"{key}_file: cannot read {what} ({exc.strerror})") from None
        if not value:
            raise error(f"{key}_file: the file is empty")
        try:
            mode = os.stat(file).st_mode
        except OSError:
            mode = 0
        if mode & 0o077:
            _LOG.warning("%s_file %s can be read by others than its owner (mode %o): "
                         "chmod 600 it", key, file, mode & 0o777)
        return value
    return os.environ.get(env, "").strip() or None

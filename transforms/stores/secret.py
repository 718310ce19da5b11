"""Reading a store's connection string (DSN) at run time, whatever the backend: from a Secret
Manager secret version, a secret file or an environment variable (``store.dsn_secret``,
``store.dsn_file``, ``store.dsn_env``), never from the config file. Nothing of the secret is in a
message (``transforms.stores.scrub`` keeps it out of the backend's)."""
from __future__ import annotations

import logging
import os
from typing import Optional

from transforms.stores.base import StoreError

_LOG = logging.getLogger("newsvec.store")

SECRET_MANAGER_URL = "https://secretmanager.googleapis.com/v1/{name}:access"
SECRET_ACCESS_TIMEOUT_S = 30


def access_secret(name: str) -> str:
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


def read_dsn(dsn_secret: Optional[str], dsn_file: Optional[str], dsn_env: str) -> str:
    """The connection string, from the Secret Manager secret ``dsn_secret``, the file
    ``dsn_file`` or the environment variable ``dsn_env`` (the first one set)."""
    if dsn_secret:
        return access_secret(dsn_secret)
    if dsn_file:
        try:
            with open(dsn_file, encoding="utf-8") as f:
                dsn = f.read().strip()
        except OSError as exc:
            raise StoreError(f"store.dsn_file: cannot read the connection string "
                             f"({exc.strerror})") from None
        if not dsn:
            raise StoreError("store.dsn_file: the file is empty")
        try:
            mode = os.stat(dsn_file).st_mode
        except OSError:
            mode = 0
        if mode & 0o077:
            _LOG.warning("store.dsn_file %s can be read by others than its owner (mode %o): "
                         "chmod 600 it", dsn_file, mode & 0o777)
        return dsn
    dsn = os.environ.get(dsn_env, "").strip()
    if not dsn:
        raise StoreError(f"store: set the environment variable {dsn_env} to the "
                         "connection string (or store.dsn_file)")
    return dsn

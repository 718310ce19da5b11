"""Shared fixtures. The vLLM engine is loaded once per test session (transforms.engines.base keeps
it)."""
from __future__ import annotations

import os
import tempfile

import pytest

from pipeline import config as config_lib
from tests.common import GCS_BUCKET, STORE_DSN_ENV, make_config
from tests.emulators import (
    gcs_for_beam,
    postgres_server_fixture,  # noqa: F401  # the postgres_server fixture
)

# Beam leaves beam-temp* folders in TMPDIR on every run: give the session its own. Worker
# processes the runners start import this module too: they keep their session's folder, where the
# shared engine's address, lock and busy files are (every process of a machine must find them).
# Each pytest-xdist worker (`make test` runs two) is a session of its own, with its own folder,
# engine and emulators: it inherits the controller's variables, so the owner tells them apart.
_SESSION = os.environ.get("PYTEST_XDIST_WORKER", "main")
if os.environ.get("NEWSVEC_TEST_SESSION_OWNER") != _SESSION:
    os.environ["NEWSVEC_TEST_SESSION_OWNER"] = _SESSION
    os.environ["NEWSVEC_TEST_SESSION_TMP"] = tempfile.mkdtemp(prefix=f"newsvec-tests-{_SESSION}-")
_SESSION_TMP = os.environ["NEWSVEC_TEST_SESSION_TMP"]
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = None
# Short publish leases and clean-up ages (below the floors users get: transforms/output/lease.py),
# for the whole session and the processes it starts; tests of the floors themselves unset it.
os.environ["NEWSVEC_UNSAFE_TEST_TIMINGS"] = "1"

# Seconds the test process may take to exit once the session is over (engines ended, exit hooks
# run) before it prints every thread's stack and exits with status 1: a thread the interpreter
# waits for at exit would otherwise hang the run, its tests all passed, until CI's own limit.
EXIT_LIMIT_S = int(os.environ.get("NEWSVEC_TEST_EXIT_LIMIT_S", "300"))


def pytest_unconfigure(config):  # pylint: disable=unused-argument
    import faulthandler

    faulthandler.dump_traceback_later(EXIT_LIMIT_S, exit=True)


@pytest.fixture(scope="session")
def fp32_config() -> config_lib.Config:
    return make_config()


@pytest.fixture(scope="session")
def tokenizer(fp32_config):
    from transforms.text import HeadTokenizer

    return HeadTokenizer(fp32_config.model)


# gcs and root: used by test_reruns.py and test_incremental.py.
@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with gcs_for_beam(GCS_BUCKET, tmp_path_factory.mktemp("gcs-log")) as emulator:
        yield emulator


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path):
    """An output root: local disk, then a folder in the GCS emulator's bucket."""
    if request.param == "gcs":
        request.getfixturevalue("gcs")
        return f"gs://{GCS_BUCKET}/{tmp_path.name}"
    return str(tmp_path)


@pytest.fixture
def pg(postgres_server, request) -> str:
    """A fresh database (with pgvector) on the session's PostgreSQL, for one test: its DSN."""
    import re

    name = "t_" + re.sub(r"[^a-z0-9_]", "_", request.node.name.lower())[:40] + "_" + \
        os.urandom(3).hex()
    dsn = postgres_server.create_database(name)
    yield dsn
    postgres_server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def store_settings(pg, monkeypatch):
    """``store:`` settings turned on, their connection string (``pg``) in the environment."""
    from transforms.stores.pgvector import StoreSettings

    monkeypatch.setenv(STORE_DSN_ENV, pg)
    return StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, retry_s=5)



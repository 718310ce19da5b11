"""Shared fixtures. The vLLM engine is loaded once per test session (transforms.engines.base keeps
it)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from pipeline import config as config_lib
from tests.emulators import (
    gcs_for_beam,
    postgres_server_fixture,  # noqa: F401  # the postgres_server fixture
)

# Beam leaves beam-temp* folders in TMPDIR on every run: give the session its own. Worker
# processes the runners start import this module too: they keep their session's folder, where the
# shared engine's address, lock and busy files are (every process of a machine must find them).
_SESSION_TMP = (os.environ.get("NEWSVEC_TEST_SESSION_TMP")
                or tempfile.mkdtemp(prefix="newsvec-tests-"))
os.environ["NEWSVEC_TEST_SESSION_TMP"] = os.environ["TMPDIR"] = _SESSION_TMP
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


REPO = Path(__file__).resolve().parent.parent
SAMPLE_EVENTS = REPO / "pipeline" / "sample_data" / "news-events.jsonl"
# The 2,225 BBC News articles (train.csv, val.csv, test.csv, a `text` column each), which some
# tests read for realistic text; not in the repository.
BBC = Path(os.environ.get("NEWSVEC_BBC_DIR") or REPO.parent / "shared" / "data" / "bbc-news")


def bbc_file(name: str) -> Path:
    """``BBC / name``, or the test is skipped (failed under ``CI=true``) saying how to get it."""
    from tests.emulators import skip_or_fail

    path = BBC / name
    if not path.is_file():
        skip_or_fail(f"the BBC News articles are not at {BBC} (no {name}): set NEWSVEC_BBC_DIR "
                     "to the folder of the BBC News dataset's train.csv, val.csv and test.csv "
                     "(columns text, label)")
    return path
# The bucket of the `gcs` fixture (test_gcs.py has its own fixture and bucket).
GCS_BUCKET = "newsvec-reruns"


def make_config(**changes) -> config_lib.Config:
    """configs/local.yaml at float32 (exact parity with sentence-transformers), with changes."""
    base = config_lib.load(config_lib.DEFAULT_CONFIG)
    model = base.model.model_copy(update={"dtype": "float32"})
    return base.model_copy(update={"model": model, **changes})


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
def roles(postgres_server, pg):
    """``roles(kind)``: a new login role of the session's PostgreSQL, its name unique (roles
    belong to the whole server, which other tests share); each dropped after the test, with what
    it owns and every privilege granted to it in ``pg``."""
    import psycopg

    made: list[str] = []

    def make(kind: str) -> str:
        name = f"{kind}_{os.urandom(4).hex()}"
        postgres_server.execute(f"CREATE ROLE {name} LOGIN")
        made.append(name)
        return name

    yield make
    if made:
        with psycopg.connect(pg, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {', '.join(made)} CASCADE")
        for name in made:
            postgres_server.execute(f"DROP ROLE IF EXISTS {name}")


STORE_DSN_ENV = "NEWSVEC_TEST_STORE_DSN"


@pytest.fixture
def store_settings(pg, monkeypatch):
    """``store:`` settings turned on, their connection string (``pg``) in the environment."""
    from transforms.stores.pgvector import StoreSettings

    monkeypatch.setenv(STORE_DSN_ENV, pg)
    return StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, retry_s=5)


# Tiny models built in the session (tools/tiny_models.py: random weights, a tokenizer trained on
# made-up text, nothing downloaded), for the parity tests and check-model's.
@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    from tools.tiny_models import build_bert

    return build_bert(tmp_path_factory.mktemp("tiny-bert"), seed=1)


@pytest.fixture(scope="session")
def tiny_modernbert(tmp_path_factory) -> Path:
    from tools.tiny_models import build_modernbert

    return build_modernbert(tmp_path_factory.mktemp("tiny-modernbert"), seed=1)


def tiny_model_settings(folder: Path, dtype: str = "float32", **changes):
    """configs/local.yaml's model section for a tiny model (tools/tiny_models.py) in ``folder``."""
    base = config_lib.load(config_lib.DEFAULT_CONFIG).model
    return base.model_copy(update={"name": f"tiny/{folder.name}", "path": str(folder),
                                   "dim": 128, "dtype": dtype, **changes})

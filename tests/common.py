"""What tests of every room use that is not a fixture: the repository's paths, the BBC News
articles, the config every test starts from. Fixtures are in the conftest.py files (tests/ for
the session's, each room's own beside its tests)."""
from __future__ import annotations

import os
from pathlib import Path

from pipeline import config as config_lib

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


STORE_DSN_ENV = "NEWSVEC_TEST_STORE_DSN"


def tiny_model_settings(folder: Path, dtype: str = "float32", **changes):
    """configs/local.yaml's model section for a tiny model (tools/tiny_models.py) in ``folder``."""
    base = config_lib.load(config_lib.DEFAULT_CONFIG).model
    return base.model_copy(update={"name": f"tiny/{folder.name}", "path": str(folder),
                                   "dim": 128, "dtype": dtype, **changes})

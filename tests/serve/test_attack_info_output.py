"""``GET /info`` reads the output's committed run (``corpus.output_record``: ``committed_summary``)
on every request. Once the service runs, that read can fail: a storage error, or a summary that
is not the committed run's (a stalled publisher of an earlier release overwrote it, which
``published_summary`` itself names; ``committed_summary`` then raises ``OutputUncheckable``).
Either escapes the route as a 500 ``internal_error`` "see the service's log", so a client that
checks itself against the service at start (docs/serving.md, "Checking a client against the
corpus") cannot read the model's label and signature, which do not depend on the output at all;
the reason is only in the log."""
from __future__ import annotations

import json

from tests.common import make_config
from tests.serve.conftest import API_KEY, headers, need
from tests.serve.test_corpus_publish import RUN_A, RUN_B, _manifest, _summary, _vectors

need("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from pipeline.serve.app import create_app  # noqa: E402
from tests.serve.test_serve_hostile import Gated  # noqa: E402


def test_info_answers_when_the_outputs_summary_cannot_be_read(tmp_path):
    config = make_config(output=str(tmp_path), serve=make_config().serve.model_copy(
        update={"search": "parquet"}))
    _vectors(tmp_path, "part-a.parquet", ["a1"])
    _summary(tmp_path, RUN_A, config.model.query_prefix, config.model.document_prefix)
    _manifest(tmp_path, RUN_A, "committed", ["vectors/part-a.parquet"])
    app = create_app(config, Gated(), api_key=API_KEY)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        before = client.get("/info", headers=headers())
        # a stalled publisher of an earlier release writes its run's summary over the committed
        # run's (what published_summary guards against)
        _summary(tmp_path, RUN_B, config.model.query_prefix, config.model.document_prefix)
        after = client.get("/info", headers=headers())
    assert before.status_code == 200 and before.json()["output_run"]["run_id"] == RUN_A
    assert after.status_code == 200, (
        f"GET /info once the output's summary is not its committed run's: {after.status_code} "
        f"{json.dumps(after.json())[:200]}")
    info = after.json()
    assert info["model"]["label"] == "gated@test" and info["embedding_signature"]
    assert "cannot be read" in json.dumps(info["output_run"]), info["output_run"]

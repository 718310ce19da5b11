"""A newer run published into the output while ``newsvec serve`` searches it: while the run is
publishing (its manifest ``publishing``: no committed summary to check it against), its files are
in ``vectors/`` already; the Parquet corpus must not search them unchecked, and once the run
commits with another model's settings its vectors must never be searched with this service's
queries (no model: the output, its manifest and summaries written by hand)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.search import Filters
from tests.common import make_config
from tests.serve.conftest import need

need("fastapi")

from pipeline.serve.corpus import corpus_for  # noqa: E402
from pipeline.serve.limits import ApiError  # noqa: E402
from tests.serve.test_corpus import DIM  # noqa: E402
from tests.serve.test_corpus import _write as _vectors  # noqa: E402
from transforms.output import manifest as manifest_lib  # noqa: E402

RUN_A, RUN_B = "20261201T000000Z-0000000a", "20261202T000000Z-0000000b"


def _manifest(out: Path, run_id: str, state: str, vectors: list[str]) -> None:
    manifest_lib.write_manifest(str(out), manifest_lib.Manifest(
        run_id=run_id, state=state, started_at=1.0, vectors=vectors, dead_letter=[],
        summary="_summary.json", counts={},
        committed_at="2026-12-01T00:00:00+00:00" if state == "committed" else None))


def _summary(out: Path, run_id: str, query_prefix: str, document_prefix: str) -> None:
    (out / "_summary.json").write_text(json.dumps({"run_id": run_id, "model": {
        "query_prefix": query_prefix, "document_prefix": document_prefix}}))


def test_a_run_publishing_with_another_model_is_never_searched(tmp_path):
    now = [0.0]
    config = make_config(output=str(tmp_path), serve=make_config().serve.model_copy(
        update={"search": "parquet"}))
    ours = (config.model.query_prefix, config.model.document_prefix)
    _vectors(tmp_path, "part-a.parquet", ["a1", "a2"])
    _summary(tmp_path, RUN_A, *ours)
    _manifest(tmp_path, RUN_A, "committed", ["vectors/part-a.parquet"])
    config, corpus = corpus_for(config)
    corpus._clock = lambda: now[0]  # pylint: disable=protected-access
    corpus._checked = 0.0  # pylint: disable=protected-access
    query = np.eye(DIM)[0]
    assert [h["id"] for h in corpus.nearest(query, 5, False, Filters())] == ["a1", "a2"]

    # run B, written by another model (its query prefix differs), publishes: its manifest says
    # "publishing", the old files are deleted and B's copied in; the summary is still A's
    _manifest(tmp_path, RUN_B, "publishing",
              [f"_staging/{RUN_B}/vectors/part-b.parquet"])
    (tmp_path / "vectors" / "part-a.parquet").unlink()
    _vectors(tmp_path, "part-b.parquet", ["b1", "b2"])
    now[0] = 61
    try:
        during = [h["id"] for h in corpus.nearest(query, 5, False, Filters())]
    except ApiError as exc:
        during = exc.code
    # B commits: its summary records the other model's prefixes
    _summary(tmp_path, RUN_B, "other model's query: ", "other model's passage: ")
    _manifest(tmp_path, RUN_B, "committed", ["vectors/part-b.parquet"])
    now[0] = 122
    with pytest.raises(ApiError) as after:  # a newer run that differs: 503, never its vectors
        hits = corpus.nearest(query, 5, False, Filters())
        pytest.fail(f"B's vectors searched after it committed with another model: {hits}")
    assert after.value.code == "corpus_unavailable"
    assert during in (["a1", "a2"], "corpus_unavailable"), (
        f"an unchecked, publishing run searched: {during}")


def test_a_run_of_the_same_model_is_searched_once_committed_and_not_before(tmp_path):
    now = [0.0]
    config = make_config(output=str(tmp_path), serve=make_config().serve.model_copy(
        update={"search": "parquet"}))
    ours = (config.model.query_prefix, config.model.document_prefix)
    _vectors(tmp_path, "part-a.parquet", ["a1"])
    _summary(tmp_path, RUN_A, *ours)
    _manifest(tmp_path, RUN_A, "committed", ["vectors/part-a.parquet"])
    config, corpus = corpus_for(config)
    corpus._clock = lambda: now[0]  # pylint: disable=protected-access
    corpus._checked = 0.0  # pylint: disable=protected-access
    query = np.eye(DIM)[0]
    _manifest(tmp_path, RUN_B, "publishing", [f"_staging/{RUN_B}/vectors/part-b.parquet"])
    (tmp_path / "vectors" / "part-a.parquet").unlink()
    _vectors(tmp_path, "part-b.parquet", ["b1", "b2"])
    now[0] = 61
    assert [h["id"] for h in corpus.nearest(query, 5, False, Filters())] == ["a1"]
    _summary(tmp_path, RUN_B, *ours)
    _manifest(tmp_path, RUN_B, "committed", ["vectors/part-b.parquet"])
    now[0] = 122
    assert [h["id"] for h in corpus.nearest(query, 5, False, Filters())] == ["b1", "b2"]


def test_a_service_started_while_a_run_publishes_searches_it_once_committed_and_checked(
        tmp_path):
    now = [0.0]
    config = make_config(output=str(tmp_path), serve=make_config().serve.model_copy(
        update={"search": "parquet"}))
    _vectors(tmp_path, "part-b.parquet", ["b1"])  # copied in already; no summary yet
    _manifest(tmp_path, RUN_B, "publishing", [f"_staging/{RUN_B}/vectors/part-b.parquet"])
    config, corpus = corpus_for(config)
    corpus._clock = lambda: now[0]  # pylint: disable=protected-access
    corpus._checked = 0.0  # pylint: disable=protected-access
    query = np.eye(DIM)[0]
    with pytest.raises(ApiError) as during:
        corpus.nearest(query, 5, False, Filters())
    assert during.value.code == "corpus_unavailable" and "publishing" in during.value.message
    _summary(tmp_path, RUN_B, "other model's query: ", config.model.document_prefix)
    _manifest(tmp_path, RUN_B, "committed", ["vectors/part-b.parquet"])
    now[0] = 61
    with pytest.raises(ApiError) as after:
        corpus.nearest(query, 5, False, Filters())
    assert after.value.code == "corpus_unavailable" and "prefix" in after.value.message

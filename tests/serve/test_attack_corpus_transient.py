"""A read of the output that fails once (a GCS 503 or a connection reset after Beam's retries, a
file gone for a moment) while the Parquet corpus loads a newly committed run: ``_load`` keeps
the failure as the corpus (``_index`` None) and records the run as read (``_run_id``), so every
later refresh finds "the same run" and never reads it again. The run read before, checked and
searchable, is thrown away, and every search answers 503 ``corpus_unavailable`` until the process
restarts or another run commits; ``/readyz`` still says ready (a Parquet corpus is not probed),
so neither Kubernetes nor Cloud Run replaces it. The same at start: one failed read and the
service never searches (docs/serving.md: the corpus is read "again when a newer run
publishes"; a transient error is no newer run)."""
from __future__ import annotations

import numpy as np

from pipeline.search import Filters
from tests.common import make_config
from tests.serve.conftest import need
from tests.serve.test_corpus_publish import DIM, RUN_A, RUN_B, _manifest, _summary, _vectors

need("fastapi")

from pipeline.serve import corpus as corpus_lib  # noqa: E402
from pipeline.serve.limits import ApiError  # noqa: E402


class FailingOnce:
    """``ParquetIndex``, whose next ``fail`` reads raise an ``OSError`` (a transient error)."""

    def __init__(self):
        self.fail = 0
        self.index = corpus_lib.ParquetIndex

    def __call__(self, *args, **kwargs):
        if self.fail > 0:
            self.fail -= 1
            raise OSError("503 Service Unavailable: backend error (transient)")
        return self.index(*args, **kwargs)


def _ids(corpus):
    try:
        return [h["id"] for h in corpus.nearest(np.eye(DIM)[0], 5, False, Filters())]
    except ApiError as exc:
        return exc.code


def _config(tmp_path):
    return make_config(output=str(tmp_path), serve=make_config().serve.model_copy(
        update={"search": "parquet"}))


def test_a_transient_error_reading_a_new_run_does_not_end_the_search(tmp_path, monkeypatch):
    now = [0.0]
    config = _config(tmp_path)
    ours = (config.model.query_prefix, config.model.document_prefix)
    _vectors(tmp_path, "part-a.parquet", ["a1"])
    _summary(tmp_path, RUN_A, *ours)
    _manifest(tmp_path, RUN_A, "committed", ["vectors/part-a.parquet"])
    reads = FailingOnce()
    monkeypatch.setattr(corpus_lib, "ParquetIndex", reads)
    config, corpus = corpus_lib.corpus_for(config)
    corpus._clock = lambda: now[0]  # pylint: disable=protected-access
    corpus._checked = 0.0  # pylint: disable=protected-access
    assert _ids(corpus) == ["a1"]

    # run B (the same model) publishes and commits
    (tmp_path / "vectors" / "part-a.parquet").unlink()
    _vectors(tmp_path, "part-b.parquet", ["b1", "b2"])
    _summary(tmp_path, RUN_B, *ours)
    _manifest(tmp_path, RUN_B, "committed", ["vectors/part-b.parquet"])
    reads.fail = 1  # its first read fails, as a GCS request may
    now[0] = 61
    during = _ids(corpus)
    later = []
    for step in (2, 3, 4):  # the refreshes after: the error has passed
        now[0] = 61 * step
        later.append(_ids(corpus))
    assert later[-1] == ["b1", "b2"], (
        f"one failed read of the new run, and the search answers {later} for good (during "
        f"the failure: {during})")
    assert during in (["a1"], "corpus_unavailable")


def test_a_transient_error_at_start_does_not_end_the_search(tmp_path, monkeypatch):
    now = [0.0]
    config = _config(tmp_path)
    _vectors(tmp_path, "part-a.parquet", ["a1"])
    _summary(tmp_path, RUN_A, config.model.query_prefix, config.model.document_prefix)
    _manifest(tmp_path, RUN_A, "committed", ["vectors/part-a.parquet"])
    reads = FailingOnce()
    reads.fail = 1
    monkeypatch.setattr(corpus_lib, "ParquetIndex", reads)
    config, corpus = corpus_lib.corpus_for(config)
    corpus._clock = lambda: now[0]  # pylint: disable=protected-access
    corpus._checked = 0.0  # pylint: disable=protected-access
    later = []
    for step in (1, 2, 3):
        now[0] = 61 * step
        later.append(_ids(corpus))
    assert later[-1] == ["a1"], f"one failed read at start, and the search answers {later}"


def test_a_transient_error_reading_the_new_runs_summary_is_no_500(tmp_path, monkeypatch):
    """The refresh reads the committed run's summary (``committed_summary``, which reads the
    manifest again): a storage error there escaped ``_read`` (only a ``ConfigError`` is caught)
    and the search that refreshed was answered 500 ``internal_error``, where the run read
    before is searched while the next one cannot be read."""
    now = [0.0]
    config = _config(tmp_path)
    ours = (config.model.query_prefix, config.model.document_prefix)
    _vectors(tmp_path, "part-a.parquet", ["a1"])
    _summary(tmp_path, RUN_A, *ours)
    _manifest(tmp_path, RUN_A, "committed", ["vectors/part-a.parquet"])
    config, corpus = corpus_lib.corpus_for(config)
    corpus._clock = lambda: now[0]  # pylint: disable=protected-access
    corpus._checked = 0.0  # pylint: disable=protected-access
    _vectors(tmp_path, "part-b.parquet", ["b1"])
    _summary(tmp_path, RUN_B, *ours)
    _manifest(tmp_path, RUN_B, "committed", ["vectors/part-b.parquet"])
    summary = corpus_lib.committed_summary
    failures = [OSError("Connection reset by peer")]

    def flaky(output):
        if failures:
            raise failures.pop()
        return summary(output)

    monkeypatch.setattr(corpus_lib, "committed_summary", flaky)
    now[0] = 61
    try:
        during = _ids(corpus)
    except Exception as exc:  # pylint: disable=broad-except  # what the route answers 500
        during = f"{type(exc).__name__}: {exc}"
    now[0] = 122
    assert during == ["a1"], f"a search during a failed refresh: {during}"
    assert _ids(corpus) == ["b1"]  # the refresh after reads run B

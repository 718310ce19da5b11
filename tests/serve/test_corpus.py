"""What ``/v1/search`` searches, without a model: the Parquet corpus reads a newer run's files once
``serve.search_refresh_s`` has passed (not before), answers 503 while nothing is published, and the
loopback rule and the API key check of ``pipeline.serve.auth``."""
from __future__ import annotations

import datetime as dt
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.search import Filters
from tests.common import make_config
from tests.serve.conftest import need

need("fastapi")

from pipeline.serve import auth  # noqa: E402
from pipeline.serve.corpus import ParquetCorpus  # noqa: E402
from pipeline.serve.limits import ApiError  # noqa: E402
from transforms.output.parquet import vector_schema  # noqa: E402

DIM = 384
T0 = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)


def _write(out: Path, name: str, ids: list[str]) -> None:
    """A vectors/ file of ``ids``, each vector the first axis (all equally near the query)."""
    schema = vector_schema(DIM)
    vector = np.eye(DIM, dtype=np.float32)[0].tolist()
    defaults = {"model": "m", "dim": DIM, "embedding": vector, "text_sha256": "x",
                "token_count": 3, "truncated": False, "embedded_at": T0, "doc_vector": "head",
                "chunk_count": 0, "published_at": T0, "source": "s", "language": "en"}
    rows = [{**defaults, "id": i, "title": f"title {i}"} for i in ids]
    (out / "vectors").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({f.name: [r.get(f.name) for r in rows] for f in schema},
                            schema=schema), out / "vectors" / name)


def test_a_newer_run_is_read_once_the_refresh_time_has_passed(tmp_path):
    now = [0.0]
    config = make_config(output=str(tmp_path))
    corpus = ParquetCorpus(config, refresh_s=60, clock=lambda: now[0])
    assert corpus.ready() is not None and "no vectors under" in corpus.ready()
    with pytest.raises(ApiError) as nothing:
        corpus.nearest(np.eye(DIM)[0], 5, False, Filters())
    assert nothing.value.status == 503 and nothing.value.code == "corpus_unavailable"
    _write(tmp_path, "part-0.parquet", ["a", "b"])
    now[0] = 61
    assert [h["id"] for h in corpus.nearest(np.eye(DIM)[0], 5, False, Filters())] == ["a", "b"]
    _write(tmp_path, "part-1.parquet", ["c"])
    now[0] = 100  # within refresh_s of the last look: the files are not listed again
    assert corpus.articles == 2
    corpus.nearest(np.eye(DIM)[0], 5, False, Filters())
    assert corpus.articles == 2
    now[0] = 122
    hits = corpus.nearest(np.eye(DIM)[0], 5, False, Filters())
    assert [h["id"] for h in hits] == ["a", "b", "c"] and corpus.ready() is None
    assert hits[0]["published_at"] == "2026-12-01T00:00:00Z" and hits[0]["source"] == "s"


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.8.0.1", True),
                                            ("::1", True), ("[::1]", True), ("localhost", True),
                                            ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.5", False), ("example.com", False)])
def test_only_a_loopback_host_goes_without_a_key(host, loopback):
    assert auth.is_loopback(host) is loopback
    if loopback:
        auth.check_binding(host, None)
    else:
        with pytest.raises(auth.ServeRefused):
            auth.check_binding(host, None)
    auth.check_binding(host, "a key")


@pytest.mark.parametrize("path, header, allowed", [
    ("/v1/embeddings", "Bearer k3y", True), ("/v1/embeddings", "bearer k3y", True),
    ("/v1/embeddings", "Bearer k3y2", False), ("/v1/embeddings", "Basic k3y", False),
    ("/v1/embeddings", None, False), ("/info", "Bearer ", False), ("/metrics", None, False),
    ("/healthz", None, True), ("/readyz", None, True)])
def test_the_api_key_is_asked_for_everywhere_but_the_probes(path, header, allowed):
    auth.check_request(path, header, None)  # no key configured: all open
    if allowed:
        auth.check_request(path, header, "k3y")
    else:
        with pytest.raises(ApiError) as refused:
            auth.check_request(path, header, "k3y")
        assert refused.value.status == 401

"""``newsvec serve`` searching the store (``serve.search: auto`` with ``store.enabled``): the
sample's batch run loaded into PostgreSQL + pgvector (the session's ``postgres_server``), its
``/v1/search`` answering what ``newsvec search --store`` answers, a filter refused (the store's
search takes none), and ``/readyz`` ready while the store answers."""
from __future__ import annotations

from apache_beam.options.pipeline_options import PipelineOptions

from tests.common import SAMPLE_EVENTS, make_config
from tests.serve.conftest import need, serving


def test_search_of_the_store(tmp_path, store_settings):
    httpx = need("httpx")
    from pipeline.run import run_batch
    from pipeline.search import search_store
    from pipeline.serve.app import create_app
    from transforms.engines.registry import load_engine

    config = make_config(input=str(SAMPLE_EVENTS), output=str(tmp_path / "out"),
                         store=store_settings)
    run_batch(config, PipelineOptions(["--runner=FnApiRunner"]))
    query = "a new battery factory in an old steel town"
    with serving(create_app(config, load_engine(config.model), api_key=None)) as url:
        assert httpx.get(f"{url}/info", timeout=30).json()["search"] == "store"
        assert httpx.get(f"{url}/readyz", timeout=30).status_code == 200
        answer = httpx.post(f"{url}/v1/search", json={"query": query, "k": 5}, timeout=30)
        filtered = httpx.post(f"{url}/v1/search", json={"query": query, "source": "x"},
                              timeout=30)
    assert answer.status_code == 200, answer.text
    hits = answer.json()["data"]
    expected = search_store(config, query, 5)
    assert [h["id"] for h in hits] == [e["id"] for e in expected] and len(hits) == 5
    assert all(abs(h["score"] - e["score"]) <= 1e-4 for h, e in zip(hits, expected, strict=True))
    assert answer.json()["searched"] == "store"
    assert filtered.status_code == 400
    assert filtered.json()["error"]["code"] == "unsupported_filter"

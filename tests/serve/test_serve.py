"""``newsvec serve`` over the sample's output (real vLLM, float32), through the real ``openai``
client and raw HTTP: query vectors are ``newsvec search``'s, document vectors the pipeline's
Parquet rows, ``/info`` is the output's summary, ``/v1/search`` answers what ``newsvec search``
does (with the articles' columns, and filters), and every bad request gets its 4xx with an
OpenAI-style error body."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.search import committed_summary, embed_queries, search
from tests.common import SAMPLE_EVENTS
from tests.serve.conftest import API_KEY, cosine, headers, need

QUERIES = [
    "a new battery factory in an old steel town",
    "late winner in a football match",
    "Élection présidentielle: résultats du premier tour",
    "[SEP] a query that writes [MASK] as text",
    "rates " * 300,  # past max_tokens: the head is kept
]
FLOAT32_COSINE = 0.99999  # "1.0 at float32": vLLM's and the numpy path's float32 agree to ~1e-7


def _post(url: str, path: str, body, key=API_KEY, **kwargs):
    httpx = need("httpx")
    return httpx.post(url + path, json=body, headers=headers(key), timeout=60, **kwargs)


def test_query_vectors_are_newsvec_searchs(server, serve_config):
    """Through the openai client (which asks for base64) and raw HTTP (float): each query's vector
    is the one ``newsvec search`` embeds it as; usage counts the prompts' tokens."""
    openai = need("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)
    answer = client.embeddings.create(model=serve_config.model.name, input=QUERIES)
    expected, _ = embed_queries(serve_config, QUERIES)
    assert [d.index for d in answer.data] == list(range(len(QUERIES)))
    for got, want in zip(answer.data, expected, strict=True):
        assert len(got.embedding) == 384 and cosine(got.embedding, want) >= FLOAT32_COSINE
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 256
    raw = _post(server, "/v1/embeddings", {"input": QUERIES[0], "encoding_format": "float"})
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["object"] == "list" and body["model"] == answer.model
    assert cosine(body["data"][0]["embedding"], expected[0]) >= FLOAT32_COSINE
    as_base64 = _post(server, "/v1/embeddings", {"input": [QUERIES[0]],
                                                 "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(as_base64["data"][0]["embedding"]), "<f4")
    assert np.array_equal(decoded, np.asarray(body["data"][0]["embedding"], np.float32))


def _sample_events() -> dict[str, dict]:
    """The sample's valid events by id, those whose id occurs once."""
    seen: dict[str, list[dict]] = {}
    for line in SAMPLE_EVENTS.read_bytes().splitlines():
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if isinstance(raw, dict) and isinstance(raw.get("id"), str):
            seen.setdefault(raw["id"], []).append(raw)
    return {i: events[0] for i, events in seen.items() if len(events) == 1}


def test_document_vectors_are_the_pipelines_rows(server, sample_output: Path):
    """``input_type: document`` (the openai client's extra_body) with an article's title, a
    newline and its body gives the article's row of the pipeline's output; an article the
    pipeline dead-letters (the sample's Japanese, unreadable to the English model) is a 400 that
    says why."""
    openai = need("openai")
    rows = pq.read_table(sorted((sample_output / "vectors").glob("*.parquet"))).to_pylist()
    events = _sample_events()
    rows = [row for row in rows if row["id"] in events]
    assert len(rows) >= 30
    texts = [f"{events[r['id']].get('title') or ''}\n{events[r['id']].get('body') or ''}"
             for r in rows]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)
    answer = client.embeddings.create(model="sentence-transformers/all-MiniLM-L6-v2", input=texts,
                                      extra_body={"input_type": "document"})
    worst = min(cosine(d.embedding, r["embedding"]) for d, r in zip(answer.data, rows,
                                                                    strict=True))
    assert worst >= FLOAT32_COSINE
    assert answer.usage.prompt_tokens == sum(r["token_count"] for r in rows)
    japanese = events["sample-0048"]
    refused = _post(server, "/v1/embeddings", {"input_type": "document", "input": [
        texts[0], f"{japanese['title']}\n{japanese['body']}"]})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "unembeddable_input"
    assert "input[1]" in refused.json()["error"]["message"]
    assert "unreadable_for_model" in refused.json()["error"]["message"]


def test_info_is_the_outputs_summary(server, sample_output: Path):
    httpx = need("httpx")
    info = httpx.get(f"{server}/info", headers=headers(), timeout=30).json()
    summary = committed_summary(str(sample_output))
    assert summary is not None and isinstance(summary.model, dict)
    model = info["model"]
    assert model["label"] == summary.model["label"]
    assert model["content_sha256"] == summary.model["content_sha256"]
    assert model["dimensions"] == summary.vectors["dim"] == 384
    assert model["dtype"] == summary.model["resolved_dtype"] == "float32"
    assert model["max_tokens"] == summary.model["max_tokens"]
    assert (model["document_prefix"], model["query_prefix"]) == (
        summary.model["document_prefix"], summary.model["query_prefix"])
    assert info["text"]["unicode_form"] == summary.text["unicode_form"]
    assert info["embedding_signature"] == summary.incremental["embedding_signature"]
    assert info["output"] == summary.output == str(sample_output)
    assert info["output_run"]["run_id"] == summary.run_id
    assert info["output_run"]["embedding_signature"] == info["embedding_signature"]
    assert info["search"] == "parquet" and info["store"] is None


@pytest.mark.parametrize("all_copies", [False, True])
def test_search_answers_as_newsvec_search(server, serve_config, all_copies):
    query = "a new battery factory in an old steel town"
    answer = _post(server, "/v1/search", {"query": query, "k": 8, "all_copies": all_copies})
    assert answer.status_code == 200, answer.text
    hits = answer.json()["data"]
    expected = search(serve_config, query, 8, all_copies=all_copies)
    assert [h["id"] for h in hits] == [e["id"] for e in expected]
    for hit, want in zip(hits, expected, strict=True):
        assert abs(hit["score"] - want["score"]) <= 1e-4
        assert (hit["story_id"], hit["copies"], hit["title"]) == (
            want["story_id"], want["copies"], want["title"])
        assert hit["url"].startswith("https://") and hit["source"].startswith("newsvec-demo")
        assert hit["published_at"].startswith("2026-11-") and hit["published_at"].endswith("Z")


def test_search_filters(server):
    every = _post(server, "/v1/search", {"query": "news", "k": 100, "all_copies": True}).json()
    hits = every["data"]
    source, language = "newsvec-demo-sport", "fr"
    times = sorted(h["published_at"] for h in hits)
    after, before = times[len(times) // 3], times[2 * len(times) // 3]
    cases = [({"source": source}, lambda h: h["source"] == source),
             ({"source": [source, "newsvec-demo-culture"]},
              lambda h: h["source"] in (source, "newsvec-demo-culture")),
             ({"language": language}, lambda h: h["language"] == language),
             ({"published_after": after, "published_before": before},
              lambda h: after <= h["published_at"] < before)]
    for filters, keeps in cases:
        found = _post(server, "/v1/search", {"query": "news", "k": 100, "all_copies": True,
                                             **filters})
        assert found.status_code == 200, found.text
        assert [h["id"] for h in found.json()["data"]] == [h["id"] for h in hits if keeps(h)], \
            filters


TEN_MB = 10 * 1000 * 1000


def _chunks(total: int, size: int = 1 << 16):
    sent = 0
    while sent < total:
        yield b" " * min(size, total - sent)
        sent += size


@pytest.mark.parametrize("case, status, code", [
    ("malformed JSON", 400, "invalid_json"),
    ("a JSON list", 400, "invalid_json"),
    ("an empty list", 400, "invalid_input"),
    ("an empty string", 400, "invalid_input"),
    ("10,000 inputs", 400, "too_many_inputs"),
    ("a 10 MB body", 413, "body_too_large"),
    ("a 10 MB body, chunked", 413, "body_too_large"),
    ("a number as input", 400, "invalid_input"),
    ("a list holding a number", 400, "invalid_input"),
    ("token ids", 400, "invalid_input"),
    ("a lone surrogate", 400, "invalid_input"),
    ("a wrong model", 404, "model_not_found"),
    ("no API key", 401, "invalid_api_key"),
    ("a wrong API key", 401, "invalid_api_key"),
    ("dimensions of a model that has no Matryoshka", 400, "unsupported_dimensions"),
    ("an unknown encoding", 400, "invalid_value"),
    ("an unknown input_type", 400, "invalid_value"),
    ("an input over max_input_chars", 400, "input_too_long"),
    ("GET on a POST route", 405, "method_not_allowed"),
    ("a search with k 0", 400, "invalid_value"),
    ("a search with a naive time", 400, "invalid_value"),
    ("a search with no query", 400, "invalid_input"),
])
def test_bad_requests_get_their_4xx(server, case, status, code):
    httpx = need("httpx")
    path, key = "/v1/embeddings", API_KEY
    body: object = None
    content = None
    if case == "malformed JSON":
        content = b'{"input": ["a",'
    elif case == "a JSON list":
        content = b'["a"]'
    elif case == "a lone surrogate":
        content = b'{"input": ["fine", "\\ud800 not"]}'
    elif case == "a 10 MB body":
        content = b'{"input": "' + b"a" * TEN_MB + b'"}'
    elif case == "a 10 MB body, chunked":
        content = _chunks(TEN_MB)
    elif case.startswith("a search"):
        path = "/v1/search"
        body = {"a search with k 0": {"query": "x", "k": 0},
                "a search with a naive time": {"query": "x",
                                               "published_after": "2026-11-29T00:00:00"},
                "a search with no query": {"k": 3}}[case]
    else:
        key = {"no API key": None, "a wrong API key": "wrong"}.get(case, API_KEY)
        body = {"an empty list": {"input": []}, "an empty string": {"input": ""},
                "10,000 inputs": {"input": ["a query"] * 10_000},
                "a number as input": {"input": 7}, "a list holding a number": {"input": ["a", 7]},
                "token ids": {"input": [[101, 102]]},
                "a wrong model": {"input": "a", "model": "text-embedding-3-small"},
                "dimensions of a model that has no Matryoshka": {"input": "a", "dimensions": 64},
                "an unknown encoding": {"input": "a", "encoding_format": "int8"},
                "an unknown input_type": {"input": "a", "input_type": "passage"},
                "an input over max_input_chars": {"input": "a" * 100_001},
                }.get(case, {"input": "a"})
    if case == "GET on a POST route":
        answer = httpx.get(server + path, headers=headers(key), timeout=60)
    elif content is not None:
        answer = httpx.post(server + path, content=content, timeout=60,
                            headers={**headers(key), "Content-Type": "application/json"})
    else:
        answer = httpx.post(server + path, json=body, headers=headers(key), timeout=60)
    assert answer.status_code == status, answer.text[:500]
    error = answer.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    if status == 401:
        assert answer.headers["www-authenticate"] == "Bearer"


def test_probes_and_metrics(server):
    """The probes answer without a key; /metrics needs it and holds RunInference's names."""
    httpx = need("httpx")
    assert httpx.get(f"{server}/healthz", timeout=10).json() == {"status": "ok"}
    ready = httpx.get(f"{server}/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert httpx.get(f"{server}/metrics", timeout=10).status_code == 401
    assert _post(server, "/v1/embeddings", {"input": ["one", "two"]}).status_code == 200
    text = httpx.get(f"{server}/metrics", headers=headers(), timeout=10).text
    for name in ("newsvec_num_inferences_total", "newsvec_inference_request_batch_size_bucket",
                 "newsvec_inference_batch_latency_micro_secs_bucket",
                 "newsvec_serve_batch_tokens_bucket", "newsvec_serve_queue_depth",
                 'newsvec_serve_requests_total{route="/v1/embeddings",status="200"}',
                 'newsvec_serve_errors_total{kind="invalid_api_key"}',
                 'newsvec_serve_request_latency_seconds_bucket{le="0.005",route="/v1/embeddings"}'):
        assert name in text, name
    models = httpx.get(f"{server}/v1/models", headers=headers(), timeout=10).json()
    assert models["data"][0]["id"].startswith("sentence-transformers/all-MiniLM-L6-v2@sha256:")

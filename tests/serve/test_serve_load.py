"""``newsvec serve`` under load and at its edges, each on a service of its own over the sample's
output with the session's engine behind a delay or a gate (``Delayed``: real vectors, a busy
engine): concurrent requests share engine calls; a flood past ``serve.max_queue`` gets 429s with
``Retry-After`` while every request taken gets its own answer; a request the engine does not
answer in ``serve.request_timeout_s`` gets a 503; a config that differs from the output's refuses
to start, and so does a public address without an API key; query texts are logged only with
``serve.log_queries``; ``dimensions`` cuts a Matryoshka model's vectors."""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline import cli
from pipeline.search import embed_queries
from tests.common import REPO
from tests.serve.conftest import Delayed, cosine, need, serving

FLOAT32_COSINE = 0.99999


def _app(config, engine, **serve):
    need("fastapi")
    from pipeline.serve.app import create_app

    config = config.model_copy(update={"serve": config.serve.model_copy(update=serve)})
    return create_app(config, engine, api_key=None)


async def _burst(url: str, bodies: list[dict]) -> list:
    httpx = need("httpx")
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post("/v1/embeddings", json=b) for b in bodies))


def _gated(engine, open_after_s: float) -> Delayed:
    """The engine, held for ``open_after_s`` (a burst then finds it busy)."""
    delayed = Delayed(engine)
    delayed.gate.clear()
    threading.Timer(open_after_s, delayed.gate.set).start()
    return delayed


def test_concurrent_requests_share_engine_calls(serve_config, engine):
    delayed = _gated(engine, 1.0)
    queries = [f"query number {i} about the harbour" for i in range(40)]
    with serving(_app(serve_config, delayed)) as url:
        answers = asyncio.run(_burst(url, [{"input": q} for q in queries]))
    assert all(a.status_code == 200 for a in answers)
    assert sum(delayed.calls) == 40 and len(delayed.calls) <= 4, delayed.calls
    expected, _ = embed_queries(serve_config, queries)
    for answer, want in zip(answers, expected, strict=True):
        assert cosine(answer.json()["data"][0]["embedding"], want) >= FLOAT32_COSINE


def test_a_flood_gets_429s_and_every_request_taken_its_answer(serve_config, engine):
    # The burst finds the engine held and the queue full: 4 requests (8 inputs) wait, or more
    # where the batcher took some into the held call before the queue filled.
    delayed = _gated(engine, 2.0)
    queries = [[f"flood {i} a", f"flood {i} b"] for i in range(60)]
    with serving(_app(serve_config, delayed, max_queue=8, max_batch_tokens=256)) as url:
        answers = asyncio.run(_burst(url, [{"input": q} for q in queries]))
    statuses = [a.status_code for a in answers]
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(429) >= 40 and statuses.count(200) >= 4, statuses
    expected, _ = embed_queries(serve_config, [q for pair in queries for q in pair])
    for i, answer in enumerate(answers):
        if answer.status_code == 429:
            assert int(answer.headers["retry-after"]) >= 1
            assert answer.json()["error"]["code"] == "queue_full"
            continue
        got = [d["embedding"] for d in answer.json()["data"]]
        assert min(cosine(g, w) for g, w in zip(got, expected[2 * i:2 * i + 2],
                                                strict=True)) >= FLOAT32_COSINE


def test_a_request_not_answered_in_time_gets_a_503(serve_config, engine):
    httpx = need("httpx")
    delayed = Delayed(engine)
    delayed.gate.clear()
    try:
        with serving(_app(serve_config, delayed, request_timeout_s=0.5)) as url:
            answer = httpx.post(f"{url}/v1/embeddings", json={"input": "held"}, timeout=30)
            assert answer.status_code == 503
            assert answer.json()["error"]["code"] == "timeout"
            delayed.gate.set()
            assert httpx.post(f"{url}/v1/embeddings", json={"input": "free"},
                              timeout=30).status_code == 200
    finally:
        delayed.gate.set()


def _config_file(tmp_path: Path, output: Path, **model) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"extends": str(REPO / "configs" / "local.yaml"),
                                    "output": str(output),
                                    "model": {"dtype": "float32", **model}}))
    return path


@pytest.mark.parametrize("changes, named", [
    ({"max_tokens": 128}, "model.max_tokens: the output's 256, the config's 128"),
    ({"query_prefix": "query: "}, "model.query_prefix: the output's '', the config's 'query: '"),
])
def test_a_config_the_output_was_not_written_with_refuses_to_start(
        sample_output, tmp_path, capsys, changes, named):
    """Exit status 2, naming the difference, before the model loads."""
    assert cli.main(["serve", "--config", str(_config_file(tmp_path, sample_output,
                                                           **changes))]) == 2
    assert named in capsys.readouterr().err


def test_a_public_address_without_an_api_key_refuses_to_start(sample_output, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.delenv("NEWSVEC_API_KEY", raising=False)
    config = _config_file(tmp_path, sample_output)
    assert cli.main(["serve", "--config", str(config), "--host", "0.0.0.0", "--port", "0"]) == 1
    assert "not a loopback address, and no API key is configured" in capsys.readouterr().err
    key_file = tmp_path / "missing-key"
    config.write_text(config.read_text() + f"serve:\n  api_key_file: {key_file}\n")
    assert cli.main(["serve", "--config", str(config), "--host", "0.0.0.0"]) == 1
    assert "serve.api_key_file: cannot read the API key" in capsys.readouterr().err


@pytest.mark.parametrize("log_queries", [False, True])
def test_query_texts_are_logged_only_when_asked(serve_config, engine, caplog, log_queries):
    httpx = need("httpx")
    secret = "zebra-crossing-7f3a health records of the mayor"
    caplog.set_level(logging.DEBUG)
    with serving(_app(serve_config, engine, log_queries=log_queries)) as url:
        assert httpx.post(f"{url}/v1/embeddings", json={"input": secret},
                          timeout=30).status_code == 200
        assert httpx.post(f"{url}/v1/search", json={"query": secret},
                          timeout=30).status_code == 200
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert (secret in logged) is log_queries


def test_dimensions_cut_a_matryoshka_models_vectors(serve_config, engine, tmp_path):
    """A model that declares Matryoshka sizes (the packaged MiniLM's files, its config.json
    saying so): ``dimensions`` gives the head of each vector, normalized again; a size it does not
    declare is a 400."""
    httpx = need("httpx")
    from transforms.engines.model import resolve_model_path

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path(serve_config.model.path), folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "matryoshka_dimensions": [384, 128]}))
    config = serve_config.model_copy(update={
        "output": str(tmp_path / "no-output"),
        "model": serve_config.model.model_copy(update={"path": str(folder)})})
    with serving(_app(config, engine)) as url:
        full = httpx.post(f"{url}/v1/embeddings", json={"input": "ferry"}, timeout=30).json()
        cut = httpx.post(f"{url}/v1/embeddings", json={"input": "ferry", "dimensions": 128},
                         timeout=30).json()
        other = httpx.post(f"{url}/v1/embeddings", json={"input": "ferry", "dimensions": 64},
                           timeout=30)
    head = np.asarray(full["data"][0]["embedding"][:128])
    assert len(cut["data"][0]["embedding"]) == 128
    assert cosine(cut["data"][0]["embedding"], head) >= FLOAT32_COSINE
    assert abs(np.linalg.norm(cut["data"][0]["embedding"]) - 1) < 1e-5
    assert other.status_code == 400 and other.json()["error"]["code"] == "unsupported_dimensions"


def test_dimensions_cut_to_the_sizes_the_config_declares(serve_config, engine, tmp_path):
    """A model whose config.json declares no Matryoshka sizes (the packaged MiniLM's, as it
    ships) and a config that lists them (``model.matryoshka_dimensions``, as for
    Qwen3-Embedding): serve accepts those sizes as the pipeline's engine does (vLLM, told them),
    and refuses the others."""
    httpx = need("httpx")

    config = serve_config.model_copy(update={
        "output": str(tmp_path / "no-output"),
        "model": serve_config.model.model_copy(update={"matryoshka_dimensions": [128, 256]})})
    with serving(_app(config, engine)) as url:
        full = httpx.post(f"{url}/v1/embeddings", json={"input": "ferry"}, timeout=30).json()
        cut = httpx.post(f"{url}/v1/embeddings", json={"input": "ferry", "dimensions": 128},
                         timeout=30).json()
        other = httpx.post(f"{url}/v1/embeddings", json={"input": "ferry", "dimensions": 64},
                           timeout=30)
        info = httpx.get(f"{url}/info", timeout=30).json()
    assert len(cut["data"][0]["embedding"]) == 128
    assert cosine(cut["data"][0]["embedding"], full["data"][0]["embedding"][:128]) >= \
        FLOAT32_COSINE
    assert abs(np.linalg.norm(cut["data"][0]["embedding"]) - 1) < 1e-5
    assert other.status_code == 400 and other.json()["error"]["code"] == "unsupported_dimensions"
    assert info["model"]["matryoshka_dimensions"] == [128, 256]

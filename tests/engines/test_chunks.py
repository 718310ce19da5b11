"""Chunks mode (transforms/chunking.py): long articles embedded as windows of their tokens, rows in
chunks/ beside vectors/, and a document vector per article.

Batch runs on FnApiRunner with real vLLM (float32) over 16 BBC articles and a short one: chunk ids
stable across runs, offsets that give the chunk text back, the short article's single chunk equal
to its head-mode vector, parity with sentence-transformers on the chunk texts, the mean document
vector, the ledger, DuckDB and pyarrow joins. The whole-article failure rule, a retried bundle and
the streaming ledger use a FAKE engine (they test the pipeline around the model, not the model)."""
from __future__ import annotations

import csv
import hashlib
import json
import threading
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
import pytest
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Timestamp

from pipeline import ledger
from pipeline.config import ConfigError, validate
from pipeline.graph import embed_and_write_streaming
from pipeline.run import run_batch
from tests.common import bbc_file, make_config
from tests.fakes import POISON, FakeEngine
from transforms.chunking import Chunker, ChunkSpan, chunk_id
from transforms.embed import Embed, Embedder
from transforms.engines.base import EngineHandle
from transforms.output.parquet import chunk_schema
from transforms.settings import ChunkingSettings, StreamingSettings
from transforms.text import compose_text
from transforms.types import NewsEvent, PreparedDoc, Reason

SHORT = {"id": "short-1", "title": "Markets calm", "body": "Shares were flat on Monday."}
CHUNKING = ChunkingSettings(mode="chunks", overlap_tokens=32, sentence_end_slack_tokens=24,
                            doc_vector="mean")


def bbc_events(n: int) -> list[dict]:
    with open(bbc_file("train.csv"), encoding="utf-8") as f:
        texts = [row["text"] for row in csv.DictReader(f)][:n]
    return [{"id": f"bbc-{i:02d}", "body": t} for i, t in enumerate(texts)]


def chunk_config(out: Path, events: Path, **chunking):
    config = make_config(input=str(events), output=str(out),
                         chunking=CHUNKING.model_copy(update=chunking))
    return config.model_copy(update={"sink": config.sink.model_copy(
        update={"store_chunk_text": True})})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two chunks-mode runs and a head-mode run of the same articles."""
    root = tmp_path_factory.mktemp("chunks")
    events = root / "in.jsonl"
    events.write_text("".join(json.dumps(e) + "\n" for e in bbc_events(16) + [SHORT]))
    options = PipelineOptions(["--runner=FnApiRunner"])
    out = {name: root / name for name in ("a", "b", "head")}
    summaries = {name: run_batch(chunk_config(out[name], events), options) for name in ("a", "b")}
    summaries["head"] = run_batch(make_config(input=str(events), output=str(out["head"])), options)
    return summaries, out


def table(out: Path, subdir: str):
    return pq.read_table(sorted((out / subdir).glob("*.parquet")))


def vectors_of(t) -> np.ndarray:
    return t["embedding"].combine_chunks().flatten().to_numpy().reshape(t.num_rows, -1)


def prepared_texts() -> dict[str, str]:
    return {e["id"]: compose_text(NewsEvent(**e)) for e in bbc_events(16) + [SHORT]}


def test_long_articles_have_several_chunks_of_at_most_the_chunk_size(runs):
    _, out = runs
    chunks = table(out["a"], "chunks")
    assert chunks.schema.equals(chunk_schema(384))
    counts = {}
    for doc_id, n in zip(chunks["id"].to_pylist(), chunks["chunk_count"].to_pylist(),
                         strict=True):
        counts[doc_id] = n
    assert counts["short-1"] == 1 and max(counts.values()) >= 3
    assert sum(counts.values()) == chunks.num_rows
    # no chunk would be truncated by the engine: at most chunk_tokens with its 2 special tokens
    spans = np.array(chunks["token_end"]) - np.array(chunks["token_start"])
    assert spans.max() + 2 <= 256


def test_chunk_ids_are_the_same_in_every_run(runs):
    _, out = runs
    a, b = (table(out[n], "chunks") for n in ("a", "b"))

    def ids(t):
        return sorted(zip(t["id"].to_pylist(), t["chunk_index"].to_pylist(),
                          t["chunk_id"].to_pylist(), strict=True))

    assert ids(a) == ids(b)
    assert len(set(a["chunk_id"].to_pylist())) == a.num_rows


def test_offsets_give_back_the_chunk_text_and_cover_the_article(runs, tokenizer):
    _, out = runs
    texts = prepared_texts()
    rows = table(out["a"], "chunks").to_pylist()
    by_doc: dict[str, list] = {}
    for row in rows:
        text = texts[row["id"]]
        assert row["chunk_text"] == text[row["char_start"]:row["char_end"]]
        assert row["chunk_sha256"] == hashlib.sha256(row["chunk_text"].encode()).hexdigest()
        assert row["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
        # the chunk's text tokenizes to exactly its tokens: chunks start and end at words
        ids = tokenizer._tok.encode(row["chunk_text"]).ids
        assert len(ids) - 2 == row["token_end"] - row["token_start"]
        by_doc.setdefault(row["id"], []).append(row)
    for doc_id, chunks in by_doc.items():
        chunks.sort(key=lambda r: r["chunk_index"])
        assert [c["chunk_index"] for c in chunks] == list(range(len(chunks)))
        assert chunks[0]["token_start"] == 0 and chunks[0]["char_start"] == 0
        assert chunks[-1]["char_end"] == len(texts[doc_id]), "the tail is embedded too"
        for before, after in zip(chunks, chunks[1:], strict=False):  # consecutive pairs
            assert before["token_end"] - after["token_start"] >= 32, "overlap_tokens"


def test_a_short_article_is_one_chunk_whose_vector_is_the_head_vector(runs):
    _, out = runs
    chunks = table(out["a"], "chunks").filter(where_id("short-1"))
    head = table(out["head"], "vectors").filter(where_id("short-1"))
    mean = table(out["a"], "vectors").filter(where_id("short-1"))
    assert chunks.num_rows == 1 and head.num_rows == 1
    chunk_vector, head_vector = vectors_of(chunks)[0], vectors_of(head)[0]
    assert float(np.dot(chunk_vector, head_vector)) >= 0.99999
    assert float(np.dot(vectors_of(mean)[0], head_vector)) >= 0.99999


def where_id(value: str):
    import pyarrow.compute as pc

    return pc.field("id") == value


def test_chunk_vectors_equal_sentence_transformers(runs):
    from sentence_transformers import SentenceTransformer

    from transforms.engines.model import resolve_model_path

    _, out = runs
    chunks = table(out["a"], "chunks")
    model = SentenceTransformer(resolve_model_path(make_config().model.path), device="cpu")
    expected = model.encode(chunks["chunk_text"].to_pylist(), normalize_embeddings=True)
    cosine = (vectors_of(chunks) * expected).sum(axis=1)
    assert cosine.min() >= 0.9999, f"min cosine {cosine.min()}"


def test_the_mean_document_vector_is_the_token_weighted_mean_of_its_chunks(runs):
    _, out = runs
    chunks, docs = table(out["a"], "chunks"), table(out["a"], "vectors")
    chunk_vectors = vectors_of(chunks)
    weights = np.array(chunks["token_end"]) - np.array(chunks["token_start"])
    for row, vector in zip(docs.to_pylist(), vectors_of(docs), strict=True):
        mine = np.array(chunks["id"].to_pylist()) == row["id"]
        mean = (chunk_vectors[mine] * weights[mine, None]).sum(axis=0)
        assert np.allclose(vector, mean / np.linalg.norm(mean), atol=1e-6)
        assert row["doc_vector"] == "mean" and row["chunk_count"] == mine.sum()
        assert row["token_count"] == np.array(chunks["token_end"])[mine].max()
        assert row["truncated"] is False
    head = table(out["head"], "vectors")
    assert set(head["doc_vector"].to_pylist()) == {"head"} and set(
        head["chunk_count"].to_pylist()) == {0}


def test_the_batch_ledger_counts_articles_and_chunks(runs):
    summaries, out = runs
    summary = summaries["a"]
    counts = summary["counts"]
    assert summary["invariant_holds"] and counts["in"] == 17 == counts["written"]
    assert counts["chunks_written"] == table(out["a"], "chunks").num_rows
    assert summary["chunking"]["mode"] == "chunks" and summary["chunking"]["doc_vector"] == "mean"
    assert summary["model"]["document_prefix"] == ""
    manifest = json.loads((out["a"] / "_manifest.json").read_text())
    assert manifest["chunks"] and all(f.startswith("chunks/") for f in manifest["chunks"])
    assert summaries["head"]["counts"]["chunks_written"] == 0
    assert not (out["head"] / "chunks").exists() or not list((out["head"] / "chunks").iterdir())


def test_duckdb_and_pyarrow_join_chunks_to_vectors(runs):
    import duckdb
    import pyarrow.dataset as ds

    _, out = runs
    prefix = out["a"]
    n_chunks = table(prefix, "chunks").num_rows
    joined = duckdb.connect().execute(f"""
        SELECT count(*), count(DISTINCT v.id), max(array_cosine_similarity(
                   c.embedding::FLOAT[384], v.embedding::FLOAT[384]))
        FROM read_parquet('{prefix}/chunks/*.parquet') c
        JOIN read_parquet('{prefix}/vectors/*.parquet') v USING (id)""").fetchone()
    assert joined[0] == n_chunks and joined[1] == 17 and joined[2] <= 1.0001
    chunks = ds.dataset(str(prefix / "chunks"), format="parquet").to_table()
    vectors = ds.dataset(str(prefix / "vectors"), format="parquet").to_table()
    both = chunks.select(["id", "chunk_index"]).join(vectors.select(["id", "title"]), "id")
    assert both.num_rows == n_chunks


# ---- the pipeline around the model: FAKE engines ----

def chunked_doc(i: int, tokenizer, text: str, poison_chunk: int | None = None) -> PreparedDoc:
    chunker = Chunker(tokenizer._tok, ChunkingSettings(mode="chunks", chunk_tokens=64,
                                                       overlap_tokens=8), 256)
    (head, cut, spans), = chunker.split([text])
    if poison_chunk is not None:
        span = spans[poison_chunk]
        spans = (spans[:poison_chunk]
                 + (ChunkSpan((101, POISON, 102), span.token_start, span.token_end,
                              span.char_start, span.char_end),)
                 + spans[poison_chunk + 1:])
    return PreparedDoc(event=NewsEvent(id=f"c{i}", body=text), text=text,
                       text_sha256=hashlib.sha256(text.encode()).hexdigest(), token_ids=head,
                       truncated=cut, chunks=spans)


def long_text(i: int) -> str:
    return " ".join(f"Sentence {j} of story {i} tells what happened next." for j in range(40))


def test_a_failing_chunk_dead_letters_its_whole_article_and_no_other(tokenizer):
    settings = make_config().model
    docs = [chunked_doc(i, tokenizer, long_text(i), poison_chunk=2 if i == 1 else None)
            for i in range(3)]
    assert all(len(d.chunks) >= 4 for d in docs)
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(docs) | Embed(
            settings, chunking=ChunkingSettings(mode="chunks", chunk_tokens=64, overlap_tokens=8,
                                                doc_vector="mean"),
            engine_factory=FakeEngine)
        assert_that(out.embedded | beam.Map(lambda e: (e.id, len(e.chunks))),
                    equal_to([("c0", len(docs[0].chunks)), ("c2", len(docs[2].chunks))]),
                    label="whole articles only")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.event_id, d.reason,
                                                          d.detail.split(":")[0])),
                    equal_to([("c1", Reason.EMBEDDING_FAILED,
                               f"input 3 of {len(docs[1].chunks)}")]), label="the article")


def test_chunks_are_batched_by_the_token_budget(tokenizer):
    settings = make_config().model.model_copy(update={"token_budget": 256})
    docs = [chunked_doc(i, tokenizer, long_text(i)) for i in range(2)]
    engine = EngineHandle(settings, FakeEngine)
    calls = []
    real = engine.embed
    engine.embed = lambda prompts: calls.append(sum(map(len, prompts))) or real(prompts)
    handler = Embedder(settings, doc_vector="mean")
    results = handler.embed_batch(docs, engine)
    assert [len(r.inference) for r in results] == [len(d.chunks) for d in docs]
    assert max(calls) <= 256 and len(calls) > 2


class BreaksOnce(FakeEngine):
    """FAKE; the first engine made breaks for good on its second call (the canary fails too)."""

    made = 0
    lock = threading.Lock()

    def __init__(self, settings=None):
        super().__init__(settings)
        with BreaksOnce.lock:
            BreaksOnce.made += 1
            self._breaks = BreaksOnce.made == 1

    def embed(self, prompts):
        if self._breaks and self.calls:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().embed(prompts)

    def healthy(self):
        return not (self._breaks and self.calls)


def test_chunk_ids_are_the_same_after_a_retried_bundle(tokenizer):
    settings = make_config().model.model_copy(update={"token_budget": 128})
    chunking = ChunkingSettings(mode="chunks", chunk_tokens=64, overlap_tokens=8)
    docs = [chunked_doc(i, tokenizer, long_text(i)) for i in range(4)]

    signature = chunking.chunk_recipe(settings.max_tokens, settings.document_prefix)
    expected = [(d.id, k, chunk_id(d.id, d.text_sha256, FakeEngine.label, signature, k))
                for d in docs for k in range(len(d.chunks))]
    BreaksOnce.made = 0
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions())
    out = p | beam.Create(docs) | Embed(settings, chunking=chunking,
                                                 engine_factory=BreaksOnce)
    assert_that(out.embedded | beam.FlatMap(lambda e: [(c.id, c.chunk_index, c.chunk_id)
                                                       for c in e.chunks]),
                equal_to(expected))
    p.run().wait_until_finish()
    assert BreaksOnce.made >= 2, "the bundle was retried on a fresh engine"


def test_the_streaming_ledger_is_exact_with_chunks(tmp_path):
    t0 = Timestamp.of(1_764_590_400)  # 2025-12-01T12:00:00Z
    events = bbc_events(6) + [SHORT]
    messages = [TimestampedValue(PubsubMessage(json.dumps(e).encode(), {}, message_id=f"m{i}",
                                               publish_time=t0 + i), t0 + i)
                for i, e in enumerate(events)]
    messages.append(TimestampedValue(PubsubMessage(b"{not json", {}, message_id="bad",
                                                   publish_time=t0 + 9), t0 + 9))
    stream = (TestStream().advance_watermark_to(t0).add_elements(messages)
              .advance_watermark_to_infinity())
    config = make_config(output=str(tmp_path), chunking=CHUNKING,
                         streaming=StreamingSettings(window_s=60, batch_shards=2))
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embed_and_write_streaming(p | stream, config, "20251201T120000Z-0c0c0c0c",
                              engine_factory=FakeEngine)
    p.run().wait_until_finish()
    report = ledger.check(str(tmp_path))
    assert report.ok, report.problems
    totals = report.totals
    assert totals["messages_in"] == 8 and totals["rows_written"] == 7
    assert totals["dead_lettered"] == 1
    chunk_rows = pq.read_table(sorted((tmp_path / "chunks").rglob("*.parquet")))
    assert totals["chunks_written"] == chunk_rows.num_rows > 7
    assert all(p.parent.name.startswith("hour=") for p in (tmp_path / "chunks").rglob("*.parquet"))
    # a chunks file the ledger does not name is found
    stray = next((tmp_path / "chunks").rglob("*.parquet"))
    stray.rename(stray.with_name(stray.name.replace("-000-", "-009-")))
    assert not ledger.check(str(tmp_path)).ok


def test_chunk_settings_that_cannot_work_fail_at_start(tokenizer):
    raw = json.loads(make_config(input="x", output="y").model_dump_json())
    with pytest.raises(ConfigError, match="chunk_tokens"):
        validate({**raw, "chunking": {"mode": "chunks", "chunk_tokens": 512}})
    with pytest.raises(ValueError, match="overlap_tokens"):
        Chunker(tokenizer._tok, ChunkingSettings(mode="chunks", chunk_tokens=40,
                                                 overlap_tokens=38), 256)


def test_the_document_prefix_is_in_every_input_and_counted_in_the_limits(tokenizer):
    prefix_ids = tuple(tokenizer._tok.encode("passage: ", add_special_tokens=False).ids)
    assert prefix_ids
    chunker = Chunker(tokenizer._tok, ChunkingSettings(mode="chunks"), 256, "passage: ")
    ((head, cut, spans),) = chunker.split([long_text(0)])
    assert head[1:1 + len(prefix_ids)] == prefix_ids and len(head) == 256 and cut
    assert all(s.token_ids[1:1 + len(prefix_ids)] == prefix_ids and len(s.token_ids) <= 256
               for s in spans)
    # head mode: the prefix goes before the text in the same way
    assert tokenizer("passage: " + "Shares were flat.")[0][1:1 + len(prefix_ids)] == prefix_ids


def test_sentence_ends_are_found_reading_each_token_a_few_times(tokenizer, monkeypatch):
    """With sentence_end_slack_tokens, each place a chunk may end is checked for a sentence end,
    looking back over closing quotes and brackets: in a text of nothing but quotes, each token is
    looked at a bounded number of times in all (counted as the lookups in the closers' set), not
    once per place checked."""
    import transforms.chunking

    lookups = {"n": 0}

    class CountingSet(frozenset):
        def __contains__(self, item):
            lookups["n"] += 1
            return super().__contains__(item)

    monkeypatch.setattr(transforms.chunking, "_CLOSERS", CountingSet(transforms.chunking._CLOSERS))
    chunker = Chunker(tokenizer._tok, ChunkingSettings(mode="chunks",
                                                       sentence_end_slack_tokens=16), 256)
    text = '"' * 20_000
    ((_, _, spans),) = chunker.split([text])
    assert spans[0].token_start == 0 and spans[-1].token_end == 20_000 and len(spans) > 50
    assert 0 < lookups["n"] <= 2 * 20_000, f"{lookups['n']:,} lookups for 20,000 tokens"

"""Late chunking (``chunking.mode: late``): the chunks of chunks mode, each vector pooled from one
pass over the article's head (vLLM's ``token_embed``), chunks past the head embedded alone.

Parity with ``transformers``' token outputs over the same spans uses the real vLLM engine on the
packaged MiniLM (float32) and on a tiny random ModernBERT with a local attention window
(tools/tiny_models.py; float32 and the dtype newsvec runs at, against a reference in that dtype);
the pipeline around it (rows, spans, budgets, failures) uses a FAKE
engine whose token vectors are one-hot at the token id."""
from __future__ import annotations

import hashlib
import json
import random

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from pipeline.config import ConfigError, validate
from pipeline.run import run_batch
from tests.common import make_config, tiny_model_settings
from tests.engines.test_chunks import bbc_events, long_text, table, vectors_of
from tests.engines.test_model_parity import WITHIN, _dtypes
from tests.fakes import POISON, FakeEngine
from tools.tiny_models import made_up_text
from transforms.chunking import Chunker
from transforms.embed import Embed, Embedder
from transforms.engines.base import EngineHandle
from transforms.engines.registry import process_engine
from transforms.settings import ChunkingSettings
from transforms.types import NewsEvent, PreparedDoc, Reason

LATE = ChunkingSettings(mode="late", chunk_tokens=64, overlap_tokens=8)


def late_docs(tokenizer, texts, chunking=LATE, max_tokens=256) -> tuple[Chunker, list]:
    chunker = Chunker(tokenizer._tok, chunking, max_tokens)
    docs = []
    for i, (text, (head, cut, spans)) in enumerate(zip(texts, chunker.split(texts),
                                                       strict=True)):
        docs.append(PreparedDoc(event=NewsEvent(id=f"d{i}", body=text), text=text,
                                text_sha256=hashlib.sha256(text.encode()).hexdigest(),
                                token_ids=head, truncated=cut, chunks=spans))
    return chunker, docs


def unit(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


# ---- parity: real vLLM (float32) against transformers' last hidden states ----

def test_late_vectors_equal_transformers_token_outputs_pooled_over_the_same_spans(tokenizer):
    import torch
    from transformers import AutoModel

    from transforms.engines.model import resolve_model_path

    settings = make_config().model
    texts = [e["body"] for e in bbc_events(6)] + ["Shares were flat on Monday."]
    chunker, docs = late_docs(tokenizer, texts)
    embedder = Embedder(settings, late=LATE)
    handle = process_engine(settings.model_copy(update={"pooling_task": "token_embed"}), None)
    assert handle.pooling() == "mean"
    results = embedder.embed_batch(docs, handle)
    model = AutoModel.from_pretrained(resolve_model_path(settings.path)).eval()

    def hidden(ids) -> np.ndarray:
        with torch.no_grad():
            return model(input_ids=torch.tensor([list(ids)])).last_hidden_state[0].numpy()

    cosines, alone = [], 0
    for doc, result in zip(docs, results, strict=True):
        vectors = result.inference
        assert len(vectors) == 1 + len(doc.chunks)
        head = hidden(doc.token_ids)
        expected = [unit(head.mean(axis=0))]  # the head, as the model pools: mean
        for span in doc.chunks:
            where = chunker.late_span(len(doc.token_ids), span)
            if where is None:  # past the head: embedded alone
                alone += 1
                expected.append(unit(hidden(span.token_ids).mean(axis=0)))
            else:
                expected.append(unit(head[where[0]:where[1]].mean(axis=0)))
        cosines += [float(unit(v) @ e) for v, e in zip(vectors, expected, strict=True)]
    assert alone > 0  # some articles are longer than the head
    assert min(cosines) >= 0.999, f"min cosine {min(cosines)}"


@pytest.mark.parametrize("dtype", _dtypes())
def test_late_vectors_on_a_modernbert_with_a_window_equal_transformers(tiny_modernbert, dtype):
    """vLLM's ModernBertModel gives token vectors (``token_embed``) that honour its local
    attention window: the head (CLS pooling) and each chunk's span mean agree with
    ``transformers``' last hidden states in the same dtype, and not with a reference whose
    layers are all global (so a window ignored would fail here)."""
    import torch
    from transformers import AutoModel

    from transforms.text import HeadTokenizer

    settings = tiny_model_settings(tiny_modernbert, dtype)
    texts = [made_up_text(random.Random(seed), words)
             for seed, words in ((1, 1), (2, 60), (3, 150), (4, 400))]
    chunker, docs = late_docs(HeadTokenizer(settings), texts, max_tokens=settings.max_tokens)
    handle = process_engine(settings.model_copy(update={"pooling_task": "token_embed"}), None)
    assert handle.pooling() == "cls"
    results = Embedder(settings, late=LATE).embed_batch(docs, handle)

    def reference(**config):
        model = AutoModel.from_pretrained(tiny_modernbert, dtype=getattr(torch, dtype),
                                          **config).eval()

        def hidden(ids) -> np.ndarray:
            with torch.no_grad():
                return model(input_ids=torch.tensor([list(ids)])
                             ).last_hidden_state[0].float().numpy()

        vectors = []
        for doc in docs:
            head = hidden(doc.token_ids)
            vectors.append(unit(head[0]))  # the head, as the model pools: CLS
            for span in doc.chunks:
                where = chunker.late_span(len(doc.token_ids), span)
                vectors.append(unit(hidden(span.token_ids)[0]) if where is None
                               else unit(head[where[0]:where[1]].mean(axis=0)))
        return vectors

    got = [unit(v) for result in results for v in result.inference]
    assert len(got) == sum(1 + len(d.chunks) for d in docs)
    assert min(len(d.token_ids) for d in docs) <= WITHIN  # all within the window
    assert any(chunker.late_span(len(d.token_ids), c) is None for d in docs for c in d.chunks)
    with_window = [float(g @ e) for g, e in zip(got, reference(), strict=True)]
    assert min(with_window) >= 0.999, f"min cosine {min(with_window)}"
    without = [float(g @ e) for g, e in zip(got, reference(local_attention=100_000), strict=True)]
    assert min(without) < 0.99, f"min cosine without the window {min(without)}"


def test_a_late_chunk_vector_differs_from_the_chunk_embedded_alone(tokenizer):
    """Late chunking is not chunks mode: a chunk inside the head saw the text around it."""
    settings = make_config().model
    _, docs = late_docs(tokenizer, [bbc_events(1)[0]["body"]])
    late = Embedder(settings, late=LATE).embed_batch(
        docs, process_engine(settings.model_copy(update={"pooling_task": "token_embed"}), None))
    alone = process_engine(settings, None).embed([docs[0].chunks[1].token_ids])[0]
    cosine = float(unit(late[0].inference[2]) @ unit(alone))
    assert cosine < 0.99, cosine


# ---- the pipeline around the model: FAKE engine ----

def test_late_chunk_vectors_are_span_means_of_one_pass_over_the_head(tokenizer):
    settings = make_config().model.model_copy(update={"token_budget": 2048})
    chunker, docs = late_docs(tokenizer, [long_text(i) for i in range(3)])
    engine = EngineHandle(settings, FakeEngine)
    calls = {"tokens": [], "embed": []}
    real_tokens, real_embed = engine.embed_tokens, engine.embed
    engine.embed_tokens = lambda p: calls["tokens"].append(list(p)) or real_tokens(p)
    engine.embed = lambda p: calls["embed"].append(list(p)) or real_embed(p)
    results = Embedder(settings, late=LATE).embed_batch(docs, engine)
    assert [list(ids) for call in calls["tokens"] for ids in call] == [
        list(d.token_ids) for d in docs]
    for doc, result in zip(docs, results, strict=True):
        onehots = FakeEngine(settings).embed_tokens([doc.token_ids])[0]
        np.testing.assert_allclose(result.inference[0], unit(onehots.mean(axis=0)), atol=1e-6)
        for span, vector in zip(doc.chunks, result.inference[1:], strict=True):
            where = chunker.late_span(len(doc.token_ids), span)
            if where is None:
                assert list(span.token_ids) in [list(ids) for c in calls["embed"] for ids in c]
            else:
                np.testing.assert_allclose(
                    vector, unit(onehots[where[0]:where[1]].mean(axis=0)), atol=1e-6)
    held = sum(chunker.late_span(len(d.token_ids), c) is not None for d in docs for c in d.chunks)
    assert 0 < held < sum(len(d.chunks) for d in docs)


def test_late_mode_writes_the_chunks_of_chunks_mode(tmp_path):
    events = tmp_path / "in.jsonl"
    events.write_text("".join(json.dumps(e) + "\n" for e in bbc_events(4)))
    options = PipelineOptions(["--runner=FnApiRunner"])
    spans, ids = {}, {}
    for mode in ("chunks", "late"):
        config = make_config(input=str(events), output=str(tmp_path / mode),
                             chunking=LATE.model_copy(update={"mode": mode}))
        run_batch(config, options, engine_factory=FakeEngine)
        chunks = table(tmp_path / mode, "chunks")
        spans[mode] = sorted(zip(*(chunks[c].to_pylist() for c in (
            "id", "chunk_index", "token_start", "token_end", "char_start", "char_end")),
            strict=True))
        ids[mode] = set(chunks["chunk_id"].to_pylist())
        assert np.isfinite(vectors_of(chunks)).all()
    assert spans["late"] == spans["chunks"] and len(spans["late"]) > 4
    assert not ids["late"] & ids["chunks"]  # other vectors: other chunk ids


def test_a_failing_pass_dead_letters_its_article_and_no_other(tokenizer):
    _, docs = late_docs(tokenizer, [long_text(i) for i in range(3)])
    docs[1] = PreparedDoc(event=docs[1].event, text=docs[1].text, text_sha256=docs[1].text_sha256,
                          token_ids=docs[1].token_ids[:5] + (POISON,) + docs[1].token_ids[6:],
                          truncated=docs[1].truncated, chunks=docs[1].chunks)
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(docs) | Embed(make_config().model, chunking=LATE,
                                            engine_factory=FakeEngine)
        assert_that(out.embedded | beam.Map(lambda e: e.id), equal_to(["d0", "d2"]),
                    label="the others")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.event_id, d.reason)),
                    equal_to([("d1", Reason.EMBEDDING_FAILED)]), label="the article")


def test_late_mode_refuses_the_shared_engine():
    raw = json.loads(make_config(input="x", output="y").model_dump_json())
    raw["chunking"]["mode"] = "late"
    raw["model"]["share_across_processes"] = True
    with pytest.raises(ConfigError, match="share_across_processes"):
        validate(raw)

"""The embed step under failure: an input that fails is dead-lettered alone (bisection), an engine
that breaks blames no input (the bundle fails, is retried, and a fresh engine serves it), and a
model that fails every input stops the job.

Failures are injected into the engine the real handler calls: a FAKE engine (tests/fakes.py) for the
unit cases, and the real vLLM engine, wrapped, for the runs through the batch embedding step
(Embed)."""
import json
import threading

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.testing.util import assert_that, equal_to

from tests.common import make_config
from tests.fakes import NAN, POISON, FakeEngine
from transforms.embed import Embed, Embedder, EmbedFailure, ModelBrokenError
from transforms.engines.base import EngineFailedError, EngineHandle
from transforms.engines.registry import load_engine
from transforms.engines.vllm import Engine
from transforms.types import NewsEvent, PreparedDoc, Reason

SETTINGS = make_config().model


def doc(i: int, poison=False, ids=None) -> PreparedDoc:
    ids = ids or (101, POISON if poison else 1000 + i, 102)
    return PreparedDoc(event=NewsEvent(id=f"d{i}", body="x"), text="x", text_sha256=str(i),
                       token_ids=tuple(ids), truncated=False)


def handler(**changes) -> Embedder:
    return Embedder(SETTINGS.model_copy(update=changes))


def test_bisection_dead_letters_only_the_failing_inputs():
    model = EngineHandle(SETTINGS, FakeEngine)
    batch = [doc(i, poison=i in (3, 11)) for i in range(16)]
    results = list(handler().embed_batch(batch, model))
    failed = [r.example.event.id for r in results if isinstance(r.inference, EmbedFailure)]
    assert failed == ["d3", "d11"]
    good = {r.example.event.id: int(np.argmax(r.inference[0])) for r in results
            if not isinstance(r.inference, EmbedFailure)}
    assert len(good) == 14 and good["d5"] == (101 + 1005 + 102) % 384, "each keeps its own vector"


class FailsEveryInput(FakeEngine):
    """Every call fails, yet the canary passes: a model broken for real inputs."""

    def embed(self, prompts):
        self.calls.append(len(prompts))
        raise RuntimeError("shape mismatch in the pooler")


def test_a_model_failing_for_every_input_stops_the_job():
    with pytest.raises(ModelBrokenError, match="in a row"):
        handler(max_consecutive_failures=8).embed_batch(
            [doc(i) for i in range(10)], EngineHandle(SETTINGS, FailsEveryInput))


def test_token_budget_drives_batching():
    kwargs = handler(token_budget=1000).batch_elements_kwargs()
    assert kwargs["max_batch_size"] == 1000 and kwargs["element_size_fn"](doc(1)) == 3


def test_embed_transform_routes_failures_to_dead_letters_and_keeps_the_rest():
    docs = [doc(i, poison=(i == 2)) for i in range(6)]
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(docs) | Embed(SETTINGS, engine_factory=FakeEngine)
        assert_that(out.embedded | beam.Map(lambda e: (e.id, e.model)),
                    equal_to([(f"d{i}", "fake@0") for i in (0, 1, 3, 4, 5)]), label="rows")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.event_id, d.step, d.reason,
                                                          "illegal memory" in d.detail)),
                    equal_to([("d2", "embed", Reason.EMBEDDING_FAILED, True)]), label="dead")


class Breaks(FakeEngine):
    """An engine that breaks for good after ``after`` calls, canary included (a CUDA error
    poisons the device context). Each instance is a fresh load."""

    loads = 0
    after = 1

    def __init__(self, settings=None):
        super().__init__(settings)
        type(self).loads += 1
        self.broken_calls = 0

    def embed(self, prompts):
        if len(self.calls) >= self.after:
            self.broken_calls += 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().embed(prompts)

    def healthy(self):
        return len(self.calls) < self.after


def test_a_broken_engine_blames_no_input_and_the_same_handle_gets_a_fresh_one():
    Breaks.loads = 0
    model = EngineHandle(SETTINGS, Breaks)
    first = model._engine
    h = handler()
    assert all(isinstance(r.inference[0], np.ndarray) for r in h.embed_batch([doc(0)], model))
    with pytest.raises(EngineFailedError, match="illegal memory access"):
        h.embed_batch([doc(i) for i in range(8)], model)
    assert first.broken_calls == 1, "no bisection: no input is to blame"
    assert first.closed, "the broken engine is closed (its GPU memory freed)"
    # The handle the embedding step keeps serves the retried bundle with a new engine.
    results = h.embed_batch([doc(i) for i in range(8)], model)
    assert Breaks.loads == 2 and all(isinstance(r.inference[0], np.ndarray) for r in results)


def test_engine_dead_error_is_an_engine_failure():
    class EngineDeadError(RuntimeError):
        """Named like vLLM's: the engine core died, whatever the input."""

    class Dead(FakeEngine):
        def embed(self, prompts):
            self.calls.append(len(prompts))
            raise EngineDeadError("EngineCore encountered an issue")

    model = EngineHandle(SETTINGS, Dead)
    with pytest.raises(EngineFailedError):
        handler().embed_batch([doc(i) for i in range(8)], model)


# ---- the real vLLM engine (float32, loaded once per session) ----

@pytest.fixture(scope="module")
def real():
    return load_engine(SETTINGS)


class BreaksOnceReal:
    """The session's real vLLM engine behind the handler; the FIRST engine this factory makes
    breaks for good after one call (every call and the canary fail), as a CUDA error does; the
    ones loaded after it work. Module-level state, so the runner's pickled factory shares it."""

    made = 0
    lock = threading.Lock()

    def __init__(self, settings):
        self._real = load_engine(settings)
        self.label = self._real.label()
        with BreaksOnceReal.lock:
            BreaksOnceReal.made += 1
            self._breaks = BreaksOnceReal.made == 1
        self._calls = 0

    def embed(self, prompts):
        self._calls += 1
        if self._breaks and self._calls > 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self._real.embed(prompts)

    def healthy(self):
        return not (self._breaks and self._calls >= 1)

    def close(self):
        pass  # the session's engine stays loaded


def _real_docs(tokenizer, n):
    texts = [f"Article number {i} about the markets, the weather and football." for i in range(n)]
    return [PreparedDoc(event=NewsEvent(id=f"r{i}", body=t), text=t, text_sha256=str(i),
                        token_ids=tokenizer(t)[0], truncated=False) for i, t in enumerate(texts)]


def test_real_engine_breaking_mid_job_is_retried_and_dead_letters_nothing(tokenizer, real):
    # BundleBasedDirectRunner retries a failed bundle (FnApiRunner would fail the job instead, with
    # the EngineFailedError, and publish nothing). token_budget = 2 documents, so the engine breaks
    # on the second batch of the bundle.
    BreaksOnceReal.made = 0
    docs = _real_docs(tokenizer, 12)
    settings = SETTINGS.model_copy(update={"token_budget": 2 * max(d.token_count for d in docs)})
    expected = dict(zip([d.event.id for d in docs], real.embed([d.token_ids for d in docs]),
                        strict=True))
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions())
    out = (p | beam.Create(docs)
           | Embed(settings, engine_factory=BreaksOnceReal))
    assert_that(out.embedded | beam.Map(lambda e: (e.id, round(float(
        np.dot(e.embedding, expected[e.id])), 4))),
        equal_to([(d.event.id, 1.0) for d in docs]), label="every row, once, its own vector")
    assert_that(out.dead_letter, equal_to([]), label="no dead letter")
    p.run().wait_until_finish()
    assert BreaksOnceReal.made >= 2, "a fresh engine served the retried bundle"


def test_real_engine_input_failure_dead_letters_that_input_alone(tokenizer, real):
    docs = _real_docs(tokenizer, 6)
    bad = doc(99, ids=(101, 10**7, 102))  # a token id the model does not have: vLLM rejects it
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(docs + [bad]) | Embed(SETTINGS)
        assert_that(out.embedded | beam.Map(lambda e: e.id),
                    equal_to([d.event.id for d in docs]), label="rows")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.event_id, d.reason)),
                    equal_to([("d99", Reason.EMBEDDING_FAILED)]), label="dead")


def test_a_failed_engine_call_leaves_no_request_behind(tokenizer, real, monkeypatch):
    # Relied on, not implemented, by newsvec: vLLM 0.32's LLM.embed() aborts the requests of a call
    # that raises in its engine loop. Were one left, it would finish in the next call and come back
    # among that call's outputs (Engine.embed would then fail that call: outputs are matched to
    # inputs by their token ids).
    engine: Engine = real._engine
    llm_engine = engine._llm.llm_engine
    step, calls = llm_engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return step()

    docs = _real_docs(tokenizer, 3)
    monkeypatch.setattr(llm_engine, "step", failing_once)
    with pytest.raises(RuntimeError, match="device-side"):
        engine.embed([d.token_ids for d in docs])
    monkeypatch.setattr(llm_engine, "step", step)
    vectors = engine.embed([docs[0].token_ids])
    assert len(vectors) == 1 and not llm_engine.has_unfinished_requests()
    assert np.dot(vectors[0], real.embed([docs[0].token_ids])[0]) > 0.9999


# ---- an engine that cannot be loaded again (section 5 of issue 21) ----

class LoadFailsAfterBreak(FakeEngine):
    """FAKE: the first engine breaks for good after ``after`` calls, canary included (a CUDA error
    poisons the device context), and every later construction raises, as a load does on a GPU whose
    context is poisoned or whose memory is not freed yet. Class state: in-process runners only."""

    loads = 0
    after = 1

    def __init__(self, settings=None):
        type(self).loads += 1
        if type(self).loads > 1:
            raise RuntimeError("CUDA error: out of memory while loading the model")
        super().__init__(settings)

    def embed(self, prompts):
        if len(self.calls) >= self.after:
            self.calls.append(len(prompts))
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().embed(prompts)

    def healthy(self):
        return len(self.calls) < self.after


def _failure_of(pipeline) -> str:
    """The error the pipeline failed with, or "the pipeline finished"."""
    try:
        pipeline.run().wait_until_finish()
    except Exception as exc:  # pylint: disable=broad-except  # the runner's wrapping varies
        return f"{type(exc).__name__}: {exc}"
    return "the pipeline finished"


def _append(path, value):
    with open(path, "a") as f:
        f.write(f"{value}\n")
    return value


def test_a_reload_that_fails_is_an_engine_failure_not_an_input_failure():
    LoadFailsAfterBreak.loads = 0
    model = EngineHandle(SETTINGS, LoadFailsAfterBreak)
    h = handler()
    assert h.embed_batch([doc(0)], model)  # the first call works
    with pytest.raises(EngineFailedError, match="illegal memory access"):
        h.embed_batch([doc(i) for i in range(4)], model)
    for _ in range(2):  # each retry of the bundle: the load fails, and no input is blamed
        with pytest.raises(EngineFailedError, match="could not be loaded.*out of memory"):
            h.embed_batch([doc(i) for i in range(4)], model)
    assert LoadFailsAfterBreak.loads == 3


@pytest.mark.parametrize("runner", ["FnApiRunner", "BundleBasedDirectRunner"])
def test_batch_with_an_engine_that_cannot_be_reloaded_fails_and_dead_letters_nothing(
        runner, tmp_path):
    # token_budget = 2 documents: the bundle makes several engine calls; the engine breaks on the
    # second, and cannot be loaded again. BundleBasedDirectRunner retries the bundle (as Dataflow
    # does a work item), FnApiRunner fails the job at once.
    LoadFailsAfterBreak.loads = 0
    settings = SETTINGS.model_copy(update={"max_tokens": 3, "token_budget": 6})
    letters, rows = tmp_path / "dead", tmp_path / "rows"
    p = TestPipeline(runner=runner, options=PipelineOptions())
    out = (p | beam.Create([doc(i) for i in range(12)])
           | Embed(settings, engine_factory=LoadFailsAfterBreak))
    _ = out.dead_letter | "Letters" >> beam.Map(lambda d: _append(letters, d.event_id))
    _ = out.embedded | "Rows" >> beam.Map(lambda e: _append(rows, e.id))
    error = _failure_of(p)
    assert not letters.exists(), f"dead-lettered: {letters.read_text().split()}"
    assert "embedding engine" in error, error


def test_streaming_with_an_engine_that_cannot_be_reloaded_fails_and_commits_no_dead_letter(
        tmp_path):
    # The whole streaming graph on a TestStream: the first micro-batch embeds, the engine breaks
    # on the second and cannot be loaded again. No micro-batch may be committed with its articles
    # as embedding_failed dead letters: the bundle fails, and the job stops naming the engine.
    from pipeline.graph import embed_and_write_streaming
    from tests.streaming.test_late_data import T0, message
    from transforms.settings import StreamingSettings

    LoadFailsAfterBreak.loads = 0
    config = make_config(output=str(tmp_path / "out"), streaming=StreamingSettings(
        window_s=60, allowed_lateness_s=600, max_wait_s=5, batch_shards=1))
    stream = (TestStream().advance_watermark_to(T0)
              .add_elements([message(f"first-{i}", T0 + 1 + i) for i in range(3)])
              .advance_watermark_to(T0 + 120)
              .add_elements([message(f"second-{i}", T0 + 121 + i) for i in range(3)])
              .advance_watermark_to(T0 + 240)
              .add_elements([message(f"third-{i}", T0 + 241 + i) for i in range(3)])
              .advance_watermark_to_infinity())
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embed_and_write_streaming(p | stream, config, "20261201T120000Z-1a7e1a7e",
                              engine_factory=LoadFailsAfterBreak)
    error = _failure_of(p)
    letters = [json.loads(line)["event_id"] for path in (tmp_path / "out").rglob("*.jsonl")
               for line in path.read_text().splitlines()]
    assert letters == [], f"dead-lettered because the engine could not load: {letters}"
    assert "embedding engine" in error, error


def test_the_count_of_failures_in_a_row_outlives_the_handler_copy():
    # Each DoFn instance (each thread, each retry of a failed bundle) holds its own unpickled copy
    # of the handler: the count is the process's, for that embedding step.
    import pickle

    h = handler(max_consecutive_failures=5)
    model = EngineHandle(SETTINGS, FailsEveryInput)
    pickle.loads(pickle.dumps(h)).embed_batch([doc(i) for i in range(3)], model)
    with pytest.raises(ModelBrokenError, match="5 documents in a row"):
        pickle.loads(pickle.dumps(h)).embed_batch([doc(i) for i in range(3)], model)
    with pytest.raises(ModelBrokenError, match="6 documents in a row"):  # the retried bundle
        pickle.loads(pickle.dumps(h)).embed_batch([doc(i) for i in range(3)], model)
    other = handler(max_consecutive_failures=5)  # another pipeline's step counts on its own
    assert len(other.embed_batch([doc(i) for i in range(3)], model)) == 3


def test_streaming_micro_batches_of_a_broken_model_stop_the_job(tmp_path):
    # Micro-batches of 3 documents, max_consecutive_failures 4, a model that fails every input
    # while its canary passes: the first micro-batch is dead-lettered (3 in a row), the second
    # trips the stop, and its retries (new DoFn instances) must trip it again, not start over.
    from pipeline.graph import embed_and_write_streaming
    from tests.streaming.test_late_data import T0, message
    from transforms.settings import StreamingSettings

    config = make_config(output=str(tmp_path / "out"), streaming=StreamingSettings(
        window_s=60, allowed_lateness_s=600, max_wait_s=5, batch_shards=1))
    config = config.model_copy(update={"model": config.model.model_copy(
        update={"max_consecutive_failures": 4})})
    stream = TestStream().advance_watermark_to(T0)
    for k, name in enumerate(("first", "second", "third")):
        stream = (stream.add_elements([message(f"{name}-{i}", T0 + 120 * k + 1 + i)
                                       for i in range(3)])
                  .advance_watermark_to(T0 + 120 * (k + 1)))
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embed_and_write_streaming(p | stream.advance_watermark_to_infinity(), config,
                              "20261201T120000Z-1a7e1a7e", engine_factory=FailsEveryInput)
    error = _failure_of(p)
    letters = sorted(json.loads(line)["event_id"] for path in (tmp_path / "out").rglob("*.jsonl")
                     for line in path.read_text().splitlines())
    assert letters == ["first-0", "first-1", "first-2"], letters
    assert "ModelBrokenError" in error or "in a row" in error, error


# ---- non-finite vectors (the store refuses them: a row must never hold one) ----

def test_a_non_finite_vector_is_that_documents_dead_letter_never_a_row():
    docs = [doc(i, ids=(101, NAN, 102) if i == 2 else None) for i in range(6)]
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(docs) | Embed(SETTINGS, engine_factory=NanEngine)
        assert_that(out.embedded | beam.Map(lambda e: (e.id, bool(np.isfinite(e.embedding).all()))),
                    equal_to([(f"d{i}", True) for i in (0, 1, 3, 4, 5)]), label="rows")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.event_id, d.reason, d.detail)),
                    equal_to([("d2", Reason.EMBEDDING_FAILED, "the engine returned a non-finite "
                               "vector (384 NaN and 0 infinite of 384 values)")]), label="dead")


class NanEngine(FakeEngine):
    """FAKE: a NaN vector for each prompt holding the NAN token; the canary passes."""

    def embed(self, prompts):
        vectors = super().embed(prompts)
        for p, v in zip(prompts, vectors, strict=True):
            if NAN in p:
                v[:] = np.nan
        return vectors


def test_non_finite_vectors_count_toward_the_broken_model_stop():
    # A model that returns NaN for every input while its canary passes is a broken model.
    with pytest.raises(ModelBrokenError, match="non-finite"):
        handler(max_consecutive_failures=3).embed_batch(
            [doc(i, ids=(101, NAN, 102 + i)) for i in range(4)], EngineHandle(SETTINGS, NanEngine))


class NanAndBroken(NanEngine):
    """FAKE: NaN vectors, and a canary that fails too (an engine gone bad, not the inputs)."""

    def healthy(self):
        return False


def test_non_finite_vectors_with_a_failing_canary_are_an_engine_failure():
    model = EngineHandle(SETTINGS, NanAndBroken)
    engine = model._engine
    with pytest.raises(EngineFailedError, match="non-finite"):
        handler().embed_batch([doc(i, ids=(101, NAN, 102 + i)) for i in range(4)], model)
    assert engine.closed, "no document is blamed; the engine is closed, the next call loads anew"

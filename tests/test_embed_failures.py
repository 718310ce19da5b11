"""Embed step under failing model calls, with a FAKE LLM (the real engine is tested in
test_batch_pipeline.py): bisection isolates poison inputs, and a broken model stops the job."""
import apache_beam as beam
import numpy as np
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from tests.conftest import make_config
from transforms.embed import EmbedWithVLLM, LoadedModel, ModelBrokenError, VLLMEmbeddingHandler
from transforms.schema import NewsEvent, PreparedDoc, Reason

POISON = 666


class _Out:
    def __init__(self, vector):
        self.outputs = type("O", (), {"embedding": vector})()


class FakeLLM:
    """Stands in for vllm.LLM: fails a whole call when any prompt holds the POISON token."""

    def __init__(self, dim=384, fail_all=False):
        self.dim, self.fail_all, self.calls = dim, fail_all, []

    def embed(self, prompts, pooling_params=None, use_tqdm=False):
        self.calls.append(len(prompts))
        if self.fail_all or any(POISON in p["prompt_token_ids"] for p in prompts):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return [_Out([float(p["prompt_token_ids"][1])] * self.dim) for p in prompts]


def doc(i: int, poison=False) -> PreparedDoc:
    ids = (101, POISON if poison else i, 102)
    return PreparedDoc(event=NewsEvent(id=f"d{i}", body="x"), text="x", text_sha256=str(i),
                       token_ids=ids, truncated=False)


def handler(**changes) -> VLLMEmbeddingHandler:
    return VLLMEmbeddingHandler(make_config().model.model_copy(update=changes))


def test_bisection_dead_letters_only_the_failing_inputs():
    llm = FakeLLM()
    batch = [doc(i, poison=i in (3, 11)) for i in range(16)]
    results = list(handler().run_inference(batch, LoadedModel(llm, "fake@0")))
    failed = [r.example.event.id for r in results if not isinstance(r.inference, np.ndarray)]
    assert failed == ["d3", "d11"]
    good = {r.example.event.id: r.inference[0] for r in results if isinstance(r.inference, np.ndarray)}
    assert len(good) == 14 and good["d5"] == 5.0, "each good doc keeps its own vector"
    assert len(llm.calls) < 16, "bisection, not one call per document"


def test_a_model_failing_for_every_input_stops_the_job():
    with pytest.raises(ModelBrokenError, match="in a row"):
        handler(max_consecutive_failures=8).run_inference(
            [doc(i) for i in range(10)], LoadedModel(FakeLLM(fail_all=True), "fake@0"))


def test_token_budget_drives_batching():
    kwargs = handler(token_budget=1000).batch_elements_kwargs()
    assert kwargs["max_batch_size"] == 1000 and kwargs["element_size_fn"](doc(1)) == 3


class FakeHandler(VLLMEmbeddingHandler):
    def load_model(self):
        return LoadedModel(FakeLLM(), "fake@0")


def test_embed_transform_routes_failures_to_dead_letters_and_keeps_the_rest():
    docs = [doc(i, poison=(i == 2)) for i in range(6)]
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(docs) | EmbedWithVLLM(
            make_config().model, handler=FakeHandler(make_config().model))
        assert_that(out.embedded | beam.Map(lambda e: (e.doc.event.id, e.model)),
                    equal_to([(f"d{i}", "fake@0") for i in (0, 1, 3, 4, 5)]), label="rows")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.event_id, d.step, d.reason,
                                                          "illegal memory" in d.detail)),
                    equal_to([("d2", "embed", Reason.EMBEDDING_FAILED, True)]), label="dead")


class EngineDeadError(RuntimeError):
    """Named like vLLM's: the engine core died, whatever the input."""


def test_a_dead_engine_is_not_blamed_on_the_inputs_and_is_evicted(monkeypatch):
    from transforms import embed

    class DeadLLM(FakeLLM):
        def embed(self, prompts, pooling_params=None, use_tqdm=False):
            self.calls.append(len(prompts))
            raise EngineDeadError("EngineCore encountered an issue")

    settings = make_config().model
    llm = DeadLLM()
    key = embed._engine_key(settings)
    monkeypatch.setitem(embed._ENGINES, key, LoadedModel(llm, "fake@0"))
    with pytest.raises(EngineDeadError):
        VLLMEmbeddingHandler(settings).run_inference([doc(i) for i in range(8)], embed._ENGINES[key])
    assert llm.calls == [8], "no bisection: no input is to blame"
    assert key not in embed._ENGINES, "the next bundle loads a fresh engine"


def test_fewer_outputs_than_inputs_is_a_failure_not_a_silent_mismatch():
    class ShortLLM(FakeLLM):
        def embed(self, prompts, pooling_params=None, use_tqdm=False):
            return super().embed(prompts)[:-1] if len(prompts) > 1 else super().embed(prompts)

    results = list(handler().run_inference([doc(i) for i in range(4)],
                                           LoadedModel(ShortLLM(), "fake@0")))
    assert [r.example.event.id for r in results] == ["d0", "d1", "d2", "d3"]
    assert all(isinstance(r.inference, np.ndarray) and r.inference[0] == i
               for i, r in enumerate(results)), "each vector stays with its own document"

"""The batch embedding step keeps an engine call in flight while its bundle goes on
(transforms.embed._EmbedBatchesFn): RunInference would wait for each call, and the bundle's core
would idle meanwhile. A FAKE engine held at a gate shows that the step takes the next batch while a
call is still running, emits each batch's results once, in order, with its window, and that a
failure in the engine's thread fails the bundle."""
from __future__ import annotations

import threading

import pytest
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.timestamp import MIN_TIMESTAMP

from tests.common import make_config
from tests.engines.test_embed_failures import doc
from tests.fakes import FakeEngine
from transforms.embed import Embedder, _EmbedBatchesFn
from transforms.engines.base import EngineFailedError

SETTINGS = make_config().model


class Gated(FakeEngine):
    """FAKE; each call waits at the gate; ``fail`` breaks the engine (its canary too)."""

    gate = threading.Event()
    started = threading.Event()
    fail = False

    def embed(self, prompts):
        Gated.started.set()
        assert Gated.gate.wait(10)
        if Gated.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().embed(prompts)

    def healthy(self):
        return not Gated.fail


def step():
    Gated.gate.clear(), Gated.started.clear()
    Gated.fail = False
    fn = _EmbedBatchesFn(Embedder(SETTINGS, Gated))
    fn.setup()
    fn.start_bundle()
    return fn


def ids(outputs):
    return [wv.value.example.id for wv in outputs]


def test_the_next_batch_is_taken_while_the_engine_embeds():
    fn = step()
    window = GlobalWindow()
    assert list(fn.process([doc(0), doc(1)], window, MIN_TIMESTAMP)) == []
    assert Gated.started.wait(10), "the first call is running"
    assert not Gated.gate.is_set(), "and the bundle went on without waiting for it"
    Gated.gate.set()
    second = list(fn.process([doc(2)], window, MIN_TIMESTAMP))  # waits for the first call only
    assert ids(second) == ["d0", "d1"] and all(wv.windows == (window,) for wv in second)
    assert ids(fn.finish_bundle()) == ["d2"]
    fn.teardown()


def test_an_engine_failure_in_its_thread_fails_the_bundle():
    fn = step()
    Gated.fail = True
    assert list(fn.process([doc(0)], GlobalWindow(), MIN_TIMESTAMP)) == []
    Gated.gate.set()
    with pytest.raises(EngineFailedError):
        list(fn.finish_bundle())
    fn.teardown()

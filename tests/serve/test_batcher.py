"""The batcher of ``newsvec serve`` (``pipeline.serve.batcher``) with a stand-in engine (no
model): calls hold up to the token budget, an idle engine waits at most ``max_wait_ms`` for more,
a full queue refuses at once, an input whose request gave up is never embedded, a failing input
is isolated from the others of its call, and an engine failure fails every input of the call."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from tests.serve.conftest import need

need("prometheus_client")

from pipeline.serve.batcher import Batcher, InputFailed, QueueFull  # noqa: E402
from pipeline.serve.metrics import ServeMetrics  # noqa: E402
from transforms.engines.base import EngineFailedError  # noqa: E402


class Engine:
    """Each prompt's vector is its first id, as one float; ``bad`` ids fail a call that holds
    them, ``nan`` ids give a NaN; ``gate`` holds calls while it is clear."""

    def __init__(self, bad=(), nan=(), broken=False):
        self.calls: list[list[int]] = []
        self.bad, self.nan, self.broken = set(bad), set(nan), broken
        self.gate = threading.Event()
        self.gate.set()

    def embed(self, prompts):
        self.gate.wait(10)
        self.calls.append([p[0] for p in prompts])
        if self.broken:
            raise EngineFailedError("the engine broke")
        if any(p[0] in self.bad for p in prompts):
            raise ValueError("an input the engine refuses")
        return [np.array([np.nan if p[0] in self.nan else float(p[0])], np.float32)
                for p in prompts]


def _run(engine: Engine, scenario, **settings):
    settings = {"max_batch_tokens": 100, "max_wait_ms": 0, "max_queue": 1000, **settings}

    async def main():
        batcher = Batcher(engine.embed, metrics=ServeMetrics(), **settings)
        batcher.start()
        try:
            return await scenario(batcher)
        finally:
            await batcher.close()

    return asyncio.run(main())


def test_calls_hold_up_to_the_token_budget_in_order():
    engine = Engine()
    engine.gate.clear()

    async def scenario(batcher):
        first = asyncio.ensure_future(batcher.embed([[0] * 10]))
        await asyncio.sleep(0.05)  # the first call is in the engine: the rest wait together
        rest = [asyncio.ensure_future(batcher.embed([[i] * 30])) for i in range(1, 8)]
        await asyncio.sleep(0.05)
        engine.gate.set()
        return [v[0][0] for v in await asyncio.gather(first, *rest)]

    assert _run(engine, scenario) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert engine.calls == [[0], [1, 2, 3], [4, 5, 6], [7]]


def test_an_idle_engine_waits_max_wait_for_more():
    engine = Engine()

    async def scenario(batcher):
        started = time.perf_counter()
        first = asyncio.ensure_future(batcher.embed([[1]]))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(batcher.embed([[2]]))
        await asyncio.gather(first, second)
        return time.perf_counter() - started

    took = _run(engine, scenario, max_wait_ms=200)
    assert engine.calls == [[1, 2]] and 0.19 <= took < 1.0


def test_a_full_queue_refuses_at_once_and_a_request_that_gave_up_is_dropped():
    engine = Engine()
    engine.gate.clear()

    async def scenario(batcher):
        held = asyncio.ensure_future(batcher.embed([[1]]))
        await asyncio.sleep(0.05)  # in the engine
        waiting = asyncio.ensure_future(batcher.embed([[2], [3]]))
        gives_up = asyncio.ensure_future(batcher.embed([[4]]))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull) as full:
            await batcher.embed([[5]])
        assert full.value.waiting == 3 and full.value.retry_after_s >= 1
        gives_up.cancel()
        await asyncio.sleep(0.01)
        engine.gate.set()
        await asyncio.gather(held, waiting)

    _run(engine, scenario, max_queue=3)
    assert engine.calls == [[1], [2, 3]]


def test_a_failing_input_is_isolated_and_an_engine_failure_fails_all():
    engine = Engine(bad={3}, nan={5})

    async def scenario(batcher):
        return await asyncio.gather(*(batcher.embed([[i]]) for i in range(1, 7)),
                                    return_exceptions=True)

    outcomes = _run(engine, scenario, max_wait_ms=50)
    assert [o[0][0] if isinstance(o, list) else type(o) for o in outcomes] == [
        1.0, 2.0, InputFailed, 4.0, InputFailed, 6.0]
    broken = Engine(broken=True)
    outcomes = _run(broken, scenario, max_wait_ms=50)
    assert all(isinstance(o, EngineFailedError) for o in outcomes) and len(broken.calls) == 1


class Paced(Engine):
    """``Engine``, every call taking ``call_s``."""

    def __init__(self, call_s: float):
        super().__init__()
        self.call_s = call_s

    def embed(self, prompts):
        time.sleep(self.call_s)
        return super().embed(prompts)


def test_a_request_that_would_outwait_its_timeout_is_refused_at_once():
    """At the pace full calls have taken (10 inputs in 0.2 s: 50 a second), 200 inputs would wait
    4 s, past the 1 s a request may: refused at once (a 429, not a 503 after waiting); 20 (0.4 s)
    are taken. Calls of one input (the pace of a quiet service, not of a queue) set no pace."""
    engine = Paced(0.2)
    ten = [(i,) * 10 for i in range(10)]

    async def scenario(batcher):
        for i in range(3):  # quiet: one input a call
            await batcher.embed([(i,) * 10])
        quiet_full = len(await batcher.embed([(9,) * 10] * 60))  # no full call yet: taken
        await batcher.embed(ten)  # a full call: 50 a second
        started = time.perf_counter()
        with pytest.raises(QueueFull):
            await batcher.embed([(7,) * 10] * 200)
        refused_in = time.perf_counter() - started
        taken = len(await batcher.embed([(8,) * 10] * 20))
        return quiet_full, refused_in, taken

    quiet_full, refused_in, taken = _run(engine, scenario, timeout_s=1.0)
    assert quiet_full == 60 and taken == 20
    assert refused_in < 0.1, f"refused after {refused_in:.2f} s"

"""The batcher's one task outlives a call that goes wrong outside the engine's own failures: an
engine that answers with fewer vectors than prompts (or something that is not a vector) fails
that call's requests, and the next request is still embedded (the task dead, every later request
would wait out ``serve.request_timeout_s`` while ``/healthz`` and ``/readyz`` say all is well)."""
from __future__ import annotations

import asyncio

import numpy as np

from tests.serve.conftest import need

need("prometheus_client")

from tests.serve.test_batcher import _run  # noqa: E402


class ShortEngine:
    """Answers one vector too few for a call that holds the id 13; else one per prompt."""

    def embed(self, prompts):
        vectors = [np.array([float(p[0])], np.float32) for p in prompts]
        return vectors[:-1] if any(p[0] == 13 for p in prompts) else vectors


def test_a_call_that_answers_too_few_vectors_does_not_stop_the_batcher():
    async def scenario(batcher):
        outcomes = []
        for prompts in ([[13], [14]], [[7]]):
            try:
                outcomes.append(await asyncio.wait_for(batcher.embed(prompts), 5))
            except asyncio.TimeoutError:
                outcomes.append("hung")
            except Exception as exc:  # pylint: disable=broad-except
                outcomes.append(exc)
        return outcomes

    first, later = _run(ShortEngine(), scenario, max_queue=100)
    assert isinstance(first, Exception), first  # that call's request fails, and is answered
    assert later != "hung" and later[0][0] == 7.0, later

"""The early refusal (429 at once for a request that would outwait ``serve.request_timeout_s``
at the pace of full engine calls, ``Batcher.embed``) measures that pace in inputs a second. An
engine's call costs its tokens, not its inputs: after full calls of long documents
(``input_type: document``, a few hundred tokens each), the pace in inputs is that of documents,
and a request of many short queries, which one call embeds in a fraction of a second, is refused
as if each query were a document: in normal operation, by a service mixing the two, and for
good (its ``Retry-After`` says 1 s with nothing waiting; its retries are refused alike).

And a request that could never be served in time (alone, it outweighs the timeout at any load)
is told ``queue_full``, "0 inputs are waiting for the engine", retry after 1 s: a client retries
it forever. It must be told what to change (fewer inputs a request)."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tests.serve.conftest import need

need("prometheus_client")

from pipeline.serve.batcher import QueueFull  # noqa: E402
from tests.serve.test_batcher import _run  # noqa: E402

TOKEN_S = 0.0002  # the engine's cost of one token: a full call of 1,000 tokens takes 0.2 s


class TokenPaced:
    """A call costs its tokens (``TOKEN_S`` each)."""

    def __init__(self):
        self.calls: list[int] = []

    def embed(self, prompts):
        time.sleep(TOKEN_S * sum(len(p) for p in prompts))
        self.calls.append(len(prompts))
        return [np.array([float(len(p))], np.float32) for p in prompts]


def test_short_queries_after_long_documents_are_not_refused():
    """Full calls of 10 documents of 100 tokens (0.2 s each: 50 inputs a second); then 200
    queries of 5 tokens, 1,000 tokens in all: one call of 0.2 s, well inside the 1 s timeout."""
    documents = [(1,) * 100] * 10

    async def scenario(batcher):
        for _ in range(3):
            await batcher.embed(documents)
        started = time.perf_counter()
        try:
            vectors = await asyncio.wait_for(batcher.embed([(2,) * 5] * 200), 5)
        except QueueFull as exc:
            return f"refused ({exc}; retry after {exc.retry_after_s} s)"
        return len(vectors), time.perf_counter() - started

    outcome = _run(TokenPaced(), scenario, max_batch_tokens=1000, max_wait_ms=0, max_queue=10_000,
                   timeout_s=1.0)
    assert not isinstance(outcome, str), (
        f"200 short queries (one call of {TOKEN_S * 1000:.1f} s) {outcome}: the pace was taken "
        "in documents a second")
    assert outcome[0] == 200 and outcome[1] < 1.0


def test_a_request_that_alone_would_outwait_the_timeout_is_told_so():
    """50 inputs a second; one request of 200 (4 s alone, past the 1 s timeout) with nothing
    waiting: refused, but not as a queue to wait out."""
    tens = [(3,) * 10] * 100

    async def scenario(batcher):
        for _ in range(3):
            await batcher.embed(tens[:100])  # full calls: 1,000 tokens in 0.2 s
        with pytest.raises(QueueFull) as refused:
            await batcher.embed([(4,) * 100] * 200)  # 20,000 tokens: 4 s of engine
        return refused.value

    refused = _run(TokenPaced(), scenario, max_batch_tokens=1000, max_wait_ms=0, max_queue=10_000,
                   timeout_s=1.0)
    message = str(refused).lower()
    assert "0 inputs are waiting" not in message and (
        "fewer" in message or "split" in message), (
        f"a request that can never be embedded in time is told {str(refused)!r}, retry after "
        f"{refused.retry_after_s} s")

"""FAKE embedding engines for tests of something other than the model (paths, sinks, windowing,
failure handling). They are ``transforms.engine.EmbeddingEngine``s: ``label``, ``embed``,
``healthy``, ``close``. The real engine (vLLM) is tested in test_batch_pipeline.py and elsewhere."""
from __future__ import annotations

import numpy as np

POISON = 666  # a token id that makes FakeEngine fail the whole call, as a poison input would


class FakeEngine:
    """A deterministic unit vector per prompt (one-hot at sum(ids) % dim). A call holding the
    POISON token fails as a whole; the canary (``healthy``) always passes."""

    label = "fake@0"

    def __init__(self, settings=None, dim: int = 384):
        self.dim = settings.output_dim if settings is not None else dim
        self.calls: list[int] = []
        self.closed = False

    def embed(self, prompts):
        self.calls.append(len(prompts))
        if any(POISON in p for p in prompts):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        out = []
        for p in prompts:
            v = np.zeros(self.dim, np.float32)
            v[sum(p) % self.dim] = 1.0
            out.append(v)
        return out

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True

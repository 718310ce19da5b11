"""FAKE embedding engines for tests of something other than the model (paths, sinks, windowing,
failure handling). They are ``transforms.engine.EmbeddingEngine``s: ``label``, ``embed``,
``healthy``, ``close``. The real engine (vLLM) is tested in test_batch_pipeline.py and elsewhere.

Also the stand-ins for an SDK process of a machine that the shared-engine tests spawn
(``sdk_process``, ``reach_engine``): they import no more than the engine's client, so they start
quickly."""
from __future__ import annotations

import os
import time

import numpy as np

POISON = 666  # a token id that makes FakeEngine fail the whole call, as a poison input would
# Token ids on which PoisonEngine ends its process, never returns, or returns a NaN vector. EXIT is
# "poison" in the test model's vocabulary (MiniLM's WordPiece), so that an article can carry it.
EXIT = 9947
HANG = 29145  # "zebra"
NAN = 668


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


class LoggingEngine(FakeEngine):
    """FAKE; appends "load <pid> 0" and "call <pid> <docs>" to $NEWSVEC_TEST_ENGINE_LOG."""

    def __init__(self, settings=None):
        super().__init__(settings)
        self._log("load")

    def _log(self, what: str, docs: int = 0) -> None:
        with open(os.environ["NEWSVEC_TEST_ENGINE_LOG"], "a") as f:
            f.write(f"{what} {os.getpid()} {docs}\n")

    def embed(self, prompts):
        self._log("call", len(prompts))
        return super().embed(prompts)


class PoisonEngine(LoggingEngine):
    """FAKE, served as the shared engine, with inputs that break it (its canary always passes):
    a call holding the EXIT token ends the engine's process (``os._exit``, as a segfault or a
    device assert on one input would), one holding HANG never returns; a prompt holding NAN gets
    a vector of NaN, the others their FakeEngine vector. Logged as "exit" and "hang"."""

    def embed(self, prompts):
        if any(EXIT in p for p in prompts):
            self._log("exit", len(prompts))
            os._exit(1)
        if any(HANG in p for p in prompts):
            self._log("hang", len(prompts))
            while True:
                time.sleep(1)
        vectors = super().embed(prompts)
        for p, v in zip(prompts, vectors, strict=True):
            if NAN in p:
                v[:] = np.nan
        return vectors


class BrokenEngine(LoggingEngine):
    """FAKE, served as the shared engine: every call ends its process, the canary's too (an engine
    broken whatever its inputs)."""

    def embed(self, prompts):
        self._log("exit", len(prompts))
        os._exit(1)

    def healthy(self) -> bool:
        self._log("exit")
        os._exit(1)


class HangsOnLoad(LoggingEngine):
    """FAKE whose load never finishes (a CUDA or driver initialization, a download that stalls):
    logged as "load", then it waits; it gives up after 45 s (so that a test of code that waits
    for it for ever still ends)."""

    def __init__(self, settings=None):
        super().__init__(settings)
        time.sleep(45)
        raise RuntimeError("HangsOnLoad gave up after 45 s")


def reach_engine(settings, factory, tag: str, out: str) -> None:
    """An SDK process that asks for the shared engine ``tag``; writes "ok" or its error to
    ``out``."""
    from transforms.shared_engine import SharedEngineClient

    try:
        SharedEngineClient(settings, factory, tag)
        result = "ok"
    except Exception as exc:  # pylint: disable=broad-except  # the test reads it
        result = f"{type(exc).__name__}: {exc}"
    with open(out, "w") as f:
        f.write(result)


def sdk_process(settings, factory, tag: str, conn) -> None:
    """An SDK process of the machine holding a client of the shared engine ``tag``: it answers
    each command received on ``conn`` with the client's engine process after running it:
    "embed" (a call), "kill" (SIGKILL the engine, then a call, which replaces it), "exit"
    (returns: the process exits normally, and its exit hooks run)."""
    import signal

    from transforms.shared_engine import SharedEngineClient

    client = SharedEngineClient(settings, factory, tag)
    conn.send(client._process)
    while True:
        command = conn.recv()
        if command == "exit":
            conn.send(None)
            return
        if command == "kill":
            os.kill(client._process[0], signal.SIGKILL)
        client.embed([(101, 1000, 102)])
        conn.send(client._process)

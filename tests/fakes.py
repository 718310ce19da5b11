"""FAKE embedding engines for tests of something other than the model (paths, sinks, windowing,
failure handling). They are ``transforms.engines.base.EmbeddingEngine``s: ``label``, ``embed``,
``healthy``, ``close``. The real engine (vLLM) is tested in test_batch_pipeline.py and elsewhere.

Also the stand-ins for an SDK process of a machine that the shared-engine tests spawn
(``SdkProcess``, ``reach_engine``): they import no more than the engine's client, so they start
quickly."""
from __future__ import annotations

import json
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

    pooling = "mean"

    def embed_tokens(self, prompts):
        """Per prompt, a vector per token: one-hot at the token's id % dim (late mode)."""
        self.calls.append(len(prompts))
        if any(POISON in p for p in prompts):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        out = []
        for p in prompts:
            m = np.zeros((len(p), self.dim), np.float32)
            m[np.arange(len(p)), np.asarray(p) % self.dim] = 1.0
            out.append(m)
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


class SlowEngine(LoggingEngine):
    """FAKE, served as the shared engine: each call takes $NEWSVEC_TEST_CALL_S seconds (a healthy
    engine under load, each call within call_timeout_s)."""

    def embed(self, prompts):
        time.sleep(float(os.environ["NEWSVEC_TEST_CALL_S"]))
        return super().embed(prompts)


class FailsOnLoad(LoggingEngine):
    """FAKE whose load fails (the GPU's memory held elsewhere, a bad weight file): logged as
    "load", then it raises."""

    def __init__(self, settings=None):
        super().__init__(settings)
        raise RuntimeError("FailsOnLoad: the load failed")


class HangsOnLoad(LoggingEngine):
    """FAKE whose load never finishes (a CUDA or driver initialization, a download that stalls):
    logged as "load", then it waits; it gives up after 45 s (so that a test of code that waits
    for it for ever still ends)."""

    def __init__(self, settings=None):
        super().__init__(settings)
        time.sleep(45)
        raise RuntimeError("HangsOnLoad gave up after 45 s")


class EndsInRealCalls(LoggingEngine):
    """FAKE, served as the shared engine: every call ends its process, whatever its inputs, but
    its canary passes (an engine broken for real inputs only)."""

    def embed(self, prompts):
        self._log("exit", len(prompts))
        os._exit(1)


class KilledInCalls(LoggingEngine):
    """FAKE, served as the shared engine: its first $NEWSVEC_TEST_KILLS calls, counted over every
    engine of the test in $NEWSVEC_TEST_ENGINE_LOG.kills, are ended by SIGKILL from outside, as
    the out-of-memory killer ends a process; where $NEWSVEC_TEST_OOM_EVENTS names a file (a
    cgroup's memory.events), the kill is counted there first, as the kernel counts it. Logged as
    "killed"."""

    def embed(self, prompts):
        import signal

        counter = os.environ["NEWSVEC_TEST_ENGINE_LOG"] + ".kills"
        with open(counter, "a+") as f:
            f.seek(0)
            kills = len(f.read())
            if kills < int(os.environ["NEWSVEC_TEST_KILLS"]):
                f.write("k")
                f.flush()
                events = os.environ.get("NEWSVEC_TEST_OOM_EVENTS")
                if events:
                    with open(events, "w") as out:
                        out.write(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {kills + 1}\n")
                self._log("killed", len(prompts))
                os.kill(os.getpid(), signal.SIGKILL)
        return super().embed(prompts)


class StartsAChild(LoggingEngine):
    """FAKE that starts a process of its own as it loads (as vLLM starts its engine core with
    VLLM_ENABLE_V1_MULTIPROCESSING on), logged as "child <its pid> 0", and logs the variable as
    "multiprocessing=<value> <pid> 0"."""

    def __init__(self, settings=None):
        import subprocess
        import sys

        super().__init__(settings)
        self._log(f"multiprocessing={os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')}")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["NEWSVEC_TEST_ENGINE_LOG"], "a") as f:
            f.write(f"child {child.pid} 0\n")


def reach_engine(settings, factory, tag: str, out: str) -> None:
    """An SDK process that asks for the shared engine ``tag``; writes "ok" or its error to
    ``out``."""
    from transforms.engines.shared.client import SharedEngineClient

    try:
        SharedEngineClient(settings, factory, tag)
        result = "ok"
    except Exception as exc:  # pylint: disable=broad-except  # the test reads it
        result = f"{type(exc).__name__}: {exc}"
    with open(out, "w") as f:
        f.write(result)


class SdkProcess:
    """An SDK process of the machine, holding a client of the shared engine ``tag``: a Python
    process of its own (``python -m tests.fakes``), not a multiprocessing child, so that it exits
    as an SDK process does, its exit hooks (Beam's among them) run by the interpreter as it ends.
    (A multiprocessing child joins its children before its exit hooks run: one that spawned the
    engine would wait for it for ever.)

    ``ask`` sends it a command and returns the client's engine process after running it:
    "embed" (a call), "kill" (SIGKILL the engine, then a call, which replaces it); ``exit`` lets
    it return from its main and waits for it to exit, returning its exit status."""

    def __init__(self, settings, factory: type, tag: str):
        import subprocess
        import sys

        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes", settings.model_dump_json(),
             f"{factory.__module__}:{factory.__qualname__}", tag],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.engine = self._answer()

    def _answer(self):
        line = self.process.stdout.readline()
        assert line, f"the SDK process ended (status {self.process.poll()})"
        return tuple(json.loads(line))

    def ask(self, command: str):
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._answer()

    def exit(self, timeout: float = 60) -> int:
        self.process.stdin.close()
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _sdk_process_main(settings_json: str, factory_name: str, tag: str) -> None:
    import importlib
    import signal
    import sys

    from transforms.engines.shared.client import SharedEngineClient
    from transforms.settings import ModelSettings

    module, name = factory_name.split(":")
    factory = getattr(importlib.import_module(module), name)
    client = SharedEngineClient(ModelSettings.model_validate_json(settings_json), factory, tag)
    print(json.dumps(client._process), flush=True)
    for command in sys.stdin:
        if command.strip() == "kill":
            os.kill(client._process[0], signal.SIGKILL)
        client.embed([(101, 1000, 102)])
        print(json.dumps(client._process), flush=True)


if __name__ == "__main__":
    import sys

    _sdk_process_main(*sys.argv[1:4])

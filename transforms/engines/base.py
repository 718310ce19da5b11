"""The embedding engine: what turns token ids into vectors, loaded once per worker process (or once
per machine, in a process of its own), never per bundle.

An engine (``EmbeddingEngine``, this module) has four members: a ``label`` (the model and its
content hash, written with every row), ``embed`` (a vector per prompt of token ids, in one call),
``healthy`` (whether a fixed canary input still embeds) and ``close``. ``Engine`` is the real one,
vLLM's ``LLM(runner="pooling")`` (``transforms.engines.vllm``); a test's FAKE or a benchmark's
MODELED engine stands in for it through an ``EngineFactory``.

``EngineHandle`` is what the ``Embedder`` (``transforms.embed``) holds as its engine. A failed call
is either an INPUT failure or an ENGINE failure, told apart by the canary:
- the canary still embeds: the inputs are to blame; the engine's error is raised as is, and the
  ``Embedder`` bisects the call to find them;
- the canary fails too, or vLLM says its engine died (a CUDA error looks like this): no input is
  blamed. The engine is closed, ``EngineFailedError`` fails the bundle, and the runner retries it;
  the handle loads a fresh engine on its next use, so whatever still holds the handle (the
  embedding step, the retried bundle) gets a working one.
A load that fails (the first, or one after an engine failure) is an engine failure too:
``EngineFailedError``, raised before any input is tried, so no input is ever blamed for it. A call
that returns a vector holding a NaN or an infinity is checked with the canary as well: a failing
canary is an engine failure; a passing one leaves those documents to be dead-lettered.

Where the engine lives: ``transforms.engines.registry.process_engine`` gives a handle in this
process (``load_engine`` keeps one per process for given engine settings, on the backend
``model.engine`` names); ``transforms.engines.shared`` serves one engine per machine, in a process
of its own (``model.share_across_processes``).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from transforms.settings import ModelSettings

_LOG = logging.getLogger(__name__)


class EmbeddingEngine(Protocol):
    """What an engine is: vLLM's (``Engine``) or a stand-in (a FAKE in a test, the MODELED engine
    of a benchmark)."""

    label: str  # the model and the hash of its files: written with every row

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """A vector per prompt, in one call; raises if the call failed."""

    def healthy(self) -> bool:
        """Whether the engine still works (after a failed call: is it the engine or the inputs)."""

    # Optional, for ``chunking.mode: late`` (an engine loaded with ``model.pooling_task:
    # token_embed``): ``embed_tokens(prompts)``, per prompt a matrix of one vector per token
    # (``len(prompt) x dim``, not normalized), and ``pooling``, how the model pools a sequence
    # (``mean``, ``cls`` or ``last``: ``transforms.vector_math.pool_tokens``).

    def close(self) -> None:
        """Release the engine; it is not used again."""


EngineFactory = Callable[[ModelSettings], EmbeddingEngine]


class EngineFailedError(RuntimeError):
    """The engine failed, not an input: the bundle fails (and is retried on a fresh engine)."""


class FreedMemory:
    """Gives the memory that a call freed back to the system, at most every ``every_s`` seconds
    (glibc's ``malloc_trim``; a no-op with another C library).

    Each call's activations are sized by its total token count, which changes from call to call;
    glibc keeps what they free in its heaps, in pieces that later calls of other sizes fit badly,
    so a long-running engine on the CPU grows though it uses no more (benchmarks/engine_memory.py
    measures it). A trim costs 25-35 ms there, and the page faults of the next call that touches
    the returned pages again: once every ``every_s`` seconds, not once per call."""

    def __init__(self, every_s: float, trim: Optional[Callable[[], Any]] = None,
                 clock: Callable[[], float] = time.monotonic):
        self.every_s, self._clock = every_s, clock
        self.trim = trim if trim is not None else _malloc_trim()
        self._last = clock()
        self._lock = threading.Lock()

    def after_call(self) -> None:
        if self.trim is None:
            return
        with self._lock:
            now = self._clock()
            if now - self._last < self.every_s:
                return
            self._last = now
        self.trim()


def _malloc_trim() -> Optional[Callable[[], Any]]:
    """glibc's ``malloc_trim(0)``: every arena's free pages go back to the system."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


FREED_MEMORY = FreedMemory(every_s=10.0)  # one per process: the heaps are the process's


def truncate_vector(vector: np.ndarray, dimensions: int, normalize: bool) -> np.ndarray:
    """The head of a vector (``model.truncate_dimensions_knowingly``), L2-normalized again when
    the model's vectors are (as vLLM does with a Matryoshka model's: cut, then normalize)."""
    head = np.array(vector[:dimensions], dtype=np.float32)
    if normalize:
        norm = float(np.linalg.norm(head))
        if norm > 0:
            head /= norm
    return head


class ModelHandle(Protocol):
    """What the ``Embedder`` holds as its engine: an ``EngineHandle`` (the engine in this process)
    or a ``SharedEngineClient`` (the machine's one engine, in a process of its own)."""

    def label(self) -> str:
        """The model and its content hash."""

    def take_load_ms(self) -> list[int]:
        """Load times not reported yet."""

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """A vector per prompt; ``EngineFailedError`` when the engine failed (or could not be
        loaded), the engine's own error when the inputs did."""


class EngineHandle:
    """What the ``Embedder`` holds as its engine in this process: the engine for some settings,
    loaded at once, and loaded again after an engine failure.

    One handle serves every DoFn thread of a process; ``LLM.embed()`` collects every finished
    request, so concurrent calls could take each other's outputs: calls are serialized.
    """

    def __init__(self, settings: ModelSettings, factory: EngineFactory):
        self._settings, self._factory = settings, factory
        self._lock = threading.Lock()
        self._engine: Optional[EmbeddingEngine] = None
        self._unreported_load_ms: list[int] = []
        self._load_ms_lock = threading.Lock()  # not self._lock: never wait for a call in flight
        self._label = ""
        with self._lock:
            self._load()

    def _load(self) -> EmbeddingEngine:
        """Load an engine. A load that fails is an engine failure (``EngineFailedError``), never
        an input's: no input was given to it."""
        started = time.perf_counter()
        try:
            engine = self._factory(self._settings)
        except Exception as exc:  # pylint: disable=broad-except  # whatever the load raised
            _LOG.error("the embedding engine %s could not be loaded (%s: %s)", self._settings.name,
                       type(exc).__name__, exc)
            raise EngineFailedError(
                f"the embedding engine {self._settings.name} could not be loaded: "
                f"{type(exc).__name__}: {exc}"[:2000]) from exc
        self._engine = engine
        self._label = engine.label
        with self._load_ms_lock:
            self._unreported_load_ms.append(int((time.perf_counter() - started) * 1000))
        return engine

    def label(self) -> str:
        return self._label

    def take_load_ms(self) -> list[int]:
        """Load times not reported yet (metrics cannot be recorded in DoFn.setup, where loading
        happens)."""
        with self._load_ms_lock:
            taken, self._unreported_load_ms = self._unreported_load_ms, []
            return taken

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """A vector per prompt. Raises ``EngineFailedError`` when the engine broke (it is closed,
        and the next call loads a fresh one), or the engine's own error when the inputs failed.
        A call that returns a non-finite vector is checked with the canary too: if it fails,
        the engine broke (``EngineFailedError``); if it passes, the vectors are returned as they
        are, and the handler dead-letters the documents whose vectors are not finite."""
        return self._call("embed", prompts)

    def embed_tokens(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Per prompt, a vector per token (the engine's ``embed_tokens``), with ``embed``'s
        failure handling."""
        return self._call("embed_tokens", prompts)

    def pooling(self) -> str:
        """How the engine's model pools a sequence (``mean``, ``cls`` or ``last``)."""
        with self._lock:
            engine = self._engine if self._engine is not None else self._load()
            return str(getattr(engine, "pooling", "mean"))

    def _call(self, method: str, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        with self._lock:
            # A reload that fails raises EngineFailedError here, before any input is tried.
            engine = self._engine if self._engine is not None else self._load()
            call = getattr(engine, method, None)
            if call is None:
                raise ValueError(f"the engine {self._label} cannot give token vectors "
                                 f"({method}): chunking.mode late needs one that can")
            try:
                vectors = call(prompts)
            except Exception as exc:  # pylint: disable=broad-except
                if not _engine_is_dead(exc) and _healthy(engine):
                    raise  # the engine works: the inputs are to blame
                raise self._broke(engine, f"{type(exc).__name__}: {exc}") from exc
            if not all_finite(vectors) and not _healthy(engine):
                raise self._broke(engine, "it returned non-finite vectors, and its canary fails")
            return vectors

    def _broke(self, engine: EmbeddingEngine, why: str) -> EngineFailedError:
        """Close a broken engine (the next call loads a fresh one); the error to raise."""
        _LOG.error("the embedding engine failed (%s); closing it, the next call loads a fresh one",
                   why)
        self._engine = None
        _close(engine)
        return EngineFailedError(f"the embedding engine failed, not the inputs: {why}"[:2000])

    def healthy(self) -> bool:
        """Whether the engine's canary embeds (after loading it if needed: a load that fails
        raises ``EngineFailedError``)."""
        with self._lock:
            engine = self._engine if self._engine is not None else self._load()
            return _healthy(engine)


def finite_rows(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Per vector, whether every value of it is finite (one ``isfinite`` over the batch's matrix;
    vectors of several lengths are checked one by one)."""
    if not len(vectors):
        return np.ones(0, dtype=bool)
    try:
        matrix = np.stack([np.asarray(v) for v in vectors])
    except ValueError:  # not all of one length
        return np.array([bool(np.isfinite(v).all()) for v in vectors], dtype=bool)
    return np.isfinite(matrix).reshape(len(vectors), -1).all(axis=1)


def all_finite(vectors: Sequence[np.ndarray]) -> bool:
    return bool(finite_rows(vectors).all())


def _healthy(engine: EmbeddingEngine) -> bool:
    """The engine's canary; a canary that raises is a failed one."""
    try:
        return engine.healthy()
    except Exception:  # pylint: disable=broad-except
        return False


def _close(engine: EmbeddingEngine) -> None:
    try:
        engine.close()
    except Exception:  # pylint: disable=broad-except  # the engine is dropped either way
        _LOG.exception("closing the failed embedding engine")


def _engine_is_dead(exc: BaseException) -> bool:
    """vLLM's engine core died (its multiprocess client says so): every later call fails too."""
    return type(exc).__name__ == "EngineDeadError"


_LLM_FIELDS = ("name", "path", "revision", "sha256", "dim", "dtype", "max_tokens",
               "pooling_task", "trust_remote_code", "enforce_eager", "gpu_memory_utilization",
               "max_num_seqs", "max_num_batched_tokens", "engine_env", "matryoshka_dimensions")

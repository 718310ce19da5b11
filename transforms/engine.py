"""The embedding engine: what turns token ids into vectors, loaded once per worker process (or once
per machine, in a process of its own), never per bundle.

An engine (``EmbeddingEngine``) has four members: a ``label`` (the model and its content hash,
written with every row), ``embed`` (a vector per prompt of token ids, in one call), ``healthy``
(whether a fixed canary input still embeds) and ``close``. ``Engine`` is the real one, vLLM's
``LLM(runner="pooling")``; a test's FAKE or a benchmark's MODELED engine stands in for it through an
``EngineFactory``.

``EngineHandle`` is what a ModelHandler holds as its model. A failed call is either an INPUT failure
or an ENGINE failure, told apart by the canary:
- the canary still embeds: the inputs are to blame; the engine's error is raised as is, and the
  handler (``transforms.embed``) bisects the call to find them;
- the canary fails too, or vLLM says its engine died (a CUDA error looks like this): no input is
  blamed. The engine is closed, ``EngineFailedError`` fails the bundle, and the runner retries it;
  the handle loads a fresh engine on its next use, so whatever still holds the handle (the
  embedding step, RunInference's shared model, the retried bundle) gets a working one.
A load that fails (the first, or one after an engine failure) is an engine failure too:
``EngineFailedError``, raised before any input is tried, so no input is ever blamed for it.

Where the engine lives: ``process_engine`` gives a handle in this process (``load_engine`` keeps one
per process for given engine settings), ``shared_engine`` a ``SharedEngineClient``: a proxy to one
engine per machine, in a process of its own (``model.share_across_processes``), which it replaces
when that process is gone or stuck in a call for over ``model.call_timeout_s``.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import json
import logging
import os
import signal
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from transforms.model import ModelSettings, model_label, resolve_model_path

_LOG = logging.getLogger(__name__)
CANARY_TEXT = "newsvec engine check"


class EmbeddingEngine(Protocol):
    """What an engine is: vLLM's (``Engine``) or a stand-in (a FAKE in a test, the MODELED engine
    of a benchmark)."""

    label: str  # the model and the hash of its files: written with every row

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """A vector per prompt, in one call; raises if the call failed."""

    def healthy(self) -> bool:
        """Whether the engine still works (after a failed call: is it the engine or the inputs)."""

    def close(self) -> None:
        """Release the engine; it is not used again."""


EngineFactory = Callable[[ModelSettings], EmbeddingEngine]


class EngineFailedError(RuntimeError):
    """The engine failed, not an input: the bundle fails (and is retried on a fresh engine)."""


class Engine:
    """``vllm.LLM(runner="pooling")`` behind the calls newsvec makes: embed token ids, check health,
    close (an ``EmbeddingEngine``)."""

    def __init__(self, llm, settings: ModelSettings, label: str):
        self._llm, self._normalize, self.label = llm, settings.normalize, label
        self._canary = [list(llm.get_tokenizer().encode(CANARY_TEXT))]

    @property
    def llm(self):
        """The vLLM ``LLM`` itself (the batch benchmark calls it raw, as a baseline)."""
        return self._llm

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        # vLLM aborts a failed call's requests itself (tests/test_embed_failures.py checks it), so
        # none of them can finish in a later call and be returned with its outputs.
        outputs = self._llm.embed(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            pooling_params=PoolingParams(use_activation=self._normalize), use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"{len(outputs)} outputs for {len(prompts)} inputs")
        for output, prompt in zip(outputs, prompts, strict=True):
            if list(output.prompt_token_ids) != list(prompt):
                raise RuntimeError("an output does not belong to its input")
        return [np.asarray(o.outputs.embedding, dtype=np.float32) for o in outputs]

    def healthy(self) -> bool:
        """Whether the canary still embeds to a finite vector: an engine that fails it is broken,
        whatever the inputs were."""
        try:
            (vector,) = self.embed(self._canary)
            return bool(np.isfinite(vector).all())
        except Exception:  # pylint: disable=broad-except  # any failure of the canary is the answer
            return False

    def close(self) -> None:
        """Stop vLLM's engine core; a process that does not may abort at exit (rc 134)."""
        try:
            self._llm.llm_engine.engine_core.shutdown()
        except Exception:  # pylint: disable=broad-except
            pass


class ModelHandle(Protocol):
    """What a ModelHandler holds as its model: an ``EngineHandle`` (the engine in this process) or
    a ``SharedEngineClient`` (the machine's one engine, in a process of its own)."""

    def label(self) -> str:
        """The model and its content hash."""

    def take_load_ms(self) -> list[int]:
        """Load times not reported yet."""

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """A vector per prompt; ``EngineFailedError`` when the engine failed (or could not be
        loaded), the engine's own error when the inputs did."""


class EngineHandle:
    """What RunInference holds as its model: the engine for some settings, loaded at once, and
    loaded again after an engine failure.

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
        and the next call loads a fresh one), or the engine's own error when the inputs failed."""
        with self._lock:
            # A reload that fails raises EngineFailedError here, before any input is tried.
            engine = self._engine if self._engine is not None else self._load()
            try:
                return engine.embed(prompts)
            except Exception as exc:  # pylint: disable=broad-except
                if not _engine_is_dead(exc) and _healthy(engine):
                    raise  # the engine works: the inputs are to blame
                _LOG.error("the embedding engine failed (%s: %s); closing it, the next call loads "
                           "a fresh one", type(exc).__name__, exc)
                self._engine = None
                _close(engine)
                raise EngineFailedError(f"the embedding engine failed, not the inputs: "
                                        f"{type(exc).__name__}: {exc}"[:2000]) from exc


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


def load_vllm(s: ModelSettings) -> Engine:
    """A real vLLM engine for these settings (the default ``EngineFactory``)."""
    s.apply_engine_env()
    from vllm import LLM  # imported on the worker, after the engine environment is set

    path = resolve_model_path(s.path)
    kwargs: dict[str, Any] = dict(
        model=path, runner="pooling", dtype=s.resolved_dtype(), revision=s.revision,
        max_model_len=s.max_tokens, trust_remote_code=s.trust_remote_code,
        enforce_eager=s.enforce_eager, seed=0)
    if s.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    if s.max_num_seqs is not None:
        kwargs["max_num_seqs"] = s.max_num_seqs
    if s.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = s.max_num_batched_tokens
    _LOG.info("loading %s at %s", s.name, kwargs["dtype"])
    engine = Engine(LLM(**kwargs), s, model_label(s, path))
    atexit.register(engine.close)
    size = engine.llm.llm_engine.model_config.embedding_size  # the pooler's output size
    if size != s.dim:
        engine.close()
        raise ValueError(f"model.dim is {s.dim} in the config but the model {s.path} "
                         f"gives {size}-dimensional embeddings")
    return engine


_HANDLES: dict[str, EngineHandle] = {}
_HANDLES_LOCK = threading.Lock()


def _engine_identity(settings: ModelSettings) -> str:
    """What the engine depends on; batching and failure settings may differ and share it."""
    fields = ("name", "path", "revision", "dim", "dtype", "max_tokens", "trust_remote_code",
              "enforce_eager", "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens",
              "engine_env")
    return json.dumps(settings.model_dump(include=set(fields)), sort_keys=True)


def load_engine(settings: ModelSettings) -> EngineHandle:
    """The process's one vLLM engine handle for these settings, loaded on first use.

    RunInference already keeps one model per DoFn; this cache also spans pipelines run one after
    another in a process (tests, a retried bundle's new DoFn), so a worker never holds two engines.
    """
    identity = _engine_identity(settings)
    with _HANDLES_LOCK:
        if identity not in _HANDLES:
            _HANDLES[identity] = EngineHandle(settings, load_vllm)
        return _HANDLES[identity]


_FACTORY_HANDLES: dict[tuple[type, str], EngineHandle] = {}
_FACTORY_HANDLES_LOCK = threading.RLock()  # a test's factory may itself call load_engine


def process_engine(settings: ModelSettings, factory: Optional[EngineFactory]) -> EngineHandle:
    """A handle in this process: without ``factory``, on the process's vLLM engine
    (``load_engine``); with one (tests, benchmarks), on an engine from it. A factory that is a
    class is kept like vLLM's engine, one handle per process for given settings, so that a
    stand-in engine goes through the handle's life as the real one does (a retried bundle's new
    DoFn finds the handle whose engine failed); any other factory gets a new handle each time."""
    if factory is None:
        return load_engine(settings)
    if not isinstance(factory, type):
        return EngineHandle(settings, factory)
    key = (factory, _engine_identity(settings))
    with _FACTORY_HANDLES_LOCK:
        if key not in _FACTORY_HANDLES:
            _FACTORY_HANDLES[key] = EngineHandle(settings, factory)
        return _FACTORY_HANDLES[key]


class _ServedEngine:
    """The shared engine as its own process serves it: a handle whose calls are taken one at a
    time, each marked in the engine's busy file (``_BusyFile``) while it runs, so that an SDK
    process can tell an engine stuck in a call from one busy with other processes' calls."""

    def __init__(self, handle: EngineHandle, busy: "_BusyFile"):
        self._handle, self._busy = handle, busy
        self._lock = threading.Lock()

    def process(self) -> tuple[int, int]:
        """This process: (pid, start time), what an SDK process needs to end it."""
        return _process_identity(os.getpid())

    def label(self) -> str:
        return self._handle.label()

    def take_load_ms(self) -> list[int]:
        return self._handle.take_load_ms()

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        with self._lock:
            self._busy.mark(time.monotonic())
            try:
                return self._handle.embed(prompts)
            finally:
                self._busy.mark(None)


class _SharedEngine:
    """Makes the shared engine's handle in the process multi_process_shared spawns for it."""

    def __init__(self, settings: ModelSettings, factory: Optional[EngineFactory],
                 busy: "_BusyFile"):
        self._settings, self._factory, self._busy = settings, factory, busy

    def __call__(self) -> _ServedEngine:
        return _ServedEngine(process_engine(self._settings, self._factory), self._busy)


class _BusyFile:
    """Where the shared engine's process says which call it is in: "<pid> <start time> <monotonic
    time the call began>", or "<pid> <start time> idle". Linux's monotonic clock is the machine's,
    the same in every process. Written whole (a rename) at the start and end of every call."""

    def __init__(self, path: str):
        self.path = path

    def mark(self, since: Optional[float]) -> None:
        pid, started = _process_identity(os.getpid())
        tmp = f"{self.path}.{pid}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{pid} {started} {'idle' if since is None else repr(since)}")
            os.replace(tmp, self.path)
        except OSError:  # the call goes on untimed; never an error of the inputs
            _LOG.exception("could not write the shared engine's busy file %s", self.path)

    def busy_for(self, process: tuple[int, int]) -> float:
        """Seconds the engine ``process`` has been in its current call; 0 when it is idle, or
        when the file is another engine's."""
        try:
            with open(self.path) as f:
                pid, started, since = f.read().split()
        except (OSError, ValueError):
            return 0.0
        if (int(pid), int(started)) != tuple(process) or since == "idle":
            return 0.0
        return max(0.0, time.monotonic() - float(since))


def _process_identity(pid: int) -> tuple[int, int]:
    """(pid, start time in clock ticks since boot): a pid alone may name another process once
    this one is gone. The start time is 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return pid, int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return pid, 0


def _process_state(process: tuple[int, int]) -> str:
    """"gone" (exited, or its pid reused), "zombie" (exited, not reaped yet) or "alive"."""
    pid, started = process
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        if not os.path.isdir("/proc/self"):  # no /proc: ask the kernel
            try:
                os.kill(pid, 0)
                return "alive"
            except OSError:
                return "gone"
        return "gone"
    fields = stat[stat.rindex(")") + 2:].split()
    if started and int(fields[19]) != started:
        return "gone"
    return "zombie" if fields[0] in ("Z", "X") else "alive"


def _end_process(process: tuple[int, int], wait_s: float = 10.0) -> None:
    """SIGKILL the process, if it is still the one named, and wait up to ``wait_s`` for it to exit
    (the GPU memory it held is freed as it exits)."""
    if _process_state(process) != "alive":
        return
    try:
        os.kill(process[0], signal.SIGKILL)
    except OSError:
        return
    deadline = time.monotonic() + wait_s
    while _process_state(process) == "alive" and time.monotonic() < deadline:
        time.sleep(0.05)


_CONNECT_ATTEMPTS = 3


def _proxy_address(proxy: Any) -> str:
    """"host:port" of the engine's server, as Beam writes it in its address file ("" if unknown)."""
    try:
        host, port = proxy.get_auto_proxy_object()._token.address
        return f"{host}:{port}"
    except Exception:  # pylint: disable=broad-except  # a Beam or Python internal moved
        return ""


class _EngineGone(Exception):
    """The shared engine's process is gone, or was ended because a call in it hung."""


class SharedEngineClient:
    """What an SDK process holds as its model with ``model.share_across_processes``: the proxy to
    the machine's one engine, replaced when that engine's process is gone or hung.

    - A call that finds the engine's process gone (it crashed, was killed, or ended with the SDK
      process that spawned it) connects to, or spawns, a new one, and is retried there once.
    - A call is timed from when the engine starts it (calls wait their turn there, behind other
      processes' calls; that wait is not timed): once the engine has been in one call for more
      than ``model.call_timeout_s``, its process is ended (SIGKILL) and replaced, and the call is
      retried there once. A second failure is ``EngineFailedError``.
    - ``EngineFailedError`` from the engine (its canary failed, or it could not be loaded) ends
      its process too: the next call spawns a fresh one, with a fresh CUDA context, instead of
      reloading inside a process that a sticky CUDA error may have spoiled.
    No input is blamed for any of these; every other error of a call is the engine's answer about
    its inputs, raised as is.
    """

    def __init__(self, settings: ModelSettings, factory: Optional[EngineFactory], tag: str):
        self._settings, self._factory, self._tag = settings, factory, tag
        # Beam's address and lock files, and the busy file: the same folder in every SDK process
        # of the machine (they share /tmp and the environment).
        self._folder = tempfile.gettempdir()
        self._busy = _BusyFile(os.path.join(self._folder, f"{tag}.busy"))
        self._timeout_s = settings.resolved_call_timeout_s()
        self._poll_s = min(1.0, max(0.05, self._timeout_s / 10))
        self._lock = threading.Lock()
        self._local = threading.local()
        self._proxy: Any = None
        self._process = (0, 0)
        self._address = ""
        self._generation = 0
        self._label = ""
        with self._lock:
            self._connect()

    def _connect(self) -> None:
        """Reach the machine's engine, spawning it if there is none (under self._lock). An engine
        that is gone by the time it is reached (another process's call has just ended it) is
        forgotten and the next one reached or spawned, a few times over."""
        from apache_beam.utils import multi_process_shared

        for attempt in range(1, _CONNECT_ATTEMPTS + 1):
            try:
                proxy = multi_process_shared.MultiProcessShared(
                    _SharedEngine(self._settings, self._factory, self._busy), tag=self._tag,
                    path=self._folder, always_proxy=True, spawn_process=True).acquire()
                process, label = tuple(proxy.process()), proxy.label()
            except (EOFError, ConnectionError) as exc:
                if attempt == _CONNECT_ATTEMPTS:
                    raise self._failed_to_connect(exc) from exc
                _LOG.warning("the shared embedding engine was gone when reached (%s: %s); "
                             "reaching or spawning another", type(exc).__name__, exc)
                time.sleep(0.1 * attempt)
                continue
            except Exception as exc:  # pylint: disable=broad-except  # spawn or load
                raise self._failed_to_connect(exc) from exc
            self._proxy, self._process, self._label = proxy, process, label
            self._address = _proxy_address(proxy)
            self._generation += 1
            _LOG.info("using the shared embedding engine in process %d", process[0])
            return

    def _failed_to_connect(self, exc: BaseException) -> EngineFailedError:
        _LOG.error("the shared embedding engine %s could not be started or reached (%s: %s)",
                   self._settings.name, type(exc).__name__, exc)
        if isinstance(exc, EngineFailedError):
            return exc
        return EngineFailedError(
            f"the shared embedding engine {self._settings.name} could not be started or "
            f"reached: {type(exc).__name__}: {exc}"[:2000])

    def _current(self) -> tuple[Any, tuple[int, int], int]:
        with self._lock:
            if self._proxy is None:
                self._connect()
            return self._proxy, self._process, self._generation

    def _drop(self, generation: int, why: str) -> None:
        """End the engine of ``generation`` and forget it (once, whichever thread asks first)."""
        with self._lock:
            if generation != self._generation or self._proxy is None:
                return  # already replaced
            process, self._proxy = self._process, None
            _LOG.error("ending the shared embedding engine (process %d): %s; the next call spawns "
                       "or reaches a new one", process[0], why)
            _end_process(process)
            self._forget_address()

    def _forget_address(self) -> None:
        """Delete Beam's address file if it still names the engine just ended, under Beam's lock
        for it: Beam would otherwise try to connect to it for about 3 s before it spawns a new one.
        (Under self._lock: this process takes Beam's lock for the tag nowhere else meanwhile.)"""
        import fasteners

        address_file = os.path.join(self._folder, self._tag) + ".address"
        try:
            with fasteners.InterProcessLock(os.path.join(self._folder, self._tag) + ".lock"):
                with open(address_file) as f:
                    named = f.read().strip()
                if self._address and named == self._address:
                    os.unlink(address_file)
        except OSError:
            pass  # no address file: nothing to forget

    def _timed(self, method: Callable, args: tuple, process: tuple[int, int]):
        """``method(*args)`` on the proxy, from a thread of this caller's own; raises
        ``_EngineGone`` when the engine's process is gone, or when it has been in one call for
        more than call_timeout_s (its process is then ended)."""
        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="newsvec-engine-call")
        future = pool.submit(method, *args)
        while True:
            try:
                return future.result(timeout=self._poll_s)
            except concurrent.futures.TimeoutError:
                pass
            except (EOFError, ConnectionError) as exc:
                raise _EngineGone(f"its process is unreachable ({type(exc).__name__}: {exc})") \
                    from exc
            except OSError as exc:
                if _process_state(process) == "alive":
                    raise  # an error of the engine itself: its answer about the inputs
                raise _EngineGone(f"its process is gone ({type(exc).__name__}: {exc})") from exc
            busy_s = self._busy.busy_for(process)
            if busy_s > self._timeout_s:
                # The thread stays blocked until the engine's process is ended; drop its pool.
                self._local.pool = None
                pool.shutdown(wait=False)
                raise _EngineGone(f"one call has run for {busy_s:.0f} s, over model.call_timeout_s "
                                  f"({self._timeout_s:g} s)")
            if _process_state(process) != "alive":
                self._local.pool = None
                pool.shutdown(wait=False)
                raise _EngineGone("its process is gone")

    def label(self) -> str:
        return self._label

    def take_load_ms(self) -> list[int]:
        proxy, process, generation = self._current()
        try:
            return list(self._timed(proxy.take_load_ms, (), process))
        except _EngineGone as exc:
            self._drop(generation, str(exc))
            return []

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        for attempt in (1, 2):
            proxy, process, generation = self._current()
            try:
                return self._timed(proxy.embed, (prompts,), process)
            except EngineFailedError as exc:
                self._drop(generation, f"it failed: {exc}")
                raise
            except _EngineGone as exc:
                self._drop(generation, str(exc))
                if attempt == 2:
                    raise EngineFailedError(
                        f"the shared embedding engine {self._settings.name} failed twice in one "
                        f"call: {exc}"[:2000]) from exc
                _LOG.warning("retrying an embedding call of %d inputs on a new shared engine",
                             len(prompts))
        raise AssertionError("unreachable")


_CLIENTS: dict[str, SharedEngineClient] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_engine(settings: ModelSettings, factory: Optional[EngineFactory],
                  tag: str) -> SharedEngineClient:
    """The machine's one engine (``model.share_across_processes``), in a process of its own that
    Beam's multi_process_shared spawns: every SDK process reaches it through a proxy, and none of
    them prepares text in the engine's process, where it would hold the GIL the engine needs.
    (RunInference's own share_model_across_processes puts the model in one of the SDK processes.)
    Every process that asks with the same ``tag`` gets the same engine, and each process keeps
    one ``SharedEngineClient`` per tag, which replaces a dead or hung engine for all its DoFns."""
    with _CLIENTS_LOCK:
        if tag not in _CLIENTS:
            _CLIENTS[tag] = SharedEngineClient(settings, factory, tag)
        return _CLIENTS[tag]

"""The shared engine's own process: the handle it loads there (``_SharedEngine``, the constructor
Beam's multi_process_shared runs in the spawned process, pinned to its device, as the one
generation of its tag allowed to load) and how it serves it (``_ServedEngine``: its calls one at a
time, in order, each named in its busy file, and a heartbeat every ``_HEARTBEAT_S``), in a process
group of its own that a SIGTERM ends whole."""
from __future__ import annotations

import collections
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from transforms.engines.base import EngineFactory, EngineFailedError, EngineHandle
from transforms.engines.registry import process_engine
from transforms.engines.shared.processes import _process_identity
from transforms.engines.shared.records import _BusyFile, _EngineRecord, _EngineState
from transforms.engines.shared.transport import _key_file, _socket_file
from transforms.settings import ModelSettings

_LOG = logging.getLogger(__name__)

# The engine rewrites its state this often (its heartbeat), whether in a call or idle.
_HEARTBEAT_S = 1.0
# The record, lock and address files are touched this often, so that a cleaner of old temp
# files does not take them from a long-running engine.
_TOUCH_S = 60.0


class _Turns:
    """The engine's calls, one at a time, in the order they came (a lock alone lets a late call
    overtake, so a caller could not bound its wait by the calls queued before it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: collections.deque[threading.Event] = collections.deque()
        self._taken = False

    def __enter__(self) -> None:
        with self._lock:
            if not self._taken:
                self._taken = True
                return
            turn = threading.Event()
            self._waiting.append(turn)
        turn.wait()

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            if self._waiting:
                self._waiting.popleft().set()  # handed on: still taken
            else:
                self._taken = False

    def queued(self) -> int:
        with self._lock:
            return len(self._waiting) + int(self._taken)


class _ServedEngine:
    """The shared engine as its own process serves it: a handle whose calls are taken one at a
    time, in order, each named in the engine's busy file (``_BusyFile``) with the caller's call
    id while it runs, and a heartbeat thread that rewrites that file every ``_HEARTBEAT_S``, so
    that an SDK process can tell an engine stuck in a call from one busy with other processes'
    calls, an engine that stopped answering from one that is slow, and an engine that ended in
    its call from one that ended in another's. A call whose start cannot be written is not run:
    ``EngineFailedError``."""

    def __init__(self, handle: EngineHandle, busy: _BusyFile, generation: int = 0,
                 keep_fresh: Sequence[str] = ()):
        self._handle, self._busy, self._generation = handle, busy, generation
        self._identity = _process_identity(os.getpid())
        self._turns = _Turns()
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self._call: Optional[tuple[float, str]] = None
        self._ending = False
        self._publish()  # an engine that cannot say what it does is not served at all
        global _SERVED  # pylint: disable=global-statement  # what this process's SIGTERM ends
        _SERVED = self
        threading.Thread(target=self._beat, args=(tuple(keep_fresh),), daemon=True,
                         name="newsvec-engine-heartbeat").start()

    def _state(self) -> _EngineState:
        with self._lock:
            since, call = self._call if self._call is not None else (0.0, None)
            ending = self._ending
        return _EngineState(self._identity, self._generation, time.monotonic(),
                            self._turns.queued(), call, since, ending)

    def _publish(self) -> None:
        with self._writing:
            self._busy.write(self._state())

    def _beat(self, keep_fresh: tuple[str, ...]) -> None:
        touched = time.monotonic()
        failing = False
        while True:
            time.sleep(_HEARTBEAT_S)
            try:
                self._publish()
                failing = False
            except EngineFailedError:  # its callers see the heartbeat stop, and end it
                if not failing:
                    _LOG.exception("the shared engine's heartbeat cannot be written")
                failing = True
            if time.monotonic() - touched > _TOUCH_S:
                touched = time.monotonic()
                for path in keep_fresh:
                    try:
                        os.utime(path)
                    except OSError:
                        pass

    def ending(self) -> None:
        """Say that the engine is shutting down (a SIGTERM), so that the call in it is retried
        rather than blamed."""
        with self._lock:
            self._ending = True
        try:
            self._publish()
        except EngineFailedError:
            pass

    def _run(self, what: Callable[[], Any], call: str) -> Any:
        with self._turns:
            with self._lock:
                self._call = (time.monotonic(), call)
            try:
                self._publish()
                return what()
            finally:
                with self._lock:
                    self._call = None
                self._publish()  # raises if it cannot be written: the bundle fails

    def process(self) -> tuple[int, int]:
        """This process: (pid, start time), what an SDK process needs to end it."""
        return self._identity

    def label(self) -> str:
        return self._handle.label()

    def take_load_ms(self) -> list[int]:
        return self._handle.take_load_ms()

    def embed(self, prompts: Sequence[Sequence[int]], call: str = "-") -> list[np.ndarray]:
        return self._run(lambda: self._handle.embed(prompts), call)

    def healthy(self, call: str = "-") -> bool:
        """The engine's canary (``EngineHandle.healthy``), timed like a call."""
        return self._run(self._handle.healthy, call)


_SERVED: Optional[_ServedEngine] = None  # in the engine's process: the engine it serves


def _own_process_group() -> None:
    """In the engine's process, before anything is loaded: a process group of its own, so that
    what the engine starts (vLLM's engine core, compile workers) can be ended with it
    (``_end_process``), and a SIGTERM (Beam's exit hook in the SDK process that spawned it) that
    says it is ending, then ends the whole group."""
    try:
        os.setpgid(0, 0)
    except OSError:
        _LOG.warning("the shared engine could not make a process group of its own; what it "
                     "starts may outlive it", exc_info=True)
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        if _SERVED is not None:
            _SERVED.ending()
        os.killpg(os.getpgrp(), signal.SIGKILL)  # its own group: this process is its leader

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: Beam's default SIGTERM handling stays
        pass


def _one_process_engine() -> None:
    """In the engine's process, before vLLM is imported: vLLM's engine runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as every config of newsvec sets it), whatever the
    worker's environment says (``model.engine_env`` only fills unset variables, and an image may
    set it): an engine core in a process of its own would hold the device after this process is
    ended, or has ended with its spawner, and the next engine would load beside it."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    if os.environ.get(key, "0") != "0":
        _LOG.warning("%s=%s in the environment: set to 0 for the shared engine, whose process "
                     "must hold the whole engine", key, os.environ[key])
    os.environ[key] = "0"


_SUPERSEDED = "not started: its generation of the shared engine is not the current one"


class _SharedEngine:
    """Makes the shared engine's handle in the process multi_process_shared spawns for it, on
    ``device`` where one is given: that process sees only it (``CUDA_VISIBLE_DEVICES``, set
    before the engine imports vLLM or torch; the process is spawned, not forked, so nothing
    there has initialized CUDA yet).

    It loads only as generation ``generation`` of its tag, spawned by the process that started
    that generation (``_EngineRecord``): Beam spawns a new engine whenever it finds no address
    file, or cannot connect to the one it names, and an engine of a generation that already had
    one, or one spawned by another process than the generation's, could have its address deleted
    by another process's exit hook while it runs (the next process would then start a second
    engine on the same device). Such a spawn raises at once, before anything is loaded."""

    def __init__(self, settings: ModelSettings, factory: Optional[EngineFactory],
                 busy: _BusyFile, device: Optional[str] = None,
                 record: Optional["_EngineRecord"] = None, generation: int = 0):
        self._settings, self._factory, self._busy = settings, factory, busy
        self._device = device
        self._record, self._generation = record, generation

    def __call__(self) -> _ServedEngine:
        keep_fresh: list[str] = []
        if self._record is not None:
            current = self._record.read()
            if (current is None or current.number != self._generation
                    or current.engine is not None or current.spawner[0] != os.getppid()):
                raise EngineFailedError(f"generation {self._generation}: {_SUPERSEDED}")
            _own_process_group()
            self._record.mark_loading(self._generation)
            address_file = self._record.address_file(current)
            keep_fresh = [self._record.path, self._record.lock_path, address_file,
                          _key_file(address_file), _socket_file(address_file)]
        _one_process_engine()
        if self._device is not None:
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                raise EngineFailedError(
                    f"the shared engine for GPU {self._device} found CUDA already initialized in "
                    "its process: it cannot be pinned to its device")
            os.environ["CUDA_VISIBLE_DEVICES"] = self._device
            _LOG.info("shared embedding engine on GPU %s (process %d)", self._device,
                      os.getpid())
        return _ServedEngine(process_engine(self._settings, self._factory), self._busy,
                             self._generation, keep_fresh)

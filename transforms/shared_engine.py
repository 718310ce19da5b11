"""One engine per machine, in a process of its own (``model.share_across_processes``), and the
client each SDK process reaches it with.

Beam's ``multi_process_shared`` spawns the engine's process (``_SharedEngine`` makes its handle
there, ``_ServedEngine`` serves it) and hands every SDK process a proxy. ``shared_engine`` gives
each SDK process one ``SharedEngineClient`` per step, which replaces the engine when its process is
gone (an out-of-memory kill, a crash) or stuck in a call for over ``model.call_timeout_s``, and
retries that call once: a second failure is an ``EngineFailedError``, as in ``transforms.engine``.

A worker with several GPUs runs one such engine per GPU (``model.gpus_per_worker``), each pinned
to its device, and each SDK process is given one of them (``transforms.devices``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from transforms.devices import DeviceSlots, engine_devices
from transforms.engine import EngineFactory, EngineFailedError, EngineHandle, process_engine
from transforms.model import ModelSettings

_LOG = logging.getLogger(__name__)


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
    """Makes the shared engine's handle in the process multi_process_shared spawns for it, on
    ``device`` where one is given: that process sees only it (``CUDA_VISIBLE_DEVICES``, set
    before the engine imports vLLM or torch; the process is spawned, not forked, so nothing
    there has initialized CUDA yet)."""

    def __init__(self, settings: ModelSettings, factory: Optional[EngineFactory],
                 busy: "_BusyFile", device: Optional[str] = None):
        self._settings, self._factory, self._busy = settings, factory, busy
        self._device = device

    def __call__(self) -> _ServedEngine:
        if self._device is not None:
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                raise EngineFailedError(
                    f"the shared engine for GPU {self._device} found CUDA already initialized in "
                    "its process: it cannot be pinned to its device")
            os.environ["CUDA_VISIBLE_DEVICES"] = self._device
            _LOG.info("shared embedding engine on GPU %s (process %d)", self._device,
                      os.getpid())
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

    def __init__(self, settings: ModelSettings, factory: Optional[EngineFactory], tag: str,
                 device: Optional[str] = None):
        self._settings, self._factory, self._tag = settings, factory, tag
        self.device = device  # CUDA_VISIBLE_DEVICES of the engine's process; None: as inherited
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
                    _SharedEngine(self._settings, self._factory, self._busy, self.device),
                    tag=self._tag,
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
    """The machine's engine (``model.share_across_processes``), in a process of its own that
    Beam's multi_process_shared spawns: every SDK process reaches it through a proxy, and none of
    them prepares text in the engine's process, where it would hold the GIL the engine needs.
    (RunInference's own share_model_across_processes puts the model in one of the SDK processes.)
    Every process that asks with the same ``tag`` gets the same engine, and each process keeps
    one ``SharedEngineClient`` per tag, which replaces a dead or hung engine for all its DoFns.

    With several GPUs (``model.gpus_per_worker``) there is one engine per GPU, tagged
    ``{tag}-gpu{index}``, and this process is given the one with the fewest processes
    (``transforms.devices.DeviceSlots``) for as long as it lives."""
    with _CLIENTS_LOCK:
        if tag not in _CLIENTS:
            _CLIENTS[tag] = _new_client(settings, factory, tag)
        return _CLIENTS[tag]


def _new_client(settings: ModelSettings, factory: Optional[EngineFactory],
                tag: str) -> SharedEngineClient:
    try:
        devices = engine_devices(settings)
    except ValueError as exc:
        _LOG.error("%s", exc)
        raise EngineFailedError(str(exc)) from exc
    if len(devices) == 1:
        return SharedEngineClient(settings, factory, tag, devices[0])
    slots = DeviceSlots(tempfile.gettempdir(), tag,
                        alive=lambda process: _process_state(process) == "alive")
    index = slots.assign(_process_identity(os.getpid()), len(devices))
    _LOG.info("this SDK process uses the shared embedding engine on GPU %s (%d of %d; "
              "processes per engine: %s)", devices[index], index + 1, len(devices),
              slots.counts(len(devices)))
    return SharedEngineClient(settings, factory, f"{tag}-gpu{index}", devices[index])

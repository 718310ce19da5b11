"""One engine per machine, in a process of its own (``model.share_across_processes``), and the
client each SDK process reaches it with.

Beam's ``multi_process_shared`` spawns the engine's process (``_SharedEngine`` makes its handle
there, ``_ServedEngine`` serves it) and hands every SDK process a proxy. ``shared_engine`` gives
each SDK process one ``SharedEngineClient`` per step, which:
- reaches or spawns the engine within ``model.load_timeout_s`` (a load that hangs is ended, and
  is an ``EngineFailedError``, as is a wait that long for another process to start it);
- replaces the engine when its process is gone (an out-of-memory kill, a crash) or stuck in a call
  for over ``model.call_timeout_s``. A call whose engine ended while in another process's call (or
  with the SDK process that spawned it) is retried on the next engine; one whose engine ended in
  the call itself is checked with the new engine's canary: a canary that fails is an
  ``EngineFailedError``, one that passes makes the call an input failure (``EngineEndedInCall``),
  which the handler bisects like any other, so an input that kills the engine takes only itself;
- never lets two engines run for one tag (one GPU): each engine is a generation of the tag, with
  its own Beam tag and address file (``_EngineRecord``), so an exit hook of Beam's that deletes an
  address file (it does not check whose it is) can only delete its own generation's.

A worker with several GPUs runs one such engine per GPU (``model.gpus_per_worker``), each pinned
to its device, and each SDK process is given one of them (``transforms.devices``).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import multiprocessing
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
    time, each marked in the engine's busy file (``_BusyFile``) with the caller's call id while it
    runs, so that an SDK process can tell an engine stuck in a call from one busy with other
    processes' calls, and an engine that ended in its call from one that ended in another's."""

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

    def embed(self, prompts: Sequence[Sequence[int]], call: str = "-") -> list[np.ndarray]:
        with self._lock:
            self._busy.mark(time.monotonic(), call)
            try:
                return self._handle.embed(prompts)
            finally:
                self._busy.mark(None)

    def healthy(self, call: str = "-") -> bool:
        """The engine's canary (``EngineHandle.healthy``), timed like a call."""
        with self._lock:
            self._busy.mark(time.monotonic(), call)
            try:
                return self._handle.healthy()
            finally:
                self._busy.mark(None)


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
                 busy: "_BusyFile", device: Optional[str] = None,
                 record: Optional["_EngineRecord"] = None, generation: int = 0):
        self._settings, self._factory, self._busy = settings, factory, busy
        self._device = device
        self._record, self._generation = record, generation

    def __call__(self) -> _ServedEngine:
        if self._record is not None:
            current = self._record.read()
            if (current is None or current.number != self._generation
                    or current.engine is not None or current.spawner[0] != os.getppid()):
                raise EngineFailedError(f"generation {self._generation}: {_SUPERSEDED}")
            self._record.mark_loading(self._generation)
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
    time the call began> <call id>", or "<pid> <start time> idle -". Linux's monotonic clock is
    the machine's, the same in every process. Written whole (a rename) at the start and end of
    every call; after the engine's process has ended, it still names the call it ended in."""

    def __init__(self, path: str):
        self.path = path

    def mark(self, since: Optional[float], call: str = "-") -> None:
        pid, started = _process_identity(os.getpid())
        tmp = f"{self.path}.{pid}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{pid} {started} {'idle' if since is None else repr(since)} "
                        f"{call if since is not None else '-'}")
            os.replace(tmp, self.path)
        except OSError:  # the call goes on untimed; never an error of the inputs
            _LOG.exception("could not write the shared engine's busy file %s", self.path)

    def _read(self, process: tuple[int, int]) -> Optional[tuple[float, str]]:
        """(when the call began, its id) if the engine ``process`` is in a call (or ended in one);
        None when it is idle, or when the file is another engine's."""
        try:
            with open(self.path) as f:
                pid, started, since, call = f.read().split()
        except (OSError, ValueError):
            return None
        if (int(pid), int(started)) != tuple(process) or since == "idle":
            return None
        return float(since), call

    def busy_for(self, process: tuple[int, int]) -> float:
        """Seconds the engine ``process`` has been in its current call; 0 when it is idle, or
        when the file is another engine's."""
        current = self._read(process)
        return 0.0 if current is None else max(0.0, time.monotonic() - current[0])

    def call(self, process: tuple[int, int]) -> Optional[str]:
        """The id of the call the engine ``process`` is in, or ended in; None if none."""
        current = self._read(process)
        return None if current is None else current[1]


@dataclasses.dataclass(frozen=True)
class _Generation:
    """One engine of a tag: its number, the SDK process that may spawn it (the one that started
    the generation) and, once reached, the engine's process. Processes are (pid, start time)."""

    number: int
    spawner: tuple[int, int]
    engine: Optional[tuple[int, int]] = None

    def beam_tag(self, tag: str) -> str:
        return f"{tag}-g{self.number}"


class _EngineRecord:
    """``{folder}/{tag}.engine``: the tag's current generation (``_Generation``), as JSON, read
    and changed under ``{tag}.lock`` (written whole, by a rename). Each generation is its own tag
    for Beam (``{tag}-g<n>``: its own address and lock files), so the exit hooks Beam registers
    (the spawning SDK process's, and the engine's, each of which deletes the address file of
    its tag whoever's it is) only ever delete the address of an engine of their own generation,
    which is gone by then or ending with them. A new generation is started only when the current
    one's engine is gone (its process ended, or its address file gone: an engine still running
    then is ended first), so one engine runs per tag."""

    def __init__(self, folder: str, tag: str):
        self.folder, self.tag = folder, tag
        self.path = os.path.join(folder, f"{tag}.engine")
        self.lock_path = os.path.join(folder, f"{tag}.lock")

    def address_file(self, generation: _Generation) -> str:
        return os.path.join(self.folder, generation.beam_tag(self.tag)) + ".address"

    def read(self) -> Optional[_Generation]:
        try:
            with open(self.path) as f:
                raw = json.load(f)
            return _Generation(int(raw["number"]), _pair(raw["spawner"]),
                               None if raw.get("engine") is None else _pair(raw["engine"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, generation: _Generation) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(generation), f)
        os.replace(tmp, self.path)

    def mark_loading(self, number: int) -> None:
        """In an engine's process, as its load begins: ``{tag}.loading`` names it, so that if its
        spawner ends before recording it, the process that starts the next generation can end
        it (else two engines could load on one device)."""
        pid, started = _process_identity(os.getpid())
        tmp = f"{self.path}.loading.{pid}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{number} {pid} {started}")
            os.replace(tmp, os.path.join(self.folder, f"{self.tag}.loading"))
        except OSError:
            _LOG.exception("could not record the loading shared engine")

    def loading(self, number: int) -> Optional[tuple[int, int]]:
        """The process that began to load generation ``number``'s engine, if recorded."""
        try:
            with open(os.path.join(self.folder, f"{self.tag}.loading")) as f:
                recorded, pid, started = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            return None
        return (pid, started) if recorded == number else None


def _pair(value: Any) -> tuple[int, int]:
    first, second = value
    return int(first), int(second)


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
# A call whose engine ended in other processes' calls (or with its spawner) is retried on the
# next engine this many times in a row, then fails as an EngineFailedError. Other processes'
# poison inputs end it a few times each while they bisect them (about log2 of their call's inputs).
_RETRIES_FOR_OTHERS = 16
_CALL_IDS = itertools.count(1)
_TAG_LOCKS: dict[str, threading.Lock] = {}  # the file lock is the process's (lockf): one thread
_TAG_LOCKS_LOCK = threading.Lock()


def _tag_lock(tag: str) -> threading.Lock:
    with _TAG_LOCKS_LOCK:
        return _TAG_LOCKS.setdefault(tag, threading.Lock())


class _EngineGone(Exception):
    """The shared engine's process is gone, or was ended because a call in it hung. ``call``: the
    id of the call it was in (or ended in), None if it was idle or that is unknown."""

    def __init__(self, why: str, call: Optional[str] = None):
        super().__init__(why)
        self.call = call


class _Unreachable(Exception):
    """The engine named for a generation could not be reached (it ended meanwhile), or Beam spawned
    one for a generation that may not have one (``_SUPERSEDED``): try again with the next."""


class EngineEndedInCall(RuntimeError):
    """The shared engine's process ended (or hung and was ended) during this call, and a new engine
    passes its canary: the call's inputs are suspected, as with any failed call whose canary
    passes, and the handler bisects them (``transforms.embed``)."""


class SharedEngineClient:
    """What an SDK process holds as its model with ``model.share_across_processes``: the proxy to
    the machine's one engine, replaced when that engine's process is gone or hung.

    - Reaching the engine (waiting for another process that is starting it, spawning and loading
      it, connecting to it) takes at most ``model.load_timeout_s`` each time: an engine that is
      not ready by then is ended (SIGKILL), and the attempt is an ``EngineFailedError``.
    - A call is timed from when the engine starts it (calls wait their turn there, behind other
      processes' calls; that wait is not timed): once the engine has been in one call for more
      than ``model.call_timeout_s``, its process is ended (SIGKILL) and replaced.
    - A call whose engine's process is gone (or was ended) while the engine was in another call,
      or idle, or because the SDK process that spawned it ended, is retried on the next engine.
      One whose engine ended in the call itself is followed by the next engine's canary: a canary
      that fails (or cannot run) is an ``EngineFailedError``; one that passes raises
      ``EngineEndedInCall``, an input failure, which the handler bisects (an input that crashes
      or hangs the engine is dead-lettered alone).
    - ``EngineFailedError`` from the engine (its canary failed, or it could not be loaded) ends
      its process too: the next call spawns a fresh one, with a fresh CUDA context, instead of
      reloading inside a process that a sticky CUDA error may have spoiled.
    Every other error of a call is the engine's answer about its inputs, raised as is.
    """

    def __init__(self, settings: ModelSettings, factory: Optional[EngineFactory], tag: str,
                 device: Optional[str] = None):
        self._settings, self._factory, self._tag = settings, factory, tag
        self.device = device  # CUDA_VISIBLE_DEVICES of the engine's process; None: as inherited
        # Beam's address and lock files, the busy file and the engine record: the same folder in
        # every SDK process of the machine (they share /tmp and the environment).
        self._folder = tempfile.gettempdir()
        self._busy = _BusyFile(os.path.join(self._folder, f"{tag}.busy"))
        self._record = _EngineRecord(self._folder, tag)
        self._timeout_s = settings.resolved_call_timeout_s()
        self._load_timeout_s = settings.load_timeout_s
        self._poll_s = min(1.0, max(0.05, self._timeout_s / 10))
        self._lock = threading.Lock()
        self._local = threading.local()
        self._proxy: Any = None
        self._process = (0, 0)
        self._spawner = (0, 0)
        self._generation = 0  # of the engine reached (_Generation.number)
        self._connection = 0  # counts the engines this client has reached
        self._label = ""
        with self._lock:
            self._connect()

    # ---- reaching the engine ----

    def _connect(self) -> None:
        """Reach the machine's engine, spawning it if there is none (under self._lock), within
        ``model.load_timeout_s`` for the wait for another process's start and as much again for
        this one's: an ``EngineFailedError`` otherwise."""
        import fasteners

        started = time.monotonic()
        thread_lock = _tag_lock(self._tag)
        if not thread_lock.acquire(timeout=self._load_timeout_s):
            raise self._failed_to_connect(None, f"waited {self._load_timeout_s:g} s "
                                                "(model.load_timeout_s) for another thread")
        try:
            machine_lock = fasteners.InterProcessLock(self._record.lock_path)
            left = max(0.0, self._load_timeout_s - (time.monotonic() - started))
            try:
                acquired = machine_lock.acquire(timeout=left)
            except (OSError, threading.ThreadError) as exc:
                raise self._failed_to_connect(exc, f"its lock file: {exc}") from exc
            if not acquired:
                raise self._failed_to_connect(None, (
                    f"waited {self._load_timeout_s:g} s (model.load_timeout_s) for another SDK "
                    "process of this machine to start or reach it"))
            try:
                self._connect_locked()
            except EngineFailedError:
                raise
            except Exception as exc:  # pylint: disable=broad-except  # the temp dir, a lock file
                # Never an input's failure: the handler would bisect it and blame the inputs.
                raise self._failed_to_connect(exc, f"{type(exc).__name__}: {exc}") from exc
            finally:
                machine_lock.release()
        finally:
            thread_lock.release()

    def _connect_locked(self) -> None:
        """_connect, under the tag's machine-wide lock."""
        for attempt in range(1, _CONNECT_ATTEMPTS + 1):
            generation = self._generation_to_use()
            try:
                proxy, process, label = self._reach(generation)
            except _Unreachable as exc:
                if attempt == _CONNECT_ATTEMPTS:
                    raise self._failed_to_connect(exc, str(exc)) from exc
                _LOG.warning("the shared embedding engine (generation %d) was gone when reached "
                             "(%s); reaching or spawning another", generation.number, exc)
                continue
            if generation.engine != process:
                generation = dataclasses.replace(generation, engine=process)
                self._record.write(generation)
            self._proxy, self._process, self._label = proxy, process, label
            self._spawner, self._generation = generation.spawner, generation.number
            self._connection += 1
            _LOG.info("using the shared embedding engine in process %d (generation %d)",
                      process[0], generation.number)
            return

    def _generation_to_use(self) -> _Generation:
        """The current generation if its engine may still be reached (its address file is there,
        its process alive or not known yet); else a new one, which this process spawns. An engine
        that runs with its address file gone cannot be reached: it is ended before another is
        started on its device."""
        current = self._record.read()
        if current is not None and os.path.exists(self._record.address_file(current)) and (
                current.engine is None or _process_state(current.engine) == "alive"):
            return current
        if current is not None:
            named = (current.engine, self._record.loading(current.number))
            for left in dict.fromkeys(p for p in named if p is not None):
                if _process_state(left) != "alive":
                    continue
                _LOG.error("the shared embedding engine of generation %d (process %d) runs, but "
                           "cannot be reached (its address file is gone, or its spawner ended "
                           "during its load); ending it before starting another", current.number,
                           left[0])
                _end_process(left)
                if _process_state(left) == "alive":
                    raise self._failed_to_connect(None, (
                        f"the previous engine (process {left[0]}) has not exited; a second one "
                        "is not started on its device"))
            for stale in (self._record.address_file(current),
                          self._record.address_file(current) + ".error"):
                try:
                    os.unlink(stale)
                except OSError:
                    pass
        generation = _Generation((current.number if current is not None else 0) + 1,
                                 _process_identity(os.getpid()))
        self._record.write(generation)
        return generation

    def _reach(self, generation: _Generation) -> tuple[Any, tuple[int, int], str]:
        """The proxy to ``generation``'s engine, its process and label, spawning it if Beam finds
        no address file for it; within ``model.load_timeout_s``, else the engine being spawned
        (or the one that does not answer) is ended: ``EngineFailedError``."""
        from apache_beam.utils import multi_process_shared

        address_file = self._record.address_file(generation)
        children_before = {c.pid for c in multiprocessing.active_children()}
        done: dict[str, Any] = {}

        def reach() -> None:
            try:
                proxy = multi_process_shared.MultiProcessShared(
                    _SharedEngine(self._settings, self._factory, self._busy, self.device,
                                  self._record, generation.number),
                    tag=generation.beam_tag(self._tag),
                    path=self._folder, always_proxy=True, spawn_process=True).acquire()
                done["result"] = (proxy, _pair(proxy.process()), proxy.label())
            except BaseException as exc:  # pylint: disable=broad-except  # raised in the caller
                done["error"] = exc

        thread = threading.Thread(target=reach, name="newsvec-engine-reach", daemon=True)
        thread.start()
        thread.join(timeout=self._load_timeout_s)
        if not thread.is_alive():
            if "error" in done:
                exc = done["error"]
                if isinstance(exc, (EOFError, ConnectionError)) or _SUPERSEDED in str(exc):
                    raise _Unreachable(f"{type(exc).__name__}: {exc}"[:500]) from exc
                raise self._failed_to_connect(exc, f"{type(exc).__name__}: {exc}") from exc
            return done["result"]
        # Not ready in time: end the engine this process is spawning (Beam's wait for it then
        # ends: its process is gone), or the one that does not answer.
        spawned = [c for c in multiprocessing.active_children()
                   if c.pid not in children_before
                   and address_file in tuple(getattr(c, "_args", ()) or (address_file,))]
        for child in spawned:
            child.kill()
            child.join(timeout=10)
        if not spawned and generation.engine is not None:
            _end_process(generation.engine)
        thread.join(timeout=10)
        what = "load" if spawned else "answer"
        raise self._failed_to_connect(None, (
            f"it did not {what} within model.load_timeout_s ({self._load_timeout_s:g} s); its "
            "process was ended"))

    def _failed_to_connect(self, exc: Optional[BaseException], why: str) -> EngineFailedError:
        _LOG.error("the shared embedding engine %s could not be started or reached: %s",
                   self._settings.name, why)
        if isinstance(exc, EngineFailedError):
            return exc
        return EngineFailedError(f"the shared embedding engine {self._settings.name} could not be "
                                 f"started or reached: {why}"[:2000])

    def _current(self) -> tuple[Any, tuple[int, int], tuple[int, int], int]:
        with self._lock:
            if self._proxy is None:
                self._connect()
            return self._proxy, self._process, self._spawner, self._connection

    def _drop(self, connection: int, why: str) -> None:
        """End the engine of ``connection`` and forget it (once, whichever thread asks first). The
        next call reaches the engine another process has started since, or starts one."""
        with self._lock:
            if connection != self._connection or self._proxy is None:
                return  # already replaced
            process, self._proxy = self._process, None
            _LOG.error("ending the shared embedding engine (process %d): %s; the next call spawns "
                       "or reaches a new one", process[0], why)
            _end_process(process)

    # ---- calls ----

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
                raise self._gone(process, f"its process is unreachable ({type(exc).__name__}: "
                                          f"{exc})") from exc
            except OSError as exc:
                if _process_state(process) == "alive":
                    raise  # an error of the engine itself: its answer about the inputs
                raise self._gone(process, f"its process is gone ({type(exc).__name__}: {exc})") \
                    from exc
            busy_s = self._busy.busy_for(process)
            if busy_s > self._timeout_s:
                # The thread stays blocked until the engine's process is ended; drop its pool.
                self._local.pool = None
                pool.shutdown(wait=False)
                raise self._gone(process, f"one call has run for {busy_s:.0f} s, over "
                                          f"model.call_timeout_s ({self._timeout_s:g} s)")
            if _process_state(process) != "alive":
                self._local.pool = None
                pool.shutdown(wait=False)
                raise self._gone(process, "its process is gone")

    def _gone(self, process: tuple[int, int], why: str) -> _EngineGone:
        return _EngineGone(why, self._busy.call(process))

    def _call(self, method: str, args: tuple) -> tuple[Any, Optional[_EngineGone], int]:
        """``method(*args, call_id)`` on the engine: (its answer, None, the engine's connection),
        or (None, the failure, its connection) when the engine's process ended (or hung) in this
        call. An engine that ended while in another call, or between calls, or with the SDK
        process that spawned it, is replaced and the call retried (``_RETRIES_FOR_OTHERS`` times
        in a row at most). ``EngineFailedError`` ends the engine and is raised."""
        for _ in range(_RETRIES_FOR_OTHERS + 1):
            proxy, process, spawner, connection = self._current()
            call_id = f"{os.getpid()}.{next(_CALL_IDS)}"
            try:
                return self._timed(getattr(proxy, method), (*args, call_id), process), None, \
                    connection
            except EngineFailedError as exc:
                self._drop(connection, f"it failed: {exc}")
                raise
            except _EngineGone as gone:
                self._drop(connection, str(gone))
                if gone.call == call_id and _process_state(spawner) == "alive":
                    return None, gone, connection
                why = ("with the SDK process that spawned it" if gone.call == call_id
                       else "in another call" if gone.call is not None else "between calls")
                _LOG.warning("the shared embedding engine ended %s (%s); retrying a %s call on "
                             "the next engine", why, gone, method)
        raise EngineFailedError(
            f"the shared embedding engine {self._settings.name} ended {_RETRIES_FOR_OTHERS + 1} "
            "times in a row in other calls than this one")

    def label(self) -> str:
        return self._label

    def take_load_ms(self) -> list[int]:
        proxy, process, _, connection = self._current()
        try:
            return list(self._timed(proxy.take_load_ms, (), process))
        except _EngineGone as exc:
            self._drop(connection, str(exc))
            return []

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """A vector per prompt; ``EngineEndedInCall`` (an input failure) when the engine ended in
        this call and a new one passes its canary; ``EngineFailedError`` when it does not."""
        vectors, ended, _ = self._call("embed", (prompts,))
        if ended is None:
            return vectors
        healthy, canary_ended, connection = self._call("healthy", ())
        if canary_ended is None and not healthy:
            self._drop(connection, "it fails its canary")
        if canary_ended is not None or not healthy:
            raise EngineFailedError(
                f"the shared embedding engine {self._settings.name} ended in a call ({ended}), "
                "and the next one fails its canary"
                f"{f' ({canary_ended})' if canary_ended is not None else ''}: the engine is "
                "broken, not the inputs"[:2000])
        _LOG.warning("the shared embedding engine ended in a call of %d inputs (%s); a new one "
                     "passes its canary, so the inputs are suspected", len(prompts), ended)
        raise EngineEndedInCall(
            f"the shared embedding engine's process ended during this call ({ended}); a new "
            "engine passes its canary, so the call's inputs are suspected"[:2000])


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

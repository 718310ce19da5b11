"""The shared engine's life as the SDK processes see it (``EngineLife``): reach it or spawn it
within ``model.load_timeout_s`` (the threads of a process share one attempt), one engine per tag at
a time (each a generation of the tag, ``records._EngineRecord``), end it with what it started and
replace it, and blame: whether an engine that ended in a call ended of that call's doing
(``EngineLife._spared``)."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.managers
import os
import signal
import threading
import time
from typing import Any, Optional

from transforms.engines.base import EngineFactory, EngineFailedError
from transforms.engines.shared.processes import (
    _describe_exit,
    _end_process,
    _exists,
    _oom_kill_file,
    _oom_kills,
    _process_identity,
)
from transforms.engines.shared.records import _BusyFile, _Ended, _EngineRecord, _Generation, _pair
from transforms.engines.shared.server import _SUPERSEDED, _SharedEngine
from transforms.engines.shared.transport import (
    _engine_folder,
    _engine_socket,
    _forget_connections,
    _key_file,
    _private_shared,
    _processes_in,
    _release_spawned,
    _socket_file,
)
from transforms.private_files import ensure_private_file, is_private
from transforms.settings import ModelSettings

_LOG = logging.getLogger(__name__)

# How long a client waits for the spawner's record of how an engine ended.
_EXIT_RECORD_WAIT_S = 2.0
# A failed attempt to reach the engine is remembered this long: the process's other threads, and
# its calls meanwhile, fail with it at once instead of each making an attempt of its own.
_REMEMBER_FAILURE_S = 5.0
_CONNECT_ATTEMPTS = 3
_TAG_LOCKS: dict[str, threading.Lock] = {}  # the file lock is the process's (lockf): one thread
_TAG_LOCKS_LOCK = threading.Lock()


def _tag_lock(tag: str) -> threading.Lock:
    with _TAG_LOCKS_LOCK:
        return _TAG_LOCKS.setdefault(tag, threading.Lock())


class _EngineGone(Exception):
    """The shared engine's process is gone (or cannot be reached), or is to be ended (``end``:
    it hung in a call, stopped answering, or is stopped). ``call``: the id of the call it was in
    (or ended in), None if it was idle or that is unknown; ``ending``: it said it was shutting
    down; ``blame``: the call it is ended for (it hung in it), if any."""

    def __init__(self, why: str, call: Optional[str] = None, ending: bool = False,
                 blame: Optional[str] = None, end: bool = False):
        super().__init__(why)
        self.call, self.ending, self.blame, self.end = call, ending, blame, end


class _Unreachable(Exception):
    """The engine named for a generation could not be reached (it ended meanwhile), or Beam spawned
    one for a generation that may not have one (``_SUPERSEDED``): try again with the next."""


@dataclasses.dataclass
class _Attempt:
    """An attempt to reach the engine, which every thread of the process that needs it joins."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: Optional[EngineFailedError] = None
    ended: float = 0.0


class EngineLife:
    """This SDK process's hold on the machine's engine of one tag: the proxy to it, replaced when
    that engine's process is gone or hung (``SharedEngineClient`` makes its calls through it).

    - Reaching the engine (waiting for another process that is starting it, spawning and loading
      it, connecting to it) takes at most ``model.load_timeout_s`` each time: an engine that is
      not ready by then is ended (SIGKILL), and the attempt is an ``EngineFailedError``. The
      process's threads share one attempt; one that failed is remembered for
      ``_REMEMBER_FAILURE_S``, and a thread that asks meanwhile fails with it at once.
    - One engine runs per tag: each is a generation of the tag (``_EngineRecord``), and a new one
      is started only once nothing of the last one runs (an engine that runs but cannot be reached
      is ended first, with what it started).
    - An engine is ended (``_drop``) once, whichever thread finds it gone or hung first; the end is
      recorded with why, and the call it blames, so that the clients of other processes can tell
      an end in their call of their call's doing from one that was not (``_spared``).
    """

    def __init__(self, settings: ModelSettings, factory: Optional[EngineFactory], tag: str,
                 device: Optional[str] = None):
        self._settings, self._factory, self._tag = settings, factory, tag
        self.device = device  # CUDA_VISIBLE_DEVICES of the engine's process; None: as inherited
        # Beam's address, key and lock files, the busy file and the engine record: the same
        # private folder in every SDK process of the machine (they share /tmp, the environment
        # and the user), which no other user may enter (``transforms.private_files``).
        self._folder = _engine_folder()
        self._busy = _BusyFile(os.path.join(self._folder, f"{tag}.busy"))
        self._record = _EngineRecord(self._folder, tag)
        self._load_timeout_s = settings.load_timeout_s
        self._lock = threading.Lock()
        self._attempt: Optional[_Attempt] = None
        self._proxy: Any = None
        self._process = (0, 0)
        self._spawner = (0, 0)
        self._generation = 0  # of the engine reached (_Generation.number)
        self._connection = 0  # counts the engines this client has reached
        self._oom_file: Optional[str] = None  # counts the OOM kills of the engine's cgroup
        self._label = ""

    # ---- reaching the engine ----

    def connect(self) -> None:
        """Reach the engine if this client has none: join the attempt another thread of this
        process is making, or make one; ``EngineFailedError`` if it fails (or failed less than
        ``_REMEMBER_FAILURE_S`` ago)."""
        while True:
            with self._lock:
                if self._proxy is not None:
                    return
                attempt = self._attempt
                if attempt is not None and attempt.done.is_set():
                    if (attempt.error is not None
                            and time.monotonic() - attempt.ended < _REMEMBER_FAILURE_S):
                        raise EngineFailedError(str(attempt.error)) from attempt.error
                    attempt = None
                mine = attempt is None
                if mine:
                    attempt = self._attempt = _Attempt()
            assert attempt is not None
            if mine:
                try:
                    self._connect()
                except EngineFailedError as exc:
                    attempt.error = exc
                    raise
                finally:
                    attempt.ended = time.monotonic()
                    attempt.done.set()
            else:
                # The attempt has deadlines of its own (twice load_timeout_s at most).
                if not attempt.done.wait(timeout=2 * self._load_timeout_s + 60):
                    raise self._failed_to_connect(None, "another thread's attempt did not end")
                if attempt.error is not None:
                    raise EngineFailedError(str(attempt.error)) from attempt.error

    def _connect(self) -> None:
        """Reach the machine's engine, spawning it if there is none, within
        ``model.load_timeout_s`` for the wait for another process's start and as much again for
        this one's: an ``EngineFailedError`` otherwise."""
        import fasteners

        started = time.monotonic()
        thread_lock = _tag_lock(self._tag)
        if not thread_lock.acquire(timeout=self._load_timeout_s):
            raise self._failed_to_connect(None, f"waited {self._load_timeout_s:g} s "
                                                "(model.load_timeout_s) for another thread")
        try:
            try:
                ensure_private_file(self._record.lock_path)
            except OSError as exc:
                raise self._failed_to_connect(exc, str(exc)) from exc
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
            oom_file = _oom_kill_file(process[0])
            if oom_file is None:
                _LOG.info("the out-of-memory kills of the shared engine's cgroup cannot be read "
                          "here: a kill of the engine is told from a crash by its exit status "
                          "alone")
            with self._lock:
                self._proxy, self._process, self._label = proxy, process, label
                self._spawner, self._generation = generation.spawner, generation.number
                self._oom_file = oom_file
                self._connection += 1
            _LOG.info("using the shared embedding engine in process %d (generation %d)",
                      process[0], generation.number)
            return

    def _end(self, process: tuple[int, int], number: Optional[int], why: str,
             blame: Optional[str] = None) -> bool:
        """End an engine (and its process group: ``_end_process``), first recording that a
        client of newsvec ended it, why, and the call it blames, if it is still there; whether
        nothing of it is left."""
        if number is not None and _exists(process):
            self._record.mark_ended(number, _Ended(process, why[:500], blame))
        return _end_process(process)

    def _generation_to_use(self) -> _Generation:
        """The current generation if its engine may still be reached (its address file is there,
        its process alive or not known yet); else a new one, which this process spawns. An engine
        that runs with its address file gone cannot be reached: it is ended, with whatever it
        started, before another is started on its device."""
        current = self._record.read()
        if current is None:
            return self._new_generation(self._number_without_record(), None)
        address_file = self._record.address_file(current)
        if is_private(address_file) and is_private(_key_file(address_file)) and (
                current.engine is None or _exists(current.engine)):
            try:
                _engine_socket(address_file)
                return current
            except ConnectionRefusedError as exc:
                _LOG.warning("the shared embedding engine of generation %d cannot be reached: "
                             "%s", current.number, exc)
        loading = self._record.loading(current.number)
        named = [current.engine, loading[1] if loading is not None else None]
        for left in dict.fromkeys(p for p in named if p is not None):
            if _exists(left):
                _LOG.error("the shared embedding engine of generation %d (process %d) runs, but "
                           "cannot be reached (its address file is gone, or its spawner ended "
                           "during its load); ending it before starting another", current.number,
                           left[0])
            if not self._end(left, current.number, "it runs but cannot be reached"):
                raise self._failed_to_connect(None, (
                    f"the previous engine (process {left[0]}), or a process it started, has not "
                    "exited; a second one is not started on its device"))
        return self._new_generation(current.number + 1, current)

    def _number_without_record(self) -> int:
        """The record is gone (a cleaner of old temp files took it) or unreadable: end any
        engine of the tag that still runs (named by the busy file, which a running engine
        rewrites every second, or by the loading file) and number the next generation above any
        that left a file."""
        numbers = self._record.numbers_on_disk()
        state = self._busy.read()
        loading = self._record.loading()
        named = [(state.generation, state.process)] if state is not None else []
        named += [loading] if loading is not None else []
        for number, left in named:
            numbers.append(number)
            if _exists(left):
                _LOG.error("the shared embedding engine's record %s is gone, but its engine "
                           "(process %d, generation %d) runs; ending it before starting another",
                           self._record.path, left[0], number)
            if not self._end(left, number, "its record is gone"):
                raise self._failed_to_connect(None, (
                    f"an engine of this tag (process {left[0]}), or a process it started, has "
                    "not exited; a second one is not started on its device"))
        return max(numbers, default=0) + 1

    def _new_generation(self, number: int, current: Optional[_Generation]) -> _Generation:
        if current is not None:
            address_file = self._record.address_file(current)
            for stale in (address_file, address_file + ".error", _key_file(address_file),
                          _socket_file(address_file)):
                try:
                    os.unlink(stale)
                except OSError:
                    pass
        generation = _Generation(number, _process_identity(os.getpid()))
        self._record.write(generation)
        self._record.forget_before(number - 1)
        return generation

    def _reach(self, generation: _Generation) -> tuple[Any, tuple[int, int], str]:
        """The proxy to ``generation``'s engine, its process and label, spawning it if Beam finds
        no address file for it; within ``model.load_timeout_s``, else the engine being spawned
        (or the one that does not answer) is ended: ``EngineFailedError``."""
        address_file = self._record.address_file(generation)
        children_before = {c.pid for c in multiprocessing.active_children()}
        done: dict[str, Any] = {}

        def reach() -> None:
            try:
                shared = done["shared"] = _private_shared(
                    _SharedEngine(self._settings, self._factory, self._busy, self.device,
                                  self._record, generation.number),
                    generation.beam_tag(self._tag), self._folder)
                proxy = shared.acquire()
                done["result"] = (proxy, _pair(proxy.process()), proxy.label())
            except BaseException as exc:  # pylint: disable=broad-except  # raised in the caller
                done["error"] = exc

        thread = threading.Thread(target=reach, name="newsvec-engine-reach", daemon=True)
        thread.start()
        thread.join(timeout=self._load_timeout_s)
        spawned = [c for c in (*multiprocessing.active_children(),
                               *_processes_in(done.get("error")))
                   if c.pid not in children_before
                   and address_file in tuple(getattr(c, "_args", ()) or (address_file,))]
        spawned = list({c.pid: c for c in spawned}.values())
        for child in spawned:
            self._watch(child, done.get("shared"), generation.number)
        if not thread.is_alive():
            if "error" in done:
                exc = done["error"]
                if isinstance(exc, (EOFError, ConnectionError)) or _SUPERSEDED in str(exc):
                    raise _Unreachable(f"{type(exc).__name__}: {exc}"[:500]) from exc
                raise self._failed_to_connect(exc, f"{type(exc).__name__}: {exc}") from exc
            return done["result"]
        # Not ready in time: end the engine this process is spawning (Beam's wait for it then
        # ends: its process is gone), or the one that does not answer.
        for child in spawned:  # the watcher reaps it
            _end_process(_process_identity(child.pid or 0))
        if not spawned and generation.engine is not None:
            self._end(generation.engine, generation.number, "it did not answer when reached")
        thread.join(timeout=10)
        what = "load" if spawned else "answer"
        raise self._failed_to_connect(None, (
            f"it did not {what} within model.load_timeout_s ({self._load_timeout_s:g} s); its "
            "process was ended"))

    def _watch(self, child: Any, shared: Any, number: int) -> None:
        """In the SDK process that spawned an engine: when its process exits, record how (the
        clients of other processes cannot see its exit status) and release what Beam keeps of
        it."""
        engine = _process_identity(child.pid or 0)

        def watch() -> None:
            while child.exitcode is None:
                # Its sentinel may stay open while a process it started holds it: poll as well.
                if multiprocessing.connection.wait([child.sentinel], timeout=0.5):
                    time.sleep(0.01)
            self._record.mark_exit(number, engine, child.exitcode)
            _release_spawned(child, shared)

        threading.Thread(target=watch, name="newsvec-engine-watch", daemon=True).start()

    def _failed_to_connect(self, exc: Optional[BaseException], why: str) -> EngineFailedError:
        _LOG.error("the shared embedding engine %s could not be started or reached: %s",
                   self._settings.name, why)
        if isinstance(exc, EngineFailedError):
            return exc
        return EngineFailedError(f"the shared embedding engine {self._settings.name} could not be "
                                 f"started or reached: {why}"[:2000])

    def _current(self) -> tuple[Any, tuple[int, int], tuple[int, int], int, int]:
        """(proxy, engine process, its spawner, connection, generation), reaching it if needed."""
        while True:
            with self._lock:
                if self._proxy is not None:
                    return (self._proxy, self._process, self._spawner, self._connection,
                            self._generation)
            self.connect()

    def _drop(self, connection: int, why: str, blame: Optional[str] = None,
               recorded: bool = True) -> None:
        """End the engine of ``connection`` and forget it (once, whichever thread asks first). The
        next call reaches the engine another process has started since, or starts one. The end is
        ``recorded`` (``_Ended``) where this client decided it; not where the engine's process
        was found gone or unreachable (it may be in the middle of exiting on its own)."""
        with self._lock:
            if connection != self._connection or self._proxy is None:
                return  # already replaced
            process, proxy, self._proxy = self._process, self._proxy, None
            number = self._generation
        _LOG.error("ending the shared embedding engine (process %d): %s; the next call spawns "
                   "or reaches a new one", process[0], why)
        self._end(process, number if recorded else None, why, blame)
        _forget_connections(proxy)

    # ---- blame ----

    def _spared(self, gone: _EngineGone, process: tuple[int, int], spawner: tuple[int, int],
                number: int, call_id: str, oom_before: Optional[int],
                oom_file: Optional[str]) -> Optional[str]:
        """Why the engine's end, in call ``call_id``, is not that call's doing (it is retried),
        or None when it is (a crash; a hang, which a client ended), and the call is an input
        failure if the next engine passes its canary."""
        if not _exists(spawner):
            return "with the SDK process that spawned it"
        ended = self._record.ended(number, process)
        if ended is not None:
            return None if ended.blame == call_id else f"ended by newsvec: {ended.why}"
        if gone.ending:
            return "as it shut down"
        oom_after = _oom_kills(oom_file)
        if oom_before is not None and oom_after is not None and oom_after > oom_before:
            return (f"killed for lack of memory (the out-of-memory kills of its cgroup went from "
                    f"{oom_before} to {oom_after})")
        status = self._record.exit_status(number, process, _EXIT_RECORD_WAIT_S)
        if status in (0, -signal.SIGKILL, -signal.SIGTERM):
            return f"{_describe_exit(status)}, which newsvec did not send"
        return None

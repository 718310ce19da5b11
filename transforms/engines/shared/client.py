"""What an SDK process holds as its model with ``model.share_across_processes``: a
``SharedEngineClient`` per step (``shared_engine``), whose calls to the machine's engine are timed
(each bounded: an engine hung in a call, silent, or stopped is ended and replaced; a call with no
answer fails at its ceiling), retried on the next engine when it ended in another's call, and
checked with the next engine's canary when it ended in this one (``EngineEndedInCall``, an input
failure, which the handler bisects; ``deaths_allowed``). Reaching, replacing and blaming the
engine: ``transforms.engines.shared.life``."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import math
import os
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from transforms.engines.base import EngineFactory, EngineFailedError, all_finite
from transforms.engines.devices import DeviceSlots, engine_devices
from transforms.engines.shared.life import EngineLife, _EngineGone
from transforms.engines.shared.processes import (
    _exists,
    _oom_kills,
    _process_identity,
    _process_state,
)
from transforms.engines.shared.records import _EngineState
from transforms.engines.shared.transport import _engine_folder
from transforms.settings import ModelSettings

_LOG = logging.getLogger(__name__)

# A stopped (or traced) engine whose heartbeat is this old is not answering: a debugger that
# only looks (py-spy dump) stops it for less.
_STOPPED_FOR_S = 3.0
# A call's ceiling is its turn (the calls queued before it, each at most call_timeout_s) and its
# own call_timeout_s, plus this.
_CEILING_SLACK_S = 10.0
# A call whose engine ended in other processes' calls (or with its spawner) is retried on the
# next engine this many times in a row, then fails as an EngineFailedError. Other processes'
# poison inputs end it a few times each while they bisect them (about log2 of their call's inputs).
_RETRIES_FOR_OTHERS = 16
# A call whose engine was killed in it by something newsvec did not send (the out-of-memory
# killer) is retried this many times, then fails as an EngineFailedError: its inputs are not
# blamed (an engine short of memory is the machine's problem, not an article's).
_RETRIES_AFTER_KILLS = 3
_CALL_IDS = itertools.count(1)
_CALL_THREAD = threading.local()  # in each call thread: the engine proxy it last called


class _CallThread:
    """One daemon thread that runs a caller's engine calls in turn, each answered through a
    ``concurrent.futures.Future``. Not a ``ThreadPoolExecutor``: the interpreter joins every
    executor thread at exit, so one call abandoned on a frozen engine (it never returns) would keep
    the SDK process, a local run or the test run from ever exiting. An abandoned thread of this
    kind is left to end with the process."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="newsvec-engine-call", daemon=True).start()

    def submit(self, function: Callable, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((future, function, args))
        return future

    def shutdown(self) -> None:
        """The thread ends after the call it is in, if that ever returns."""
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, function, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # pylint: disable=broad-except  # the caller's to read
                future.set_exception(exc)


def _call_in_thread(method: Callable, args: tuple) -> Any:
    """``method(*args)``, run in a caller's call thread. The proxies keep a connection per thread
    and engine for the life of the thread: this thread's connection to an engine it called before
    (one that has since been replaced) is closed first, so that a call thread holds one at most."""
    proxy = getattr(method, "__self__", None)
    previous = getattr(_CALL_THREAD, "proxy", None)
    if previous is not None and previous is not proxy:
        connection = getattr(previous._tls, "connection", None)
        if connection is not None:
            connection.close()
            del previous._tls.connection
    _CALL_THREAD.proxy = proxy
    return method(*args)


class _NoAnswer(Exception):
    """A call got no answer by its ceiling although the engine is alive, answers (its heartbeat
    goes on) and is not in this call: the call or its answer was lost, or never got its turn."""


class EngineEndedInCall(RuntimeError):
    """The shared engine's process ended (or hung and was ended) during this call, and a new engine
    passes its canary: the call's inputs are suspected, as with any failed call whose canary
    passes, and the handler bisects them (``transforms.embed``)."""


@dataclasses.dataclass
class _CallWatch:
    """What a waiting call (``SharedEngineClient._timed``) has heard of the engine: when it was
    sent, the engine's last heartbeat (or when the call was sent), the most calls it has been
    heard of with queued, and the call's ceiling (its turn, then its own call_timeout_s, then
    ``_CEILING_SLACK_S``)."""

    sent: float
    timeout_s: float
    heard: float = 0.0
    ceiling: Optional[float] = None
    ahead: int = 0

    def __post_init__(self) -> None:
        self.heard = self.sent

    def hear(self, state: _EngineState, now: float) -> Optional[_EngineGone]:
        """Take in the engine's state; the engine to end, if it has been in one call for more
        than call_timeout_s."""
        self.heard = max(self.heard, state.heartbeat)
        # The calls queued (this one among them, and those behind it) as the engine last
        # wrote them: a state written before this call arrived counts fewer, so the
        # ceiling grows to the most seen (each later state is at most a heartbeat old).
        if state.queued > self.ahead or self.ceiling is None:
            self.ahead = max(self.ahead, state.queued)
            self.ceiling = self.sent + (self.ahead + 1) * self.timeout_s + _CEILING_SLACK_S
        if state.call is not None and now - state.since > self.timeout_s:
            return _EngineGone(
                f"one call has run for {now - state.since:.0f} s, over "
                f"model.call_timeout_s ({self.timeout_s:g} s)", state.call,
                blame=state.call, end=True)
        return None


class SharedEngineClient(EngineLife):
    """What an SDK process holds as its model with ``model.share_across_processes``: the proxy to
    the machine's one engine, replaced when that engine's process is gone or hung (reaching,
    ending and replacing it, and blaming a call it ended in: ``EngineLife``).

    - A call is timed from when the engine starts it (calls wait their turn there, behind other
      processes' calls, in order): once the engine has been in one call for more than
      ``model.call_timeout_s``, its process is ended (SIGKILL) and replaced. So is an engine
      whose heartbeat has stopped for as long (frozen, or stuck outside a call), or that is
      stopped (SIGSTOP, a tracer) for ``_STOPPED_FOR_S``. A call that gets no answer from an
      engine that is alive, answering and not in it, by its ceiling (its turn: the most calls
      the engine has been seen with queued, each ``call_timeout_s``; then its own
      ``call_timeout_s``; then ``_CEILING_SLACK_S``) is an ``EngineFailedError``, and the engine
      is left to the others.
    - A call whose engine's process is gone (or was ended) while the engine was in another call,
      or idle, or because the SDK process that spawned it ended, or that was ended by a kill
      newsvec did not send (the out-of-memory killer: the count of its memory cgroup, or the
      exit status its spawner saw), or as it shut down, is retried on the next engine. One whose
      engine ended in the call itself (a crash; a hang, which a client ended) is followed by the
      next engine's canary: a canary that fails (or cannot run) is an ``EngineFailedError``; one
      that passes raises ``EngineEndedInCall``, an input failure, which the handler bisects (an
      input that crashes or hangs the engine is dead-lettered alone).
    - ``EngineFailedError`` from the engine (its canary failed, it could not be loaded, it could
      not write its busy file) ends its process too: the next call spawns a fresh one, with a
      fresh CUDA context, instead of reloading inside a process that a sticky CUDA error may
      have spoiled.
    Every other error of a call is the engine's answer about its inputs, raised as is.
    """

    def __init__(self, settings: ModelSettings, factory: Optional[EngineFactory], tag: str,
                 device: Optional[str] = None, connect: bool = True):
        super().__init__(settings, factory, tag, device)
        self._timeout_s = settings.resolved_call_timeout_s()
        self._poll_s = min(1.0, max(0.05, self._timeout_s / 10))
        self._local = threading.local()
        self._known_good: Optional[tuple[int, ...]] = None  # an input the engine embedded
        if connect:
            self.connect()

    # ---- calls ----

    def _timed(self, method: Callable, args: tuple, process: tuple[int, int],
               call_id: Optional[str] = None):
        """``method(*args)`` on the proxy, from a thread of this caller's own; raises
        ``_EngineGone`` when the engine's process is gone, or when it has been in one call for
        more than call_timeout_s, has been silent (no heartbeat) for as long, or is stopped (it
        is then to be ended), and ``_NoAnswer`` when this call is past its ceiling."""
        pool = getattr(self._local, "pool", None)
        if pool is None:
            pool = self._local.pool = _CallThread()
        watch = _CallWatch(time.monotonic(), self._timeout_s)
        future = pool.submit(_call_in_thread, method, args)
        while True:
            try:
                return future.result(timeout=self._poll_s)
            except concurrent.futures.TimeoutError:
                pass
            except (EOFError, ConnectionError) as exc:
                raise self._gone(process, f"its process is unreachable ({type(exc).__name__}: "
                                          f"{exc})") from exc
            except OSError as exc:
                if _exists(process):
                    raise  # an error of the engine itself: its answer about the inputs
                raise self._gone(process, f"its process is gone ({type(exc).__name__}: {exc})") \
                    from exc
            given_up = self._given_up(watch, process, call_id)
            if given_up is not None:  # the thread stays blocked until the engine's process ends
                self._local.pool = None
                pool.shutdown()
                raise given_up

    def _given_up(self, watch: _CallWatch, process: tuple[int, int],
                  call_id: Optional[str]) -> Optional[Exception]:
        """Why a call still waiting is given up on (``_timed``), or None while it may wait on."""
        status = _process_state(process)
        if status not in ("alive", "stopped"):
            return self._gone(process, "its process is gone")
        now = time.monotonic()
        state = self._busy.read(process)
        if state is not None:
            hung = watch.hear(state, now)
            if hung is not None:
                return hung
        in_call = state.call if state is not None else None
        if status == "stopped" and now - watch.heard > _STOPPED_FOR_S:
            return _EngineGone(f"its process is stopped (SIGSTOP or a tracer), silent for "
                               f"{now - watch.heard:.0f} s", in_call, end=True)
        if now - watch.heard > self._timeout_s:
            return _EngineGone(f"it has been silent (no heartbeat) for {now - watch.heard:.0f} s, "
                               f"over model.call_timeout_s ({self._timeout_s:g} s)", in_call,
                               blame=in_call, end=True)
        if (watch.ceiling is not None and now > watch.ceiling
                and (call_id is None or in_call != call_id)):
            return _NoAnswer(
                f"no answer after {now - watch.sent:.0f} s, though the engine is alive, answers "
                f"and is not in this call: past the ceiling of a call that found up to "
                f"{watch.ahead} queued, each given model.call_timeout_s ({self._timeout_s:g} s), "
                f"and {_CEILING_SLACK_S:g} s more")
        return None

    def _gone(self, process: tuple[int, int], why: str) -> _EngineGone:
        state = self._busy.read(process)
        return _EngineGone(why, state.call if state is not None else None,
                           ending=state is not None and state.ending)

    def _call(self, method: str, args: tuple) -> tuple[Any, Optional[_EngineGone], int]:
        """``method(*args, call_id)`` on the engine: (its answer, None, the engine's connection),
        or (None, the failure, its connection) when the engine's process ended (or hung) in this
        call, of this call's doing. An engine that ended while in another call, or between calls,
        or with the SDK process that spawned it, or killed from outside in this call, is replaced
        and the call retried (``_RETRIES_FOR_OTHERS`` times in a row at most, and
        ``_RETRIES_AFTER_KILLS`` times after kills from outside). ``EngineFailedError`` ends the
        engine and is raised; a call past its ceiling is an ``EngineFailedError`` too."""
        kills = 0
        for _ in range(_RETRIES_FOR_OTHERS + 1):
            proxy, process, spawner, connection, number = self._current()
            call_id = f"{os.getpid()}.{next(_CALL_IDS)}"
            oom_file = self._oom_file
            oom_before = _oom_kills(oom_file)
            try:
                return self._timed(getattr(proxy, method), (*args, call_id), process,
                                   call_id), None, connection
            except EngineFailedError as exc:
                self._drop(connection, f"it failed: {exc}")
                raise
            except _NoAnswer as exc:
                _LOG.error("a call to the shared embedding engine (process %d) got no answer: %s",
                           process[0], exc)
                raise EngineFailedError(f"the shared embedding engine {self._settings.name}: "
                                        f"{exc}"[:2000]) from exc
            except _EngineGone as gone:
                self._drop(connection, str(gone), gone.blame, gone.end)
                if gone.call == call_id:
                    spared = self._spared(gone, process, spawner, number, call_id, oom_before,
                                          oom_file)
                    if spared is None:
                        return None, gone, connection
                    kills += 1
                    if kills > _RETRIES_AFTER_KILLS:
                        raise EngineFailedError(
                            f"the shared embedding engine {self._settings.name} ended {kills} "
                            f"times during one call, each time not of the call's doing (last: "
                            f"{spared}): the engine or the machine is failing, not the inputs"
                            [:2000]) from gone
                    why = spared
                else:
                    why = "in another call" if gone.call is not None else "between calls"
                _LOG.warning("the shared embedding engine ended %s (%s); retrying a %s call on "
                             "the next engine", why, gone, method)
        raise EngineFailedError(
            f"the shared embedding engine {self._settings.name} ended {_RETRIES_FOR_OTHERS + 1} "
            "times in a row in other calls than this one")

    def label(self) -> str:
        return self._label

    def take_load_ms(self) -> list[int]:
        proxy, process, _, connection, _ = self._current()
        try:
            return list(self._timed(proxy.take_load_ms, (), process))
        except _EngineGone as exc:
            self._drop(connection, str(exc), exc.blame, exc.end)
            return []
        except _NoAnswer:
            return []

    def embed(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """A vector per prompt; ``EngineEndedInCall`` (an input failure) when the engine ended in
        this call and a new one passes its canary; ``EngineFailedError`` when it does not."""
        vectors, ended, _ = self._call("embed", (prompts,))
        if ended is None:
            if prompts and all_finite(vectors):
                longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
                self._known_good = tuple(prompts[longest])
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

    def embeds_known_good(self) -> Optional[bool]:
        """Whether the engine embeds an input it embedded before (the longest of the last call
        that came back whole); None if there is none yet. An engine that ends on it is broken,
        whatever the inputs that ended it before were."""
        known = self._known_good
        if known is None:
            return None
        try:
            vectors, ended, _ = self._call("embed", ([known],))
        except EngineFailedError:
            raise
        except Exception:  # pylint: disable=broad-except  # any failure of it is the answer
            return False
        return ended is None and all_finite(vectors)


def deaths_allowed(inputs: int) -> int:
    """In-call ends of the shared engine (``EngineEndedInCall``) in a row, with no call
    succeeding between them, that one input which ends the engine can cause in the bisection of
    a call of ``inputs`` inputs: one per halving (the calls holding it: ``inputs``, half as many,
    ..., 1) and the single input's retry. More in a row mean several such inputs side by side,
    or an engine that ends on any real input (``transforms.embed`` then asks
    ``SharedEngineClient.embeds_known_good``)."""
    return math.ceil(math.log2(max(inputs, 1))) + 2


_CLIENTS: dict[str, SharedEngineClient] = {}
_CLIENTS_LOCK = threading.Lock()


def shared_engine(settings: ModelSettings, factory: Optional[EngineFactory],
                  tag: str) -> SharedEngineClient:
    """The machine's engine (``model.share_across_processes``), in a process of its own that
    Beam's multi_process_shared spawns: every SDK process reaches it through a proxy, and none of
    them prepares text in the engine's process, where it would hold the GIL the engine needs.
    (RunInference's own share_model_across_processes puts the model in one of the SDK processes.)
    Every process that asks with the same ``tag`` gets the same engine, and each process keeps
    one ``SharedEngineClient`` per tag, which replaces a dead or hung engine for all its DoFns;
    its threads that ask at once share one attempt to reach it (``SharedEngineClient.connect``).

    With several GPUs (``model.gpus_per_worker``) there is one engine per GPU, tagged
    ``{tag}-gpu{index}``, and this process is given the one with the fewest processes
    (``transforms.engines.devices.DeviceSlots``) for as long as it lives."""
    with _CLIENTS_LOCK:
        if tag not in _CLIENTS:
            _CLIENTS[tag] = _new_client(settings, factory, tag)
        client = _CLIENTS[tag]
    client.connect()
    return client


def _new_client(settings: ModelSettings, factory: Optional[EngineFactory],
                tag: str) -> SharedEngineClient:
    try:
        devices = engine_devices(settings)
    except ValueError as exc:
        _LOG.error("%s", exc)
        raise EngineFailedError(str(exc)) from exc
    if len(devices) == 1:
        return SharedEngineClient(settings, factory, tag, devices[0], connect=False)
    slots = DeviceSlots(_engine_folder(), tag, alive=_exists)
    index = slots.assign(_process_identity(os.getpid()), len(devices))
    _LOG.info("this SDK process uses the shared embedding engine on GPU %s (%d of %d; "
              "processes per engine: %s)", devices[index], index + 1, len(devices),
              slots.counts(len(devices)))
    return SharedEngineClient(settings, factory, f"{tag}-gpu{index}", devices[index],
                              connect=False)

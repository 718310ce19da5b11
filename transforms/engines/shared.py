"""One engine per machine, in a process of its own (``model.share_across_processes``), and the
client each SDK process reaches it with.

Beam's ``multi_process_shared`` spawns the engine's process (``_SharedEngine`` makes its handle
there, ``_ServedEngine`` serves it) and hands every SDK process a proxy. ``shared_engine`` gives
each SDK process one ``SharedEngineClient`` per step, which:
- reaches or spawns the engine within ``model.load_timeout_s`` (a load that hangs is ended, and
  is an ``EngineFailedError``, as is a wait that long for another process to start it); the
  threads of a process share one attempt, and a failed one is remembered for a few seconds;
- bounds every call: the engine writes which call it is in and a heartbeat every second
  (``_EngineState``); an engine in one call for over ``model.call_timeout_s``, or silent (no
  heartbeat) for as long, or stopped (SIGSTOP, a debugger), is ended and replaced; and a call
  that gets no answer from an engine that is alive and serving others fails after its turn
  could have come (``EngineFailedError``), so no call waits without bound;
- replaces the engine when its process is gone. A call whose engine ended while in another
  process's call (or with the SDK process that spawned it, or killed by something newsvec did not
  send: the out-of-memory killer, an operator) is retried on the next engine; one whose engine
  ended in the call itself (a crash, a hang) is checked with the new engine's canary: a canary
  that fails is an ``EngineFailedError``, one that passes makes the call an input failure
  (``EngineEndedInCall``), which the handler bisects like any other, so an input that kills the
  engine takes only itself;
- never lets two engines run for one tag (one GPU): each engine is a generation of the tag, with
  its own Beam tag and address file (``_EngineRecord``), so an exit hook of Beam's that deletes an
  address file (it does not check whose it is) can only delete its own generation's. The engine
  runs in a process group of its own, and ending it ends the group: what it started (vLLM's
  engine core, with ``VLLM_ENABLE_V1_MULTIPROCESSING`` on) goes with it, and a new generation
  starts only once nothing of the last one runs.

A worker with several GPUs runs one such engine per GPU (``model.gpus_per_worker``), each pinned
to its device, and each SDK process is given one of them (``transforms.engines.devices``).

Only the job's user reaches the engine: it serves on a Unix socket (``_serve_privately``, in
place of Beam's server function, which binds a TCP port on 127.0.0.1), 0600, in one private
folder (``transforms.private_files.private_folder``: 0700, this user's, shared by every SDK process
of the machine), and takes connections only from processes of this user (``_OwnUsersServer``);
a client connects only to that socket, named by its generation's address file
(``_engine_socket``), never to a TCP address or a path elsewhere. Each engine authenticates with
a random key of its own as well (``_private_shared``; never Beam's constant ``b'mps'``). Every
file the engine and its clients meet at is in that folder, written 0600 and read only if no
other user could have written it: Beam's ``{tag}-g<n>.address``, ``.key`` and ``.lock``, the
socket (``<hash of {tag}-g<n>>.sock``), and newsvec's ``{tag}.engine``, ``{tag}.lock``,
``{tag}.busy``, ``{tag}.loading``, ``{tag}-g<n>.ended`` and ``{tag}-g<n>.exit``.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.managers
import os
import queue
import re
import signal
import socket
import stat
import struct
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import numpy as np

from transforms.engines.base import (
    EngineFactory,
    EngineFailedError,
    EngineHandle,
    all_finite,
)
from transforms.engines.devices import DeviceSlots, engine_devices
from transforms.engines.registry import process_engine
from transforms.private_files import (
    UnsafeFolderError,
    check_private_folder,
    ensure_private_file,
    is_private,
    private_folder,
    read_private,
    refusal,
    write_private,
)
from transforms.settings import ModelSettings

_LOG = logging.getLogger(__name__)

# The engine rewrites its state this often (its heartbeat), whether in a call or idle.
_HEARTBEAT_S = 1.0
# The record, lock and address files are touched this often, so that a cleaner of old temp
# files does not take them from a long-running engine.
_TOUCH_S = 60.0
# A stopped (or traced) engine whose heartbeat is this old is not answering: a debugger that
# only looks (py-spy dump) stops it for less.
_STOPPED_FOR_S = 3.0
# A call's ceiling is its turn (the calls queued before it, each at most call_timeout_s) and its
# own call_timeout_s, plus this.
_CEILING_SLACK_S = 10.0
# How long a client waits for the spawner's record of how an engine ended.
_EXIT_RECORD_WAIT_S = 2.0
# A failed attempt to reach the engine is remembered this long: the process's other threads, and
# its calls meanwhile, fail with it at once instead of each making an attempt of its own.
_REMEMBER_FAILURE_S = 5.0


@dataclasses.dataclass(frozen=True)
class _EngineState:
    """What the shared engine's process says of itself in its busy file (``_BusyFile``), written
    whole at the start and end of every call and every ``_HEARTBEAT_S`` between: which process
    it is, its generation, its heartbeat, the calls queued in it (waiting for their turn, and the
    one in progress), the call it is in and since when, and whether it is shutting down. Times
    are Linux's monotonic clock, the machine's, the same in every process. After the engine's
    process has ended, the file still says what it was doing."""

    process: tuple[int, int]
    generation: int
    heartbeat: float
    queued: int = 0
    call: Optional[str] = None
    since: float = 0.0
    ending: bool = False


class _BusyFile:
    """``{tag}.busy``: the shared engine's ``_EngineState``, as JSON, written by a rename."""

    def __init__(self, path: str):
        self.path = path

    def write(self, state: _EngineState) -> None:
        """Raises ``EngineFailedError``: an engine whose calls cannot be timed must not take any
        (a call that hung in it would hang its caller for ever). One writer at a time."""
        try:
            _write_json(self.path, dataclasses.asdict(state))
        except OSError as exc:
            raise EngineFailedError(
                f"the shared engine cannot write its busy file {self.path} "
                f"({type(exc).__name__}: {exc}), so its calls could not be timed") from exc

    def read(self, process: Optional[tuple[int, int]] = None) -> Optional[_EngineState]:
        """The state, if the file is there, readable, and (given ``process``) that engine's."""
        try:
            raw = _read_json(self.path)
            state = _EngineState(**{**raw, "process": _pair(raw["process"])})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if process is not None and state.process != tuple(process):
            return None
        return state


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


@dataclasses.dataclass(frozen=True)
class _Generation:
    """One engine of a tag: its number, the SDK process that may spawn it (the one that started
    the generation) and, once reached, the engine's process. Processes are (pid, start time)."""

    number: int
    spawner: tuple[int, int]
    engine: Optional[tuple[int, int]] = None

    def beam_tag(self, tag: str) -> str:
        return f"{tag}-g{self.number}"


@dataclasses.dataclass(frozen=True)
class _Ended:
    """``{tag}-g<n>.ended``: an engine a client of newsvec ended, why, and the call it blamed
    (the one it hung in), if any; written before the kill is sent."""

    engine: tuple[int, int]
    why: str
    blame: Optional[str] = None


class _EngineRecord:
    """``{folder}/{tag}.engine``: the tag's current generation (``_Generation``), as JSON, read
    and changed under ``{tag}.lock`` (written whole, by a rename). Each generation is its own tag
    for Beam (``{tag}-g<n>``: its own address and lock files), so the exit hooks Beam registers
    (the spawning SDK process's, and the engine's, each of which deletes the address file of
    its tag whoever's it is) only ever delete the address of an engine of their own generation,
    which is gone by then or ending with them. A new generation is started only when the current
    one's engine is gone (its process ended, or its address file gone: an engine still running
    then is ended first), so one engine runs per tag.

    Beside it, per generation: ``.ended`` (a kill a client sent, and why: ``_Ended``) and
    ``.exit`` (how its process ended, as the SDK process that spawned it saw it)."""

    def __init__(self, folder: str, tag: str):
        self.folder, self.tag = folder, tag
        self.path = os.path.join(folder, f"{tag}.engine")
        self.lock_path = os.path.join(folder, f"{tag}.lock")
        self._loading_path = os.path.join(folder, f"{tag}.loading")
        self._files = re.compile(re.escape(tag) + r"-g(\d+)\.(address|lock|key|ended|exit)")

    def address_file(self, generation: _Generation) -> str:
        return os.path.join(self.folder, generation.beam_tag(self.tag)) + ".address"

    def _generation_file(self, number: int, kind: str) -> str:
        return os.path.join(self.folder, f"{self.tag}-g{number}.{kind}")

    def read(self) -> Optional[_Generation]:
        try:
            raw = _read_json(self.path)
            return _Generation(int(raw["number"]), _pair(raw["spawner"]),
                               None if raw.get("engine") is None else _pair(raw["engine"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, generation: _Generation) -> None:
        _write_json(self.path, dataclasses.asdict(generation))

    def mark_loading(self, number: int) -> None:
        """In an engine's process, as its load begins: ``{tag}.loading`` names it, so that if its
        spawner ends before recording it, the process that starts the next generation can end
        it (else two engines could load on one device)."""
        pid, started = _process_identity(os.getpid())
        try:
            write_private(self._loading_path, f"{number} {pid} {started}".encode())
        except OSError:
            _LOG.exception("could not record the loading shared engine")

    def loading(self, number: Optional[int] = None) -> Optional[tuple[int, tuple[int, int]]]:
        """(generation, process) of the engine that began to load last, if recorded (and of
        generation ``number``, if given)."""
        data = read_private(self._loading_path)
        try:
            recorded, pid, started = (int(x) for x in (data or b"").split())
        except ValueError:
            return None
        if number is not None and recorded != number:
            return None
        return recorded, (pid, started)

    def numbers_on_disk(self) -> list[int]:
        """The generations some file of this folder names (an address, an end, an exit)."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        return [int(m.group(1)) for m in map(self._files.fullmatch, names) if m is not None]

    def forget_before(self, number: int) -> None:
        """Delete the ``.ended``, ``.exit`` and ``.key`` files of generations before
        ``number``."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        for match in map(self._files.fullmatch, names):
            if (match is not None and match.group(2) in ("ended", "exit", "key")
                    and int(match.group(1)) < number):
                try:
                    os.unlink(os.path.join(self.folder, match.group(0)))
                except OSError:
                    pass

    def mark_ended(self, number: int, ended: _Ended) -> None:
        try:
            _write_json(self._generation_file(number, "ended"), dataclasses.asdict(ended))
        except OSError:
            _LOG.exception("could not record why the shared engine was ended")

    def ended(self, number: int, engine: tuple[int, int]) -> Optional[_Ended]:
        try:
            raw = _read_json(self._generation_file(number, "ended"))
            ended = _Ended(_pair(raw["engine"]), str(raw["why"]), raw.get("blame"))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return ended if ended.engine == tuple(engine) else None

    def mark_exit(self, number: int, engine: tuple[int, int], status: int) -> None:
        try:
            _write_json(self._generation_file(number, "exit"),
                        {"engine": list(engine), "status": status})
        except OSError:
            _LOG.exception("could not record how the shared engine ended")

    def exit_status(self, number: int, engine: tuple[int, int], wait_s: float) -> Optional[int]:
        """How the engine ended (``Process.exitcode``: minus the signal that ended it), as the
        SDK process that spawned it recorded it, waiting up to ``wait_s`` for the record."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                raw = _read_json(self._generation_file(number, "exit"))
                if _pair(raw["engine"]) == tuple(engine):
                    return int(raw["status"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def _write_json(path: str, value: Any) -> None:
    """Written whole, 0600, through a temp file of a random name (``write_private``)."""
    write_private(path, json.dumps(value).encode())


def _read_json(path: str) -> Any:
    """The JSON in ``path``, if it is this user's private file (``read_private``); raises
    ``OSError`` if it is not (or is not there), ``ValueError`` if it is not JSON."""
    data = read_private(path)
    if data is None:
        raise FileNotFoundError(path)
    return json.loads(data)


def _engine_folder() -> str:
    """The machine's private folder for the engine's files (``private_folder``), or
    ``EngineFailedError`` where it is not safe (another user's, a symlink, open to others)."""
    try:
        return private_folder()
    except (UnsafeFolderError, OSError) as exc:
        _LOG.error("%s", exc)
        raise EngineFailedError(f"the shared embedding engine cannot be reached safely: "
                                f"{exc}"[:2000]) from exc


def _key_file(address_file: str) -> str:
    """The engine's authentication key, beside its address: ``{tag}-g<n>.key``."""
    return address_file[:-len(".address")] + ".key"


# AF_UNIX's limit on a socket's path: sun_path holds 108 bytes, with the NUL that ends it.
_SOCKET_PATH_MAX = 107


def _socket_file(address_file: str) -> str:
    """The engine's Unix socket, beside its address file in the private folder:
    ``<10 hex digits of the SHA-256 of its Beam tag>.sock`` (a tag can be long, and AF_UNIX takes
    ``_SOCKET_PATH_MAX`` bytes of path). ``EngineFailedError`` where the folder's path leaves no
    room for it."""
    folder, name = os.path.split(address_file)
    digest = hashlib.sha256(name[:-len(".address")].encode()).hexdigest()[:10]
    path = os.path.join(folder, f"{digest}.sock")
    if len(os.fsencode(path)) > _SOCKET_PATH_MAX:
        raise EngineFailedError(
            f"the shared engine's socket {path} would be {len(os.fsencode(path))} bytes long, over "
            f"the {_SOCKET_PATH_MAX} a Unix socket's path may have: point TMPDIR (where the "
            "private folder is made) at a folder with a shorter path")
    return path


def _engine_socket(address_file: str) -> str:
    """The socket to reach the engine at: the one its address file names, if that is the name
    its generation's engine binds (``_socket_file``, in the same private folder), and a socket of
    this user's that no one else may use. Anything else (a TCP address, a path elsewhere, another
    name, a file that is not a socket) is refused, never connected to: ``ConnectionRefusedError``.
    (A server another user runs would have the client unpickle its answers, and with a TCP port,
    freed when an engine ends, it could pass the key's challenge by relaying two clients'.)"""
    expected = _socket_file(address_file)
    address = read_private(address_file)
    if address is None:
        raise ConnectionRefusedError(f"the engine's address file {address_file} is missing, or "
                                     "not this user's private file: not connected to")
    if address != os.path.basename(expected).encode():
        raise ConnectionRefusedError(
            f"the engine's address file {address_file} names {address[:200]!r}, not its socket "
            f"{os.path.basename(expected)} in the private folder: not connected to")
    check_private_folder(os.path.dirname(expected))
    try:
        info = os.lstat(expected)
    except OSError as exc:
        raise ConnectionRefusedError(f"the engine's socket {expected}: {exc}") from exc
    why = refusal(info, stat.S_ISSOCK, "a socket")
    if why is not None:
        raise ConnectionRefusedError(f"the engine's socket {expected} {why}: not connected to")
    return expected


def _peer_is_this_user(connection: multiprocessing.connection.Connection) -> bool:
    """Whether the process at the other end of an accepted Unix socket runs as this user
    (``SO_PEERCRED``: its credentials when it connected)."""
    try:
        with socket.socket(fileno=os.dup(connection.fileno())) as peer:
            credentials = peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                          struct.calcsize("3i"))
    except OSError:
        return False
    _, uid, _ = struct.unpack("3i", credentials)
    return uid == os.geteuid()


class _OwnUsersServer(multiprocessing.managers.Server):
    """multiprocessing's manager server, on the engine's Unix socket, that hands a connection to
    a thread of its own (as multiprocessing's does: the key's challenge is met there, not in the
    accept loop) only if its peer runs as this user (the 0700 folder already keeps others from
    the socket), and that waits a little when accepting fails (out of descriptors: its loop
    would spin) instead of trying again at once."""

    def accepter(self) -> None:
        listener = self.listener  # type: ignore[attr-defined]
        while True:
            try:
                connection = listener.accept()
            except OSError:
                time.sleep(0.05)
                continue
            if not _peer_is_this_user(connection):
                _LOG.warning("the shared engine refused a connection from another user")
                connection.close()
                continue
            threading.Thread(target=self.handle_request, args=(connection,), daemon=True,
                             name="newsvec-engine-connection").start()


def _serve_privately(address_file: str, tag: str, constructor: Callable, authkey: bytes,
                     life_line: Any) -> None:
    """The engine's process (spawned): what Beam's ``_run_server_process`` does (load the
    engine as the singleton of ``tag``, end when the spawner's life line breaks, an error file
    if it fails, its files removed as it ends), but serving on a Unix socket in the private
    folder (``_socket_file``; 0600, with the engine's own key as well), whose name it writes to
    its address file once it listens; umask 077, so that whatever else it writes there is
    0600 too."""
    from apache_beam.utils import multi_process_shared as mps

    os.umask(0o077)
    error_file = address_file + ".error"
    socket_file = ""

    def remove_files() -> None:
        for path in (address_file, error_file, socket_file):
            try:
                if path:
                    os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                _LOG.warning("could not remove the shared engine's file %s: %s", path, exc)

    def hard_delete() -> None:
        remove_files()
        os._exit(0)  # pylint: disable=protected-access

    def watch_life_line() -> None:
        while True:
            try:
                life_line.recv_bytes()
            except (EOFError, OSError):
                _LOG.warning("the shared engine's spawner (process %d) has ended: so does the "
                             "engine (process %d)", os.getppid(), os.getpid())
                hard_delete()
            time.sleep(0.5)

    atexit.register(remove_files)
    try:
        logging.getLogger().setLevel(logging.INFO)
        multiprocessing.current_process().authkey = authkey
        socket_file = _socket_file(address_file)
        singletons = mps._process_level_singleton_manager  # pylint: disable=protected-access
        singletons.set_hard_delete_callback(hard_delete)
        singletons.register_singleton(constructor, tag, initialize_eagerly=True,
                                      hard_delete_callback=hard_delete)
        # Watched once loaded, as Beam does.
        threading.Thread(target=watch_life_line, daemon=True,
                         name="newsvec-engine-life-line").start()
        try:
            os.unlink(socket_file)  # left by an engine of this tag that was killed
        except FileNotFoundError:
            pass
        # What BaseManager.get_server makes, but of the class above.
        registrar: Any = mps._SingletonRegistrar  # pylint: disable=protected-access
        server = _OwnUsersServer(registrar._registry, socket_file, authkey, "pickle")
        os.chmod(socket_file, 0o600)
        _LOG.info("process %d: the shared engine %s serves at %s", os.getpid(), tag, socket_file)
        write_private(address_file, os.path.basename(socket_file).encode())
        server.serve_forever()
    except Exception:  # pylint: disable=broad-except  # told to the spawner through the file
        trace = traceback.format_exc()
        try:
            write_private(error_file, trace.encode())
        except Exception:  # pylint: disable=broad-except
            _LOG.error("the shared engine failed, and its error file cannot be written:\n%s",
                       trace)
        os._exit(1)  # pylint: disable=protected-access


_PRIVATE_SHARED: Any = None


def _private_shared(constructor: Callable, tag: str, folder: str) -> Any:
    """Beam's ``MultiProcessShared`` (``spawn_process=True``, ``always_proxy=True``) on a Unix
    socket in the private folder, with a key of the engine's own: Beam 2.77 serves on TCP
    (``localhost``, a free port) and authenticates with the module's constant
    ``AUTH_KEY = b'mps'``, which it also makes the whole SDK process's
    ``current_process().authkey``. This subclass replaces the two methods that spawn and reach
    the server: the spawner makes a random key (``secrets.token_bytes(32)``) per engine, writes
    it 0600 to ``{tag}.key`` in the private folder and hands it to the engine's process in the
    spawn's arguments (a pipe), which runs newsvec's server function (``_serve_privately``); a
    client reads the key from that file and connects with it only to the socket the address file
    names (``_engine_socket``), reading both only from files of this user's that no one else may
    write. Neither touches ``AUTH_KEY`` or the SDK process's ``current_process().authkey``."""
    global _PRIVATE_SHARED  # pylint: disable=global-statement  # made once, on first use
    if _PRIVATE_SHARED is None:
        _PRIVATE_SHARED = _make_private_shared()
    return _PRIVATE_SHARED(constructor, tag, path=folder, always_proxy=True, spawn_process=True)


def _make_private_shared() -> Any:
    import secrets

    from apache_beam.utils import multi_process_shared as mps
    from apache_beam.utils import retry

    class PrivateShared(mps.MultiProcessShared):
        """See ``_private_shared``."""

        def _get_manager(self) -> Any:
            address_file = os.path.join(self._path, self._tag) + ".address"
            while self._manager is None:
                with mps._process_local_lock:  # pylint: disable=protected-access
                    ensure_private_file(os.path.join(self._path, self._tag) + ".lock")
                    with self._cross_process_lock:
                        if not os.path.lexists(address_file):
                            self._create_server(address_file)
                        self._manager = self._connect(address_file)
            return self._manager

        def _connect(self, address_file: str) -> Any:
            key = read_private(_key_file(address_file))
            if key is None:
                raise ConnectionRefusedError(
                    f"the engine's key for {address_file} is missing, or not this user's private "
                    "file: not connected to")
            manager = mps._SingletonRegistrar(  # pylint: disable=protected-access
                address=_engine_socket(address_file), authkey=key)

            @retry.with_exponential_backoff(
                num_retries=5, initial_delay_secs=0.1,
                retry_filter=lambda exn: isinstance(exn, (ConnectionError, EOFError)))
            def connect() -> None:
                manager.connect()

            try:
                connect()
            except (ConnectionError, EOFError):
                os.unlink(address_file)  # the server is gone: as Beam does
                return None
            except multiprocessing.AuthenticationError as exc:
                raise ConnectionRefusedError(
                    f"the server at {address_file} did not take the engine's key: {exc}") from exc
            return manager

        def _create_server(self, address_file: str) -> None:
            error_file = address_file + ".error"
            try:
                os.remove(error_file)
            except OSError:
                pass
            socket_file = _socket_file(address_file)  # too long a path: fails here
            key = secrets.token_bytes(32)
            write_private(_key_file(address_file), key)
            reader, writer = multiprocessing.Pipe(duplex=False)
            self._life_line = writer
            p = multiprocessing.get_context("spawn").Process(
                target=_serve_privately,
                args=(address_file, self._tag, self._constructor, key, reader), daemon=False)
            p.start()

            def cleanup_process() -> None:  # as Beam's: an engine ends with its spawner
                writer.close()
                if p.is_alive():
                    p.terminate()
                    p.join()
                for path in (address_file, error_file, socket_file):
                    try:
                        os.remove(path)
                    except OSError:
                        pass

            atexit.register(cleanup_process)
            while not os.path.exists(address_file):
                if os.path.exists(error_file):
                    error = read_private(error_file)
                    try:
                        os.remove(error_file)
                    except OSError:
                        pass
                    if p.is_alive():
                        p.terminate()
                    raise RuntimeError("Shared Server Process crashed:\n" + (
                        error.decode(errors="replace") if error is not None
                        else "(its error file was refused)"))
                if not p.is_alive():
                    raise RuntimeError(
                        f"Shared Server Process died unexpectedly with exit code {p.exitcode}")
                time.sleep(0.05)

    return PrivateShared


def _pair(value: Any) -> tuple[int, int]:
    first, second = value
    return int(first), int(second)


def _stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2:].split()
    except (OSError, ValueError):
        return None


def _process_identity(pid: int) -> tuple[int, int]:
    """(pid, start time in clock ticks since boot): a pid alone may name another process once
    this one is gone. The start time is 0 where /proc is missing."""
    fields = _stat(pid)
    try:
        return pid, int(fields[19]) if fields is not None else 0
    except (ValueError, IndexError):
        return pid, 0


def _process_state(process: tuple[int, int]) -> str:
    """"gone" (exited, or its pid reused), "zombie" (exited, not reaped yet), "stopped" (SIGSTOP,
    a frozen job control, a tracer) or "alive"."""
    pid, started = process
    fields = _stat(pid)
    if fields is None:
        if not os.path.isdir("/proc/self"):  # no /proc: ask the kernel
            try:
                os.kill(pid, 0)
                return "alive"
            except OSError:
                return "gone"
        return "gone"
    if started and int(fields[19]) != started:
        return "gone"
    if fields[0] in ("Z", "X"):
        return "zombie"
    return "stopped" if fields[0] in ("T", "t") else "alive"


def _exists(process: tuple[int, int]) -> bool:
    """Whether the process has not exited (it may be stopped)."""
    return _process_state(process) in ("alive", "stopped")


def _group_members(leader: tuple[int, int]) -> list[tuple[int, int]]:
    """The processes, other than ``leader``, of the process group ``leader`` made (the shared
    engine makes its own as it starts: ``_own_process_group``), started no earlier than it: what
    it started, which may outlive it (vLLM's engine core). [] where /proc is missing."""
    pid, started = leader
    if _process_state(leader) == "gone" and _stat(pid) is not None:
        return []  # its pid is another process's: its group cannot have members left
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    members = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == pid:
            continue
        fields = _stat(int(entry))
        try:
            if (fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) == pid
                    and int(fields[19]) >= started):
                members.append((int(entry), int(fields[19])))
        except (ValueError, IndexError):
            continue
    return members


def _end_process(process: tuple[int, int], wait_s: float = 10.0) -> bool:
    """SIGKILL the process, if it is still the one named, and every process left of its group
    (``_group_members``), whether it is still there or not; wait up to ``wait_s`` for all of
    them to exit (the GPU memory they held is freed as they do). Whether none is left."""
    pid = process[0]
    members = _group_members(process)
    if _exists(process):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if members:
        try:
            os.killpg(pid, signal.SIGKILL)  # the group is theirs: its id cannot be reused meanwhile
        except OSError:
            pass
    deadline = time.monotonic() + wait_s
    while _exists(process) or _group_members(process):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


_CGROUP_ROOT = "/sys/fs/cgroup"


def _oom_kill_file(pid: int) -> Optional[str]:
    """The file that counts the out-of-memory kills of the process's memory cgroup: cgroup v2's
    ``memory.events``, else v1's ``memory.oom_control`` (each with an ``oom_kill`` line), under
    the cgroup's path or, where the container sees its own cgroup as the root, at the root. None
    where neither is there (no cgroup memory controller, another OS)."""
    paths = {"v2": "/", "v1": "/"}
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    paths["v2"] = path
                elif "memory" in controllers.split(","):
                    paths["v1"] = path
    except (OSError, ValueError):
        pass
    candidates = (
        os.path.join(_CGROUP_ROOT, paths["v2"].lstrip("/"), "memory.events"),
        os.path.join(_CGROUP_ROOT, "memory.events"),
        os.path.join(_CGROUP_ROOT, "memory", paths["v1"].lstrip("/"), "memory.oom_control"),
        os.path.join(_CGROUP_ROOT, "memory", "memory.oom_control"))
    return next((c for c in candidates if os.path.isfile(c)), None)


def _oom_kills(path: Optional[str]) -> Optional[int]:
    if path is None:
        return None
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _describe_exit(status: int) -> str:
    if status < 0:
        try:
            return f"ended by {signal.Signals(-status).name}"
        except ValueError:
            return f"ended by signal {-status}"
    return f"exited with status {status}"


def _release_spawned(child: Any, shared: Any) -> None:
    """What Beam keeps of an engine this process spawned, once its process has exited: the life
    line (both ends) and the process's pipes, which Beam's exit hook (registered for each engine
    spawned, for the life of the SDK process) would otherwise hold open for ever."""
    life_line = getattr(shared, "_life_line", None)
    for connection in (life_line, *getattr(child, "_args", ())):
        if isinstance(connection, multiprocessing.connection.Connection):
            connection.close()
    popen = getattr(child, "_popen", None)
    if popen is not None and hasattr(popen, "close"):
        popen.close()  # its exit code is kept: Beam's hook can still ask whether it is alive


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


def _processes_in(error: Optional[BaseException]) -> list[Any]:
    """The processes Beam's spawn had in hand where ``error`` was raised: an engine whose load
    failed has exited (and been reaped) before the caller can list this process's children, and
    Beam keeps no other handle on it but its exit hook."""
    found = []
    traceback = error.__traceback__ if error is not None else None
    while traceback is not None:
        found += [v for v in traceback.tb_frame.f_locals.values()
                  if isinstance(v, multiprocessing.process.BaseProcess)]
        traceback = traceback.tb_next
    return found


def _forget_connections(proxy: Any) -> None:
    """Drop the connections this process's threads kept to an engine that is gone (the
    multiprocessing proxies keep one per thread and address, for the life of the process)."""
    from multiprocessing.managers import BaseProxy

    try:
        address = proxy.get_auto_proxy_object()._token.address
    except AttributeError:
        return
    cached = BaseProxy._address_to_local.pop(address, None)
    if cached is not None:
        connection = getattr(cached[0], "connection", None)  # this thread's
        if connection is not None:
            connection.close()


# A call whose engine ended in other processes' calls (or with its spawner) is retried on the
# next engine this many times in a row, then fails as an EngineFailedError. Other processes'
# poison inputs end it a few times each while they bisect them (about log2 of their call's inputs).
_RETRIES_FOR_OTHERS = 16
# A call whose engine was killed in it by something newsvec did not send (the out-of-memory
# killer) is retried this many times, then fails as an EngineFailedError: its inputs are not
# blamed (an engine short of memory is the machine's problem, not an article's).
_RETRIES_AFTER_KILLS = 3
_CONNECT_ATTEMPTS = 3
_CALL_IDS = itertools.count(1)
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


class _NoAnswer(Exception):
    """A call got no answer by its ceiling although the engine is alive, answers (its heartbeat
    goes on) and is not in this call: the call or its answer was lost, or never got its turn."""


class _Unreachable(Exception):
    """The engine named for a generation could not be reached (it ended meanwhile), or Beam spawned
    one for a generation that may not have one (``_SUPERSEDED``): try again with the next."""


class EngineEndedInCall(RuntimeError):
    """The shared engine's process ended (or hung and was ended) during this call, and a new engine
    passes its canary: the call's inputs are suspected, as with any failed call whose canary
    passes, and the handler bisects them (``transforms.embed``)."""


@dataclasses.dataclass
class _Attempt:
    """An attempt to reach the engine, which every thread of the process that needs it joins."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: Optional[EngineFailedError] = None
    ended: float = 0.0


class SharedEngineClient:
    """What an SDK process holds as its model with ``model.share_across_processes``: the proxy to
    the machine's one engine, replaced when that engine's process is gone or hung.

    - Reaching the engine (waiting for another process that is starting it, spawning and loading
      it, connecting to it) takes at most ``model.load_timeout_s`` each time: an engine that is
      not ready by then is ended (SIGKILL), and the attempt is an ``EngineFailedError``. The
      process's threads share one attempt; one that failed is remembered for
      ``_REMEMBER_FAILURE_S``, and a thread that asks meanwhile fails with it at once.
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
        self._settings, self._factory, self._tag = settings, factory, tag
        self.device = device  # CUDA_VISIBLE_DEVICES of the engine's process; None: as inherited
        # Beam's address, key and lock files, the busy file and the engine record: the same
        # private folder in every SDK process of the machine (they share /tmp, the environment
        # and the user), which no other user may enter (``transforms.private_files``).
        self._folder = _engine_folder()
        self._busy = _BusyFile(os.path.join(self._folder, f"{tag}.busy"))
        self._record = _EngineRecord(self._folder, tag)
        self._timeout_s = settings.resolved_call_timeout_s()
        self._load_timeout_s = settings.load_timeout_s
        self._poll_s = min(1.0, max(0.05, self._timeout_s / 10))
        self._lock = threading.Lock()
        self._local = threading.local()
        self._attempt: Optional[_Attempt] = None
        self._proxy: Any = None
        self._process = (0, 0)
        self._spawner = (0, 0)
        self._generation = 0  # of the engine reached (_Generation.number)
        self._connection = 0  # counts the engines this client has reached
        self._oom_file: Optional[str] = None  # counts the OOM kills of the engine's cgroup
        self._label = ""
        self._known_good: Optional[tuple[int, ...]] = None  # an input the engine embedded
        if connect:
            self.connect()

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
        sent = time.monotonic()
        future = pool.submit(_call_in_thread, method, args)
        heard = sent  # the engine's last heartbeat, or when the call was sent
        ceiling: Optional[float] = None
        ahead = 0  # the most calls queued in the engine it has been heard of with

        def abandon() -> None:  # the thread stays blocked until the engine's process ends
            self._local.pool = None
            pool.shutdown()

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
            status = _process_state(process)
            if status not in ("alive", "stopped"):
                abandon()
                raise self._gone(process, "its process is gone")
            now = time.monotonic()
            state = self._busy.read(process)
            if state is not None:
                heard = max(heard, state.heartbeat)
                # The calls queued (this one among them, and those behind it) as the engine last
                # wrote them: a state written before this call arrived counts fewer, so the
                # ceiling grows to the most seen (each later state is at most a heartbeat old).
                if state.queued > ahead or ceiling is None:
                    ahead = max(ahead, state.queued)
                    ceiling = sent + (ahead + 1) * self._timeout_s + _CEILING_SLACK_S
                if state.call is not None and now - state.since > self._timeout_s:
                    abandon()
                    raise _EngineGone(
                        f"one call has run for {now - state.since:.0f} s, over "
                        f"model.call_timeout_s ({self._timeout_s:g} s)", state.call,
                        blame=state.call, end=True)
            in_call = state.call if state is not None else None
            if status == "stopped" and now - heard > _STOPPED_FOR_S:
                abandon()
                raise _EngineGone(f"its process is stopped (SIGSTOP or a tracer), silent for "
                                  f"{now - heard:.0f} s", in_call, end=True)
            if now - heard > self._timeout_s:
                abandon()
                raise _EngineGone(f"it has been silent (no heartbeat) for {now - heard:.0f} s, "
                                  f"over model.call_timeout_s ({self._timeout_s:g} s)", in_call,
                                  blame=in_call, end=True)
            if ceiling is not None and now > ceiling and (call_id is None or in_call != call_id):
                abandon()
                raise _NoAnswer(
                    f"no answer after {now - sent:.0f} s, though the engine is alive, answers "
                    f"and is not in this call: past the ceiling of a call that found up to {ahead} "
                    f"queued, each given model.call_timeout_s ({self._timeout_s:g} s), and "
                    f"{_CEILING_SLACK_S:g} s more")

    def _gone(self, process: tuple[int, int], why: str) -> _EngineGone:
        state = self._busy.read(process)
        return _EngineGone(why, state.call if state is not None else None,
                           ending=state is not None and state.ending)

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

"""What the shared engine and its clients tell each other through files in the private folder:
the engine's state and heartbeat (``{tag}.busy``: ``_EngineState``, ``_BusyFile``), and the tag's
engine record (``{tag}.engine``: its current generation, ``_Generation``), with beside it the
loading engine (``{tag}.loading``), why a client ended an engine (``{tag}-g<n>.ended``:
``_Ended``) and how its process ended (``{tag}-g<n>.exit``). Each is written whole, 0600, and read
only if it is this user's private file (``transforms.private_files``)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from typing import Any, Optional

from transforms.engines.base import EngineFailedError
from transforms.engines.shared.processes import _process_identity
from transforms.private_files import read_private, write_private

_LOG = logging.getLogger(__name__)


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


def _pair(value: Any) -> tuple[int, int]:
    first, second = value
    return int(first), int(second)

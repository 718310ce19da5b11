"""The shared engine's private door: only the job's user reaches it.

The engine serves on a Unix socket (``_serve_privately``, in place of Beam's server function, which
binds a TCP port on 127.0.0.1), 0600, in one private folder (``_engine_folder``:
``transforms.private_files.private_folder``, 0700, this user's, shared by every SDK process of the
machine), and takes connections only from processes of this user (``_OwnUsersServer``); a client
connects only to that socket, named by its generation's address file (``_engine_socket``), never to
a TCP address or a path elsewhere. Each engine authenticates with a random key of its own as well
(``_private_shared``, Beam's ``MultiProcessShared`` spawning that server; never Beam's constant
``b'mps'``). Also here: what the proxies and Beam's spawn keep of an engine that is gone (its
connections, its pipes), released."""
from __future__ import annotations

import atexit
import hashlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.managers
import os
import socket
import stat
import struct
import threading
import time
import traceback
from typing import Any, Callable, Optional

from transforms.engines.base import EngineFailedError
from transforms.private_files import (
    UnsafeFolderError,
    check_private_folder,
    ensure_private_file,
    private_folder,
    read_private,
    refusal,
    write_private,
)

_LOG = logging.getLogger(__name__)


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


class _ServerFiles:
    """The files of the engine's process that go with it: its address file, its error file and its
    socket (once it is named)."""

    def __init__(self, address_file: str):
        self.address_file = address_file
        self.error_file = address_file + ".error"
        self.socket_file = ""

    def remove(self) -> None:
        for path in (self.address_file, self.error_file, self.socket_file):
            try:
                if path:
                    os.remove(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                _LOG.warning("could not remove the shared engine's file %s: %s", path, exc)

    def hard_delete(self) -> None:
        self.remove()
        os._exit(0)  # pylint: disable=protected-access


def _watch_life_line(life_line: Any, files: _ServerFiles) -> None:
    """In the engine's process: end it (``hard_delete``) when its spawner's life line breaks."""
    while True:
        try:
            life_line.recv_bytes()
        except (EOFError, OSError):
            _LOG.warning("the shared engine's spawner (process %d) has ended: so does the "
                         "engine (process %d)", os.getppid(), os.getpid())
            files.hard_delete()
        time.sleep(0.5)


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
    files = _ServerFiles(address_file)
    atexit.register(files.remove)
    try:
        logging.getLogger().setLevel(logging.INFO)
        multiprocessing.current_process().authkey = authkey
        files.socket_file = _socket_file(address_file)
        singletons = mps._process_level_singleton_manager  # pylint: disable=protected-access
        singletons.set_hard_delete_callback(files.hard_delete)
        singletons.register_singleton(constructor, tag, initialize_eagerly=True,
                                      hard_delete_callback=files.hard_delete)
        # Watched once loaded, as Beam does.
        threading.Thread(target=_watch_life_line, args=(life_line, files), daemon=True,
                         name="newsvec-engine-life-line").start()
        registrar: Any = mps._SingletonRegistrar  # pylint: disable=protected-access
        _serve_on_socket(files, tag, authkey, registrar._registry)
    except Exception:  # pylint: disable=broad-except  # told to the spawner through the file
        trace = traceback.format_exc()
        try:
            write_private(files.error_file, trace.encode())
        except Exception:  # pylint: disable=broad-except
            _LOG.error("the shared engine failed, and its error file cannot be written:\n%s",
                       trace)
        os._exit(1)  # pylint: disable=protected-access


def _serve_on_socket(files: _ServerFiles, tag: str, authkey: bytes, registry: Any) -> None:
    """Listen on the engine's socket, say so in its address file, and serve for ever."""
    try:
        os.unlink(files.socket_file)  # left by an engine of this tag that was killed
    except FileNotFoundError:
        pass
    # What BaseManager.get_server makes, but of ``_OwnUsersServer``.
    server = _OwnUsersServer(registry, files.socket_file, authkey, "pickle")
    os.chmod(files.socket_file, 0o600)
    _LOG.info("process %d: the shared engine %s serves at %s", os.getpid(), tag,
              files.socket_file)
    write_private(files.address_file, os.path.basename(files.socket_file).encode())
    server.serve_forever()


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
    """``_private_shared``'s class, made on first use (Beam is imported then)."""
    from apache_beam.utils import multi_process_shared as mps

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
            return _connect_privately(address_file)

        def _create_server(self, address_file: str) -> None:
            _spawn_server(self, address_file)

    return PrivateShared


def _connect_privately(address_file: str) -> Any:
    """A manager connected, with the engine's key, to the socket its address file names; None
    (the address file deleted, as Beam does) where the server is gone."""
    from apache_beam.utils import multi_process_shared as mps
    from apache_beam.utils import retry

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


def _spawn_server(shared: Any, address_file: str) -> None:
    """Spawn the engine's process (``_serve_privately``) with a new key of its own, written
    beside its address file, and wait for it to listen; as Beam's, it ends with this process
    (its life line, ``shared._life_line``, and an exit hook)."""
    import secrets

    error_file = address_file + ".error"
    try:
        os.remove(error_file)
    except OSError:
        pass
    socket_file = _socket_file(address_file)  # too long a path: fails here
    key = secrets.token_bytes(32)
    write_private(_key_file(address_file), key)
    reader, writer = multiprocessing.Pipe(duplex=False)
    shared._life_line = writer
    p = multiprocessing.get_context("spawn").Process(
        target=_serve_privately,
        args=(address_file, shared._tag, shared._constructor, key, reader), daemon=False)
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
    _await_server(p, address_file, error_file)


def _await_server(p: Any, address_file: str, error_file: str) -> None:
    """Wait until the spawned engine ``p`` writes its address file; ``RuntimeError``, as Beam's,
    if it writes its error file instead, or exits."""
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


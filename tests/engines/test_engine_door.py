"""Who can reach the shared engine (model.share_across_processes): only the SDK processes of its
job's user.

The engine serves pickle over ``multiprocessing.managers``: whoever can authenticate to it can run
code in it, and whoever can make an SDK process connect to a server of theirs can run code in the
SDK process. So the engine serves on a Unix socket (0600) in a private folder (0700, this
user's), never on a TCP port (which another user may bind once the engine ends, or flood), and a
client connects to nothing else; the engine authenticates with a random key of its own as well
(never Beam's constant ``b'mps'``), read from a file no one else can read; and every rendezvous
and state file is kept in the private folder and is read only if it is a regular file of this
user's that no one else may write (``transforms.private_files``).

These tests run as root on the CI machine, where no second user exists: "another user" is
simulated by files and folders chowned to uid 65534 (nobody), or left writable by others (mode
0o666, 0o755), which the code must refuse as if another user had written them, or by a child
process that drops to uid 65534. Each planted file
is put both where the code before this change looked (the machine's temp folder) and in the
private folder, so the test shows the planted file is never acted on, wherever it is."""
from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable

import pytest

from tests.common import make_config
from tests.fakes import FakeEngine
from transforms.engines.base import EngineFailedError
from transforms.engines.devices import DeviceSlots
from transforms.engines.shared.client import SharedEngineClient
from transforms.engines.shared.processes import _end_process, _process_identity
from transforms.private_files import write_private

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="simulates another user by chown")


@pytest.fixture
def temp(monkeypatch):
    """A temp folder of the test's own (the machine's, as the SDK processes see it), with a short
    path: the engine's Unix socket is in it, and AF_UNIX takes 107 bytes of path (pytest's
    ``tmp_path`` here is about 100 before the private folder's name)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="door-"))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _private(temp) -> str:
    """The private folder the client uses, made as it makes it (0700, this user's)."""
    folder = os.path.join(str(temp), f"newsvec-engine-{os.geteuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder


def _plant(temp, name: str, content: str, how: str) -> None:
    """``name`` with ``content`` in the temp folder and in the private folder, there as another
    user would have left it: owned by uid 65534 (``how="owner"``) or writable by all
    (``"mode"``)."""
    for folder in (str(temp), _private(temp)):
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write(content)
        os.chmod(path, 0o600 if how == "owner" else 0o666)
        if how == "owner":
            os.chown(path, NOBODY, NOBODY)


def _counting_connections(listener: socket.socket) -> tuple[list, Callable[[], None]]:
    """Every connection made to ``listener`` (closed at once), counted by a thread of its own
    until the function returned is called: a server of someone else's that a client must never
    reach."""
    listener.settimeout(0.2)
    connections: list = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            connections.append(conn)
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()

    def stopped() -> None:
        stop.set()
        thread.join()

    return connections, stopped


def _client(tag: str) -> SharedEngineClient:
    return SharedEngineClient(make_config().model, FakeEngine, tag)


def _end(client: SharedEngineClient) -> None:
    _end_process(client._process)


def test_a_connection_without_the_engines_key_is_refused(temp):
    """A local process that reads the engine's address and connects with Beam's public key (or
    any key but the engine's) is refused before anything is unpickled; the engine's files are all
    in the private folder, 0600 and this user's; the client's own calls work."""
    tag = f"newsvec-test-{uuid.uuid4().hex}"
    client = _client(tag)
    try:
        address_file = client._record.address_file(client._record.read())
        path = _engine_socket(client, temp)
        with pytest.raises(multiprocessing.AuthenticationError):
            multiprocessing.connection.Client(path, authkey=b"mps").close()
        with pytest.raises(multiprocessing.AuthenticationError):
            multiprocessing.connection.Client(path, authkey=os.urandom(32)).close()
        folder = _private(temp)
        assert os.path.dirname(address_file) == folder
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
        mine = [n for n in os.listdir(folder) if n.startswith(tag)]
        assert f"{tag}-g1.key" in mine and f"{tag}.busy" in mine
        for name in mine + [os.path.basename(path)]:
            info = os.lstat(os.path.join(folder, name))
            kind = stat.S_ISSOCK if name == os.path.basename(path) else stat.S_ISREG
            assert kind(info.st_mode) and info.st_uid == os.geteuid(), name
            assert stat.S_IMODE(info.st_mode) == 0o600, (name, oct(info.st_mode))
        assert not [n for n in os.listdir(temp) if n.startswith(tag)], "nothing in the temp folder"
        (vector,) = client.embed([[5, 7, 11]])
        assert vector.shape == (384,)
    finally:
        _end(client)


@as_root
@pytest.mark.parametrize("how", ["owner", "mode"])
def test_a_planted_address_file_is_never_connected_to(temp, how):
    """Another user (simulated: files owned by uid 65534, or mode 0o666) plants an engine record
    and an address file naming a server of theirs: the client never connects to it (it would
    unpickle that server's answers), and starts an engine of its own."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections, stop = _counting_connections(listener)
    tag = f"newsvec-test-{uuid.uuid4().hex}"
    me = _process_identity(os.getpid())
    _plant(temp, f"{tag}.engine", json.dumps({"number": 1, "spawner": list(me), "engine": None}),
           how)
    _plant(temp, f"{tag}-g1.address", f"127.0.0.1:{listener.getsockname()[1]}", how)
    _plant(temp, f"{tag}-g1.key", "k" * 32, how)
    client = None
    try:
        client = _client(tag)
        assert connections == [], f"the client connected to the planted address " \
                                  f"{len(connections)} time(s)"
        assert client._generation != 1, "the planted generation is not used"
        (vector,) = client.embed([[1, 2, 3]])
        assert vector.shape == (384,)
    finally:
        stop()
        listener.close()
        if client is not None:
            _end(client)


@as_root
@pytest.mark.parametrize("which,how", [("engine", "owner"), ("busy", "mode"),
                                       ("loading", "owner"), ("loading", "mode")])
def test_a_planted_state_file_never_makes_a_client_kill_an_unrelated_process(temp, which, how):
    """Another user (simulated: the file owned by uid 65534, or mode 0o666) plants the tag's
    engine record, busy file or loading file naming an unrelated process (a ``sleep`` this test
    starts: its pid and start time, both readable in /proc): the client that reaches the engine
    never kills it."""
    victim = subprocess.Popen(["sleep", "600"])
    client = None
    try:
        pid, started = _process_identity(victim.pid)
        tag = f"newsvec-test-{uuid.uuid4().hex}"
        content = {
            "engine": json.dumps({"number": 1, "spawner": [pid, started],
                                  "engine": [pid, started]}),
            "busy": json.dumps({"process": [pid, started], "generation": 1,
                                "heartbeat": time.monotonic()}),
            "loading": f"1 {pid} {started}",
        }[which]
        _plant(temp, f"{tag}.{which}", content, how)
        client = _client(tag)
        assert victim.poll() is None, f"the planted {which} file made the client kill pid {pid}"
        assert client._process[0] != pid
    finally:
        victim.kill()
        victim.wait()
        if client is not None:
            _end(client)


def test_a_symlink_in_place_of_a_state_file_is_not_followed(temp):
    """A symlink where the engine record is (to a record that names an unrelated process) is not
    read through; a symlink at the name a temp file of the device slots used to take is not
    written through; a symlink in place of the engine's lock file is refused (the client fails,
    creating nothing where it points)."""
    victim = subprocess.Popen(["sleep", "600"])
    client = None
    try:
        pid, started = _process_identity(victim.pid)
        target = temp / "record-elsewhere.json"
        target.write_text(json.dumps({"number": 1, "spawner": [pid, started],
                                      "engine": [pid, started]}))
        os.chmod(target, 0o600)
        tag = f"newsvec-test-{uuid.uuid4().hex}"
        for folder in (str(temp), _private(temp)):
            os.symlink(target, os.path.join(folder, f"{tag}.engine"))
        client = _client(tag)
        assert victim.poll() is None, f"the record was read through its symlink: pid {pid} killed"
        assert json.loads(target.read_text())["engine"] == [pid, started], "target untouched"
    finally:
        victim.kill()
        victim.wait()
        if client is not None:
            _end(client)

    # DeviceSlots' temp file: a predictable name once ({path}.{pid}.tmp).
    victim_file = temp / "victim.conf"
    victim_file.write_text("precious\n")
    folder = _private(temp)
    slots = DeviceSlots(folder, "t", alive=lambda p: True)
    os.symlink(victim_file, f"{slots.path}.{os.getpid()}.tmp")
    assert slots.assign((os.getpid(), 1), 2) == 0
    assert victim_file.read_text() == "precious\n", "written through the symlink"
    assert not os.path.islink(slots.path)

    # The engine's lock file.
    tag = f"newsvec-test-{uuid.uuid4().hex}"
    nowhere = temp / "created-through-a-symlink"
    for folder in (str(temp), _private(temp)):
        os.symlink(nowhere, os.path.join(folder, f"{tag}.lock"))
    client = None
    error = None
    try:
        client = _client(tag)
    except EngineFailedError as exc:
        error = exc
    finally:
        if client is not None:
            _end(client)
    assert not nowhere.exists(), "the lock file's symlink was followed"
    assert error is not None and "refused" in str(error), error


@pytest.mark.parametrize("how", [pytest.param("owner", marks=as_root), "mode", "symlink"])
def test_a_private_folder_another_user_could_write_is_refused(temp, how):
    """The private folder, made first by another user (simulated: chowned to uid 65534), or open
    to others (mode 0o755), or a symlink (to a folder of this user's), is refused: the client
    fails with ``EngineFailedError`` and uses nothing in it."""
    folder = os.path.join(str(temp), f"newsvec-engine-{os.geteuid()}")
    if how == "symlink":
        real = temp / "elsewhere"
        real.mkdir(mode=0o700)
        os.symlink(real, folder)
    else:
        os.mkdir(folder, 0o700)
        if how == "owner":
            os.chown(folder, NOBODY, NOBODY)
        else:
            os.chmod(folder, 0o755)
    with pytest.raises(EngineFailedError, match="private folder"):
        SharedEngineClient(make_config().model, FakeEngine, f"newsvec-test-{uuid.uuid4().hex}",
                           connect=False)


def _listening_sockets(pid: int) -> dict[str, list[str]]:
    """The sockets process ``pid`` listens on, by kind: ``tcp`` (the ``local address:port`` of
    each TCP or TCP6 socket in state LISTEN, 0A) and ``unix`` (the path of each Unix stream
    socket that accepts connections, flag __SO_ACCEPTCON), matched by inode against the
    ``socket:[inode]`` links among its descriptors, in the process's own network namespace."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found: dict[str, list[str]] = {"tcp": [], "unix": []}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in list(f)[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    found["tcp"].append(fields[1])
    with open(f"/proc/{pid}/net/unix") as f:
        for row in list(f)[1:]:
            fields = row.split()
            if int(fields[3], 16) & 0x10000 and fields[6] in inodes:
                found["unix"].append(fields[7] if len(fields) > 7 else "")
    return found


def _engine_socket(client: SharedEngineClient, temp) -> str:
    """The socket the engine's address file names, which must be a bare name in the private
    folder."""
    address_file = client._record.address_file(client._record.read())
    with open(address_file) as f:
        name = f.read()
    assert "/" not in name and ":" not in name, f"the address file names {name!r}"
    return os.path.join(_private(temp), name)


def test_the_engine_listens_on_no_tcp_port_only_on_a_unix_socket_in_the_private_folder(temp):
    """The engine's process listens on no TCP port (a port is freed when the engine ends, and
    another local user may bind it and relay two clients' challenges to each other), only on the
    Unix socket its address file names, in the private folder."""
    client = _client(f"newsvec-test-{uuid.uuid4().hex}")
    try:
        listening = _listening_sockets(client._process[0])
        assert listening["tcp"] == [], f"the engine listens on TCP {listening['tcp']}"
        path = _engine_socket(client, temp)
        assert listening["unix"] == [path], listening
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        (vector,) = client.embed([[5, 7, 11]])
        assert vector.shape == (384,)
    finally:
        _end(client)


_CONNECTS_AS = """
import ctypes, os, socket, sys
uid, path, files_as_root = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
try:
    os.setgroups([])
    if files_as_root:
        os.setegid(uid)
        os.seteuid(uid)
        ctypes.CDLL(None, use_errno=True).setfsuid(0)
    else:
        os.setgid(uid)
        os.setuid(uid)
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.settimeout(10)
        print("challenged" if s.recv(1) else "closed", end="")
except BaseException as exc:
    print(type(exc).__name__, end="")
"""


def _connects_as(uid: int, path: str, files_as_root: bool = False) -> str:
    """What a process of user ``uid`` (a fresh interpreter started by this one as root, which
    drops to it) meets at the Unix socket at ``path``: "challenged" (it connected and the server
    sent it the key's challenge), "closed" (it connected, and the server closed the connection),
    or the error's name. With ``files_as_root``, only its effective uid drops (the one the server
    sees, ``SO_PEERCRED``), and it reaches files as root (``setfsuid(0)``): past the folder's
    0700, which would otherwise stop it first. (Not a bare ``os.fork``: this test process runs
    many threads, and a forked child of it may deadlock on a lock one of them held.)"""
    done = subprocess.run([sys.executable, "-c", _CONNECTS_AS, str(uid), path,
                           "1" if files_as_root else "0"], capture_output=True, text=True,
                          timeout=60)
    return done.stdout


@as_root
def test_the_engines_socket_is_this_users_alone_and_a_silent_connection_blocks_no_call(temp):
    """The engine's socket is 0600, this user's, in the 0700 private folder: another user
    (simulated: a child that drops to uid 65534) cannot connect to it at all, so cannot hold
    connections open to starve it (the server runs a thread and holds a descriptor for every
    connection until its handshake ends, with no time limit: enough silent ones exhaust its
    descriptors, and then no client is accepted and the engine cannot write its heartbeat). Silent
    connections this user holds open do not stop another's call."""
    client = _client(f"newsvec-test-{uuid.uuid4().hex}")
    silent = []
    try:
        path = _engine_socket(client, temp)
        info = os.lstat(path)
        assert stat.S_ISSOCK(info.st_mode) and info.st_uid == os.geteuid()
        assert stat.S_IMODE(info.st_mode) == 0o600, oct(info.st_mode)
        assert stat.S_IMODE(os.lstat(os.path.dirname(path)).st_mode) == 0o700
        assert _connects_as(NOBODY, path) == "PermissionError"
        assert _connects_as(os.geteuid(), path) == "challenged"
        for _ in range(20):
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(True)  # as multiprocessing's client: a default timeout set by another
            s.connect(path)  # test would make a full backlog an EAGAIN instead of a wait
            silent.append(s)
        started = time.monotonic()
        (vector,) = client.embed([[5, 7, 11]])
        assert vector.shape == (384,)
        assert time.monotonic() - started < 10
    finally:
        for s in silent:
            s.close()
        _end(client)


@pytest.mark.parametrize("where", ["tcp", "outside", "relative", "other-socket"])
def test_an_address_file_naming_anything_but_the_engines_socket_is_never_connected_to(temp,
                                                                                       where):
    """An address file of this user's (0600, in the private folder: not refused as planted) that
    names a TCP address, a socket outside the private folder (by an absolute or a relative path),
    or another socket in it than the one its generation's engine binds, is never connected to
    (whoever listens there could be another user's server, which could have relayed a challenge
    and would then be unpickled); the client starts an engine of its own."""
    folder = _private(temp)
    if where == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        address = f"127.0.0.1:{listener.getsockname()[1]}"
    else:
        path = os.path.join(folder if where == "other-socket" else str(temp), "x.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(16)
        address = {"outside": path, "relative": "../x.sock", "other-socket": "x.sock"}[where]
    connections, stop = _counting_connections(listener)
    tag = f"newsvec-test-{uuid.uuid4().hex}"
    me = _process_identity(os.getpid())
    for name, content in ((f"{tag}.engine", json.dumps({"number": 1, "spawner": list(me),
                                                          "engine": None})),
                          (f"{tag}-g1.address", address), (f"{tag}-g1.key", "k" * 32)):
        write_private(os.path.join(folder, name), content.encode())
    client = None
    try:
        client = _client(tag)
        assert connections == [], f"the client connected to {address} {len(connections)} time(s)"
        assert client._generation != 1, "the generation that names it is not used"
        (vector,) = client.embed([[1, 2, 3]])
        assert vector.shape == (384,)
    finally:
        stop()
        listener.close()
        if client is not None:
            _end(client)


def test_a_temp_folder_too_deep_for_the_engines_socket_fails_saying_so(monkeypatch, tmp_path):
    """Where the private folder's path leaves no room for the socket's (AF_UNIX takes 107 bytes),
    reaching the engine fails with an ``EngineFailedError`` that says so and what to do, rather
    than an error from deep in multiprocessing."""
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(EngineFailedError, match="shorter path"):
        _client(f"newsvec-test-{uuid.uuid4().hex}")


@as_root
def test_the_engine_hangs_up_on_a_process_of_another_user_before_its_challenge(temp):
    """A process of another user that reaches the socket all the same (simulated: a child whose
    effective uid is 65534 but that reaches files as root, past the private folder) is hung up on
    at once (the engine checks the peer's uid, ``SO_PEERCRED``), before the key's challenge: it
    holds no thread or descriptor of the engine."""
    client = _client(f"newsvec-test-{uuid.uuid4().hex}")
    try:
        path = _engine_socket(client, temp)
        assert _connects_as(NOBODY, path, files_as_root=True) == "closed"
        (vector,) = client.embed([[5, 7, 11]])
        assert vector.shape == (384,)
    finally:
        _end(client)

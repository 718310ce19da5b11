"""One publisher per output prefix at a time, enforced by the storage: a renewed, fenced lease.

A batch run publishes into an output (``transforms.output.manifest.publish``) only while it holds
the lease on ``<output>/_publish.lock``. The lock object is a small JSON body (who holds it, since
when), and every change to it is conditional on the generation the changer last saw:

- on GCS, through google-cloud-storage's preconditions: ``if_generation_match=0`` creates it only if
  absent, ``if_generation_match=G`` replaces it only if nobody changed it since G. The storage
  refuses the loser of any race (``412 Precondition Failed``). Releasing is a conditional replace
  too (a body that says ``released``), not a delete: fake-gcs-server, the emulator the tests use,
  does not enforce preconditions on deletes. google-cloud-storage retries a conditional upload
  whose response was lost; the retry then gets 412 although the first request was applied: a
  refused change is therefore followed by a read, and a lock whose body is this holder's is its own;
- on local disk, the same operations under an OS lock (``fcntl.flock``) on a file of its own,
  ``_publish.lock.flock`` (made 0600 by the job's user, through no symlink, and refused if it is
  a symlink or another user's: no one else can open it, so no one else can hold its flock and
  stop every publish, as anyone who could read the output folder could when the folder itself
  was flocked), with the generation kept in the file; a released lock is deleted. ``flock``
  does not span machines (NFS, SMB, FUSE mounts such as gcsfuse, virtiofs, 9p): only the local
  filesystems of ``LOCAL_FILESYSTEMS`` are accepted, any other (or one whose type cannot be
  read) refused unless the user names it in ``NEWSVEC_LOCAL_LOCK_FILESYSTEMS`` (an output only
  this machine writes).

The holder renews the lease every ``lease_s / 4`` (a new generation each time). Another run waits
while the generation changes; when it has seen one generation stand for ``lease_s`` by its own
clock (started after the read that saw it), the holder is dead or stalled, and it takes the lease
over with a conditional replace of that generation. No clocks are compared across machines; time
is counted with ``CLOCK_BOOTTIME``, which runs while a machine is suspended.

Every change the holder makes to the output goes through ``change`` (or ``put``/``remove`` for the
manifest): immediately before it, the lock is read again and must still name this holder, and the
holder must have renewed within ``lease_s / 2``; else ``LeaseLost``, and nothing is changed:

- on local disk the read and the change run under the same ``flock`` that a taker needs to take
  the lease over: a change never lands after a takeover;
- on GCS a request can be delayed after that read (a frozen process, a request retried through a
  brown-out). The small objects that name files (the manifest, the summary, a compaction
  manifest) are therefore written with a precondition on the generation this holder last read or
  wrote: a late write is refused by GCS. A copy is made only over the generation the holder
  listed (0: absent), so a late copy never replaces a file written since; it is followed by
  another read of the lock, and undone if the lease was lost meanwhile, by deleting only the
  generation it created. A late delete only removes a file the holder listed before the takeover
  (an older run's file, never the taker's, whose names hold its run id).

The margin of that fencing is ``lease_s / 2`` minus the longest a single storage request can take,
so ``lease_s`` has a floor (``MIN_LEASE_S``, ``transforms.timing_floors``): twice the longest one
request can take through Beam's GCS client (a 120 s retry deadline, then up to 60 s for the last
attempt). Each fenced change is therefore one request (a batch of up to 100 deletes is one GCS
batch request), or is read again after it. The conditional GCS operations are
``transforms.gcs``'s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import random
import re
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional, Protocol

from apache_beam.io.filesystems import FileSystems

from transforms.gcs import gcs_delete, gcs_read, gcs_updated, gcs_write
from transforms.output.layout import PUBLISH_LOCK_FILE, UnsafePath, join_path
from transforms.private_files import open_private_file
from transforms.timing_floors import require_lease_s

_LOG = logging.getLogger(__name__)

_CLOCK_ID = getattr(time, "CLOCK_BOOTTIME", None)


def now() -> float:
    """Seconds on a clock that keeps running while the machine is suspended (``CLOCK_BOOTTIME``,
    Linux); elsewhere ``time.monotonic``."""
    if _CLOCK_ID is not None:
        return time.clock_gettime(_CLOCK_ID)
    return time.monotonic()


class LeaseLost(RuntimeError):
    """This holder's lease was taken over, or could not be renewed in time: it must stop writing."""


class LockStore(Protocol):
    """A small object with generations: every change is conditional, and the storage decides."""

    exclusive: bool  # whether a change inside ``fenced`` cannot interleave with a takeover

    def read(self) -> Optional[tuple[int, dict]]:
        """(generation, body), or None when there is no lock."""

    def create(self, body: dict) -> Optional[int]:
        """The new generation, or None when a lock exists."""

    def replace(self, body: dict, generation: int) -> Optional[int]:
        """The new generation, or None when the lock is not at ``generation`` any more."""

    def release(self, body: dict, generation: int) -> None:
        """Free the lock if it is still at ``generation``; else leave it (somebody else's)."""

    def holder_is_gone(self, body: dict) -> bool:
        """Whether the holder is known dead now (no need to wait out its lease)."""

    def fenced(self) -> contextlib.AbstractContextManager[Optional[tuple[int, dict]]]:
        """The lock as it is now, read for a change made inside the block (locally, the block
        holds the OS lock that every change to the lock needs)."""


class GcsLockStore:
    """The lock as a GCS object, every change under an ``if_generation_match`` precondition."""

    exclusive = False

    def __init__(self, path: str):
        self._path = path

    @property
    def path(self) -> str:
        return self._path

    def read(self) -> Optional[tuple[int, dict]]:
        found = gcs_read(self._path)
        return None if found is None else (found[0], json.loads(found[1]))

    def _upload(self, body: dict, generation: int) -> Optional[int]:
        return gcs_write(self._path, json.dumps(body).encode("utf-8"), generation)

    def create(self, body: dict) -> Optional[int]:
        return self._upload(body, 0)  # 0: only if no live object has this name

    def replace(self, body: dict, generation: int) -> Optional[int]:
        return self._upload(body, generation)

    def release(self, body: dict, generation: int) -> None:
        self._upload({**body, "released": True}, generation)

    def holder_is_gone(self, body: dict) -> bool:
        return False  # another machine's process: only its lease running out tells

    @contextlib.contextmanager
    def fenced(self) -> Iterator[Optional[tuple[int, dict]]]:
        yield self.read()


# Local disk.

# The filesystems whose flock every publisher of an output shares: disks of this machine (and
# tmpfs, overlay). Any other type (NFS, SMB, CephFS, Lustre, gcsfuse and Cloud Storage FUSE's
# "fuse", virtiofs, 9p...) may be mounted by several machines, where flock does not span them.
LOCAL_FILESYSTEMS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "jfs", "reiserfs",
    "nilfs2", "tmpfs", "ramfs", "overlay", "apfs", "hfs", "hfsplus", "ufs", "ffs"})
# Filesystem types a user accepts besides, comma-separated (``unknown``: where the type cannot be
# read): for an output that only this machine ever writes.
LOCAL_LOCK_FILESYSTEMS_ENV = "NEWSVEC_LOCAL_LOCK_FILESYSTEMS"
UNKNOWN_FILESYSTEM = "unknown"


def accepted_filesystems() -> frozenset:
    """``LOCAL_FILESYSTEMS`` and the types named in ``NEWSVEC_LOCAL_LOCK_FILESYSTEMS``."""
    extra = os.environ.get(LOCAL_LOCK_FILESYSTEMS_ENV, "")
    return LOCAL_FILESYSTEMS | {kind.strip() for kind in extra.split(",") if kind.strip()}


def _unescape_mount_path(path: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space) undone."""
    out, i = [], 0
    while i < len(path):
        if path[i] == "\\" and path[i + 1:i + 4].isdigit():
            out.append(chr(int(path[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(path[i])
            i += 1
    return "".join(out)


def _mount_points(mountinfo: str) -> Optional[list[tuple[str, str]]]:
    """(mount point, filesystem type) of every mount: from ``mountinfo`` (Linux), else from what
    ``mount`` prints (macOS, BSD: ``/dev/disk3s1 on / (apfs, local, journaled)``); None where
    neither can be read."""
    try:
        with open(mountinfo, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = None
    if lines is not None:
        out = []
        for line in lines:
            fields, _, rest = line.partition(" - ")
            parts, kinds = fields.split(), rest.split()
            if len(parts) >= 5 and kinds:
                out.append((_unescape_mount_path(parts[4]), kinds[0]))
        return out
    if sys.platform == "linux":
        return None  # no /proc: nothing else to ask
    try:
        printed = subprocess.run(["mount"], capture_output=True, text=True, timeout=10,
                                 check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = [re.fullmatch(r".+? on (.+) \(([^,)]+)[,)].*", line) for line in printed.splitlines()]
    return [(m.group(1), m.group(2).strip()) for m in found if m]


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> Optional[str]:
    """The type of the filesystem that holds ``path`` (``ext4``, ``nfs4``, ``fuse.gcsfuse``,
    ``apfs``...) from the longest mount point above it (``/proc/self/mountinfo``, or ``mount``
    where there is no /proc); None where it cannot be read."""
    mounts = _mount_points(mountinfo)
    if mounts is None:
        return None
    real = os.path.realpath(path)
    best, best_type = "", None
    for mount, kind in mounts:
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, best_type = mount, kind
    return best_type


def _read_text(path: str) -> Optional[str]:
    try:
        if os.path.islink(path):
            return os.readlink(path)
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def process_identity() -> dict:
    """Where this process lives: hostname, pid, and (Linux) its PID namespace and boot, so that a
    holder on the same hostname in another container or after a reboot is never judged by a pid
    that means nothing here."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "pid_namespace": _read_text("/proc/self/ns/pid"),
            "boot_id": _read_text("/proc/sys/kernel/random/boot_id")}


# How the local lock's flock is waited for: polled, and logged after a second, then every 30 s.
_FLOCK_POLL_S, _FLOCK_QUIET_S, _FLOCK_LOG_EVERY_S = 0.02, 1.0, 30.0


class LocalLockStore:
    """The lock as a local file; each read-compare-write holds ``flock`` on ``<lock>.flock``
    beside it (``_guarded``: every process on this machine sees it; a killed process's flock is
    released by the OS)."""

    exclusive = True

    def __init__(self, path: str, filesystem: Optional[str] = None):
        self._path = path
        self._flock_path = f"{path}.flock"
        self._folder = os.path.dirname(path) or "."
        os.makedirs(self._folder, exist_ok=True)
        mode = stat.S_IMODE(os.stat(self._folder).st_mode)
        if mode & stat.S_IWOTH:
            # Whoever may write the folder may replace the lock file (naming a live holder
            # elsewhere, for ever) or unlink the flocked file under a holder (two processes then
            # change the output at once): the lock is only as private as the folder.
            raise UnsafePath(
                f"{self._folder} may be written by every user (mode {mode:o}): any of them could "
                "hold or void its publish lock, so nothing is published there; make it writable "
                f"by the job's user (and a group it trusts) alone: chmod o-w {self._folder}")
        kind = (filesystem if filesystem is not None else filesystem_type(self._folder)
                or UNKNOWN_FILESYSTEM)
        if kind not in accepted_filesystems():
            raise ValueError(
                f"{self._folder} is on a filesystem of type {kind}, not a local disk the publish "
                f"lock trusts ({', '.join(sorted(LOCAL_FILESYSTEMS))}): the lock is an flock, "
                f"which does not span machines where several mount the same files (NFS, SMB, "
                f"Cloud Storage FUSE, virtiofs, 9p). Write to gs:// or to a local disk; if only "
                f"this machine ever writes this output, accept the type with "
                f"{LOCAL_LOCK_FILESYSTEMS_ENV}={kind}")

    def _holder(self) -> str:
        """Who the lock file names (read without the flock: it is replaced whole), for a log."""
        try:
            body = json.loads(self._read_bytes())["body"]
        except (OSError, ValueError, KeyError, TypeError):
            return "a process of this machine"
        return (f"{body.get('holder')} (pid {body.get('pid')} on {body.get('host')}"
                + (", released)" if body.get("released") else ")"))

    def _flocked(self) -> int:
        """A descriptor of ``<lock>.flock`` (``private_files.open_private_file``: 0600, this
        user's, no symlink; ``UnsafeFileError`` if not) holding its flock. Taken without
        blocking, again and again: a holder frozen inside a change keeps it (a change must never
        land after a takeover, so nobody may take the lease over meanwhile), and whoever waits
        for it says so in the log. Taken again if the name no longer names the file flocked (it
        was removed or replaced meanwhile): every holder flocks the one file the name holds."""
        started = now()
        next_log = started + _FLOCK_QUIET_S
        while True:
            guard = open_private_file(self._flock_path)
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(guard)
                if now() >= next_log:
                    _LOG.warning("waiting %.0f s for the publish lock of %s: %s is inside a "
                                 "change of the output (a holder frozen there is waited for, "
                                 "never taken over)", now() - started, self._folder,
                                 self._holder())
                    next_log = now() + _FLOCK_LOG_EVERY_S
                time.sleep(_FLOCK_POLL_S)
                continue
            held = os.fstat(guard)
            try:
                named = os.stat(self._flock_path, follow_symlinks=False)
            except FileNotFoundError:
                named = None
            if named is not None and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                return guard
            os.close(guard)

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """The flock every read-compare-write of the lock holds (``_flocked``)."""
        guard = self._flocked()
        try:
            yield
        finally:
            os.close(guard)  # and with it the flock

    def _read_bytes(self) -> bytes:
        """The lock file's bytes: a regular file, opened through no symlink and without waiting
        (a FIFO in its place would block every publish); ``UnsafePath`` if it is not one,
        ``FileNotFoundError`` if it is not there."""
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):
                raise UnsafePath(f"the publish lock {self._path} is a symlink or a socket: "
                                 f"refused; move it aside") from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafePath(f"the publish lock {self._path} is not a regular file: "
                                 f"refused; move it aside")
            os.set_blocking(fd, True)
            return f.read()

    def _read(self) -> Optional[tuple[int, dict]]:
        try:
            stored = json.loads(self._read_bytes())
        except FileNotFoundError:
            return None
        return stored["generation"], stored["body"]

    def _write(self, body: dict, generation: int) -> int:
        temp = f"{self._path}.{uuid.uuid4().hex}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"generation": generation, "body": body}, f)
        os.replace(temp, self._path)  # a rename replaces a symlink there, never follows it
        return generation

    def read(self) -> Optional[tuple[int, dict]]:
        with self._guarded():
            return self._read()

    def create(self, body: dict) -> Optional[int]:
        with self._guarded():
            current = self._read()
            if current is not None:
                return None
            return self._write(body, time.time_ns())

    def replace(self, body: dict, generation: int) -> Optional[int]:
        with self._guarded():
            current = self._read()
            if current is None or current[0] != generation:
                return None
            return self._write(body, max(time.time_ns(), generation + 1))

    def release(self, body: dict, generation: int) -> None:
        with self._guarded():
            current = self._read()
            if current is not None and current[0] == generation:
                os.remove(self._path)
                # Under its flock: a waiter that flocked this file finds the name gone and flocks
                # the one made next (``_flocked``).
                os.remove(self._flock_path)

    @contextlib.contextmanager
    def fenced(self) -> Iterator[Optional[tuple[int, dict]]]:
        with self._guarded():
            yield self._read()

    def holder_is_gone(self, body: dict) -> bool:
        """A holder in this machine's boot and PID namespace whose process has ended (killed: it
        never released). A holder that recorded another namespace or boot, or none (an earlier
        release), is waited for: its pid means nothing here."""
        here = process_identity()
        if (body.get("host") != here["host"] or not isinstance(body.get("pid"), int)
                or here["pid_namespace"] is None or here["boot_id"] is None
                or body.get("pid_namespace") != here["pid_namespace"]
                or body.get("boot_id") != here["boot_id"]):
            return False
        try:
            os.kill(body["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # alive, another user's
        return False


def lock_store(output: str) -> LockStore:
    """The lock store of an output prefix: GCS for ``gs://``, the local disk for a path."""
    path = join_path(output, PUBLISH_LOCK_FILE)
    scheme = FileSystems.get_scheme(path)
    if scheme == "gs":
        return GcsLockStore(path)
    if scheme is None:
        return LocalLockStore(os.path.abspath(path))
    raise ValueError(f"no publish lock for {scheme}:// outputs (gs:// or a local path)")


@dataclasses.dataclass
class _Held:
    generation: int
    renewed: float  # now() at the start of the last successful renewal


class PublishLease:
    """``with PublishLease(output, run_id, lease_s):`` holds the output's publish lease inside the
    block, renewed in a thread of its own. ``change(action, ...)`` runs one change of the output
    fenced by it (``LeaseLost`` once it is not safe to write any more); ``check()`` verifies it
    without a change."""

    def __init__(self, output: str, run_id: str, lease_s: float = 600,
                 poll_s: Optional[float] = None, store: Optional[LockStore] = None):
        require_lease_s(lease_s)
        self._output, self._lease_s = output, lease_s
        self._poll_s = min(lease_s / 4, 5.0) if poll_s is None else poll_s
        self._store = store if store is not None else lock_store(output)
        self._body: dict[str, Any] = {
            "holder": f"{run_id}/{uuid.uuid4().hex[:8]}", "run_id": run_id, **process_identity()}
        self._held: Optional[_Held] = None
        self._lost: Optional[str] = None
        self._stop = threading.Event()
        self._renewer: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        # GCS generations of the small objects (the manifest) this holder read or wrote: its
        # writes of them are conditional on these (``put``, ``remove``).
        self.generations: dict[str, int] = {}
        # GCS generations of the files this holder copied
        # (``transforms.output.manifest.copy_fenced``).
        self.copied: dict[str, int] = {}
        # What this holder deleted (``transforms.output.manifest.delete_fenced``,
        # ``delete_tree_fenced``: files, and local folders), in order: ``newsvec cleanup`` reports
        # it.
        self.removed: list[str] = []

    @property
    def holder(self) -> str:
        return self._body["holder"]

    @property
    def output(self) -> str:
        return self._output

    def _ours(self, current: Optional[tuple[int, dict]]) -> bool:
        return (current is not None and current[1].get("holder") == self.holder
                and not current[1].get("released"))

    def _adopt(self, refused_generation: Optional[int]) -> Optional[int]:
        """After a refused create or replace: the lock's generation if it holds this holder's
        body (the change was applied, its response lost, its retry refused), else None."""
        if refused_generation is not None:
            return refused_generation
        current = self._store.read()
        if self._ours(current):
            assert current is not None
            _LOG.info("the publish lease on %s: a change reported refused had been applied "
                      "(a lost response); %s holds it", self._output, self.holder)
            return current[0]
        return None

    def acquire(self) -> None:
        """Wait until the lease is free, or has stood unrenewed for ``lease_s``, and take it."""
        seen: Optional[int] = None
        seen_since = 0.0
        while True:
            current = self._store.read()
            read_at = now()  # after the read: a read that took long saw a generation at its end
            if current is None:
                generation = self._adopt(self._store.create(self._body))
            elif self._ours(current):
                generation = current[0]  # our own create or takeover, its response lost
            elif current[1].get("released"):
                generation = self._adopt(self._store.replace(self._body, current[0]))
            else:
                if current[0] != seen:  # renewed since we last looked: the holder lives
                    seen, seen_since = current[0], read_at
                generation = None
                if self._store.holder_is_gone(current[1]):
                    _LOG.warning("the publish lease on %s is held by %s, whose process has ended: "
                                 "%s takes it over", self._output, current[1].get("holder"),
                                 self.holder)
                    generation = self._adopt(self._store.replace(self._body, current[0]))
                elif read_at - seen_since >= self._lease_s:
                    _LOG.warning("the publish lease on %s held by %s was not renewed for %.0f s "
                                 "(killed or stalled): %s takes it over", self._output,
                                 current[1].get("holder"), read_at - seen_since, self.holder)
                    generation = self._adopt(self._store.replace(self._body, current[0]))
                else:
                    _LOG.info("%s is publishing into %s; %s waits", current[1].get("holder"),
                              self._output, self.holder)
            if generation is not None:
                self._held = _Held(generation, read_at)
                self._renewer = threading.Thread(target=self._renew, daemon=True,
                                                 name="newsvec-publish-lease")
                self._renewer.start()
                return
            time.sleep(self._poll_s * random.uniform(0.75, 1.25))

    def _renew(self) -> None:
        while not self._stop.wait(self._lease_s / 4):
            with self._lock:
                held = self._held
            if held is None:
                return
            started = now()
            try:
                generation = self._adopt(self._store.replace(self._body, held.generation))
            except Exception as exc:  # pylint: disable=broad-except  # retried at the next turn
                _LOG.warning("renewing the publish lease on %s failed (%s); retrying",
                             self._output, exc)
                continue
            with self._lock:
                if generation is None:
                    self._lost = "it was taken over"
                    _LOG.error("the publish lease on %s was taken over: %s stops", self._output,
                               self.holder)
                    return
                if self._held is not None:
                    self._held = _Held(generation, started)

    def _check_time(self) -> None:
        with self._lock:
            if self._held is None:
                raise LeaseLost(f"{self.holder} does not hold the publish lease on {self._output}")
            if self._lost:
                raise LeaseLost(f"{self.holder} lost the publish lease on {self._output}: "
                                f"{self._lost}")
            stale = now() - self._held.renewed
            if stale > self._lease_s / 2:
                raise LeaseLost(f"{self.holder}: the publish lease on {self._output} was not "
                                f"renewed for {stale:.0f} s (lease {self._lease_s:.0f} s)")

    def _verify(self, current: Optional[tuple[int, dict]]) -> None:
        """The lock as just read must still name this holder, and its renewal be recent."""
        if not self._ours(current):
            other = current[1].get("holder") if current is not None else None
            with self._lock:
                if self._held is not None and not self._lost:
                    self._lost = f"it was taken over by {other}" if other else "it is gone"
            self._check_time()  # raises: lost
        self._check_time()

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """The block changes the output only while this holder holds the lease: the lock is read
        immediately before it (locally the block holds the OS lock a takeover needs)."""
        with self._store.fenced() as current:
            self._verify(current)
            yield

    def check(self) -> None:
        """Raise ``LeaseLost`` unless this holder may still write: the lock read again, and a
        renewal within half the lease."""
        with self.fenced():
            pass

    def change(self, action: Callable[..., Any], *args, undo: Optional[Callable[[], Any]] = None
               ) -> Any:
        """``action(*args)``, one change of the output, fenced (``fenced``). ``undo``: for a long
        change (a copy), what makes it harmless if the lease turns out lost by its end; then the
        lock is read again after it (where the storage cannot exclude a takeover during it). The
        undo runs after a takeover, so it must change nothing the taker needs: it deletes only
        what the change created (on GCS by the generation it created)."""
        with self.fenced():
            result = action(*args)
        if undo is not None and not self._store.exclusive:
            try:
                self.check()
            except LeaseLost:
                _LOG.error("%s lost the publish lease on %s during a change: undoing it",
                           self.holder, self._output)
                undo()
                raise
        return result

    def put(self, path: str, data: bytes, write_local: Callable[[], Any]) -> None:
        """Replace a small object of the output (the manifest), fenced: on GCS only if it is
        still at the generation this holder last read or wrote (``generations``, read now if
        this holder never did), so that a write delayed past a takeover is refused by GCS; on
        local disk by ``write_local()`` under the lock (``change``)."""
        self._fenced(path, write_local, lambda generation: gcs_write(path, data, generation))

    def remove(self, path: str, remove_local: Callable[[], Any]) -> None:
        """Delete a small object of the output (the manifest), fenced as ``put``."""
        self._fenced(path, remove_local,
                     lambda generation: 0 if gcs_delete(path, generation) else None)

    def _fenced(self, path: str, local: Callable[[], Any],
                on_gcs: Callable[[int], Optional[int]]) -> None:
        """``local()`` under the lock, or on GCS ``on_gcs(generation this holder last saw)``,
        which gives the object's new generation (0: deleted), or None where GCS refused it: the
        object was changed by another holder, the lease taken over."""
        if not path.startswith("gs://"):
            self.change(local)
            return
        if path not in self.generations:
            self.read_object(path)

        def conditional() -> None:
            generation = on_gcs(self.generations[path])
            if generation is None:
                raise LeaseLost(f"{self.holder}: {path} was changed by another holder of the "
                                f"publish lease on {self._output}: it was taken over")
            self.generations[path] = generation

        self.change(conditional)

    def storage_time(self) -> float:
        """Now, by the storage's clock where it has one: on GCS the time the lock object was last
        written (this holder renews it every quarter lease, so it is at most that much behind),
        on local disk this machine's clock. Ages of files on GCS (their ``updated``) are measured
        against it, so a skewed local clock makes no file look older than it is."""
        if isinstance(self._store, GcsLockStore):
            updated = gcs_updated(self._store.path)
            if updated is not None:
                return updated
        return time.time()

    def read_object(self, path: str) -> Optional[bytes]:
        """A small GCS object of the output, its generation kept for ``put`` and ``remove``."""
        found = gcs_read(path)
        self.generations[path] = found[0] if found is not None else 0
        return found[1] if found is not None else None

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with self._lock:
            held, self._held = self._held, None
        if held is not None and not self._lost:
            # Only if still ours: a holder whose lease was taken over releases nothing.
            self._store.release(self._body, held.generation)

    def __enter__(self) -> "PublishLease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

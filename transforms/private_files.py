"""The private folder where the shared engine and the SDK processes of a machine meet, and the
only ways newsvec reads and writes the files in it.

The shared engine's rendezvous and state files (Beam's address, key, lock and error files,
newsvec's engine record, busy, loading, ended, exit and devices files, and their temp files) used
to sit in the machine's temp folder, which every local user may write: a planted address file
made an SDK process connect to (and unpickle the answers of) someone else's server, a planted
busy or loading file made a client SIGKILL whatever process it named, and a symlink at a
predictable temp name made the engine overwrite any file. Now:

- they live in ``private_folder()``: ``{temp}/newsvec-engine-<uid>``, made 0700 and refused
  (``UnsafeFolderError``) where it is a symlink, not a directory, owned by another user, or open
  to group or others. (A folder of that name that another user made first is refused, not worked
  around: the job then fails to reach its engine and says why, rather than use a folder someone
  else controls.)
- every file is written by ``write_private``: a temp file made by ``tempfile.mkstemp`` (a random
  name, ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600) in the same folder, then renamed into place (a
  rename replaces a symlink, never follows it); lock files are made by ``ensure_private_file``
  (``O_NOFOLLOW``, 0600, then checked);
- every file is read by ``read_private`` (``O_NOFOLLOW``, then ``fstat`` on the descriptor read
  from): a symlink, a file that is not a regular file, one owned by another user, or one that
  group or others may write or read, is not there as far as newsvec is concerned (a warning is
  logged), whatever it says.
"""
from __future__ import annotations

import logging
import os
import stat
import tempfile
from typing import Callable, Optional

_LOG = logging.getLogger(__name__)


class UnsafeFolderError(RuntimeError):
    """The engine's private folder is a symlink, not a directory, another user's, or open to
    others."""


class UnsafeFileError(OSError):
    """A file newsvec would make in the private folder is a symlink, not a regular file, another
    user's, or open to others."""


def private_folder(base: Optional[str] = None) -> str:
    """``{base}/newsvec-engine-<uid>`` (``base``: the temp folder), made 0700 if missing, and
    checked (``check_private_folder``)."""
    folder = os.path.join(base or tempfile.gettempdir(), f"newsvec-engine-{os.geteuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    check_private_folder(folder)
    return folder


def check_private_folder(folder: str) -> None:
    """Raise ``UnsafeFolderError`` unless ``folder`` is a real directory (not a symlink) owned by
    this user that no one else may enter, read or write (mode & 0o077 == 0)."""
    info = os.lstat(folder)
    why = ("is a symlink" if stat.S_ISLNK(info.st_mode)
           else refusal(info, stat.S_ISDIR, "a directory"))
    if why is not None:
        raise UnsafeFolderError(
            f"the shared engine's private folder {folder} {why}: refused (another user could "
            "plant the engine's address or state files there); remove it, or run as its owner")


def refusal(info: os.stat_result, is_kind: Callable[[int], bool] = stat.S_ISREG,
            kind: str = "a regular file") -> Optional[str]:
    """Why an entry of the private folder (``info``: its ``lstat`` or ``fstat``) is not this
    user's own ``kind`` that no one else may use, or None."""
    if not is_kind(info.st_mode):
        return f"is not {kind}"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not this user ({os.geteuid()})"
    if info.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(info.st_mode):o} (group or others may use it)"
    return None


def read_private(path: str) -> Optional[bytes]:
    """The bytes of ``path`` if it is a regular file (not a symlink) of this user's that no one
    else may read or write; else None (a file that is there but refused is logged)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink; EACCES, ...
        _LOG.warning("refused %s: %s", path, exc)
        return None
    try:
        why = refusal(os.fstat(fd))
        if why is not None:
            _LOG.warning("refused %s: it %s, so another user could have written it", path, why)
            return None
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)


def is_private(path: str) -> bool:
    """Whether ``path`` is there and would be read by ``read_private``."""
    try:
        return refusal(os.lstat(path)) is None
    except OSError:
        return False


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole: a fresh 0600 temp file of a random name beside it
    (``O_CREAT|O_EXCL|O_NOFOLLOW``), renamed into place. Raises ``OSError``."""
    folder, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=folder or ".", prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_private_file(path: str) -> int:
    """A descriptor (read-write) of ``path``, a lock file made 0600 if missing, without following
    a symlink; ``UnsafeFileError`` if what is there is a symlink or is not this user's private
    file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     0o600)
    except OSError as exc:
        raise UnsafeFileError(exc.errno, f"refused {path}: {exc.strerror}") from exc
    try:
        why = refusal(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if why is not None:
        os.close(fd)
        raise UnsafeFileError(f"refused {path}: it {why}, so another user could have made it")
    return fd


def ensure_private_file(path: str) -> None:
    """Make ``path`` (a lock file) 0600 if missing (``open_private_file``)."""
    os.close(open_private_file(path))

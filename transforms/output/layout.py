"""The output layout's one home: folder and file names, run ids, and writing a file whole.

An output prefix holds (docs/output.md)::

    vectors/  chunks/  keys/  dead_letter/   the published data (batch: one run's files; streaming:
                                             one file per micro-batch under dt=YYYY-MM-DD/hour=HH/)
    ledger/                                  streaming: a record per micro-batch
    _manifest.json  _summary.json            batch: the committed run and its summary
    _staging/<run_id>/                       batch: a run's files until it commits
    _temp/                                   files being written, renamed into place when whole
    _compaction/                             streaming: per partition, which micro-batch files its
                                             compacted-<id> files replace
                                             (transforms.output.compaction)

Every writer (the sinks, the commit, the manifest) and every reader (the ledger, the clean-up, the
incremental key lookup) takes its names from here, so a name is formatted and parsed in one place.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import errno
import os
import re
import shutil
import stat
import uuid
from typing import IO, BinaryIO, Callable, Iterable, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystem import CompressedFile, CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms.window import IntervalWindow

VECTORS_DIR = "vectors"
CHUNKS_DIR = "chunks"
KEYS_DIR = "keys"
DEAD_LETTER_DIR = "dead_letter"
LEDGER_DIR = "ledger"
TEMP_DIR = "_temp"
STAGING_DIR = "_staging"
SUMMARY_FILE = "_summary.json"
MANIFEST_FILE = "_manifest.json"
PUBLISH_LOCK_FILE = "_publish.lock"  # the publish lease (transforms.output.lease)
# Streaming compaction (transforms.output.compaction): a partition's manifest under _compaction/,
# and the compacted files' names (compacted-<id>.parquet), which PartFileName never parses.
COMPACTION_DIR = "_compaction"
COMPACTED_PREFIX = "compacted-"
# The folders a batch commit publishes (and a rerun replaces), in the order it replaces them.
PUBLISHED_DIRS = (VECTORS_DIR, DEAD_LETTER_DIR, CHUNKS_DIR, KEYS_DIR)
# Beam's shard template for a batch run's files: part-<run_id>-00000-of-00004.parquet.
SHARD_TEMPLATE = "-SSSSS-of-NNNNN"
SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")  # what BigQuery, gsutil and shells take unquoted
# What ``new_run_id`` makes (ASCII digits): the only run id a manifest may name.
RUN_ID_FORMAT = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}")
PARTITION_FORMAT = re.compile(r"dt=[0-9]{4}-[0-9]{2}-[0-9]{2}/hour=[0-9]{2}")


class InvalidManifest(ValueError):
    """A manifest (``_manifest.json``, a compaction manifest, a ledger record) that names a run id
    not of ``new_run_id``'s format, or a path that is not relative, holds ``.``, ``..``, an empty
    segment or a backslash, or lies outside the folder its state allows: refused, never
    followed. The message names the file."""


class UnsafePath(ValueError):
    """A local path that would be read, deleted, copied, renamed or written outside the output's
    real folder, or through a symlink below it (a symlinked ``_temp/``, ``_staging/``, published or
    partition folder), or a file read that is not a regular file (a symlink, a FIFO): refused
    before anything is changed."""


def new_run_id(now: Optional[dt.datetime] = None) -> str:
    """A sortable id safe in any file name: 20261201T093000Z-1a2b3c4d. The newest run wins by
    this order (``transforms.commit``), so the first 3 hex digits are the launch's millisecond:
    two launches in one second sort by time, not by chance; the other 5 are random (two launches
    in one millisecond get one id with a chance of 2**-20)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{now.microsecond // 1000:03x}{uuid.uuid4().hex[:5]}"


def run_id_time(run_id: str) -> dt.datetime:
    """When run ``run_id`` (of ``new_run_id``'s form) was launched, to the second, in UTC."""
    return dt.datetime.strptime(run_id[:16], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)


def require_safe_run_id(run_id: str) -> None:
    if not SAFE_NAME.fullmatch(run_id) or set(run_id) == {"."}:
        raise ValueError(f"run_id {run_id!r} must match {SAFE_NAME.pattern} and not be . or ..")


def require_run_id(run_id: object) -> str:
    """A run id as ``new_run_id`` makes it (what a manifest may name); ``ValueError`` if not."""
    if not isinstance(run_id, str) or not RUN_ID_FORMAT.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r} is not of the form {RUN_ID_FORMAT.pattern}")
    try:
        run_id_time(run_id)
    except ValueError:
        raise ValueError(f"run id {run_id!r} does not begin with a real time (UTC, to the "
                         "second)") from None
    return run_id


def safe_relative(path: object, under: str) -> str:
    """``path`` as a manifest may name it: relative to the output, under the folder ``under``
    (``vectors``, ``_staging/<run_id>/vectors``...), every segment non-empty and neither ``.`` nor
    ``..``, no backslash or control character. ``ValueError`` if not."""
    if not isinstance(path, str):
        raise ValueError(f"{path!r} is not a path")
    segments = path.split("/")
    if ("\\" in path or any(ord(c) < 0x20 for c in path)
            or any(s in ("", ".", "..") for s in segments)):
        raise ValueError(f"{path!r} is not a plain relative path (an absolute path, an empty, . or "
                         f".. segment, a backslash or a control character)")
    folder = under.strip("/").split("/")
    if segments[:len(folder)] != folder or len(segments) <= len(folder):
        raise ValueError(f"{path!r} is not under {under}/")
    return path


def require_inside(output: str, *paths: str) -> None:
    """Before a local delete, copy, rename or write: each path must be plain (no ``.``/``..``
    segment) below the output, reach it through no symlink (the output's own folder may be
    one), and really lie in the output's real folder. ``UnsafePath`` if not. A ``gs://`` name is
    literal: nothing to check."""
    if FileSystems.get_scheme(output) is not None:
        return
    base = os.path.abspath(output)
    root = os.path.realpath(output)
    for path in paths:
        if FileSystems.get_scheme(path) is not None:
            raise UnsafePath(f"{path} is not on local disk like the output {output}")
        prefix = output.rstrip("/") + "/"
        if not path.startswith(prefix) and os.path.abspath(path) != base:
            raise UnsafePath(f"{path} is not under the output {output}")
        relative = path[len(prefix):] if path.startswith(prefix) else ""
        segments = [s for s in relative.split("/") if s]
        if any(s in (".", "..") for s in segments):
            raise UnsafePath(f"{path} leaves the output {output} (a . or .. segment)")
        current = base
        for segment in segments:
            current = os.path.join(current, segment)
            if os.path.islink(current):
                raise UnsafePath(f"{current} is a symlink (to {os.readlink(current)}): nothing "
                                 f"is deleted, copied, renamed or written through it; make it a "
                                 f"folder of the output {output}")
        real = os.path.realpath(path)
        if real != root and not real.startswith(root + os.sep):
            raise UnsafePath(f"{path} is really {real}, outside the output {output} ({root})")


# Local files of the output, reached through no symlink when they are used.
#
# ``require_inside`` checks a path's name before an operation; a folder swapped for a symlink
# between that check and the operation would still be followed. The functions below walk from the
# output's own folder (which may itself be a symlink) one segment at a time, each opened
# ``O_DIRECTORY|O_NOFOLLOW`` relative to the one before, and act on the last one by its
# descriptor (``dir_fd``): whatever is swapped in meanwhile, no symlink below the output is
# followed. Every local read, delete, copy, rename and write of the output's files goes through
# them; ``require_inside`` stays as the early, clearer refusal.

def is_local(path: str) -> bool:
    return FileSystems.get_scheme(path) is None


def _segments(output: str, path: str) -> list[str]:
    """``path``'s segments below the output; ``UnsafePath`` unless plainly under it."""
    prefix = output.rstrip("/") + "/"
    if not path.startswith(prefix):
        raise UnsafePath(f"{path} is not under the output {output}")
    segments = path[len(prefix):].rstrip("/").split("/")
    if any(s in ("", ".", "..") for s in segments):
        raise UnsafePath(f"{path} is not a plain path below the output {output} (an empty, . or "
                         f".. segment)")
    return segments


def _refusal(folder: int, name: str, path: str, output: str) -> UnsafePath:
    """Why ``name`` (in the folder ``folder``, on the way to ``path``) cannot be used."""
    try:
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError as exc:
        return UnsafePath(f"{path}: {name} cannot be used ({exc.strerror})")
    if stat.S_ISLNK(info.st_mode):
        return UnsafePath(f"{path}: {name} is a symlink (to {os.readlink(name, dir_fd=folder)}): "
                          f"nothing is read, deleted, copied, renamed or written through it; make "
                          f"it a folder or file of the output {output}")
    return UnsafePath(f"{path}: {name} is not a regular file or folder "
                      f"({stat.filemode(info.st_mode)}): refused")


def _open_folder(output: str, segments: Sequence[str], path: str, make: bool = False) -> int:
    """A descriptor of the folder ``output/segments...``, each segment opened through no symlink;
    with ``make``, the folders that are missing made. Raises ``UnsafePath`` naming ``path``."""
    if make:
        os.makedirs(output, exist_ok=True)
    fd = os.open(output, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for segment in segments:
            if make:
                try:
                    os.mkdir(segment, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(segment, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refusal(fd, segment, path, output) from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_inside(output: str, path: str) -> BinaryIO:
    """A local file of the output opened for reading: a regular file reached through no symlink,
    opened without waiting (a FIFO someone left there would block a plain open). ``UnsafePath``
    naming it otherwise, ``FileNotFoundError`` if it is not there."""
    *folders, name = _segments(output, path)
    parent = _open_folder(output, folders, path)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):
                raise _refusal(parent, name, path, output) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _refusal(parent, name, path, output)
    finally:
        os.close(parent)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_inside(output: str, path: str) -> bytes:
    """``open_inside``'s bytes."""
    with open_inside(output, path) as f:
        return f.read()


def open_output_file(output: str, path: str) -> IO[bytes]:
    """A file of the output opened for reading: the one way every reader of an output's files
    (the commit's counts, ``newsvec load``, ``search``, ``ledger``, compaction, the key index, the
    current-vector reader) opens them. On local disk only a regular file reached from ``output``
    through no symlink, opened without waiting (``open_inside``): a file swapped for a symlink to
    a file outside would be read as the output's, a FIFO or a device would block the reader (and
    the lease it holds) for ever; ``UnsafePath`` naming it. On GCS, as Beam opens it (no symlinks
    there)."""
    if is_local(path):
        return open_inside(output, path)
    return FileSystems.open(path)


# The folders of the layout right below an output: what ``output_of`` cuts a path at.
_LAYOUT_DIRS = frozenset({*PUBLISHED_DIRS, LEDGER_DIR, STAGING_DIR, TEMP_DIR, COMPACTION_DIR})


def output_of(path: str) -> str:
    """Where ``open_output_file`` starts its walk for a reader given only a path (callers that
    know the output pass it instead): the part before the path's first folder of the layout
    (``vectors``, ``_staging``...). The first, so the prefix is the output or a folder above it,
    never one below: the walk checks every folder of the output (and, where the output's own
    name holds such a folder, some above it too, refusing a symlink there). A path with no such
    folder (not an output's file): its own folder, so that the file itself is still refused if
    it is a symlink or a FIFO."""
    segments = path.split("/")
    if is_local(path):
        for i, segment in enumerate(segments[:-1]):
            if i > 0 and segment in _LAYOUT_DIRS:
                return "/".join(segments[:i])
    return "/".join(segments[:-1]) or "."


def create_inside(output: str, path: str) -> BinaryIO:
    """A new local file of the output for writing (``O_CREAT|O_EXCL|O_NOFOLLOW``), its folders
    made, each reached through no symlink."""
    *folders, name = _segments(output, path)
    parent = _open_folder(output, folders, path, make=True)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o666, dir_fd=parent)
    finally:
        os.close(parent)
    return os.fdopen(fd, "wb")


def makedirs_inside(output: str, path: str) -> None:
    """A local folder of the output (and those above it) made, each reached through no symlink."""
    os.close(_open_folder(output, _segments(output, path), path, make=True))


def rename_inside(output: str, source: str, target: str) -> None:
    """Move a local file of the output to another name in it (replacing what is there: a
    symlink there is replaced, not followed), the target's folders made; every folder on both
    ways reached through no symlink."""
    *source_folders, source_name = _segments(output, source)
    *target_folders, target_name = _segments(output, target)
    source_fd = _open_folder(output, source_folders, source)
    try:
        target_fd = _open_folder(output, target_folders, target, make=True)
        try:
            os.replace(source_name, target_name, src_dir_fd=source_fd, dst_dir_fd=target_fd)
        finally:
            os.close(target_fd)
    finally:
        os.close(source_fd)


def remove_inside(output: str, path: str, missing_ok: bool = False) -> None:
    """Delete a local entry of the output by its exact name (never a glob): a file or a symlink
    itself, or a folder with everything in it (``shutil.rmtree`` by descriptor, which follows no
    symlink inside), reached through no symlink. ``FileNotFoundError`` if it is not there, unless
    ``missing_ok``."""
    *folders, name = _segments(output, path)
    try:
        parent = _open_folder(output, folders, path)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    try:
        if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            shutil.rmtree(name, dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)
    except FileNotFoundError:
        if not missing_ok:
            raise
    finally:
        os.close(parent)


def join_path(prefix: str, *parts: str) -> str:
    return "/".join([prefix.rstrip("/"), *parts])


def relative_to(output: str, path: str) -> str:
    """``path`` relative to the output prefix (the form the manifest and the ledger record)."""
    prefix = output.rstrip("/") + "/"
    if not path.startswith(prefix):
        raise ValueError(f"{path} is not under {prefix}")
    return path[len(prefix):]


def staging_prefix(output: str, run_id: str) -> str:
    """Where a batch run writes its files until it commits."""
    return join_path(output, STAGING_DIR, run_id)


def is_compacted(path: str) -> bool:
    """Whether a file (a path or a bare name) is a compacted file rather than a micro-batch's."""
    return path.rsplit("/", 1)[-1].startswith(COMPACTED_PREFIX)


_PARTITION = "dt=%Y-%m-%d/hour=%H"  # the one format of a partition's name: written and read here
_DAY_IN_PATH = re.compile(r"(?:^|/)dt=([0-9]{4}-[0-9]{2}-[0-9]{2})(?:/|$)")  # a dt= folder


def day_of_path(path: str) -> Optional[dt.date]:
    """The day of the last ``dt=YYYY-MM-DD`` folder in ``path`` (an output prefix such as
    ``.../dt=2026-11-30``, a file's path under a partition), None where it has none;
    ``ValueError`` for a folder of that form that is no day."""
    found = _DAY_IN_PATH.findall(path.rstrip("/"))
    return dt.date.fromisoformat(found[-1]) if found else None


def partition_path(window: IntervalWindow) -> str:
    """``dt=YYYY-MM-DD/hour=HH`` of the window start (UTC). Never from an event's fields, which the
    publisher controls; digits by construction, so safe in any path."""
    if not isinstance(window, IntervalWindow):
        raise ValueError(f"an event-time window is needed to partition by, got {window!r}")
    return window.start.to_utc_datetime().strftime(_PARTITION)


def partition_hour(partition: str) -> dt.datetime:
    """The hour (UTC) a ``dt=YYYY-MM-DD/hour=HH`` partition holds: ``partition_path`` read back."""
    return dt.datetime.strptime(partition, _PARTITION).replace(tzinfo=dt.timezone.utc)


def partitions_between(start: dt.datetime, end: dt.datetime) -> list[str]:
    """The ``dt=/hour=`` partitions of the hours that ``[start, end)`` touches."""
    hour = start.replace(minute=0, second=0, microsecond=0)
    out = []
    while hour < end:
        out.append(hour.strftime(_PARTITION))
        hour += dt.timedelta(hours=1)
    return out


_WINDOW_FORMAT = "%Y%m%dT%H%M%SZ"


@dataclasses.dataclass(frozen=True)
class PartFileName:
    """A streaming micro-batch's file name: ``part-<window start>-<pane>-<shard>-of-<n>-<digest>
    <suffix>``, e.g. ``part-20261201T095900Z-001-00000-of-00004-0123456789abcdef.parquet``.

    The window start and pane keep a late pane from replacing its window's on-time file. The digest
    is of the micro-batch's messages (``transforms.sinks.micro_batch_digest``), not of the launch:
    a micro-batch redone by another attempt, by the job that replaced its writer after an update,
    or by a restart from a snapshot gets the same names and replaces its files, while different
    messages in the same window, pane and shard (a new job's late pane after a drain) get names of
    their own. ``file_name()`` writes it, ``parse()`` reads it back: the sinks and the ledger share
    this one definition. ``parse()`` also reads the names of releases before, which began with the
    launch's run id instead (``run_id``, and no digest).
    """

    window_start: dt.datetime  # UTC
    pane: int
    shard: int
    shards: int
    digest: Optional[str]  # 16 hex; None in a name of an earlier release
    suffix: str  # ".parquet", ".jsonl", ".json"
    run_id: Optional[str] = None  # only in a name of an earlier release

    _TAIL = (r"(?P<window>[0-9]{8}T[0-9]{6}Z)-(?P<pane>[0-9]{3,})-(?P<shard>[0-9]{5,})"
             r"-of-(?P<shards>[0-9]{5,})")
    _PATTERN = re.compile(r"part-" + _TAIL
                          + r"-(?P<digest>[0-9a-f]{16})(?P<suffix>\.[A-Za-z0-9]+)")
    _EARLIER = re.compile(r"part-(?P<run_id>[A-Za-z0-9._-]+)-" + _TAIL
                          + r"(?P<suffix>\.[A-Za-z0-9]+)")

    @classmethod
    def for_window(cls, window: IntervalWindow, pane: int, shard: int, shards: int, digest: str,
                   suffix: str) -> "PartFileName":
        return cls(window.start.to_utc_datetime(has_tz=True), pane, shard, shards, digest, suffix)

    def file_name(self) -> str:
        if self.digest is None or not re.fullmatch(r"[0-9a-f]{16}", self.digest):
            raise ValueError(f"a micro-batch's file name needs 16 hex of digest: {self.digest!r}")
        name = (f"part-{self.window_start:{_WINDOW_FORMAT}}-{self.pane:03d}-{self.shard:05d}"
                f"-of-{self.shards:05d}-{self.digest}{self.suffix}")
        if not SAFE_NAME.fullmatch(name):
            raise ValueError(f"unsafe file name {name!r}")
        return name

    @classmethod
    def parse(cls, name: str) -> Optional["PartFileName"]:
        """The parts of a file name (a bare name or a path), or None if it is not one of ours."""
        base = name.rsplit("/", 1)[-1]
        match = cls._PATTERN.fullmatch(base) or cls._EARLIER.fullmatch(base)
        if not match or set(match.groupdict().get("run_id") or "x") == {"."}:
            return None
        groups = match.groupdict()
        try:
            window_start = dt.datetime.strptime(groups["window"], _WINDOW_FORMAT).replace(
                tzinfo=dt.timezone.utc)
        except ValueError:  # no such date or time (month 13, hour 99): not one of ours
            return None
        return cls(window_start, int(groups["pane"]), int(groups["shard"]),
                   int(groups["shards"]), groups.get("digest"), groups["suffix"],
                   groups.get("run_id"))


def mkdirs(path: str) -> None:
    try:
        FileSystems.mkdirs(path)
    except IOError:
        pass  # it exists (another shard, another worker); a real failure fails the rename after


def _delete_quietly(output: str, path: str) -> None:
    try:
        if is_local(path):
            remove_inside(output, path, missing_ok=True)  # by name, not a glob
        else:
            FileSystems.delete([path])
    except (IOError, ValueError):
        pass  # never created, or refused; the error that brought us here matters more


def temp_path(output: str, run_id: Optional[str] = None) -> str:
    """A fresh name under ``<output>/_temp/`` (``_temp/<run_id>/`` for a run's files), its folder
    made. ``transforms.output.manifest.clean_stale`` deletes what a killed worker leaves there."""
    folder = join_path(output, TEMP_DIR, run_id) if run_id else join_path(output, TEMP_DIR)
    require_inside(output, folder)
    if is_local(folder):
        makedirs_inside(output, folder)
    else:
        mkdirs(folder)
    return join_path(folder, f"{uuid.uuid4().hex}.tmp")


def write_whole(output: str, target: str, write: Callable[[IO[bytes]], object], *,
                run_id: Optional[str] = None, mime_type: str = "application/octet-stream",
                compression_type: str = CompressionTypes.UNCOMPRESSED) -> str:
    """Write ``target`` whole, by ``write(handle)``: first to a temp file under ``<output>/_temp/``,
    then renamed into place, so nothing half-written is ever visible where readers look (a worker
    killed mid-write leaves only the temp file). A retry with the same target replaces it whole.
    An object upload is atomic on GCS, a rename on local disk (the temp file made, and renamed,
    through no symlink below the output: ``create_inside``, ``rename_inside``). Returns
    ``target``."""
    temp = temp_path(output, run_id)
    local = is_local(output)
    try:
        if local:
            with create_inside(output, temp) as raw:
                if compression_type in (CompressionTypes.UNCOMPRESSED, CompressionTypes.AUTO):
                    write(raw)  # AUTO: by the name, which ends in .tmp
                else:
                    with CompressedFile(raw, compression_type) as handle:
                        write(handle)
        else:
            with FileSystems.create(temp, mime_type=mime_type,
                                    compression_type=compression_type) as handle:
                write(handle)
    except BaseException:
        _delete_quietly(output, temp)
        raise
    require_inside(output, target)
    if local:
        try:
            rename_inside(output, temp, target)
        except BaseException:
            _delete_quietly(output, temp)
            raise
    else:
        mkdirs(target.rsplit("/", 1)[0])
        FileSystems.rename([temp], [target])
    return target


def list_files(pattern: str) -> dict[str, int]:
    """{path: size} of the files matching a glob; {} when none."""
    return {m.path: m.size_in_bytes for m in FileSystems.match([pattern])[0].metadata_list}


def read_parquet(output: str, paths: Iterable[str], columns: Optional[Sequence[str]] = None,
                 each: Optional[Callable[[pa.Table], pa.Table]] = None) -> Optional[pa.Table]:
    """The Parquet files ``paths`` of ``output`` as one table, None for no files. Each is a
    regular file of the output (``open_output_file``: a symlink or a FIFO in place of one is an
    ``UnsafePath`` naming it, never read or waited on), read for those of ``columns`` it holds
    (None: all; a file written before a column was added lacks it), then passed through ``each``
    (which may make files written by two releases one schema) before they are concatenated."""
    tables = []
    for path in paths:
        with open_output_file(output, path) as f:
            parquet = pq.ParquetFile(f)
            held = set(parquet.schema_arrow.names)
            table = parquet.read(columns=None if columns is None
                                 else [c for c in columns if c in held])
        tables.append(table if each is None else each(table))
    return pa.concat_tables(tables) if tables else None


def parquet_rows(paths: Iterable[str], output: Optional[str] = None) -> int:
    """Rows in these Parquet files of ``output`` (each opened by ``open_output_file``), from their
    footers. Without ``output``, each file's own (``output_of``)."""
    rows = 0
    for path in paths:
        with open_output_file(output or output_of(path), path) as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    return rows

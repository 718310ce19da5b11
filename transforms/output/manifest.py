"""A batch output's manifest, and publishing a staged run under it: no Beam here.

A batch run writes into ``<output>/_staging/<run_id>/`` (``vectors/``, ``dead_letter/``,
``chunks/`` in chunks mode, ``keys/``, ``_summary.json``). Once the run balances (``CommitRun`` in
``transforms.commit``, the job's last step), ``publish``:

1. writes ``_manifest.json`` (state ``publishing``) naming the staged files: from this moment a
   reader that follows the manifest reads the new run, whole. An incremental run's manifest also
   records the snapshots of the previous outputs it skipped articles for (``skipped_from``) and
   the manifest it replaces (``previous``): before anything else, whoever publishes it (the run,
   a retried attempt of it, an older run that finds it cut off, ``repair``) checks that each
   snapshot still holds; if one does not, it puts ``previous`` back and fails
   (``SnapshotChanged``); if all do, it writes the manifest again without them (checked: from
   here on the publish only goes forward);
2. deletes every file of the published folders (``vectors/``, ``dead_letter/``, ``chunks/``,
   ``keys/``) that is not this run's, then copies this run's files in (a copy, so that the staged
   files the manifest names stay whole meanwhile): a reader that globs ``vectors/**/*.parquet``
   sees part of the old run, then part of the new one, never rows of two runs at once;
3. writes ``_summary.json`` (the staged summary's bytes, fenced as the manifest is), writes the
   manifest again (state ``committed``, naming the published files) and deletes the staging
   folder.

Every step can run again (a retried bundle, ``repair``). Only the holder of the output's publish
lease (``transforms.output.lease``) publishes, and every change it makes is fenced by it
(``PublishLease.change``: the lock read again just before; on GCS the manifest and the summary
written only if unchanged since this holder last saw them, a copy made only over the generation
this holder listed and undone, by the generation it created, if the lease was lost during it): a
publisher whose lease was taken over stops before it changes one more file. ``repair``,
``remove_strays``, ``missing_files`` and ``clean_stale`` serve ``newsvec cleanup``
(``pipeline/cleanup.py``) after a kill. ``published_summary`` is how newsvec reads an output's
summary: only the committed run's.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import shutil
from typing import Any, Iterable, Optional

from apache_beam.io.filesystem import BeamIOError
from apache_beam.io.filesystems import FileSystems

from transforms.gcs import gcs_bucket_and_name, gcs_copy, gcs_delete, gcs_read_generation
from transforms.output.key_checksums import key_file_checksums, local_checksum
from transforms.output.layout import (
    KEYS_DIR,
    MANIFEST_FILE,
    PUBLISHED_DIRS,
    STAGING_DIR,
    SUMMARY_FILE,
    TEMP_DIR,
    InvalidManifest,
    UnsafePath,
    create_inside,
    is_local,
    join_path,
    list_files,
    makedirs_inside,
    mkdirs,
    open_inside,
    open_output_file,
    output_of,
    parquet_rows,
    read_inside,
    relative_to,
    remove_inside,
    rename_inside,
    require_inside,
    require_run_id,
    safe_relative,
    staging_prefix,
    temp_path,
    write_whole,
)
from transforms.output.lease import LeaseLost, PublishLease
from transforms.output.summary import RunSummary
from transforms.timing_floors import unsafe_test_timings
from transforms.types import Counts

_LOG = logging.getLogger(__name__)

PUBLISHING, COMMITTED = "publishing", "committed"
STALE_AFTER_S = 2 * 86400  # older staged or temporary files than this are a dead run's
# The youngest staged or temporary file a clean-up may take for a dead run's: a live writer's
# temporary file is younger (it is written within one bundle), and so is the newest staged file of
# a batch job that still runs unless the job has been running for longer (the default of
# ``newsvec cleanup`` is a day, of the commit's own clean-up two). Under the test override only
# (``transforms.timing_floors.UNSAFE_TEST_TIMINGS_ENV``) it may be less.
MIN_STALE_AGE_S = 3600.0
# Files in one fenced delete: on GCS one batch request (``delete_files``), as each fenced change
# must be one request for the lease's floor to hold (``transforms.timing_floors.MIN_LEASE_S``).
_DELETES_PER_CHANGE = 100
_COPY_ATTEMPTS = 3  # a GCS copy whose target another holder wrote since it was listed, tried again


@dataclasses.dataclass(frozen=True)
class Manifest:
    """``<output>/_manifest.json``: which run the output holds, and its files (relative to the
    output prefix). Readers that must never see a partial or mixed output read these files."""

    run_id: str
    state: str  # "publishing": the files are the staged copies; "committed": the published ones
    started_at: float  # when publishing began (Unix seconds; the lease is in _publish.lock)
    vectors: list
    dead_letter: list
    summary: str
    counts: dict  # Counts.to_summary()
    committed_at: Optional[str] = None
    chunks: list = dataclasses.field(default_factory=list)  # chunks mode
    keys: list = dataclasses.field(default_factory=list)  # the key index (transforms.incremental)
    # A publishing manifest of an incremental run, until its check: the snapshots it skipped
    # articles for (``Snapshot.to_dict``), and the manifest it replaces (None: there was none).
    # Both absent (written without) once checked, in a committed manifest, and in the manifests
    # of earlier releases.
    skipped_from: Optional[list] = None
    previous: Optional[dict] = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if not self.skipped_from:  # nothing to check: neither field is written
            del out["skipped_from"], out["previous"]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        """The manifest these fields make, checked (``check``): ``ValueError`` (or
        ``TypeError``: a field missing) if it names what no publish of newsvec writes."""
        if not isinstance(data, dict):
            raise ValueError(f"a manifest is a JSON object, not {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        manifest = cls(**{k: v for k, v in data.items() if k in known})  # a later release's fields
        manifest.check()
        return manifest

    def check(self) -> None:
        """What every reader relies on before it follows a manifest (it is never followed
        otherwise): the run id is ``new_run_id``'s format; the state one of the two; every file
        a plain relative path (no ``.``, ``..``, empty segment or backslash) under
        ``_staging/<run_id>/<folder>/`` (publishing) or ``<folder>/`` (committed), the summary
        ``_staging/<run_id>/_summary.json`` or ``_summary.json``; the manifest it would put back
        (``previous``) the same. ``ValueError`` naming what is wrong."""
        run_id = require_run_id(self.run_id)
        if self.state not in (PUBLISHING, COMMITTED):
            raise ValueError(f"state {self.state!r} is neither {PUBLISHING} nor {COMMITTED}")
        staged = join_path(STAGING_DIR, run_id)
        for subdir in PUBLISHED_DIRS:
            paths = getattr(self, subdir)
            if not isinstance(paths, list):
                raise ValueError(f"{subdir} is not a list of paths")
            under = join_path(staged, subdir) if self.state == PUBLISHING else subdir
            for path in paths:
                safe_relative(path, under)
        summaries = ((join_path(staged, SUMMARY_FILE), SUMMARY_FILE) if self.state == PUBLISHING
                     else (SUMMARY_FILE,))
        if self.summary not in summaries:
            raise ValueError(f"summary {self.summary!r} is not {' or '.join(summaries)}")
        if self.skipped_from is not None:
            if not isinstance(self.skipped_from, list):
                raise ValueError("skipped_from is not a list")
            for snapshot in self.skipped_from:
                check_snapshot(snapshot)
        if self.previous is not None:
            try:
                Manifest.from_dict(self.previous)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"the manifest it would put back (previous): {exc}") from None


def _plain_prefix(prefix: str) -> bool:
    """Whether ``prefix`` is an output prefix as ``transforms.incremental.output_prefixes``
    resolves one: ``gs://bucket/path`` or an absolute, normalized local path, no ``.``, ``..``,
    empty segment, backslash or control character."""
    if "\\" in prefix or any(ord(c) < 0x20 for c in prefix):
        return False
    if prefix.startswith("gs://"):
        return all(s not in ("", ".", "..") for s in prefix[len("gs://"):].split("/"))
    return (FileSystems.get_scheme(prefix) is None and os.path.isabs(prefix)
            and os.path.normpath(prefix) == prefix and prefix != "/")


def check_snapshot(data: object) -> None:
    """A snapshot as a publishing manifest records it (``skipped_from``,
    ``Snapshot.to_dict``): its ``prefix`` an output prefix
    (``_plain_prefix``; which outputs a run may read is its own configuration's, not known to
    whoever finishes its publish, so the form is what is checked), its ``run_id`` None or
    ``new_run_id``'s format, each pin a key file's plain relative path under ``keys/`` and a
    checksum. ``ValueError`` if not: a crafted snapshot would make the publish read, hash or wait
    on any file the prefix leads to."""
    if not isinstance(data, dict):
        raise ValueError(f"skipped_from: {data!r} is not a snapshot")
    prefix = data.get("prefix")
    if not isinstance(prefix, str) or not _plain_prefix(prefix):
        raise ValueError(f"skipped_from: prefix {prefix!r} is not gs://bucket/path or an "
                         f"absolute, normalized local path")
    if data.get("run_id") is not None:
        require_run_id(data["run_id"])
    pins = data.get("pins", [])
    if not isinstance(pins, list):
        raise ValueError("skipped_from: pins is not a list")
    for pin in pins:
        if (not isinstance(pin, list) or len(pin) != 2
                or not all(isinstance(part, str) for part in pin)):
            raise ValueError(f"skipped_from: pin {pin!r} is not [path, checksum]")
        safe_relative(pin[0], KEYS_DIR)


def parse_manifest(path: str, data: bytes) -> Manifest:
    """The manifest stored at ``path``, checked (``Manifest.check``); ``InvalidManifest`` naming
    ``path`` if it is not one newsvec wrote."""
    try:
        return Manifest.from_dict(json.loads(data.decode("utf-8")))
    # JSONDecodeError and UnicodeDecodeError included; RecursionError: nested too deep (as JSON,
    # or as a chain of ``previous`` manifests)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidManifest(
            f"{path} is refused, not followed: {exc}. No newsvec run writes such a manifest: "
            f"whoever can write the output wrote it; see what it names, then move it aside (a "
            f"rerun of the output's run writes a new one)") from None


def _manifest_path(output: str) -> str:
    return join_path(output, MANIFEST_FILE)


def read_manifest(output: str, lease: Optional[PublishLease] = None) -> Optional[Manifest]:
    """The output's manifest, or None. With ``lease`` (its holder's read, before it writes the
    manifest), on GCS the generation read is kept for the holder's conditional writes."""
    path = _manifest_path(output)
    if lease is not None and path.startswith("gs://"):
        data = lease.read_object(path)
        return None if data is None else parse_manifest(path, data)
    if is_local(path):  # a regular file, through no symlink, without waiting on a FIFO
        try:
            return parse_manifest(path, read_inside(output, path))
        except FileNotFoundError:
            return None
    if not FileSystems.exists(path):
        return None
    with FileSystems.open(path) as f:
        return parse_manifest(path, f.read())


def write_manifest(output: str, manifest: Manifest, lease: Optional[PublishLease] = None) -> None:
    """Replace ``<output>/_manifest.json`` whole: by the holder of ``lease``, fenced by it
    (``PublishLease.put``); without (a tool that writes an output no run publishes into), as is."""
    path = _manifest_path(output)
    data = manifest.to_json().encode("utf-8")

    def write() -> None:
        write_whole(output, path, lambda f: f.write(data))

    if lease is None:
        write()
    else:
        lease.put(path, data, write)


def _remove_manifest(output: str, lease: PublishLease) -> None:
    path = _manifest_path(output)
    if is_local(path):
        lease.remove(path, lambda: remove_inside(output, path, missing_ok=True))
    else:
        lease.remove(path, lambda: FileSystems.delete([path]) if FileSystems.exists(path)
                     else None)


def delete_files(paths: list[str], output: Optional[str] = None) -> None:
    """Delete files: on GCS up to ``_DELETES_PER_CHANGE`` in one batch request (Beam's
    ``FileSystems.delete`` makes a listing and a batch request of its own for every path), a file
    already gone not an error; on local disk each file by its name, reached through no symlink
    below ``output`` (``_delete_local``), every local path first checked to lie in it
    (``layout.require_inside``), and none deleted if one does not."""
    remote = [p for p in paths if p.startswith("gs://")]
    local = [p for p in paths if not p.startswith("gs://")]
    for start in range(0, len(remote), _DELETES_PER_CHANGE):
        chunk = remote[start:start + _DELETES_PER_CHANGE]
        # Beam's own client, set up as its FileSystems are (pipeline options, retries).
        filesystem: Any = FileSystems.get_filesystem(chunk[0])
        gcs = filesystem._gcsIO()  # pylint: disable=protected-access
        failed = {path: status for path, status in gcs.delete_batch(chunk) if status}
        if failed:
            raise IOError(f"GCS refused to delete {failed}")
    if local:
        if output is None:
            raise ValueError(f"local deletes need the output they lie in: {local[:3]}")
        require_inside(output, *local)
        _delete_local(local, output)


def _delete_local(paths: list[str], output: str) -> None:
    """Each local path by its name (a folder with what it holds: ``layout.remove_inside``), as
    Beam's local filesystem deletes it but for two things: Beam takes each path for a glob
    pattern, so that a file named ``*`` (a stray anyone could leave in the output) would take
    every file beside it; and it follows a folder swapped for a symlink after the check."""
    failed: dict[str, Exception] = {}
    for path in paths:
        try:
            remove_inside(output, path)
        except OSError as exc:
            failed[path] = exc
    if failed:
        raise BeamIOError("Delete operation failed", failed)


def delete_tree_fenced(path: str, lease: PublishLease) -> None:
    """Every file under ``path``, and on local disk the folders left empty (Beam's local delete
    does not take them), by the holder of ``lease``, checked before each batch of deletes; on local
    disk only a folder of the output reached through no symlink (``layout.require_inside``). The
    files and (local) folders it removes are added to ``lease.removed``."""
    local = is_local(path)
    if local:
        require_inside(lease.output, path)
    delete_fenced(sorted(list_files(join_path(path, "**"))), lease)
    if local and os.path.isdir(path):
        folders = [join_path(path, os.path.relpath(d, path)) if d != path else path
                   for d, _, _ in os.walk(path)]
        lease.change(remove_inside, lease.output, path.rstrip("/"), True)
        lease.removed += sorted(f for f in folders if not os.path.exists(f))


def _delete_quietly(output: str, paths: list[str]) -> None:
    try:
        for path in paths:
            if is_local(path):
                remove_inside(output, path, missing_ok=True)
            else:
                FileSystems.delete([path])
    except (IOError, ValueError):
        pass  # already gone, or refused: the error that brought us here matters more


def copy_fenced(output: str, source: str, target: str, lease: PublishLease,
                if_generation: int = 0) -> None:
    """Copy so that the target never exists half-written, fenced by ``lease``.

    On GCS a copy creates the object whole, in one request, and only if the target is still at
    ``if_generation`` (0: absent; the generation the caller listed): a stalled holder's late copy
    never replaces what was written since. If the target changed (such a late copy, or its undo,
    landed in between), the lease is checked and the copy made again over what is there now. If
    the lease was lost while the copy ran, it is undone: the generation it created is deleted,
    and nothing if another holder has written the name since. The generation is kept in
    ``lease.copied``.

    On local disk the copy goes to ``_temp/`` first (not a change: nobody reads there) and the
    rename is the change, under the lock a takeover needs."""
    if FileSystems.get_scheme(target) is not None:
        from google.api_core import exceptions  # pylint: disable=import-outside-toplevel

        created: list[int] = []

        def copy() -> None:
            created.append(gcs_copy(source, target, if_generation))

        for _ in range(_COPY_ATTEMPTS):
            try:
                lease.change(copy, undo=lambda: gcs_delete(target, created[-1]))
                lease.copied[target] = created[-1]
                return
            except exceptions.PreconditionFailed:
                found = gcs_read_generation(target)
                _LOG.warning("%s was written by another holder since it was listed (at %s, now "
                             "%s): copied again", target, if_generation or "absent",
                             found or "absent")
                if_generation = found
        raise LeaseLost(f"{target} kept changing under {lease.holder}: another holder of the "
                        f"publish lease on {output} is writing it")
    require_inside(output, source, target)
    temp = temp_path(output)
    try:
        _copy_regular_file(output, source, temp)
        lease.change(rename_inside, output, temp, target)
    except BaseException:
        _delete_quietly(output, [temp])
        raise


def _copy_regular_file(output: str, source: str, target: str) -> None:
    """A local copy of ``source``, a regular file of the output reached through no symlink
    (``layout.open_inside``; Beam's local copy copies a folder whole, following every symlink
    inside it: a manifest naming a staged folder of links would publish files from outside the
    output), to ``target``, a new file made through no symlink (``layout.create_inside``)."""
    try:
        src = open_inside(output, source)
    except UnsafePath as exc:
        raise UnsafePath(f"{exc}: a manifest names regular files only") from None
    with src, create_inside(output, target) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


def _copy_whole(output: str, source: str, target: str, lease: PublishLease,
                if_generation: int = 0) -> None:
    """A staged file of a run copied to its published name (``copy_fenced``)."""
    copy_fenced(output, source, target, lease, if_generation)


def delete_fenced(paths: list[str], lease: PublishLease) -> None:
    """Delete files, the lease checked before each request (of up to ``_DELETES_PER_CHANGE``).
    A delete that lands late (after a takeover) removes only a file listed before it, whose name
    the taker never reuses (file names hold their run id or compaction id)."""
    for start in range(0, len(paths), _DELETES_PER_CHANGE):
        chunk = paths[start:start + _DELETES_PER_CHANGE]
        lease.change(delete_files, chunk, lease.output)
        lease.removed += chunk



def _published(relative_staged: str) -> str:
    """``_staging/<run>/vectors/part-x.parquet`` -> ``vectors/part-x.parquet``."""
    return relative_staged.split("/", 2)[2]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One previous output as a run read its keys: a batch output's committed run (``run_id``),
    or a streaming output (``run_id`` None; no manifest). A streaming output's files can change
    under a reader: a micro-batch redone with another outcome rewrites its key file without a key,
    or deletes it (``transforms.sinks``); compaction replaces micro-batch files by one file an
    hour. So its snapshot pins each micro-batch key file it read by a checksum of its bytes
    (``pins``: (path relative to the output, checksum)); compacted files are not pinned (a
    compaction only ever adds to an hour's compacted file)."""

    prefix: str
    run_id: Optional[str]
    pins: tuple[tuple[str, str], ...] = ()

    def still_holds(self) -> bool:
        """Whether the output still holds what was read: the same run, committed; for a streaming
        output, every pinned key file still there with the same bytes."""
        if self.run_id is None:
            if is_local(self.prefix):  # each pinned file alone, reached through no symlink
                return all(local_checksum(self.prefix, path) == checksum
                           for path, checksum in self.pins)
            now = key_file_checksums(self.prefix)
            return all(now.get(path) == checksum for path, checksum in self.pins)
        current = read_manifest(self.prefix)
        return current is not None and current.state == COMMITTED and current.run_id == self.run_id

    def describe(self) -> str:
        return (f"{self.prefix} (run {self.run_id})" if self.run_id is not None
                else f"{self.prefix} (streaming, {len(self.pins)} micro-batch key files)")

    def to_dict(self) -> dict:
        """As a ``publishing`` manifest records it (``Manifest.skipped_from``)."""
        out: dict = {"prefix": self.prefix, "run_id": self.run_id}
        if self.pins:
            out["pins"] = [list(pin) for pin in self.pins]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Snapshot":
        return cls(data["prefix"], data.get("run_id"),
                   tuple((str(p), str(c)) for p, c in data.get("pins", ())))


class SnapshotChanged(RuntimeError):
    """A previous output that this run skipped articles for was republished while it ran."""


def check_snapshots(output: str, manifest: Manifest, lease: PublishLease) -> Manifest:
    """Before a ``publishing`` manifest is published: each snapshot it skipped articles for must
    still hold the run that was read (``Snapshot.still_holds``). If one
    does not, the manifest it replaced is put back (nothing has been changed yet but the
    manifest), and ``SnapshotChanged`` is raised. If all do, the manifest is written again without
    them, and returned: from then on the publish only goes forward, and a retry does not check
    again. A manifest without snapshots is returned as it is."""
    if not manifest.skipped_from:
        return manifest
    snapshots = [Snapshot.from_dict(s) for s in manifest.skipped_from]
    own = output.rstrip("/") if not is_local(output) else os.path.abspath(output)
    for snapshot in snapshots:  # checked by Manifest.check: plain, so compared by their names
        if snapshot.prefix == own or snapshot.prefix.startswith(own + "/"):
            raise InvalidManifest(
                f"{_manifest_path(output)} is refused, not followed: it skipped articles for "
                f"{snapshot.prefix}, which is this output or inside it (a run never reads its own "
                f"output as a previous one)")
    changed = [s for s in snapshots if not s.still_holds()]
    if changed:
        if manifest.previous is None:
            _remove_manifest(output, lease)
        else:
            write_manifest(output, Manifest.from_dict(manifest.previous), lease)
        raise SnapshotChanged(
            f"run {manifest.run_id} counted articles unchanged because "
            + ", ".join(s.describe() for s in changed)
            + " held them, but each has changed since (republished, being published, or a "
              "micro-batch redone or compacted): nothing published, the output's previous "
              "manifest put back; rerun this run, which reads the new output")
    checked = dataclasses.replace(manifest, skipped_from=None, previous=None)
    write_manifest(output, checked, lease)
    return checked


def _listed(folder: str) -> dict[str, tuple[int, Optional[int]]]:
    """{path: (size, generation)} of the files under a folder: on GCS one listing through
    google-cloud-storage (Beam's has no generations), on local disk generation None."""
    if not folder.startswith("gs://"):
        return {path: (size, None) for path, size in list_files(join_path(folder, "**")).items()}
    bucket, name = gcs_bucket_and_name(folder.rstrip("/") + "/")
    return {f"gs://{bucket.name}/{blob.name}": (int(blob.size), int(blob.generation))
            for blob in bucket.list_blobs(prefix=name)}


def _write_summary(output: str, staged_summary: str, lease: PublishLease) -> None:
    """``_summary.json`` from the staged summary, fenced as the manifest is (``PublishLease.put``:
    on GCS only if unchanged since this holder last saw it, so a stalled publisher's late write
    of its own summary is refused). Never a copy: a copy undone by a publisher that lost its
    lease would delete the name every run shares."""
    source = join_path(output, staged_summary)
    require_inside(output, source)  # never a file a symlinked _staging/ leads to
    with open_output_file(output, source) as f:  # and never one swapped for a symlink since
        data = f.read()
    path = join_path(output, SUMMARY_FILE)
    lease.put(path, data, lambda: write_whole(output, path, lambda f: f.write(data)))


def publish(output: str, manifest: Manifest, lease: PublishLease) -> Manifest:
    """Steps 1-3 of the module docstring, for a manifest in state ``publishing``, by the holder of
    ``lease``: its snapshot check first (``check_snapshots``). Returns the committed manifest."""
    manifest = check_snapshots(output, manifest, lease)
    # First every old file, in every folder, then the new ones: a reader never sees two runs.
    for subdir in PUBLISHED_DIRS:
        ours = {_published(p) for p in getattr(manifest, subdir)}
        delete_fenced([path for path in list_files(join_path(output, subdir, "**"))
                        if relative_to(output, path) not in ours], lease)
    sizes = list_files(join_path(staging_prefix(output, manifest.run_id), "**"))
    for subdir in PUBLISHED_DIRS:
        present = _listed(join_path(output, subdir))
        if is_local(output):
            makedirs_inside(output, join_path(output, subdir))
        else:
            mkdirs(join_path(output, subdir))
        for staged in getattr(manifest, subdir):
            source, target = join_path(output, staged), join_path(output, _published(staged))
            size, generation = present.get(target, (None, 0))
            # On local disk a whole file of the right size is this run's. On GCS only one this
            # holder copied itself: another holder's late copy may still be undone (by its
            # generation), so it is replaced by this holder's own (conditional on it).
            there = size == sizes.get(source) and (
                generation is None or lease.copied.get(target) == generation)
            if not there:
                _copy_whole(output, source, target, lease, generation or 0)
    if manifest.summary != SUMMARY_FILE:
        _write_summary(output, manifest.summary, lease)
    committed = dataclasses.replace(
        manifest, state=COMMITTED, summary=SUMMARY_FILE,
        vectors=[_published(p) for p in manifest.vectors],
        dead_letter=[_published(p) for p in manifest.dead_letter],
        chunks=[_published(p) for p in manifest.chunks],
        keys=[_published(p) for p in manifest.keys],
        committed_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    write_manifest(output, committed, lease)
    delete_tree_fenced(staging_prefix(output, manifest.run_id), lease)
    return committed


def repair(output: str, lease: PublishLease) -> Optional[Manifest]:
    """Finish a publish that was killed midway (its manifest still says ``publishing``, and its
    staged files are whole), by the holder of ``lease``, after its snapshot check (which may put
    the previous manifest back and raise ``SnapshotChanged``). Returns the committed manifest, or
    None if there was nothing to do."""
    current = read_manifest(output, lease)
    if current is None or current.state != PUBLISHING:
        return None
    return publish(output, current, lease)


def remove_strays(output: str, lease: PublishLease) -> list[str]:
    """Delete the files of the published folders that a committed manifest does not name: what a
    publisher that lost its lease may have landed after the taker published (a late copy it could
    not undo). Nothing while the manifest says publishing, or without a manifest (a streaming
    output)."""
    current = read_manifest(output, lease)
    if current is None or current.state != COMMITTED:
        return []
    strays = []
    for subdir in PUBLISHED_DIRS:
        ours = set(getattr(current, subdir))
        strays += [path for path in list_files(join_path(output, subdir, "**"))
                   if relative_to(output, path) not in ours]
    delete_fenced(strays, lease)
    return strays


def missing_files(output: str) -> list[str]:
    """The files the committed manifest names that are not there (relative to the output), the
    summary included: an output whose readers would fail or miss rows. None missing, or no
    committed manifest (a streaming output, a publish in progress): []."""
    current = read_manifest(output)
    if current is None or current.state != COMMITTED:
        return []
    named = [p for subdir in PUBLISHED_DIRS for p in getattr(current, subdir)] + [current.summary]
    present = {relative_to(output, p) for subdir in PUBLISHED_DIRS
               for p in list_files(join_path(output, subdir, "**"))}
    present |= {relative_to(output, p) for p in list_files(join_path(output, SUMMARY_FILE))}
    return sorted(p for p in named if p not in present)


class SummaryUnavailable(FileNotFoundError):
    """An output has no committed run, so no summary of one."""


def published_summary(output: str) -> RunSummary:
    """The summary of the output's committed run: ``_summary.json`` if it is that run's (its
    ``run_id`` the manifest's); else, with a warning, what the manifest says of the run
    (``run_id``, ``counts``, and ``summary_unavailable`` saying why), which holds no model or
    settings. An output whose ``_summary.json`` is another run's (a stalled publisher of an
    earlier release overwrote it) is never taken for the committed run's.
    ``SummaryUnavailable`` if no run is committed."""
    current = read_manifest(output)
    if current is None or current.state != COMMITTED:
        raise SummaryUnavailable(f"{output}: no committed run, so no {SUMMARY_FILE} of one (its "
                                 f"manifest is {'absent' if current is None else current.state})")
    path = join_path(output, current.summary)
    reason = None
    try:
        # a regular file, through no symlink: never a file outside echoed
        with open_output_file(output, path) as f:
            summary: Optional[RunSummary] = RunSummary.from_json(f.read())
    # gone (FileNotFoundError, BeamIOError), torn, refused, nested too deep (RecursionError)
    except (OSError, ValueError, RecursionError) as exc:
        summary, reason = None, f"{path} could not be read ({type(exc).__name__})"
    if summary is not None and summary.run_id != current.run_id:
        reason = f"{path} is run {summary.run_id}'s, not the committed run {current.run_id}'s"
        summary = None
    if summary is not None:
        return summary
    _LOG.warning("%s: %s; the committed run's counts are taken from its manifest (newsvec "
                 "cleanup names what is missing)", output, reason)
    return RunSummary(run_id=current.run_id, counts=current.counts, summary_unavailable=reason)


def min_stale_age_s() -> float:
    """The youngest a staged or temporary file taken for a dead run's may be."""
    return 0.0 if unsafe_test_timings() else MIN_STALE_AGE_S


def require_stale_age(older_than_s: float) -> float:
    floor = min_stale_age_s()
    if older_than_s < floor:
        raise ValueError(f"older than {older_than_s:g} s: a staged or temporary file that young "
                         f"may be a live run's; the least is {floor:g} s")
    return older_than_s


def _runs_being_published(manifest: Optional[Manifest]) -> set[str]:
    """The runs whose staged files a publishing manifest may still need: its own, and those of the
    publishing manifests it would put back (``previous``)."""
    runs: set[str] = set()
    current: Optional[dict[str, Any]] = manifest.to_dict() if manifest is not None else None
    while current is not None and current.get("state") == PUBLISHING:
        runs.add(current["run_id"])
        current = current.get("previous")
    return runs


def clean_stale(output: str, older_than_s: float, lease: PublishLease,
                now: Optional[float] = None) -> list[str]:
    """Delete what killed workers and runs leave behind, by the holder of ``lease`` (checked
    before each batch of deletes): the files under ``_temp/`` last written more than
    ``older_than_s`` ago (by the storage's clock: ``PublishLease.storage_time``),
    and the staging folders ``_staging/<run_id>/`` whose newest file is that old (a run that still
    writes keeps all of its files). ``older_than_s`` is at least ``MIN_STALE_AGE_S``. Never the
    files of a run that the manifest says is publishing (``repair`` finishes that one), never
    published data."""
    require_stale_age(older_than_s)
    # The ages are the storage's (GCS's ``updated``): counted on its clock, not this machine's.
    now = lease.storage_time() if now is None else now
    keep = _runs_being_published(read_manifest(output, lease))
    # A symlinked _staging/ or _temp/ is refused before it is listed (Beam's local listing walks
    # a symlinked root): its files are not the output's.
    require_inside(output, join_path(output, STAGING_DIR), join_path(output, TEMP_DIR))
    doomed: list[str] = []
    staging_root = join_path(output, STAGING_DIR, "")
    runs: dict[str, list] = {}
    for match in FileSystems.match([join_path(output, STAGING_DIR, "**")])[0].metadata_list:
        run = match.path[len(staging_root):].split("/", 1)[0]
        runs.setdefault(run, []).append(match)
    for run, matches in sorted(runs.items()):
        newest = max(m.last_updated_in_seconds for m in matches)
        if run not in keep and now - newest > older_than_s:
            doomed += sorted(m.path for m in matches)
    for match in FileSystems.match([join_path(output, TEMP_DIR, "**")])[0].metadata_list:
        if now - match.last_updated_in_seconds > older_than_s:
            doomed.append(match.path)
    delete_fenced(doomed, lease)
    return doomed


def dead_letter_reasons(paths: Iterable[str], output: Optional[str] = None
                        ) -> list[tuple[Optional[str], str]]:
    """The (language, reason) of every dead letter in these JSON Lines files of ``output`` (one
    JSON per line; language None where the event gave none, or in files written before it was
    kept), each opened by ``layout.open_output_file``: a symlink or a FIFO in place of one is an
    ``UnsafePath`` naming it, never read or waited on. Without ``output``, each file's own
    (``layout.output_of``)."""
    letters = []
    for path in paths:
        with open_output_file(output or output_of(path), path) as f:
            for line in f.read().splitlines():
                if line:
                    letter = json.loads(line)
                    letters.append((letter.get("language"), letter["reason"]))
    return letters


def count_stored(vectors: Iterable[str], dead_letters: Iterable[str],
                 chunks: Iterable[str] = (), output: Optional[str] = None) -> Counts:
    """What the files of ``output`` hold: rows and chunk rows (Parquet footers), and dead letters
    by reason and by language; each file opened by ``layout.open_output_file`` (without
    ``output``: its own, ``layout.output_of``)."""
    letters = dead_letter_reasons(dead_letters, output)
    reasons = Counts.by_reason(reason for _, reason in letters)
    return Counts(written=parquet_rows(vectors, output), dead_lettered=sum(reasons.values()),
                  dead_lettered_by_reason=reasons,
                  dead_lettered_by_language=Counts.by_language(letters),
                  chunks_written=parquet_rows(chunks, output))

"""A batch output's manifest, and publishing a staged run under it: no Beam here.

A batch run writes into ``<output>/_staging/<run_id>/`` (``vectors/``, ``dead_letter/``,
``chunks/`` in chunks mode, ``keys/``, ``_summary.json``). Once the run balances (``CommitRun`` in
``transforms.commit``, the job's last step), ``publish``:

1. writes ``_manifest.json`` (state ``publishing``) naming the staged files: from this moment a
   reader that follows the manifest reads the new run, whole;
2. deletes every file of the published folders (``vectors/``, ``dead_letter/``, ``chunks/``,
   ``keys/``) that is not this run's, then copies this run's files in (a copy, so that the staged
   files the manifest names stay whole meanwhile): a reader that globs ``vectors/**/*.parquet``
   sees part of the old run, then part of the new one, never rows of two runs at once;
3. copies the summary, writes the manifest again (state ``committed``, naming the published files)
   and deletes the staging folder.

Every step can run again (a retried bundle, ``repair``). Only the holder of the output's publish
lease (``transforms.lease``) publishes, and it checks the lease before every file it writes,
deletes or copies: a publisher whose lease was taken over stops before it changes one more file.
``repair`` and ``clean_stale`` serve ``newsvec cleanup`` (``pipeline/cleanup.py``) after a kill.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import shutil
import time
from typing import Iterable, Optional

from apache_beam.io.filesystems import FileSystems

from transforms.layout import (
    MANIFEST_FILE,
    PUBLISHED_DIRS,
    STAGING_DIR,
    SUMMARY_FILE,
    TEMP_DIR,
    join_path,
    list_files,
    mkdirs,
    parquet_rows,
    relative_to,
    staging_prefix,
    temp_path,
    write_whole,
)
from transforms.lease import PublishLease
from transforms.schema import Counts

PUBLISHING, COMMITTED = "publishing", "committed"
STALE_AFTER_S = 2 * 86400  # older staged or temporary files than this are a dead run's


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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def read_manifest(output: str) -> Optional[Manifest]:
    path = join_path(output, MANIFEST_FILE)
    if not FileSystems.exists(path):
        return None
    with FileSystems.open(path) as f:
        return Manifest(**json.loads(f.read().decode("utf-8")))


def write_manifest(output: str, manifest: Manifest) -> None:
    """Replace ``<output>/_manifest.json`` whole."""
    data = manifest.to_json().encode("utf-8")
    write_whole(output, join_path(output, MANIFEST_FILE), lambda f: f.write(data))


def delete_tree(path: str) -> None:
    """Every file under ``path``, and on local disk the folders left empty."""
    files = list(list_files(join_path(path, "**")))
    if files:
        FileSystems.delete(files)
    if FileSystems.get_scheme(path) is None:  # a local path
        shutil.rmtree(path, ignore_errors=True)  # Beam's local delete does not take empty folders


def _copy_whole(output: str, source: str, target: str) -> None:
    """Copy so that the target never exists half-written: a GCS copy creates the object whole; on
    local disk the copy goes to ``_temp/`` first and is renamed."""
    if FileSystems.get_scheme(target) is not None:
        FileSystems.copy([source], [target])
        return
    temp = temp_path(output)
    FileSystems.copy([source], [temp])
    FileSystems.rename([temp], [target])


def _published(relative_staged: str) -> str:
    """``_staging/<run>/vectors/part-x.parquet`` -> ``vectors/part-x.parquet``."""
    return relative_staged.split("/", 2)[2]


def publish(output: str, manifest: Manifest, lease: PublishLease) -> Manifest:
    """Steps 1-3 of the module docstring, for a manifest in state ``publishing``, by the holder of
    ``lease``. Returns the committed manifest."""

    def change(action, *args) -> None:
        lease.check()  # fenced: never one more change once the lease is lost
        action(*args)

    change(write_manifest, output, manifest)
    # First every old file, in every folder, then the new ones: a reader never sees two runs.
    for subdir in PUBLISHED_DIRS:
        ours = {_published(p) for p in getattr(manifest, subdir)}
        for path in list_files(join_path(output, subdir, "**")):
            if relative_to(output, path) not in ours:
                change(FileSystems.delete, [path])
    sizes = list_files(join_path(staging_prefix(output, manifest.run_id), "**"))
    for subdir in PUBLISHED_DIRS:
        present = list_files(join_path(output, subdir, "**"))
        mkdirs(join_path(output, subdir))
        for staged in getattr(manifest, subdir):
            source, target = join_path(output, staged), join_path(output, _published(staged))
            if present.get(target) != sizes.get(source):  # not there yet, or a torn local copy
                change(_copy_whole, output, source, target)
    if manifest.summary != SUMMARY_FILE:
        change(FileSystems.copy, [join_path(output, manifest.summary)],
               [join_path(output, SUMMARY_FILE)])
    committed = dataclasses.replace(
        manifest, state=COMMITTED, summary=SUMMARY_FILE,
        vectors=[_published(p) for p in manifest.vectors],
        dead_letter=[_published(p) for p in manifest.dead_letter],
        chunks=[_published(p) for p in manifest.chunks],
        keys=[_published(p) for p in manifest.keys],
        committed_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    change(write_manifest, output, committed)
    change(delete_tree, staging_prefix(output, manifest.run_id))
    return committed


def repair(output: str, lease: PublishLease) -> Optional[Manifest]:
    """Finish a publish that was killed midway (its manifest still says ``publishing``, and its
    staged files are whole), by the holder of ``lease``. Returns the committed manifest, or None if
    there was nothing to do."""
    current = read_manifest(output)
    if current is None or current.state != PUBLISHING:
        return None
    return publish(output, current, lease)


def clean_stale(output: str, older_than_s: float, now: Optional[float] = None) -> list[str]:
    """Delete what killed workers and runs leave behind: files under ``_temp/`` and
    ``_staging/<run_id>/`` last written more than ``older_than_s`` ago. Never the files of a run
    that the manifest says is publishing (``repair`` finishes that one), never published data."""
    now = time.time() if now is None else now
    current = read_manifest(output)
    keep = (join_path(staging_prefix(output, current.run_id), "")
            if current is not None and current.state == PUBLISHING else None)
    doomed = []
    for subdir in (TEMP_DIR, STAGING_DIR):
        for match in FileSystems.match([join_path(output, subdir, "**")])[0].metadata_list:
            if keep and match.path.startswith(keep):
                continue
            if now - match.last_updated_in_seconds > older_than_s:
                doomed.append(match.path)
    if doomed:
        FileSystems.delete(doomed)
    return doomed


def dead_letter_reasons(paths: Iterable[str]) -> list[tuple[Optional[str], str]]:
    """The (language, reason) of every dead letter in these JSON Lines files (one JSON per line;
    language None where the event gave none, or in files written before it was kept)."""
    letters = []
    for path in paths:
        with FileSystems.open(path) as f:
            for line in f.read().splitlines():
                if line:
                    letter = json.loads(line)
                    letters.append((letter.get("language"), letter["reason"]))
    return letters


def count_stored(vectors: Iterable[str], dead_letters: Iterable[str],
                 chunks: Iterable[str] = ()) -> Counts:
    """What the files hold: rows and chunk rows (Parquet footers), and dead letters by reason and
    by language."""
    letters = dead_letter_reasons(dead_letters)
    reasons = Counts.by_reason(reason for _, reason in letters)
    return Counts(written=parquet_rows(vectors), dead_lettered=sum(reasons.values()),
                  dead_lettered_by_reason=reasons,
                  dead_lettered_by_language=Counts.by_language(letters),
                  chunks_written=parquet_rows(chunks))

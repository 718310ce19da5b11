"""Commit a batch run: check its ledger against what it wrote, then publish it, so that a rerun of the
same input into the same output replaces the previous run, never appends to it.

A batch run writes into ``<output>/_staging/<run_id>/`` (``vectors/``, ``dead_letter/``,
``chunks/`` in chunks mode, ``keys/``, ``_summary.json``). Nothing under ``vectors/`` or ``dead_letter/`` changes until the whole job has
succeeded: a run that fails or is killed midway leaves the previous output as it was. Then
``CommitRun``, the job's last step:

1. counts what is in storage (rows from the Parquet footers, dead letters by reason from the JSON
   Lines) and checks ``in = written + dead_lettered + duplicates + unchanged`` against the job's
   own counts (and one key in ``keys/`` per row); a run that does not balance fails here and
   publishes nothing;
2. writes ``_manifest.json`` (state ``publishing``) naming the staged files: from this moment a reader
   that follows the manifest reads the new run, whole;
3. deletes every file of the published folders (``vectors/``, ``dead_letter/``, ``chunks/``,
   ``keys/``) that is not this run's, then copies this run's files in (a copy, so that the staged
   files the manifest names stay whole meanwhile): a reader that globs ``vectors/**/*.parquet``
   sees part of the old run, then part of the new one, never rows of two runs at once;
4. copies the summary, writes the manifest again (state ``committed``, naming the published files),
   deletes the staging folder, and deletes what runs killed before they committed left in
   ``_staging/`` and ``_temp/`` more than ``STALE_AFTER_S`` ago.

Every step can run again (a retried bundle, ``repair``), and only one run publishes into an output at
a time: another run's ``publishing`` manifest younger than the lease makes the commit wait.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import logging
import shutil
import time
import uuid
from typing import Optional

import apache_beam as beam
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from transforms.sinks import (CHUNKS_DIR, DEAD_LETTER_DIR, KEYS_DIR, SUMMARY_FILE, TEMP_DIR,
                             VECTORS_DIR, join_path, mkdirs)

_LOG = logging.getLogger(__name__)
STAGING_DIR = "_staging"
MANIFEST_FILE = "_manifest.json"
PUBLISHED_DIRS = (VECTORS_DIR, DEAD_LETTER_DIR, CHUNKS_DIR, KEYS_DIR)
PUBLISHING, COMMITTED = "publishing", "committed"
STALE_AFTER_S = 2 * 86400  # older staged or temporary files than this are a dead run's


class AccountingError(RuntimeError):
    """Some input is neither written, dead-lettered nor a counted duplicate."""


def staging_prefix(output: str, run_id: str) -> str:
    return join_path(output, STAGING_DIR, run_id)


@dataclasses.dataclass(frozen=True)
class Manifest:
    """``<output>/_manifest.json``: which run the output holds, and its files (relative to the
    output prefix). Readers that must never see a partial or mixed output read these files."""

    run_id: str
    state: str  # "publishing": the files are the staged copies; "committed": the published ones
    started_at: float  # when publishing began (Unix seconds): the lease runs from here
    vectors: list
    dead_letter: list
    summary: str
    counts: dict
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


def _relative(output: str, path: str) -> str:
    prefix = output.rstrip("/") + "/"
    if not path.startswith(prefix):
        raise ValueError(f"{path} is not under {prefix}")
    return path[len(prefix):]


def _write(output: str, relative: str, data: bytes) -> None:
    """Replace ``<output>/<relative>`` whole: written under ``_temp/`` and renamed (an object
    upload is atomic on GCS; a rename is on local disk)."""
    temp = join_path(output, TEMP_DIR, f"{uuid.uuid4().hex}.tmp")
    mkdirs(join_path(output, TEMP_DIR))
    with FileSystems.create(temp) as f:
        f.write(data)
    FileSystems.rename([temp], [join_path(output, relative)])


def _files(pattern: str) -> dict[str, int]:
    """{path: size} of the files matching a glob; {} when none."""
    return {m.path: m.size_in_bytes for m in FileSystems.match([pattern])[0].metadata_list}


def _delete_tree(path: str) -> None:
    """Every file under ``path``, and on local disk the folders left empty."""
    files = list(_files(join_path(path, "**")))
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
    temp = join_path(output, TEMP_DIR, f"{uuid.uuid4().hex}.tmp")
    mkdirs(join_path(output, TEMP_DIR))
    FileSystems.copy([source], [temp])
    FileSystems.rename([temp], [target])


def _published(relative_staged: str) -> str:
    """``_staging/<run>/vectors/part-x.parquet`` -> ``vectors/part-x.parquet``."""
    return relative_staged.split("/", 2)[2]


def _wait_for_other_publisher(output: str, run_id: str, lease_s: float, poll_s: float) -> None:
    while True:
        current = read_manifest(output)
        if current is None or current.state == COMMITTED or current.run_id == run_id:
            return
        age = time.time() - current.started_at
        if age > lease_s:
            _LOG.warning("run %s began publishing into %s %.0f s ago and never finished (killed?): "
                         "run %s takes over", current.run_id, output, age, run_id)
            return
        _LOG.info("run %s is publishing into %s; run %s waits", current.run_id, output, run_id)
        time.sleep(poll_s)


def publish(output: str, manifest: Manifest, lease_s: float = 600, poll_s: float = 5) -> Manifest:
    """Steps 2-4 of the module docstring, for a manifest in state ``publishing``. Returns the
    committed manifest."""
    while True:
        _wait_for_other_publisher(output, manifest.run_id, lease_s, poll_s)
        _write(output, MANIFEST_FILE, manifest.to_json().encode("utf-8"))
        time.sleep(min(poll_s, 1.0))  # two runs that wrote it at once: the last write stands
        if read_manifest(output).run_id == manifest.run_id:
            break
    # First every old file, in every folder, then the new ones: a reader never sees two runs.
    for subdir in PUBLISHED_DIRS:
        ours = {_published(p) for p in getattr(manifest, subdir)}
        stale = [p for p in _files(join_path(output, subdir, "**"))
                 if _relative(output, p) not in ours]
        if stale:
            FileSystems.delete(stale)
    sizes = _files(join_path(staging_prefix(output, manifest.run_id), "**"))
    for subdir in PUBLISHED_DIRS:
        present = _files(join_path(output, subdir, "**"))
        mkdirs(join_path(output, subdir))
        for staged in getattr(manifest, subdir):
            source, target = join_path(output, staged), join_path(output, _published(staged))
            if present.get(target) != sizes.get(source):  # not there yet, or a torn local copy
                _copy_whole(output, source, target)
    summary_target = join_path(output, SUMMARY_FILE)
    if manifest.summary != SUMMARY_FILE:
        FileSystems.copy([join_path(output, manifest.summary)], [summary_target])
    committed = dataclasses.replace(
        manifest, state=COMMITTED, summary=SUMMARY_FILE,
        vectors=[_published(p) for p in manifest.vectors],
        dead_letter=[_published(p) for p in manifest.dead_letter],
        chunks=[_published(p) for p in manifest.chunks],
        keys=[_published(p) for p in manifest.keys],
        committed_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    _write(output, MANIFEST_FILE, committed.to_json().encode("utf-8"))
    _delete_tree(staging_prefix(output, manifest.run_id))
    return committed


def repair(output: str, lease_s: float = 600) -> Optional[Manifest]:
    """Finish a publish that was killed midway (its manifest still says ``publishing``, and its
    staged files are whole). Returns the committed manifest, or None if there was nothing to do."""
    current = read_manifest(output)
    if current is None or current.state != PUBLISHING:
        return None
    return publish(output, current, lease_s=lease_s)


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


def parquet_rows(paths: list[str]) -> int:
    """Rows in these Parquet files, from their footers."""
    rows = 0
    for path in paths:
        with FileSystems.open(path) as f:
            rows += pq.ParquetFile(f).metadata.num_rows
    return rows


def count_stored(output: str, vectors: list[str], dead_letters: list[str],
                 chunks: list[str] = ()) -> dict:
    """What the files hold: rows and chunk rows (Parquet footers), and dead letters by reason (one
    JSON per line)."""
    rows = parquet_rows(vectors)
    reasons = collections.Counter()
    for path in dead_letters:
        with FileSystems.open(path) as f:
            reasons.update(json.loads(line)["reason"] for line in f.read().splitlines() if line)
    return {"written": rows, "dead_lettered": sum(reasons.values()),
            "dead_lettered_by_reason": dict(sorted(reasons.items())),
            "chunks_written": parquet_rows(list(chunks))}


class _CommitFn(beam.DoFn):
    def __init__(self, output: str, run_id: str, summary: dict, lease_s: float):
        self._output, self._run_id, self._summary, self._lease_s = output, run_id, summary, lease_s

    def process(self, _, staged, tallies):
        current = read_manifest(self._output)
        if current is not None and current.run_id == self._run_id and current.state == COMMITTED:
            # A retry of a commit that went through (its staging is gone): nothing left to do.
            with FileSystems.open(join_path(self._output, SUMMARY_FILE)) as f:
                yield json.loads(f.read().decode("utf-8"))
            return
        files = {subdir: [] for subdir in PUBLISHED_DIRS}
        for subdir, path in staged:
            files[subdir].append(path)
        files = {subdir: sorted(paths) for subdir, paths in files.items()}
        tallies = collections.defaultdict(int, tallies)
        stored = count_stored(self._output, files[VECTORS_DIR], files[DEAD_LETTER_DIR],
                              files[CHUNKS_DIR])
        keys = parquet_rows(files[KEYS_DIR])
        counts = {"in": tallies["in"], **stored, "duplicates": tallies["duplicates"],
                  "unchanged": tallies["unchanged"], "truncated": tallies["truncated"]}
        counts["accounted"] = (counts["written"] + counts["dead_lettered"] + counts["duplicates"]
                               + counts["unchanged"])
        holds = counts["in"] == counts["accounted"]
        summary = {**self._summary, "run_id": self._run_id, "counts": counts,
                   "invariant_holds": holds}
        if (not holds or stored["written"] != tallies["rows"]
                or stored["chunks_written"] != tallies["chunks"] or keys != stored["written"]):
            raise AccountingError(
                f"run {self._run_id} does not balance, nothing published: in={counts['in']}, "
                f"written (in storage)={counts['written']} (rows sent: {tallies['rows']}, keys "
                f"{keys}), dead_lettered={counts['dead_lettered']}, duplicates="
                f"{counts['duplicates']}, unchanged={counts['unchanged']}, chunks (in storage)="
                f"{counts['chunks_written']} (sent: {tallies['chunks']})")
        staging = staging_prefix(self._output, self._run_id)
        summary_path = join_path(staging, SUMMARY_FILE)
        with FileSystems.create(summary_path, mime_type="application/json") as f:
            f.write(json.dumps(summary, indent=2, default=str).encode("utf-8"))
        manifest = Manifest(
            run_id=self._run_id, state=PUBLISHING, started_at=time.time(),
            summary=_relative(self._output, summary_path), counts=counts,
            **{subdir: [_relative(self._output, p) for p in paths]
               for subdir, paths in files.items()})
        publish(self._output, manifest, self._lease_s)
        # What runs killed before their commit left here (on local disk, also partial files).
        clean_stale(self._output, STALE_AFTER_S)
        yield summary


def tally(pcoll, name: str, value=lambda _: 1):
    """(name, value) per element, for ``CommitRun``'s ``tallies`` (summed per name)."""
    return pcoll | f"Tally_{name}" >> beam.Map(lambda x: (name, value(x)))


class CommitRun(beam.PTransform):
    """The batch job's last step (see the module docstring), applied to the pipeline. It reads, as
    side inputs, the names of the files the run staged (``files``: the writes' outputs, so it runs
    after them, by folder: ``vectors``, ``dead_letter``, and ``chunks``, ``keys`` where written)
    and the tallies ``in``, ``rows`` (sent to the writer), ``duplicates``, ``unchanged``,
    ``truncated``, ``chunks`` (sent). Output: the summary."""

    def __init__(self, output: str, run_id: str, summary: dict, *, files: dict, tallies: list,
                 lease_s: float = 600):
        super().__init__()
        unknown = set(files) - set(PUBLISHED_DIRS)
        if unknown:
            raise ValueError(f"not a published folder: {sorted(unknown)}")
        self._fn = _CommitFn(output, run_id, summary, lease_s)
        self._files, self._tallies = files, tallies

    def expand(self, pbegin):
        totals = (self._tallies | "FlattenTallies" >> beam.Flatten()
                  | "SumTallies" >> beam.CombinePerKey(sum))
        staged = (tuple(names | f"In_{subdir}" >> beam.Map(lambda p, d=subdir: (d, p))
                        for subdir, names in self._files.items())
                  | "StagedFiles" >> beam.Flatten())
        return (pbegin
                | "Once" >> beam.Create([None])
                | "CheckAndPublish" >> beam.ParDo(
                    self._fn, beam.pvalue.AsList(staged), beam.pvalue.AsDict(totals)))

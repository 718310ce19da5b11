"""Compaction of a streaming output: a closed hour's micro-batch files rewritten, one file a kind.

A streaming job writes up to five small files per micro-batch (``transforms.sinks``,
``WriteStreaming``): hundreds of thousands a day, which slow every reader that lists them.
``compact_partition`` rewrites one partition (``dt=YYYY-MM-DD/hour=HH``) into one file per kind::

    vectors/<partition>/compacted-<id>.parquet       row groups of ``sink.row_group_rows``
    chunks/<partition>/compacted-<id>.parquet        (chunks mode)
    keys/<partition>/compacted-<id>.parquet
    dead_letter/<partition>/compacted-<id>.jsonl
    ledger/<partition>/compacted-<id>.jsonl          the micro-batches' ledger records, one a line
    _compaction/<partition>/manifest.json            which micro-batches those files replace

It takes the micro-batches whose ledger record it finds when it starts (a record is written after
its files, so they are whole) and nothing else: a micro-batch that lands while it runs, or a data
file without a record yet, stays as it is, and the next run merges it with the compacted files.

The order of operations makes every step safe to kill. Under the output's publish lease (one
compaction, publish or clean-up at a time), every change fenced by it (``PublishLease.change``:
on local disk the lease checked and the change made under the one ``flock`` a takeover needs; on
GCS the lease read again just before each request, the manifest written only if it is still at
the generation this run read, a copy read again after and undone if the lease was lost):

1. write the new compacted files (the rows of the current compacted files, then of the new
   micro-batches), each to ``_temp/`` first and then moved into place (a rename on local disk, a
   copy on GCS);
2. write the manifest: from this moment readers that follow it read the new files, and the
   replaced micro-batch files are ignored wherever they are still found. On GCS it is written
   only if no one wrote it since this run read it: a compaction frozen before its write lands,
   whose lease was taken over meanwhile, is refused by GCS, never lands over the taker's;
3. delete the replaced micro-batch files and the superseded compacted files, and what a killed
   run left: compacted files no manifest names (written, never adopted), micro-batch files the
   manifest says it replaced (adopted, never deleted).

The leftovers are deleted only after this run's own manifest write (or, with nothing new to
compact, after a rewrite of the manifest as it was read, on GCS): on GCS an unadopted compacted
file may be a stalled run's whose manifest write is still on its way; once this run has written
the manifest, that late write is refused, and the file is no one's.

Before step 2, readers that follow the manifest or the ledger (``resolve``, ``ledger_records``,
``current_files``) see the old state: the new compacted files are named by no manifest, so they
are skipped. From step 2 on they see the new one: the replaced files are skipped. So a row is never
counted twice or not at all. A reader that only globs ``vectors/**/*.parquet`` (DuckDB) sees the
new compacted file beside the files it replaces from step 1 until step 3 ends (seconds): rows twice.
``newsvec ledger`` names that state (an unfinished compaction) until a run finishes it.

No Beam pipeline: one process reads and writes a partition at a time, through Beam's
``FileSystems`` (local disk or ``gs://``), streaming row groups (``ParquetWriter``), so memory is
about two row groups whatever the size of the hour.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as dt
import json
import logging
import re
from typing import Callable, Iterable, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from transforms.output import layout
from transforms.output.layout import (
    CHUNKS_DIR,
    COMPACTED_PREFIX,
    COMPACTION_DIR,
    DEAD_LETTER_DIR,
    KEYS_DIR,
    LEDGER_DIR,
    PARTITION_FORMAT,
    RUN_ID_FORMAT,
    VECTORS_DIR,
    InvalidManifest,
    is_compacted,
    is_local,
    join_path,
    list_files,
    new_run_id,
    open_output_file,
    relative_to,
    require_run_id,
    safe_relative,
    temp_path,
    write_whole,
)
from transforms.output.lease import PublishLease
from transforms.output.manifest import copy_fenced, delete_fenced
from transforms.output.parquet import common_schema, conform
from transforms.types import LedgerRecord

MANIFEST_NAME = "manifest.json"
_LOG = logging.getLogger(__name__)
# Each kind: its folder, the compacted file's suffix, and the ledger record's field naming its file.
PARQUET_KINDS = {VECTORS_DIR: "vectors_file", CHUNKS_DIR: "chunks_file", KEYS_DIR: "keys_file"}
KINDS = (VECTORS_DIR, CHUNKS_DIR, KEYS_DIR, DEAD_LETTER_DIR, LEDGER_DIR)
_SUFFIX = {VECTORS_DIR: ".parquet", CHUNKS_DIR: ".parquet", KEYS_DIR: ".parquet",
           DEAD_LETTER_DIR: ".jsonl", LEDGER_DIR: ".jsonl"}
# What readers take from each kind's folder: the ledger's records are .json, compacted .jsonl.
_READ_SUFFIXES: dict[str, tuple[str, ...]] = {
    **{kind: (suffix,) for kind, suffix in _SUFFIX.items()}, LEDGER_DIR: (".json", ".jsonl")}
_RECORD_FIELD = {**PARQUET_KINDS, DEAD_LETTER_DIR: "dead_letter_file"}


@dataclasses.dataclass(frozen=True)
class CompactionManifest:
    """``_compaction/<partition>/manifest.json``: the partition's compacted files (relative to the
    output, with their rows or lines) and every micro-batch file they replace, grouped by
    micro-batch (``batches``: its ledger record's path, and its data files by kind)."""

    partition: str
    compaction_id: str
    compacted_at: str
    files: dict  # kind -> {"path": relative path, "rows": rows or lines}
    batches: list  # [{"record": relative path, "files": {kind: relative path}}]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    def replaced(self) -> dict[str, str]:
        """{micro-batch file: the compacted file that holds its rows}, ledger records included."""
        out = {}
        for batch in self.batches:
            out[batch["record"]] = self.files[LEDGER_DIR]["path"]
            for kind, path in batch["files"].items():
                out[path] = self.files[kind]["path"]
        return out

    def current(self) -> set[str]:
        return {f["path"] for f in self.files.values()}

    @classmethod
    def from_dict(cls, data: object, partition: str) -> "CompactionManifest":
        """The manifest of ``partition`` these fields make, checked: ``ValueError`` (or
        ``TypeError``) unless its partition is ``partition``, its id ``new_run_id``'s format,
        every compacted file ``<kind>/<partition>/compacted-<id><suffix>`` of a kind it knows,
        and every replaced file a plain relative path under ``<kind>/<partition>/`` (the ledger
        record's under ``ledger/<partition>/``). Never followed otherwise."""
        if not isinstance(data, dict):
            raise ValueError(f"a manifest is a JSON object, not {type(data).__name__}")
        manifest = cls(**data)
        if manifest.partition != partition or not PARTITION_FORMAT.fullmatch(partition):
            raise ValueError(f"partition {manifest.partition!r} is not its folder's, {partition}")
        require_run_id(manifest.compaction_id)
        if not isinstance(manifest.files, dict) or not isinstance(manifest.batches, list):
            raise ValueError("files is not an object, or batches not a list")
        for kind, file in manifest.files.items():
            if kind not in KINDS or not isinstance(file, dict):
                raise ValueError(f"files: {kind!r} is not a kind of file it compacts")
            path = safe_relative(file.get("path"), join_path(kind, partition))
            name = re.escape(COMPACTED_PREFIX) + RUN_ID_FORMAT.pattern + re.escape(_SUFFIX[kind])
            if not re.fullmatch(name, path.rsplit("/", 1)[-1]) or path.count("/") != 3:
                raise ValueError(f"files: {path!r} is not a compacted {kind} file of {partition}")
        for batch in manifest.batches:
            if not isinstance(batch, dict) or not isinstance(batch.get("files"), dict):
                raise ValueError(f"batches: {batch!r} is not a micro-batch's files")
            safe_relative(batch.get("record"), join_path(LEDGER_DIR, partition))
            for kind, path in batch["files"].items():
                if kind not in _RECORD_FIELD:
                    raise ValueError(f"batches: {kind!r} is not a kind of file it compacts")
                safe_relative(path, join_path(kind, partition))
        return manifest


def manifest_path(output: str, partition: str) -> str:
    return join_path(output, COMPACTION_DIR, partition, MANIFEST_NAME)


def read_compaction(output: str, partition: str, lease: Optional[PublishLease] = None
                    ) -> Optional[CompactionManifest]:
    """A partition's compaction manifest, or None. With ``lease`` (its holder's read, before it
    compacts), on GCS the generation read is kept for the holder's conditional write."""
    path = manifest_path(output, partition)
    if lease is not None and path.startswith("gs://"):
        data = lease.read_object(path)
        return None if data is None else _parse(path, data, partition)
    if is_local(path):  # a regular file, through no symlink, without waiting on a FIFO
        try:
            return _parse(path, layout.read_inside(output, path), partition)
        except FileNotFoundError:
            return None
    if not FileSystems.exists(path):
        return None
    with FileSystems.open(path) as f:
        return _parse(path, f.read(), partition)


def _parse(path: str, data: bytes, partition: str) -> CompactionManifest:
    """``CompactionManifest.from_dict``; ``InvalidManifest`` naming ``path`` if it is refused."""
    try:
        return CompactionManifest.from_dict(json.loads(data.decode("utf-8")), partition)
    except (TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise InvalidManifest(
            f"{path} is refused, not followed: {exc}. No newsvec compaction writes such a "
            f"manifest: whoever can write the output wrote it; see what it names, then move it "
            f"aside") from None


def _write_manifest(output: str, manifest: CompactionManifest, lease: PublishLease) -> None:
    """The partition's manifest, whole, fenced (``PublishLease.put``: on GCS only if it is still
    at the generation this holder read, so a stalled holder's late write is refused)."""
    path = manifest_path(output, manifest.partition)
    data = manifest.to_json().encode("utf-8")
    lease.put(path, data, lambda: write_whole(output, path, lambda f: f.write(data)))


def partition_of(relative: str) -> str:
    """``vectors/dt=…/hour=…/name`` -> ``dt=…/hour=…``."""
    parts = relative.split("/")
    return "/".join(parts[1:-1])


def compacted_partitions(output: str) -> list[str]:
    """The partitions that have a compaction manifest: one listing of ``_compaction/``."""
    return sorted(partition_of(relative_to(output, p)) for p in
                  list_files(join_path(output, COMPACTION_DIR, "**", MANIFEST_NAME)))


@dataclasses.dataclass
class PartitionView:
    """What a reader that follows the manifest sees of one partition."""

    manifest: Optional[CompactionManifest]
    replaced: dict  # micro-batch file -> compacted file (relative paths)
    current: set  # the compacted files the manifest names (relative)

    @classmethod
    def of(cls, manifest: CompactionManifest) -> "PartitionView":
        return cls(manifest, manifest.replaced(), manifest.current())

    def visible(self, relative: str) -> bool:
        """Whether a reader that follows the manifest reads this file: a compacted file the
        manifest names, or a micro-batch file it does not say it replaced."""
        if is_compacted(relative):
            return relative in self.current
        return relative not in self.replaced


class CompactionChanging(RuntimeError):
    """A partition was compacted again and again while its files were listed."""


def _manifests(output: str, partitions: Optional[set]) -> dict[str, CompactionManifest]:
    """The compaction manifest of every compacted partition (of ``partitions``): one listing of
    ``_compaction/``, the manifests read in parallel."""
    names = [p for p in compacted_partitions(output) if partitions is None or p in partitions]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        read = dict(zip(names, pool.map(lambda p: read_compaction(output, p), names), strict=True))
    return {p: m for p, m in read.items() if m is not None}


def current_view(output: str, kind: str, partitions: Optional[Iterable[str]] = None,
                 attempts: int = 5) -> tuple[list[str], dict[str, PartitionView]]:
    """The files of one kind (``vectors``, ``keys``...) that hold its rows, each once, and the
    view of each compacted partition they were chosen by: the compacted files each manifest names,
    plus the micro-batch files no manifest says it replaced. Consistent whenever a compaction runs:
    the manifests are read before the listing and after it, and it is done again if any changed
    (a compaction writes its files, then its manifest, then deletes what it replaced, so a listing
    between two equal reads holds every file the manifest names and every file not replaced yet).
    One listing of the kind's folder (or of each partition) and of ``_compaction/``."""
    wanted = None if partitions is None else set(partitions)
    patterns = ([join_path(output, kind, "**")] if wanted is None
                else [join_path(output, kind, p, "*") for p in sorted(wanted)])
    for _ in range(attempts):
        before = _manifests(output, wanted)
        found = [m.path for result in FileSystems.match(patterns) for m in result.metadata_list
                 if m.path.endswith(_READ_SUFFIXES[kind])]
        if _manifests(output, wanted) != before:
            continue
        views = {p: PartitionView.of(m) for p, m in before.items()}
        out = {join_path(output, m.files[kind]["path"]) for m in before.values()
               if kind in m.files}
        for path in found:
            relative = relative_to(output, path)
            view = views.get(partition_of(relative))
            if is_compacted(relative):
                continue  # named by its manifest, or left by a killed run
            if view is None or relative not in view.replaced:
                out.add(path)
        return sorted(out), views
    raise CompactionChanging(f"{output}: its {kind} kept being compacted while listed "
                             f"({attempts} attempts)")


def current_files(output: str, kind: str, partitions: Optional[Iterable[str]] = None
                  ) -> list[str]:
    """``current_view``'s files."""
    return current_view(output, kind, partitions)[0]


def current_key_files(prefix: str) -> list[str]:
    """A streaming output's key index, compaction-aware: what ``ReadKeys`` should read."""
    return [p for p in current_files(prefix, KEYS_DIR) if p.endswith(".parquet")]


def record_files(record: LedgerRecord, partition: str, where: str) -> dict[str, str]:
    """{kind: file} of a ledger record, each checked to be a plain relative path under
    ``<kind>/<partition>/`` (``layout.safe_relative``); ``InvalidManifest`` naming ``where`` (the
    record's file) if one is not: such a record is never followed."""
    named = {kind: getattr(record, field) for kind, field in _RECORD_FIELD.items()
             if getattr(record, field) is not None}
    try:
        for kind, path in named.items():
            safe_relative(path, join_path(kind, partition))
    except ValueError as exc:
        raise InvalidManifest(f"{where} is refused, not followed: a ledger record names {exc}") \
            from None
    return named


def _read_record_file(output: str, path: str) -> str:
    """A ledger file's text (``layout.open_output_file``)."""
    with open_output_file(output, path) as f:
        return f.read().decode("utf-8")


def ledger_records(output: str, partitions: Optional[Iterable[str]] = None,
                   unreadable: Optional[list[str]] = None
                   ) -> tuple[list[LedgerRecord], dict[str, PartitionView]]:
    """Every ledger record of these partitions (all without), each once: the compacted ledger
    files the manifests name, and the record files they do not replace; and the view of each
    compacted partition they were read by (``current_view``), to resolve the records' files.
    A file that is not a ledger record (not a regular file, not UTF-8 JSON of a record) raises
    ``ValueError`` naming it, or, given ``unreadable``, is named there and skipped."""
    records = []
    paths, views = current_view(output, LEDGER_DIR, partitions)
    with concurrent.futures.ThreadPoolExecutor(_READERS) as pool:  # a request each on GCS
        read = list(pool.map(lambda path: _records_of(output, path), paths))
    for path, found in zip(paths, read, strict=True):
        if isinstance(found, Exception):
            why = (f"{relative_to(output, path)} is not a ledger record "
                   f"({type(found).__name__}: {found})"[:500])
            if unreadable is None:
                raise ValueError(why) from None
            unreadable.append(why)
            continue
        records += found
    return records, views


_READERS = 16  # ledger files read at once


def _records_of(output: str, path: str) -> Union[list[LedgerRecord], Exception]:
    """The records of one ledger file (a compacted one holds one a line), or why it holds
    none (a file that is not a ledger record, or a record naming a file outside its partition's
    folders: ``record_files``, never followed)."""
    try:
        text = _read_record_file(output, path)
        if path.endswith(".jsonl"):  # compacted: one record a line
            found = [LedgerRecord.from_json(line) for line in text.splitlines() if line]
        else:
            found = [LedgerRecord.from_json(text)]
        for record in found:
            record_files(record, partition_of(relative_to(output, path)), path)
        return found
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        return exc


# Compaction.

Hook = Callable[[str], None]  # called with a step's name before it; tests kill runs there


@dataclasses.dataclass
class CompactionResult:
    partition: str
    batches: int  # micro-batches compacted by this run
    files_before: int
    files_after: int
    rows: dict  # kind -> rows (lines) in the partition's compacted file
    cleaned: int  # files a killed run left, deleted


def _relative_files(output: str, kind: str, partition: str) -> list[str]:
    return sorted(relative_to(output, p)
                  for p in list_files(join_path(output, kind, partition, "*"))
                  if p.endswith(_READ_SUFFIXES[kind]))


def _write_compacted(output: str, target: str, write: Callable, lease: PublishLease) -> None:
    """Write a compacted file whole, fenced: first to ``_temp/`` (not a change: nobody reads
    there, and it may take long), then moved into place as one fenced change (on local disk a
    rename under the lock; on GCS a copy, read again after it and deleted again if the lease was
    lost: its name is this compaction's own, needed by no one else)."""
    temp = temp_path(output)
    try:
        if target.startswith("gs://"):
            with FileSystems.create(temp) as handle:
                write(handle)
            copy_fenced(output, temp, target, lease)
        else:  # made and moved through no symlink below the output (``layout.rename_inside``)
            with layout.create_inside(output, temp) as handle:
                write(handle)
            layout.require_inside(output, target)
            lease.change(layout.rename_inside, output, temp, target)
    finally:
        try:
            if is_local(temp):
                layout.remove_inside(output, temp, missing_ok=True)
            else:
                FileSystems.delete([temp])
        except (IOError, ValueError):
            pass  # gone already


def _write_parquet(output: str, target: str, sources: list[str], row_group_rows: int,
                   lease: PublishLease) -> int:
    """Concatenate Parquet files into ``target`` (``_write_compacted``) in row groups of
    ``row_group_rows``, reading one batch at a time, so at most about two row groups are held.
    Returns the rows written. Files with the ``embedding`` column written before its elements
    were declared not null, or at another ``sink.vector_dtype``, are compacted with the others
    under their common schema (``schema.common_schema``)."""
    rows = 0
    schemas = []
    for source in sources:
        with open_output_file(output, source) as f:
            schemas.append(pq.ParquetFile(f).schema_arrow)
    try:
        schema = common_schema(schemas)
    except ValueError:
        raise ValueError(f"{sources} do not share a schema: not compacted together") from None

    def write(handle) -> None:
        nonlocal rows
        writer: Optional[pq.ParquetWriter] = None
        pending: list[pa.RecordBatch] = []
        try:
            writer = pq.ParquetWriter(handle, schema, compression="zstd")
            for source in sources:
                with open_output_file(output, source) as f:
                    parquet = pq.ParquetFile(f)
                    for batch in parquet.iter_batches(batch_size=row_group_rows):
                        batch = conform(batch, schema)
                        pending.append(batch)
                        rows += batch.num_rows
                        if sum(b.num_rows for b in pending) >= row_group_rows:
                            pending = _write_row_groups(writer, pending, row_group_rows, False)
            if writer is not None:
                _write_row_groups(writer, pending, row_group_rows, True)
        finally:
            if writer is not None:
                writer.close()

    _write_compacted(output, target, write, lease)
    return rows


def _write_row_groups(writer: pq.ParquetWriter, batches: list[pa.RecordBatch],
                      row_group_rows: int, last: bool) -> list[pa.RecordBatch]:
    """Write the whole row groups these batches make (and with ``last`` the rest); return the
    rows left over, for the next row group."""
    table = pa.Table.from_batches(batches, schema=writer.schema)
    while table.num_rows >= row_group_rows or (last and table.num_rows):
        writer.write_table(table.slice(0, row_group_rows), row_group_size=row_group_rows)
        table = table.slice(row_group_rows)
    return table.to_batches()


def _write_lines(output: str, target: str, sources: list[str], lease: PublishLease) -> int:
    """Concatenate JSON Lines (and one-record JSON) files into ``target``, one record a line."""
    lines = 0

    def write(handle) -> None:
        nonlocal lines
        for source in sources:
            with open_output_file(output, source) as f:
                for line in f.read().splitlines():
                    if line.strip():
                        handle.write(line.rstrip(b"\r") + b"\n")
                        lines += 1

    _write_compacted(output, target, write, lease)
    return lines


def compact_partition(output: str, partition: str, lease: PublishLease, row_group_rows: int,
                      hook: Optional[Hook] = None) -> CompactionResult:
    """Compact one partition (steps 1-3 of the module docstring), by the holder of ``lease``.
    Idempotent: a partition with nothing new is left as it is (but for a killed run's
    leftovers)."""
    hook = hook or (lambda step: None)
    # A partition folder linked elsewhere is refused before it is listed: its files are not ours.
    layout.require_inside(output, *(join_path(output, kind, partition) for kind in KINDS),
                          join_path(output, COMPACTION_DIR, partition))
    old = read_compaction(output, partition, lease)  # on GCS its generation, for the write
    replaced, current = (old.replaced(), old.current()) if old else ({}, set())
    # The ledger first: a record is written after its files, so every file a listed record names
    # is in the listings that follow.
    listed = {kind: _relative_files(output, kind, partition)
              for kind in (LEDGER_DIR, *KINDS[:-1])}
    present = {p for paths in listed.values() for p in paths}
    files_before = len(present)

    # What a killed run left: unadopted compacted files, replaced files not yet deleted. Deleted
    # last (see the module docstring).
    leftovers = [p for kind in KINDS for p in listed[kind]
                 if (p not in current if is_compacted(p) else p in replaced)]
    batches = _new_batches(output, partition, listed[LEDGER_DIR], replaced, present)
    if not batches:
        return _nothing_new(output, partition, old, leftovers, files_before, lease, hook)

    # 1. The new compacted files: the current ones' rows first, then the new micro-batches'.
    sources_of = _sources(output, partition, old, batches, present)
    compaction_id = new_run_id()
    files = _write_kinds(output, partition, old, sources_of, compaction_id, row_group_rows,
                         lease, hook)

    # 2. Adopt them: one manifest, written whole, fenced (on GCS conditional on the one read).
    manifest = CompactionManifest(
        partition=partition, compaction_id=compaction_id,
        compacted_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        files=files, batches=(old.batches if old else []) + batches)
    hook("manifest")
    _write_manifest(output, manifest, lease)

    # 3. Delete what they replace, and what a killed run left.
    done = ([p for b in batches for p in (b["record"], *b["files"].values())]
            + sorted(current - manifest.current()))
    doomed = sorted({p for p in done + leftovers if p in present})
    if doomed:
        hook("delete")
        delete_fenced(_absolute(output, doomed), lease)
    files_after = files_before - len(doomed) + len(sources_of)
    return CompactionResult(partition, len(batches), files_before, files_after,
                            {k: f["rows"] for k, f in files.items()}, len(leftovers))


def _absolute(output: str, paths: Iterable[str]) -> list[str]:
    return [join_path(output, p) for p in paths]


def _new_batches(output: str, partition: str, records: list[str], replaced: dict,
                 present: set[str]) -> list[dict]:
    """The micro-batches to take: those whose ledger record is here now (their files are whole),
    and no compaction replaced, each ``{"record", "files"}``; ``FileNotFoundError`` for a record
    that names a file that is not there."""
    batches: list[dict] = []
    for record_path in records:
        if is_compacted(record_path) or record_path in replaced:
            continue
        record = LedgerRecord.from_json(_read_record_file(output, join_path(output, record_path)))
        named = record_files(record, partition, join_path(output, record_path))
        missing = sorted(set(named.values()) - present)
        if missing:
            raise FileNotFoundError(f"{record_path} names files that are not there: {missing} "
                                    f"(newsvec ledger says more); {partition} is not compacted")
        batches.append({"record": record_path, "files": named})
    return batches


def _nothing_new(output: str, partition: str, old: Optional[CompactionManifest],
                 leftovers: list[str], files_before: int, lease: PublishLease,
                 hook: Hook) -> CompactionResult:
    """A partition with no new micro-batch: only what a killed run left is deleted (on GCS after
    the manifest as read is written again, so that a stalled run's late write is refused)."""
    if leftovers and output.startswith("gs://"):
        if old is None:  # no manifest to write first: a late one of a stalled run may come
            _LOG.warning("%s: %d compacted files no manifest names are left for a run "
                         "with something to compact", partition, len(leftovers))
            leftovers = []
        else:  # the manifest as read, written again: a stalled run's late write is refused
            hook("claim")
            _write_manifest(output, old, lease)
    if leftovers:
        hook("clean")
        delete_fenced(_absolute(output, leftovers), lease)
    return CompactionResult(partition, 0, files_before, files_before - len(leftovers),
                            {k: f["rows"] for k, f in (old.files if old else {}).items()},
                            len(leftovers))


def _sources(output: str, partition: str, old: Optional[CompactionManifest], batches: list[dict],
             present: set[str]) -> dict[str, list[str]]:
    """Of each kind with new files: the files its new compacted file is made of, the current
    compacted file's first. Every source refused before anything is written if it is not a
    regular file of the output (a symlink, a FIFO: ``layout.open_output_file``); each is opened
    the same way again when it is read."""
    sources_of: dict[str, list[str]] = {}
    for kind in KINDS:
        current_file = old.files.get(kind) if old else None
        new = ([b["record"] for b in batches] if kind == LEDGER_DIR
               else [b["files"][kind] for b in batches if kind in b["files"]])
        if not new:  # nothing new of this kind: its compacted file stays as it is
            continue
        if current_file and current_file["path"] not in present:
            raise FileNotFoundError(f"{manifest_path(output, partition)} names {kind} file "
                                    f"{current_file['path']}, which is not in {partition}; "
                                    f"{partition} is not compacted")
        sources_of[kind] = ([current_file["path"]] if current_file else []) + new
    if not output.startswith("gs://"):
        for source in _absolute(output, (p for paths in sources_of.values() for p in paths)):
            open_output_file(output, source).close()
    return sources_of


def _write_kinds(output: str, partition: str, old: Optional[CompactionManifest],
                 sources_of: dict[str, list[str]], compaction_id: str, row_group_rows: int,
                 lease: PublishLease, hook: Hook) -> dict[str, dict]:
    """Write each kind's new compacted file from its sources; the manifest's ``files``: those
    written, and the current compacted files of the kinds with nothing new."""
    files: dict[str, dict] = {}
    for kind in KINDS:
        if kind not in sources_of:
            if old and kind in old.files:
                files[kind] = old.files[kind]
            continue
        sources = _absolute(output, sources_of[kind])
        target = f"{kind}/{partition}/{COMPACTED_PREFIX}{compaction_id}{_SUFFIX[kind]}"
        hook(f"write {kind}")
        if kind in PARQUET_KINDS:
            rows = _write_parquet(output, join_path(output, target), sources, row_group_rows,
                                  lease)
        else:
            rows = _write_lines(output, join_path(output, target), sources, lease)
        files[kind] = {"path": target, "rows": rows}
    return files

"""Sinks: vector rows as Parquet under ``vectors/`` (and chunk rows under ``chunks/``, chunks mode),
dead letters as JSON Lines under ``dead_letter/``.

Batch: ``WriteVectors``, ``WriteChunks`` and ``WriteDeadLetters`` write a run's files into the folder
they are given
(the run's staging folder, ``transforms.commit``), named by run id and shard
(``part-<run_id>-00000-of-00004.parquet``), and return the names written; Beam writes them to a
temporary folder there and renames them on success. ``CommitRun`` then publishes them.

Streaming: ``WriteMicroBatches`` writes each ``MicroBatch`` as one set of files under
``dt=YYYY-MM-DD/hour=HH/`` of its window start: its vectors, its chunks, its dead letters, then its
ledger record
(``ledger/``), each written under ``_temp/`` and renamed into place. It does not use
``fileio.WriteToFiles``: on windowed input with late panes it loses files (see ``write_file``).
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import itertools
import re
import uuid
from typing import Iterable, Optional

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io import fileio
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms.window import IntervalWindow
from apache_beam.utils.timestamp import Timestamp

from transforms.metrics import (DEAD_LETTERED, END_TO_END_MS, ROWS_WRITTEN, TRUNCATED,
                               dead_letter_counter)
from transforms.schema import (ChunkRow, DeadLetter, EmbeddedDoc, LedgerRecord, MicroBatch,
                               chunk_schema, key_schema, vector_schema)

VECTORS_DIR = "vectors"
CHUNKS_DIR = "chunks"
KEYS_DIR = "keys"
DEAD_LETTER_DIR = "dead_letter"
LEDGER_DIR = "ledger"
SUMMARY_FILE = "_summary.json"
SHARD_TEMPLATE = "-SSSSS-of-NNNNN"
TEMP_DIR = "_temp"
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")


def new_run_id(now: dt.datetime | None = None) -> str:
    """A sortable, collision-free id safe in any file name: 20261201T093000Z-1a2b3c4d."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


def join_path(prefix: str, *parts: str) -> str:
    return "/".join([prefix.rstrip("/"), *parts])


def _embeddings(rows, schema: pa.Schema) -> pa.FixedSizeListArray:
    dim = schema.field("embedding").type.list_size
    vectors = np.stack([r.embedding for r in rows]).astype(np.float32, copy=False)
    if vectors.shape[1] != dim:
        raise ValueError(f"embedding has {vectors.shape[1]} dimensions, the schema {dim}")
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim)


def _dims(rows, schema: pa.Schema) -> pa.Array:
    return pa.array(np.full(len(rows), schema.field("embedding").type.list_size, dtype=np.int32))


def to_table(rows: list[EmbeddedDoc], schema: pa.Schema) -> pa.Table:
    """A batch of rows as one Arrow table (one Parquet row group)."""
    lineages = [r.lineage for r in rows]  # None for events read from files: null columns
    table = pa.table({
        "id": [r.id for r in rows],
        "url": [r.url for r in rows],
        "source": [r.source for r in rows],
        "title": [r.title for r in rows],
        "published_at": [r.published_at for r in rows],
        "language": [r.language for r in rows],
        "model": [r.model for r in rows],
        "dim": _dims(rows, schema),
        "embedding": _embeddings(rows, schema),
        "text_sha256": [r.text_sha256 for r in rows],
        "token_count": pa.array([r.token_count for r in rows], pa.int32()),
        "truncated": [r.truncated for r in rows],
        "embedded_at": [r.embedded_at for r in rows],
        "pubsub_message_id": [x.message_id if x else None for x in lineages],
        "pubsub_publish_time": [x.publish_time if x else None for x in lineages],
        "pubsub_attributes": [list(x.attributes) if x else None for x in lineages],
        "doc_vector": [r.doc_vector for r in rows],
        "chunk_count": pa.array([r.chunk_count for r in rows], pa.int32()),
    }, schema=schema)
    ROWS_WRITTEN.inc(len(rows))
    TRUNCATED.inc(sum(r.truncated for r in rows))
    now = dt.datetime.now(dt.timezone.utc)
    for lineage in lineages:
        if lineage is not None and lineage.publish_time is not None:
            END_TO_END_MS.update(int((now - lineage.publish_time).total_seconds() * 1000))
    return table


def chunks_table(rows: list[ChunkRow], schema: pa.Schema) -> pa.Table:
    """A batch of chunk rows as one Arrow table (one Parquet row group)."""
    return pa.table({
        "id": [r.id for r in rows],
        "chunk_id": [r.chunk_id for r in rows],
        **{name: pa.array([getattr(r, name) for r in rows], pa.int32())
           for name in ("chunk_index", "chunk_count", "token_start", "token_end", "char_start",
                        "char_end")},
        "chunk_sha256": [r.chunk_sha256 for r in rows],
        "text_sha256": [r.text_sha256 for r in rows],
        "model": [r.model for r in rows],
        "dim": _dims(rows, schema),
        "embedding": _embeddings(rows, schema),
        "embedded_at": [r.embedded_at for r in rows],
        "chunk_text": [r.chunk_text for r in rows],
    }, schema=schema)


@dataclasses.dataclass(frozen=True)
class KeysTable:
    """Rows -> a table of their keys (``transforms.incremental.embedding_key``) under the
    embedding signature they were made with."""

    signature: str

    def __call__(self, rows: list[EmbeddedDoc], schema: pa.Schema) -> pa.Table:
        from transforms.incremental import embedding_key

        return pa.table({
            "key": [embedding_key(r.id, r.text_sha256, r.model, self.signature) for r in rows],
            "id": [r.id for r in rows],
            "text_sha256": [r.text_sha256 for r in rows],
        }, schema=schema)


class _WriteParquet(beam.PTransform):
    def __init__(self, output: str, subdir: str, run_id: str, schema: pa.Schema, table_fn,
                 row_group_rows: int):
        super().__init__()
        self._prefix = join_path(output, subdir, f"part-{run_id}")
        self._schema, self._table_fn, self._row_group_rows = schema, table_fn, row_group_rows

    def expand(self, rows):
        schema = self._schema
        return (rows
                | "RowGroups" >> beam.BatchElements(min_batch_size=self._row_group_rows,
                                                    max_batch_size=self._row_group_rows)
                | "ToArrow" >> beam.Map(self._table_fn, schema)
                | "WriteParquet" >> beam.io.WriteToParquetBatched(
                    self._prefix, schema=schema, codec="zstd", file_name_suffix=".parquet",
                    shard_name_template=SHARD_TEMPLATE))


class WriteVectors(_WriteParquet):
    """EmbeddedDoc -> zstd Parquet files ``<output>/vectors/part-<run_id>-SSSSS-of-NNNNN.parquet``."""

    def __init__(self, output: str, run_id: str, dim: int, row_group_rows: int = 16384):
        super().__init__(output, VECTORS_DIR, run_id, vector_schema(dim), to_table, row_group_rows)


class WriteChunks(_WriteParquet):
    """ChunkRow -> zstd Parquet files ``<output>/chunks/part-<run_id>-SSSSS-of-NNNNN.parquet``."""

    def __init__(self, output: str, run_id: str, dim: int, row_group_rows: int = 16384):
        super().__init__(output, CHUNKS_DIR, run_id, chunk_schema(dim), chunks_table,
                         row_group_rows)


class WriteKeys(_WriteParquet):
    """EmbeddedDoc -> the key index, ``<output>/keys/part-<run_id>-SSSSS-of-NNNNN.parquet``."""

    def __init__(self, output: str, run_id: str, signature: str, row_group_rows: int = 16384):
        super().__init__(output, KEYS_DIR, run_id, key_schema(), KeysTable(signature),
                         row_group_rows)


def _count_dead_letter(letter: DeadLetter) -> str:
    DEAD_LETTERED.inc()
    dead_letter_counter(letter.reason).inc()
    return letter.to_json()


class WriteDeadLetters(beam.PTransform):
    """DeadLetter -> JSON Lines ``<output>/dead_letter/part-<run_id>-SSSSS-of-NNNNN.jsonl``."""

    def __init__(self, output: str, run_id: str):
        super().__init__()
        self._prefix = join_path(output, DEAD_LETTER_DIR, f"part-{run_id}")

    def expand(self, letters):
        return (letters
                | "ToJson" >> beam.Map(_count_dead_letter)
                | "WriteJsonl" >> beam.io.WriteToText(
                    self._prefix, file_name_suffix=".jsonl", shard_name_template=SHARD_TEMPLATE))


# Streaming: windowed input, one file per window, pane and shard.

def partition_path(window: IntervalWindow) -> str:
    """``dt=YYYY-MM-DD/hour=HH`` of the window start (UTC). Never from an event's fields, which the
    publisher controls; digits by construction, so safe in any path."""
    if not isinstance(window, IntervalWindow):
        raise ValueError(f"an event-time window is needed to partition by, got {window!r}")
    start = window.start.to_utc_datetime()
    return f"dt={start:%Y-%m-%d}/hour={start:%H}"


def window_file_name(run_id: str, window: IntervalWindow, pane_index: int, shard: int, shards: int,
                     suffix: str) -> str:
    """``part-<run_id>-<window start>-<pane>-<shard>-of-<n><suffix>``: a late pane never replaces
    the on-time file of its window, nor one run another's. Only [A-Za-z0-9._-] (BigQuery, gsutil,
    shells)."""
    start = window.start.to_utc_datetime()
    name = (f"part-{run_id}-{start:%Y%m%dT%H%M%SZ}-{pane_index:03d}-{shard:05d}-of-{shards:05d}"
            f"{suffix}")
    if not _SAFE_NAME.fullmatch(name):
        raise ValueError(f"unsafe file name {name!r}")
    return name


class ParquetTableSink(fileio.FileSink):
    """pyarrow Tables -> one zstd Parquet file, a row group per table of up to ``row_group_rows``.

    ``flush`` writes the footer, so it ends the file: fileio (and ``_WriteWindowPaneFn``) call it
    once, just before closing the handle, which stays open for its owner to close.
    """

    def __init__(self, schema: pa.Schema, row_group_rows: int = 16384):
        self._schema = schema
        self._row_group_rows = row_group_rows
        self._writer = None

    def create_metadata(self, destination, full_file_name) -> fileio.FileMetadata:
        # AUTO would guess a compression from the name; Parquet compresses its own pages.
        return fileio.FileMetadata(mime_type="application/vnd.apache.parquet",
                                   compression_type=CompressionTypes.UNCOMPRESSED)

    def open(self, fh) -> None:
        self._writer = pq.ParquetWriter(fh, self._schema, compression="zstd")

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table, row_group_size=self._row_group_rows)

    def flush(self) -> None:
        self._writer.close()


class _JsonLinesSink(fileio.TextSink):
    def create_metadata(self, destination, full_file_name) -> fileio.FileMetadata:
        return fileio.FileMetadata(mime_type="application/x-ndjson",
                                   compression_type=CompressionTypes.UNCOMPRESSED)


def mkdirs(path: str) -> None:
    try:
        FileSystems.mkdirs(path)
    except IOError:
        pass  # it exists (another shard, another worker); a real failure fails the rename after


def _delete_quietly(path: str) -> None:
    try:
        FileSystems.delete([path])
    except IOError:
        pass  # never created; the error that brought us here matters more


def write_file(output: str, run_id: str, final_dir: str, name: str, sink: fileio.FileSink,
               records: Iterable) -> str:
    """Write ``records`` through ``sink`` to ``<final_dir>/<name>``: first to
    ``<output>/_temp/<run_id>/<random>.tmp``, then renamed into place, so nothing half-written is
    ever visible where readers look (a worker killed mid-write leaves only the temp file: see
    ``transforms.commit.clean_stale``). A retry with the same name replaces the file whole.

    Why not ``fileio.WriteToFiles`` (Beam 2.77, tried on TestStream): by default it names files
    without the pane (pane=None), so each firing of a window overwrote the last; with
    ``max_writers_per_bundle=0`` the pane index counts per internal shard key, which
    ``file_naming`` cannot see, so two late panes got one name; and a name with a subfolder fails to
    rename on local disk (no such folder), logged at DEBUG, the files left in its temp folder.
    """
    temp_dir = join_path(output, TEMP_DIR, run_id)
    temp = join_path(temp_dir, f"{uuid.uuid4().hex}.tmp")
    mkdirs(temp_dir)
    try:
        with FileSystems.create(temp, **sink.create_metadata(final_dir, temp)._asdict()) as fh:
            sink.open(fh)
            try:
                for record in records:
                    sink.write(record)
            finally:
                sink.flush()  # also on failure: a Parquet writer must not outlive its handle
    except BaseException:
        _delete_quietly(temp)
        raise
    mkdirs(final_dir)
    final = join_path(final_dir, name)
    FileSystems.rename([temp], [final])
    return final


def _require_safe_run_id(run_id: str) -> None:
    if not _SAFE_NAME.fullmatch(run_id):
        raise ValueError(f"run_id {run_id!r} must match {_SAFE_NAME.pattern}")


def _row_group_tables(rows: Iterable, schema: pa.Schema, row_group_rows: int, table_fn=None):
    """Tables of at most ``row_group_rows`` rows, by ``table_fn`` (default: ``to_table``)."""
    rows = iter(rows)
    while batch := list(itertools.islice(rows, row_group_rows)):
        yield (table_fn or to_table)(batch, schema)


def micro_batch_window(batch: MicroBatch) -> IntervalWindow:
    return IntervalWindow(Timestamp(micros=batch.window_start_us),
                          Timestamp(micros=batch.window_end_us))


class _WriteMicroBatchFn(beam.DoFn):
    """MicroBatch -> its vectors, chunks and dead-letter files (each only if it has any), then its
    ledger record, which names them: a record implies that its files are complete."""

    def __init__(self, output: str, run_id: str, dim: int, row_group_rows: int,
                 signature: Optional[str]):
        self._output, self._run_id = output, run_id
        self._schema, self._chunk_schema = vector_schema(dim), chunk_schema(dim)
        self._row_group_rows = row_group_rows
        self._keys = KeysTable(signature) if signature is not None else None

    def _write(self, subdir, batch, suffix, sink, records):
        window = micro_batch_window(batch)
        partition = partition_path(window)
        name = window_file_name(self._run_id, window, batch.pane, batch.shard, batch.shards, suffix)
        write_file(self._output, self._run_id, join_path(self._output, subdir, partition), name,
                   sink, records)
        return f"{subdir}/{partition}/{name}"

    def process(self, batch: MicroBatch):
        vectors = chunks = letters = None
        if batch.rows:
            vectors = self._write(VECTORS_DIR, batch, ".parquet",
                                  ParquetTableSink(self._schema, self._row_group_rows),
                                  _row_group_tables(batch.rows, self._schema, self._row_group_rows))
        chunk_rows = [c for row in batch.rows for c in row.chunks]
        if chunk_rows:
            chunks = self._write(CHUNKS_DIR, batch, ".parquet",
                                 ParquetTableSink(self._chunk_schema, self._row_group_rows),
                                 _row_group_tables(chunk_rows, self._chunk_schema,
                                                   self._row_group_rows, chunks_table))
        if batch.rows and self._keys is not None:  # the key index, for the nightly batch jobs
            self._write(KEYS_DIR, batch, ".parquet",
                        ParquetTableSink(key_schema(), self._row_group_rows),
                        _row_group_tables(batch.rows, key_schema(), self._row_group_rows,
                                          self._keys))
        if batch.dead_letters:
            letters = self._write(DEAD_LETTER_DIR, batch, ".jsonl", _JsonLinesSink(),
                                  map(_count_dead_letter, batch.dead_letters))
        window = micro_batch_window(batch)
        record = LedgerRecord(
            run_id=self._run_id, window_start=_rfc3339(window.start), window_end=_rfc3339(window.end),
            pane=batch.pane, shard=batch.shard, shards=batch.shards,
            messages_in=batch.messages_in, rows_written=len(batch.rows),
            dead_lettered=len(batch.dead_letters),
            dead_lettered_by_reason=dict(sorted(collections.Counter(
                letter.reason for letter in batch.dead_letters).items())),
            duplicates=batch.duplicates, late_reassigned=batch.late_reassigned,
            vectors_file=vectors, dead_letter_file=letters,
            written_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"),
            chunks_written=len(chunk_rows), chunks_file=chunks)
        self._write(LEDGER_DIR, batch, ".json", _JsonLinesSink(), [record.to_json()])
        yield record


def _rfc3339(t: Timestamp) -> str:
    return t.to_utc_datetime(has_tz=True).isoformat().replace("+00:00", "Z")


class WriteMicroBatches(beam.PTransform):
    """Streaming: MicroBatch -> zstd Parquet vectors (and chunks), JSON Lines dead letters and a
    JSON ledger record per micro-batch, under ``vectors/`` (``chunks/``), ``dead_letter/`` and
    ``ledger/``, and with ``signature`` (``transforms.incremental.embedding_signature``) the keys
    of its rows under ``keys/``, each in
    ``dt=YYYY-MM-DD/hour=HH/`` of the window start, named
    ``part-<run_id>-<window start>-<pane>-<shard>-of-<n>``. Returns the ledger records."""

    def __init__(self, output: str, run_id: str, dim: int, row_group_rows: int = 16384,
                 signature: Optional[str] = None):
        super().__init__()
        _require_safe_run_id(run_id)
        if row_group_rows < 1:
            raise ValueError("row_group_rows must be >= 1")
        self._fn = _WriteMicroBatchFn(output, run_id, dim, row_group_rows, signature)

    def expand(self, batches):
        return batches | "WriteFiles" >> beam.ParDo(self._fn)

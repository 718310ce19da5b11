"""Sinks: vector rows as Parquet under ``vectors/`` (and chunk rows under ``chunks/``, chunks mode;
their keys under ``keys/``), dead letters as JSON Lines under ``dead_letter/``. Folder and file
names come from ``transforms.output.layout``.

Batch: ``WriteVectors``, ``WriteChunks``, ``WriteKeys`` and ``WriteDeadLetters`` write a run's files
into the folder they are given (the run's staging folder), named by run id and shard
(``part-<run_id>-00000-of-00004.parquet``), and return the names written; Beam writes them to a
temporary folder there and renames them on success. ``CommitRun`` (``transforms.commit``) then
publishes them.

Streaming: ``WriteStreaming`` writes each ``MicroBatch`` as one set of files under
``dt=YYYY-MM-DD/hour=HH/`` of its window start: its vectors, its chunks, its keys, its dead letters,
then its ledger record (``ledger/``), each written whole (``layout.write_whole``). It does not use
``fileio.WriteToFiles``: on windowed input with late panes it loses files (see ``write_file``).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import itertools
from typing import Any, Callable, Iterable, Optional

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io import fileio
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.transforms.window import IntervalWindow
from apache_beam.utils.timestamp import Timestamp

from transforms.incremental import KeysTable
from transforms.metrics import (
    DEAD_LETTERED,
    END_TO_END_MS,
    MICRO_BATCH_ROWS,
    ROWS_WRITTEN,
    STORE_LOAD_FAILURES,
    STORE_LOADS,
    STORE_ROWS_LOADED,
    TRUNCATED,
    dead_letter_counter,
)
from transforms.output.layout import (
    CHUNKS_DIR,
    DEAD_LETTER_DIR,
    KEYS_DIR,
    LEDGER_DIR,
    SHARD_TEMPLATE,
    VECTORS_DIR,
    PartFileName,
    is_local,
    join_path,
    partition_path,
    remove_inside,
    require_inside,
    require_safe_run_id,
    write_whole,
)
from transforms.output.parquet import chunk_schema, key_schema, vector_schema
from transforms.settings import VectorDtype
from transforms.stores import Settings as StoreSettings
from transforms.stores import store_for
from transforms.stores.base import LoadRows, StoreLoadFailed, VectorStore, streaming_load_key
from transforms.types import ChunkRow, Counts, DeadLetter, EmbeddedDoc, LedgerRecord, MicroBatch


def _column(rows, field: pa.Field, schema: pa.Schema) -> pa.Array:
    """A column of a Parquet schema from the rows' attribute of the same name; ``embedding`` as a
    fixed-size list of the schema's element type (float32 zero-copy from numpy; float16 rounded to
    nearest) and ``dim`` as its length."""
    embedding = schema.field("embedding").type
    dim = embedding.list_size
    if field.name == "dim":
        return pa.array(np.full(len(rows), dim, dtype=np.int32))
    if field.name == "embedding":
        element = np.float16 if pa.types.is_float16(embedding.value_type) else np.float32
        vectors = np.stack([r.embedding for r in rows]).astype(element, copy=False)
        if vectors.shape[1] != dim:
            raise ValueError(f"embedding has {vectors.shape[1]} dimensions, the schema {dim}")
        return pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), type=embedding)
    return pa.array([getattr(r, field.name) for r in rows], field.type)


def rows_table(rows, schema: pa.Schema, columns: Optional[dict] = None) -> pa.Table:
    """A batch of rows as one Arrow table (one Parquet row group): each column of ``schema`` from
    ``columns`` where given, else from the rows' attribute of its name (``_column``)."""
    columns = columns or {}
    return pa.table({f.name: columns[f.name] if f.name in columns else _column(rows, f, schema)
                     for f in schema}, schema=schema)


def vectors_table(rows: list[EmbeddedDoc], schema: pa.Schema) -> pa.Table:
    """Vector rows as one Arrow table, their Pub/Sub lineage as columns (null for events read
    from files)."""
    if not rows:
        return schema.empty_table()
    lineages = [r.lineage for r in rows]
    return rows_table(rows, schema, {
        "pubsub_message_id": [x.message_id if x else None for x in lineages],
        "pubsub_publish_time": [x.publish_time if x else None for x in lineages],
        "pubsub_attributes": [list(x.attributes) if x else None for x in lineages]})


def to_table(rows: list[EmbeddedDoc], schema: pa.Schema) -> pa.Table:
    """``vectors_table``, its rows counted as written."""
    table = vectors_table(rows, schema)
    lineages = [r.lineage for r in rows]
    ROWS_WRITTEN.inc(len(rows))
    TRUNCATED.inc(sum(r.truncated for r in rows))
    now = dt.datetime.now(dt.timezone.utc)
    for lineage in lineages:
        if lineage is not None and lineage.publish_time is not None:
            END_TO_END_MS.update(int((now - lineage.publish_time).total_seconds() * 1000))
    return table


def chunks_table(rows: list[ChunkRow], schema: pa.Schema) -> pa.Table:
    """Chunk rows as one Arrow table."""
    return rows_table(rows, schema)


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
    """EmbeddedDoc -> zstd Parquet files
    ``<output>/vectors/part-<run_id>-SSSSS-of-NNNNN.parquet``."""

    def __init__(self, output: str, run_id: str, dim: int, row_group_rows: int = 16384,
                 vector_dtype: VectorDtype = "float32"):
        super().__init__(output, VECTORS_DIR, run_id, vector_schema(dim, vector_dtype), to_table,
                         row_group_rows)


class WriteChunks(_WriteParquet):
    """ChunkRow -> zstd Parquet files ``<output>/chunks/part-<run_id>-SSSSS-of-NNNNN.parquet``."""

    def __init__(self, output: str, run_id: str, dim: int, row_group_rows: int = 16384,
                 vector_dtype: VectorDtype = "float32"):
        super().__init__(output, CHUNKS_DIR, run_id, chunk_schema(dim, vector_dtype),
                         chunks_table, row_group_rows)


class WriteKeys(_WriteParquet):
    """EmbeddedDoc -> the key index, ``<output>/keys/part-<run_id>-SSSSS-of-NNNNN.parquet``."""

    def __init__(self, output: str, run_id: str, signature: str, row_group_rows: int = 16384,
                 minhash_version: Optional[str] = None):
        super().__init__(output, KEYS_DIR, run_id, key_schema(),
                         KeysTable(signature, minhash_version), row_group_rows)


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

class ParquetTableSink(fileio.FileSink):
    """pyarrow Tables -> one zstd Parquet file, a row group per table of up to ``row_group_rows``.

    ``flush`` writes the footer, so it ends the file: fileio (and ``_WriteWindowPaneFn``) call it
    once, just before closing the handle, which stays open for its owner to close.
    """

    def __init__(self, schema: pa.Schema, row_group_rows: int = 16384):
        self._schema = schema
        self._row_group_rows = row_group_rows
        self._writer: Any = None  # a pyarrow.parquet.ParquetWriter while a file is open

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


def write_file(output: str, run_id: str, final_dir: str, name: str, sink: fileio.FileSink,
               records: Iterable) -> str:
    """Write ``records`` through ``sink`` to ``<final_dir>/<name>``, whole (``layout.write_whole``:
    under ``<output>/_temp/<run_id>/`` first, then renamed into place).

    Why not ``fileio.WriteToFiles`` (Beam 2.77, tried on TestStream): by default it names files
    without the pane (pane=None), so each firing of a window overwrote the last; with
    ``max_writers_per_bundle=0`` the pane index counts per internal shard key, which
    ``file_naming`` cannot see, so two late panes got one name; and a name with a subfolder fails to
    rename on local disk (no such folder), logged at DEBUG, the files left in its temp folder.
    """
    def write(handle) -> None:
        sink.open(handle)
        try:
            for record in records:
                sink.write(record)
        finally:
            sink.flush()  # also on failure: a Parquet writer must not outlive its handle

    metadata = sink.create_metadata(final_dir, name)
    return write_whole(output, join_path(final_dir, name), write, run_id=run_id,
                       mime_type=metadata.mime_type, compression_type=metadata.compression_type)


def _row_group_tables(rows: Iterable, schema: pa.Schema, row_group_rows: int,
                      table_fn: Optional[Callable[[list, pa.Schema], pa.Table]] = None):
    """Tables of at most ``row_group_rows`` rows, by ``table_fn`` (default: ``to_table``)."""
    rows = iter(rows)
    while batch := list(itertools.islice(rows, row_group_rows)):
        yield (table_fn or to_table)(batch, schema)


def micro_batch_window(batch: MicroBatch) -> IntervalWindow:
    return IntervalWindow(Timestamp(micros=batch.window_start_us),
                          Timestamp(micros=batch.window_end_us))


def micro_batch_digest(batch: MicroBatch) -> str:
    """16 hex of what a micro-batch took in: the Pub/Sub message id of each row and dead letter (or,
    without one, its event id, or a parse dead letter's payload), and its counts. Every attempt at
    the same micro-batch gives the same digest, whatever it made of it: a row in one attempt may be
    a dead letter in the next, with the same message. So do the launches of a job across an update
    or a restart, which redo what their predecessor wrote but did not commit."""
    identities = sorted(
        [row.lineage.message_id if row.lineage and row.lineage.message_id
         else f"event\0{row.id}" for row in batch.rows]
        + [letter.message_id or (f"event\0{letter.event_id}" if letter.event_id is not None
                                 else f"payload\0{letter.payload}")
           for letter in batch.dead_letters])
    identities.append(f"in={batch.messages_in} duplicates={batch.duplicates}"
                      + (f" near_duplicates={batch.near_duplicates}" if batch.near_duplicates
                         else ""))
    return hashlib.sha256("\n".join(identities).encode("utf-8")).hexdigest()[:16]


def micro_batch_load_key(batch: MicroBatch, digest: str) -> str:
    """The store's load key of a micro-batch (``stores.base.streaming_load_key``)."""
    return streaming_load_key(micro_batch_window(batch).start.to_utc_datetime(), batch.pane,
                              batch.shard, digest)


class _WriteStreamingFn(beam.DoFn):
    """MicroBatch -> its vectors, chunks, keys and dead-letter files, then its ledger record, which
    names them: a record implies that its files are complete.

    The files are one set, named by window, pane, shard and digest (``layout.PartFileName``): a
    later attempt at the same micro-batch replaces each of them, and deletes those of its kinds it
    has no rows for (an earlier attempt wrote vectors, this one dead-letters everything). With the
    store on (``store.enabled``), its rows are loaded into the store between its files and its
    record."""

    def __init__(self, output: str, run_id: str, dim: int, row_group_rows: int,
                 signature: Optional[str], vector_dtype: VectorDtype = "float32",
                 store: Optional[StoreSettings] = None, minhash_version: Optional[str] = None):
        self._output, self._run_id = output, run_id
        self._schema = vector_schema(dim, vector_dtype)
        self._chunk_schema = chunk_schema(dim, vector_dtype)
        self._row_group_rows = row_group_rows
        self._keys = KeysTable(signature, minhash_version) if signature is not None else None
        self._store_settings = store if store is not None and store.enabled else None
        self._store: Optional[VectorStore] = None

    def setup(self):
        if self._store_settings is not None:
            self._store = store_for(self._store_settings)

    def _load(self, batch: MicroBatch, digest: str, rows: list, chunk_rows: list
              ) -> tuple[int, Optional[str], list, list]:
        """The micro-batch's rows into the store, after its files and before its ledger record,
        under its load key. Returns the rows stored, the key, the rows the store refused
        (``StoreLoad.rejected``: set aside with their reason, the rest stored) and the articles
        whose rows an earlier attempt stored and this one withdrew (``StoreLoad.withdrawn``).
        Once per outcome: a retried micro-batch changes nothing, and one redone with another
        outcome (a row this time, a dead letter the last, or the reverse) replaces what the
        earlier attempt stored, bringing back the versions it had replaced, so the store holds
        what the files hold. It is loaded even with no rows when a dead letter
        names an article an earlier attempt may have stored. Retried on transient errors
        (``store.retry_s``); then the bundle fails and Beam retries it."""
        if self._store is None:
            return 0, None, [], []
        maybe_stored = {letter.event_id for letter in batch.dead_letters
                        if letter.event_id is not None and "\x00" not in letter.event_id}
        if not rows and not maybe_stored:
            return 0, None, [], []
        window = micro_batch_window(batch)
        key = micro_batch_load_key(batch, digest)
        try:
            loaded = self._store.load(LoadRows(
                vectors=vectors_table(rows, self._schema),
                chunks=chunks_table(chunk_rows, self._chunk_schema) if chunk_rows else None,
                dt=window.start.to_utc_datetime().date()), key,
                ids=sorted({row.id for row in rows} | maybe_stored))
        except StoreLoadFailed:
            STORE_LOAD_FAILURES.inc()
            raise
        STORE_LOADS.inc()
        STORE_ROWS_LOADED.inc(loaded.rows)
        return loaded.rows, key, list(loaded.rejected), list(loaded.withdrawn)

    def _path(self, subdir: str, batch: MicroBatch, digest: str, suffix: str) -> str:
        """``<subdir>/dt=…/hour=…/<name>``, relative to the output."""
        window = micro_batch_window(batch)
        name = PartFileName.for_window(window, batch.pane, batch.shard, batch.shards, digest,
                                       suffix).file_name()
        return f"{subdir}/{partition_path(window)}/{name}"

    def _write(self, relative: str, sink, records) -> str:
        folder, name = relative.rsplit("/", 1)
        write_file(self._output, self._run_id, join_path(self._output, folder), name, sink,
                   records)
        return relative

    def _write_or_delete(self, relative: str, sink, records: list, tables) -> Optional[str]:
        """Write the file if there are records, else delete an earlier attempt's."""
        if records:
            return self._write(relative, sink, tables)
        path = join_path(self._output, relative)
        if is_local(path):  # by its name, never through a symlinked partition folder
            require_inside(self._output, path)
            remove_inside(self._output, path, missing_ok=True)
        elif FileSystems.exists(path):
            FileSystems.delete([path])
        return None

    def process(self, batch: MicroBatch):
        digest = micro_batch_digest(batch)
        rows = list(batch.rows)
        chunk_rows = [c for row in rows for c in row.chunks]
        key_rows = rows if self._keys is not None else []  # the key index, for the nightly jobs
        vectors = self._write_or_delete(
            self._path(VECTORS_DIR, batch, digest, ".parquet"),
            ParquetTableSink(self._schema, self._row_group_rows), rows,
            _row_group_tables(rows, self._schema, self._row_group_rows))
        chunks = self._write_or_delete(
            self._path(CHUNKS_DIR, batch, digest, ".parquet"),
            ParquetTableSink(self._chunk_schema, self._row_group_rows), chunk_rows,
            _row_group_tables(chunk_rows, self._chunk_schema, self._row_group_rows, chunks_table))
        keys = self._write_or_delete(
            self._path(KEYS_DIR, batch, digest, ".parquet"),
            ParquetTableSink(key_schema(), self._row_group_rows), key_rows,
            _row_group_tables(key_rows, key_schema(), self._row_group_rows, self._keys))
        letters = self._write_or_delete(
            self._path(DEAD_LETTER_DIR, batch, digest, ".jsonl"), _JsonLinesSink(),
            list(batch.dead_letters), map(_count_dead_letter, batch.dead_letters))
        store_rows, store_key, store_rejected, store_withdrawn = self._load(
            batch, digest, rows, chunk_rows)
        MICRO_BATCH_ROWS.update(len(rows))
        window = micro_batch_window(batch)
        record = LedgerRecord(
            run_id=self._run_id, window_start=_rfc3339(window.start),
            window_end=_rfc3339(window.end),
            pane=batch.pane, shard=batch.shard, shards=batch.shards,
            messages_in=batch.messages_in, rows_written=len(rows),
            dead_lettered=len(batch.dead_letters),
            dead_lettered_by_reason=Counts.by_reason(
                letter.reason for letter in batch.dead_letters),
            dead_lettered_by_language=Counts.by_language(
                (letter.language, letter.reason) for letter in batch.dead_letters),
            duplicates=batch.duplicates, late_reassigned=batch.late_reassigned,
            near_duplicates=batch.near_duplicates,
            vectors_file=vectors, dead_letter_file=letters,
            written_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"),
            chunks_written=len(chunk_rows), chunks_file=chunks,
            keys_written=len(key_rows), keys_file=keys, digest=digest,
            store_rows=store_rows, store_load_key=store_key, store_rejected=store_rejected,
            store_withdrawn=store_withdrawn)
        self._write(self._path(LEDGER_DIR, batch, digest, ".json"), _JsonLinesSink(),
                    [record.to_json()])
        yield record


def _rfc3339(t: Timestamp) -> str:
    return t.to_utc_datetime(has_tz=True).isoformat().replace("+00:00", "Z")


class WriteStreaming(beam.PTransform):
    """Streaming: MicroBatch -> zstd Parquet vectors (and chunks), JSON Lines dead letters and a
    JSON ledger record per micro-batch, under ``vectors/`` (``chunks/``), ``dead_letter/`` and
    ``ledger/``, and with ``signature`` (``transforms.settings.embedding_signature``) the keys
    of its rows under ``keys/``, each in ``dt=YYYY-MM-DD/hour=HH/`` of the window start, named by
    ``layout.PartFileName``; with ``store`` enabled, each micro-batch's rows also into the store
    (``transforms.stores``). Returns the ledger records."""

    def __init__(self, output: str, run_id: str, dim: int, row_group_rows: int = 16384,
                 signature: Optional[str] = None, vector_dtype: VectorDtype = "float32",
                 store: Optional[StoreSettings] = None, minhash_version: Optional[str] = None):
        super().__init__()
        require_safe_run_id(run_id)
        if row_group_rows < 1:
            raise ValueError("row_group_rows must be >= 1")
        self._fn = _WriteStreamingFn(output, run_id, dim, row_group_rows, signature,
                                      vector_dtype, store, minhash_version)

    def expand(self, batches):
        return batches | "WriteFiles" >> beam.ParDo(self._fn)

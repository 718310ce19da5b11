"""Sinks: vector rows as Parquet under ``vectors/``, dead letters as JSON Lines under ``dead_letter/``.

File names carry the run id and the shard (``part-<run_id>-00000-of-00004.parquet``), so two runs or
two shards never write the same name. Beam writes to a temporary folder and renames on success, so
readers never see a half-written file.
"""
from __future__ import annotations

import datetime as dt
import uuid

import apache_beam as beam
import numpy as np
import pyarrow as pa

from transforms.metrics import DEAD_LETTERED, ROWS_WRITTEN, TRUNCATED, dead_letter_counter
from transforms.schema import DeadLetter, EmbeddedDoc, vector_schema

VECTORS_DIR = "vectors"
DEAD_LETTER_DIR = "dead_letter"
SUMMARY_FILE = "_summary.json"
SHARD_TEMPLATE = "-SSSSS-of-NNNNN"


def new_run_id(now: dt.datetime | None = None) -> str:
    """A sortable, collision-free id safe in any file name: 20261201T093000Z-1a2b3c4d."""
    now = now or dt.datetime.now(dt.timezone.utc)
    return f"{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"


def join_path(prefix: str, *parts: str) -> str:
    return "/".join([prefix.rstrip("/"), *parts])


def to_table(rows: list[EmbeddedDoc], schema: pa.Schema) -> pa.Table:
    """A batch of rows as one Arrow table (one Parquet row group)."""
    dim = schema.field("embedding").type.list_size
    vectors = np.stack([r.embedding for r in rows]).astype(np.float32, copy=False)
    if vectors.shape[1] != dim:
        raise ValueError(f"embedding has {vectors.shape[1]} dimensions, the schema {dim}")
    events = [r.doc.event for r in rows]
    table = pa.table({
        "id": [e.id for e in events],
        "url": [e.url for e in events],
        "source": [e.source for e in events],
        "title": [e.title for e in events],
        "published_at": [e.published_at for e in events],
        "language": [e.language for e in events],
        "model": [r.model for r in rows],
        "dim": pa.array(np.full(len(rows), dim, dtype=np.int32)),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim),
        "text_sha256": [r.doc.text_sha256 for r in rows],
        "token_count": pa.array([r.doc.token_count for r in rows], pa.int32()),
        "truncated": [r.doc.truncated for r in rows],
        "embedded_at": [r.embedded_at for r in rows],
    }, schema=schema)
    ROWS_WRITTEN.inc(len(rows))
    TRUNCATED.inc(sum(r.doc.truncated for r in rows))
    return table


class WriteVectors(beam.PTransform):
    """EmbeddedDoc -> zstd Parquet files ``<output>/vectors/part-<run_id>-SSSSS-of-NNNNN.parquet``."""

    def __init__(self, output: str, run_id: str, dim: int, row_group_rows: int = 16384):
        super().__init__()
        self._prefix = join_path(output, VECTORS_DIR, f"part-{run_id}")
        self._schema = vector_schema(dim)
        self._row_group_rows = row_group_rows

    def expand(self, rows):
        schema = self._schema
        return (rows
                | "RowGroups" >> beam.BatchElements(min_batch_size=self._row_group_rows,
                                                    max_batch_size=self._row_group_rows)
                | "ToArrow" >> beam.Map(to_table, schema)
                | "WriteParquet" >> beam.io.WriteToParquetBatched(
                    self._prefix, schema=schema, codec="zstd", file_name_suffix=".parquet",
                    shard_name_template=SHARD_TEMPLATE))


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

"""The current vector of every article, across daily outputs (and a streaming output): for each id,
its current version (``transforms.types.VERSION_ORDER``): the row with the latest ``updated_at``,
then the latest ``published_at`` (the article's own order, which its producer gives), then the
latest day (the ``dt=`` partition in its path), then the latest Pub/Sub publish time, the latest
embedded only among rows equal in all of those; a null is lower than any value.

An incremental run writes only what is new or changed, so an article's current vector can be in any
day's output; a corrected article's new vector replaces its old one for readers that use this when
its producer sends a later ``updated_at`` (docs/input.md), or, without one, when it comes in a
later day's input. Ordered by the article's own times and then by day, not by ``embedded_at``, so
that a rerun of an older day, or the slower of two workers that embedded two versions, does not
make older text current again. Articles are never deleted by it (there are no tombstones in the
input contract). The store's upsert (``transforms.stores.pgvector``) keeps the same version.

DuckDB (``CURRENT_VECTORS_SQL``, docs/incremental.md shows it; ``{files}`` is a glob or a list of
globs of vector files under ``dt=`` folders):
"""
from __future__ import annotations

import glob as globlib
import os
import re

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from transforms.output.layout import open_output_file
from transforms.output.parquet import NULLABLE_IN_ORDER, VERSION_ORDER, common_schema, conform

LATEST_FIRST = ", ".join(f"{name} DESC NULLS LAST" if name in NULLABLE_IN_ORDER
                         else f"{name} DESC" for name in VERSION_ORDER)
"""``ORDER BY`` terms of ``VERSION_ORDER``: the current version first."""

CURRENT_VECTORS_SQL = """\
SELECT * EXCLUDE (rank_in_id) FROM (
  SELECT *, row_number() OVER (PARTITION BY id ORDER BY updated_at DESC NULLS LAST,
      published_at DESC NULLS LAST, dt DESC, pubsub_publish_time DESC NULLS LAST,
      embedded_at DESC) AS rank_in_id
  FROM read_parquet({files}, hive_partitioning = true, union_by_name = true))
WHERE rank_in_id = 1"""
if LATEST_FIRST not in " ".join(CURRENT_VECTORS_SQL.split()):
    raise AssertionError("CURRENT_VECTORS_SQL must order by VERSION_ORDER")

__doc__ += "\n" + CURRENT_VECTORS_SQL + "\n"


def _partition_values(root: str, path: str) -> dict[str, str]:
    """The ``key=value`` folders between ``root`` and ``path`` (hive partitioning)."""
    folder = os.path.relpath(os.path.dirname(path), root)
    return dict(s.split("=", 1) for s in folder.split(os.sep) if "=" in s)


def _partition_type(values: list[str]) -> pa.DataType:
    """As pyarrow's hive partitioning infers it: int32 if every value is one, else a string."""
    if all(re.fullmatch(r"-?[0-9]+", v) and -2**31 <= int(v) < 2**31 for v in values):
        return pa.int32()
    return pa.string()


def current_vectors(root: str, pattern: str = "dt=*/vectors/*.parquet") -> pa.Table:
    """pyarrow: the current row of every article among the vector files ``root/pattern`` (on
    local disk). ``dt`` comes from the path (as pyarrow's hive partitioning reads it).
    Each file is read as a regular file below ``root`` (``layout.open_output_file``): a symlink
    (to a file or a folder outside) or a FIFO in place of one is an ``UnsafePath`` naming it,
    never read or waited on."""
    files = sorted(globlib.glob(os.path.join(root, pattern)))
    if not files:
        raise FileNotFoundError(f"no vector files match {os.path.join(root, pattern)}")
    read = []
    for path in files:
        with open_output_file(root, path) as f:
            read.append(pq.read_table(f))
    # Files written before the embedding's elements were declared not null, or at another
    # sink.vector_dtype, are read under one schema (float32 if any file's is).
    schema = common_schema([t.schema for t in read], merge_columns=True)
    # A column some file lacks (written before it existed) is null there, whatever later files
    # declare: nullable in the merged schema, as pyarrow's dataset read it.
    schema = pa.schema([field if all(field.name in t.schema.names for t in read)
                        else field.with_nullable(True) for field in schema],
                       metadata=schema.metadata)
    values = [_partition_values(root, path) for path in files]
    keys = list(dict.fromkeys(k for found in values for k in found if k not in schema.names))
    types = {k: _partition_type([found[k] for found in values if k in found]) for k in keys}
    tables = []
    for table, found in zip(read, values, strict=True):
        table = pa.Table.from_batches([conform(b, schema) for b in table.to_batches()], schema)
        for key in keys:
            column = pa.array([found.get(key)] * table.num_rows, pa.string()).cast(types[key])
            table = table.append_column(pa.field(key, types[key]), column)
        tables.append(table)
    table = pa.concat_tables(tables)
    for name in VERSION_ORDER:  # files written before a column existed: null there
        if name not in table.column_names:
            table = table.append_column(name, pa.nulls(table.num_rows, pa.timestamp("us", "UTC")))
    # Descending with nulls at the end: a null is lower than any value (VERSION_ORDER).
    table = table.take(pc.sort_indices(
        table, [("id", "ascending")] + [(name, "descending") for name in VERSION_ORDER],
        null_placement="at_end"))
    ids = table["id"].combine_chunks()
    first = pc.invert(pc.equal(ids[1:], ids[:-1])).to_pylist() if len(ids) > 1 else []
    return table.filter(pa.array([True] + first, pa.bool_()))

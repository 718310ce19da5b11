"""The current vector of every article, across daily outputs (and a streaming output): for each id,
its current version (``transforms.schema.VERSION_ORDER``): the row with the latest ``updated_at``,
then the latest ``published_at`` (the article's own order, which its producer gives), then the
latest day (the ``dt=`` partition in its path), then the latest Pub/Sub publish time, the latest
embedded only among rows equal in all of those; a null is lower than any value.

An incremental run writes only what is new or changed, so an article's current vector can be in any
day's output; a corrected article's new vector replaces its old one for readers that use this when
its producer sends a later ``updated_at`` (docs/input.md), or, without one, when it comes in a
later day's input. Ordered by the article's own times and then by day, not by ``embedded_at``, so
that a rerun of an older day, or the slower of two workers that embedded two versions, does not
make older text current again. Articles are never deleted by it (there are no tombstones in the
input contract). The store's upsert (``transforms.store``) keeps the same version.

DuckDB (``CURRENT_VECTORS_SQL``, docs/incremental.md shows it; ``{files}`` is a glob or a list of
globs of vector files under ``dt=`` folders):
"""
from __future__ import annotations

import glob as globlib
import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from transforms.schema import NULLABLE_IN_ORDER, VERSION_ORDER, common_schema

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


def current_vectors(root: str, pattern: str = "dt=*/vectors/*.parquet") -> pa.Table:
    """pyarrow: the current row of every article among the vector files ``root/pattern`` (local;
    for gs:// give ``ds.dataset`` a ``pyarrow.fs.GcsFileSystem``). ``dt`` comes from the path."""
    files = sorted(globlib.glob(os.path.join(root, pattern)))
    if not files:
        raise FileNotFoundError(f"no vector files match {os.path.join(root, pattern)}")
    # Files written before the embedding's elements were declared not null, or at another
    # sink.vector_dtype, are read under one schema (float32 if any file's is).
    schema = common_schema([pq.read_schema(f) for f in files], merge_columns=True)
    partitioning = ds.partitioning(flavor="hive")
    found = ds.dataset(files, format="parquet", partitioning=partitioning,
                       partition_base_dir=root).schema
    extra = [found.field(name) for name in found.names if name not in schema.names]
    table = ds.dataset(files, schema=pa.schema([*schema, *extra]), format="parquet",
                       partitioning=partitioning, partition_base_dir=root).to_table()
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

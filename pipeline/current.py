"""The current vector of every article, across daily outputs (and a streaming output): for each id,
its row from the latest day (the ``dt=`` partition in its path), the latest embedded among equals.

An incremental run writes only what is new or changed, so an article's current vector can be in any
day's output; a corrected article's new vector is in a later day than its old one, and replaces it
for readers that use this. Ordered by day first, not by ``embedded_at``, so that a rerun of an
older day does not make its older text current again. Articles are never deleted by it (there are
no tombstones in the input contract).

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

from transforms.schema import common_schema

CURRENT_VECTORS_SQL = """\
SELECT * EXCLUDE (rank_in_id) FROM (
  SELECT *, row_number() OVER (PARTITION BY id ORDER BY dt DESC, embedded_at DESC) AS rank_in_id
  FROM read_parquet({files}, hive_partitioning = true, union_by_name = true))
WHERE rank_in_id = 1"""

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
    table = table.take(pc.sort_indices(table, [("id", "ascending"), ("dt", "descending"),
                                               ("embedded_at", "descending")]))
    ids = table["id"].combine_chunks()
    first = pc.invert(pc.equal(ids[1:], ids[:-1])).to_pylist() if len(ids) > 1 else []
    return table.filter(pa.array([True] + first, pa.bool_()))

"""A load's rows staged in temporary tables of its session (``stage``), before the table's lock
is taken: a binary COPY of the articles' rows and of their chunks, in a transaction of its own
that locks none of the store's tables, so a loader that stalls here holds nothing another load
waits for. A row that cannot be sent, or that the server refuses as its COPY's input, is set
aside with its chunks (``retry.Isolation``). What was staged, and how the upsert walks it by
article, is ``Staged``."""
from __future__ import annotations

import bisect
import dataclasses
from typing import Callable, Optional

import pyarrow as pa

from transforms.settings import VectorDtype
from transforms.stores.base import LoadRows
from transforms.stores.pgvector.rows import chunk_groups, copy_rows, refusal
from transforms.stores.pgvector.schema import ident, latest_first, store_tables, type_sql
from transforms.stores.pgvector.settings import StoreSettings
from transforms.stores.retry import Isolation


@dataclasses.dataclass
class Staged:
    """A load's rows in temporary tables of its session, staged before the table's lock is
    taken: ``vectors`` (the columns of the articles' table, ``rn`` and ``position``) and
    ``chunks`` (the chunks of those rows), both built from ``LoadRows``. The rows are staged in
    the order of their ids, at ``position`` 0, 1, ...; ``rn`` numbers the articles, not the rows
    (a dense rank of the id): every version of one article has the same ``rn``, so no range of
    ``rn`` an isolation tries splits an article's versions (a range with only an older one would
    store it, then lose it to the later one, and a withdrawal could later bring that older one
    back as if it were another load's)."""

    keep: list[int]  # indices in rows.vectors of the rows staged, by id: positions 0, 1, ...
    rank: list[int]  # rn of each position: the dense rank of its id
    names: list[str]  # the articles' table's columns
    chunk_names: list[str]
    vectors: str = "newsvec_stage_vectors"
    chunks: Optional[str] = None  # None: no chunks
    missing: set[int] = dataclasses.field(default_factory=set)  # positions the staging set aside

    @classmethod
    def of(cls, ids: list, keep: list[int], names: list[str], chunk_names: list[str]
           ) -> "Staged":
        ordered = sorted(keep, key=lambda i: (ids[i], i))
        rank: list[int] = []
        for position, i in enumerate(ordered):
            same = position and ids[ordered[position - 1]] == ids[i]
            rank.append(rank[-1] if same else (rank[-1] + 1 if rank else 0))
        return cls(keep=ordered, rank=rank, names=names, chunk_names=chunk_names)

    @property
    def articles(self) -> int:
        """How many ``rn`` there are: ``rn`` goes from 0 to this (excluded)."""
        return self.rank[-1] + 1 if self.rank else 0

    def positions(self, lo: int, hi: int) -> list[int]:
        """The positions staged (not set aside) with ``lo <= rn < hi``."""
        first = bisect.bisect_left(self.rank, lo)
        last = bisect.bisect_left(self.rank, hi)
        return [p for p in range(first, last) if p not in self.missing]

    def rows_between(self, lo: int, hi: int) -> int:
        return len(self.positions(lo, hi))

    def set_aside(self, conn, rn: int) -> int:
        """Set aside the version of article ``rn`` that the upsert tries (the latest, as its
        ``DISTINCT ON`` orders them), which the server refused: out of the staged rows, so that
        the next try of ``rn`` tries its earlier version, if any. Returns its position."""
        from psycopg import sql

        row = conn.execute(sql.SQL(
            "DELETE FROM {stage} WHERE position = (SELECT position FROM {stage} WHERE rn = %s "
            "ORDER BY {latest}, position LIMIT 1) RETURNING position").format(
                stage=ident("pg_temp", self.vectors), latest=latest_first()),
            (rn,)).fetchone()
        position = int(row[0])
        self.missing.add(position)
        return position


class _Stager:
    """The staging of one load on its connection: the temporary tables, their COPY, and the
    rows set aside on the way (``staged.missing``, their rejections into ``isolation``)."""

    def __init__(self, conn, rows: LoadRows, ids: list, staged: Staged, pgvector_schema: str,
                 pgvector_oid: int, isolation: Isolation, scrub: Callable[[str], str]):
        self.conn, self.rows, self.ids, self.staged = conn, rows, ids, staged
        self.pgvector_schema, self.pgvector_oid = pgvector_schema, pgvector_oid
        self.isolation, self.scrub = isolation, scrub

    def create(self, name: str, types: list[tuple[str, str]], extra: str = ""):
        from psycopg import sql

        return sql.SQL("CREATE TEMP TABLE {} ({}{})").format(
            ident("pg_temp", name), sql.SQL(", ").join(
                sql.SQL("{} {}").format(ident(n), type_sql(t, self.pgvector_schema))
                for n, t in types), sql.SQL(extra))

    def copy(self, name: str, names: list[str], types: list[int | str], batch: list) -> None:
        from psycopg import sql

        with self.conn.cursor().copy(sql.SQL("COPY {} ({}) FROM STDIN (FORMAT BINARY)").format(
                ident("pg_temp", name), sql.SQL(", ").join(map(ident, names)))) as out:
            out.set_types(types)
            for row in batch:
                out.write_row(row)

    def sql_types(self, types: list[tuple[str, str]]) -> list[int | str]:
        # pgvector's type by its oid (in its own schema), psycopg's built-in ones by name
        return [self.pgvector_oid if n == "embedding" else t for n, t in types]

    def refused(self, position: int, exc: BaseException) -> dict:
        return refusal(self.rows, self.staged.keep[position], exc, self.scrub)

    def vectors(self, types: list[tuple[str, str]], data: list[tuple]) -> None:
        """The articles' rows ``data`` (``types``: their columns), each one set aside that
        cannot be sent or that the server refuses."""
        staged = self.staged

        def refused_row(position: int, exc: BaseException) -> list[dict]:
            staged.missing.add(position)
            return [self.refused(position, exc)]

        self.conn.execute(self.create(staged.vectors, types,
                                      ", rn integer NOT NULL, position integer NOT NULL"))
        self.isolation.halve(self.conn.transaction, len(data), lambda lo, hi: self.copy(
            staged.vectors, [*staged.names, "rn", "position"],
            [*self.sql_types(types), "integer", "integer"], data[lo:hi]), refused_row)

    def chunks(self, name: str, types: list[tuple[str, str]], chunks: pa.Table,
               load_key: str) -> None:
        """The chunk rows ``chunks`` into ``name``; a chunk that cannot be sent or that the
        server refuses sets its article's version aside (all of its staged rows)."""
        staged, rows = self.staged, self.rows
        self.conn.execute(self.create(name, types))
        chunk_data = list(copy_rows(chunks, staged.chunk_names, rows.dt, load_key))
        chunk_keys = list(zip(chunks.column("id").to_pylist(),
                              chunks.column("text_sha256").to_pylist(), strict=True))
        shas = rows.vectors.column("text_sha256").to_pylist()
        positions: dict[tuple, list[int]] = {}
        for p, i in enumerate(staged.keep):
            positions.setdefault((self.ids[i], shas[i]), []).append(p)
        gone: list[tuple] = []

        def refused_chunk(i: int, exc: BaseException) -> list[dict]:
            version = [p for p in positions[chunk_keys[i]] if p not in staged.missing]
            if not version:
                return []  # its article is set aside already
            staged.missing.update(version)
            gone.append(chunk_keys[i])
            items = [self.refused(p, exc) for p in version]
            for item in items:
                item["detail"] = f"a chunk: {item['detail']}"[:300]
            return items

        self.isolation.halve(self.conn.transaction, len(chunk_data), lambda lo, hi: self.copy(
            name, staged.chunk_names, self.sql_types(types), chunk_data[lo:hi]), refused_chunk)
        if gone:  # the articles of the chunks refused: out of the staged rows
            self._drop_versions(gone)

    def _drop_versions(self, gone: list[tuple]) -> None:
        """The staged rows of the article versions (id, text_sha256) ``gone``."""
        from psycopg import sql

        self.conn.execute(sql.SQL(
            "DELETE FROM {} s USING unnest(%s::text[], %s::text[]) AS g(id, sha) "
            "WHERE s.id = g.id AND s.text_sha256 = g.sha").format(
                ident("pg_temp", self.staged.vectors)),
            ([g[0] for g in gone], [g[1] for g in gone]))


def _chunks_of(rows: LoadRows, kept: pa.Table) -> Optional[pa.Table]:
    """The chunk rows of the article versions ``kept``; None when there are none."""
    if rows.chunks is None or not rows.chunks.num_rows:
        return None
    groups = chunk_groups(rows)
    versions = zip(kept.column("id").to_pylist(), kept.column("text_sha256").to_pylist(),
                   strict=True)
    indices = sorted({c for key in versions for c in groups.get(key, ())})
    return rows.chunks.take(pa.array(indices, pa.int64())) if indices else None


def stage(conn, settings: StoreSettings, rows: LoadRows, keep: list[int], pgvector_type: str,
          pgvector_oid: int, pgvector_schema: str, load_key: str, isolation: Isolation,
          scrub: Callable[[str], str]) -> Staged:
    """The rows ``keep`` (and their chunks) into temporary tables (``Staged``), in a
    transaction of their own before the table's lock: no lock of the store's tables is
    taken (the staging tables' types are written out, not copied with LIKE). The rows are
    built before each COPY starts, so a COPY only sends. A row that cannot be sent or that
    the server refuses as its COPY's input is set aside (``Isolation.halve``), with its chunks."""
    vectors_table, chunks_table = store_tables(settings)
    dtype: VectorDtype = "float16" if pgvector_type == "halfvec" else "float32"
    vector_types = vectors_table.column_types(rows.dim, dtype)
    chunk_types = chunks_table.column_types(rows.dim, dtype)
    ids = rows.vectors.column("id").to_pylist()
    staged = Staged.of(ids, keep, [n for n, _ in vector_types], [n for n, _ in chunk_types])
    order = staged.keep
    kept = rows.vectors if order == list(range(rows.vectors.num_rows)) else \
        rows.vectors.take(pa.array(order, pa.int64()))
    data = [(*row, rn, position) for position, (rn, row) in enumerate(zip(
        staged.rank, copy_rows(kept, staged.names, rows.dt, load_key), strict=True))]
    chunks = _chunks_of(rows, kept)
    if chunks is not None:
        staged.chunks = "newsvec_stage_chunks"
    stager = _Stager(conn, rows, ids, staged, pgvector_schema, pgvector_oid, isolation, scrub)
    with conn.transaction():
        stager.vectors(vector_types, data)
        if chunks is not None and staged.chunks is not None:
            stager.chunks(staged.chunks, chunk_types, chunks, load_key)
    return staged

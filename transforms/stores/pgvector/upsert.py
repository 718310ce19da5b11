"""Under the table's lock, the staged rows (``stage.Staged``) into the store's tables, one range
of articles at a time (``load_part``): an upsert that keeps each article's current version
(``schema.version_order``: a row replaces the stored one only if it is a later version), the
chunks of the versions it wrote, and the versions it replaced or that lost to another load's row
kept for a withdrawal to bring back (``withdraw``)."""
from __future__ import annotations

import dataclasses

from transforms.stores.pgvector.schema import ident, latest_first, table_names, version_order
from transforms.stores.pgvector.settings import StoreSettings
from transforms.stores.pgvector.stage import Staged


@dataclasses.dataclass
class Part:
    """What the parts of one load did, summed."""

    rows: int = 0
    chunk_rows: int = 0
    current: int = 0

    def add(self, other: "Part") -> None:
        self.rows += other.rows
        self.chunk_rows += other.chunk_rows
        self.current += other.current


def load_part(conn, settings: StoreSettings, staged: Staged, lo: int, hi: int, load_key: str
              ) -> Part:
    """Upsert the staged rows ``lo <= rn < hi``; the articles whose row it wrote (the
    upsert's ``RETURNING``: no scan of the table) get these rows' chunks of the same version,
    and only them. Each row it replaces (and its chunks) is kept under ``load_key``, and each
    of its rows that loses to another load's row is kept under that load's key: what a
    withdrawal of either load brings back (``withdraw.withdraw``)."""
    from psycopg import sql

    names = table_names(settings)
    won, lost = _upsert(conn, settings, staged, lo, hi, load_key)
    part = Part(rows=staged.rows_between(lo, hi), current=len(won))
    chunk_names = sql.SQL(", ").join(map(ident, staged.chunk_names))
    s_chunk_names = sql.SQL(", ").join(sql.SQL("s.{}").format(ident(n))
                                       for n in staged.chunk_names)
    if won:
        won_ids = sorted({doc_id for doc_id, _ in won})
        conn.execute(sql.SQL(
            "WITH gone AS (DELETE FROM {chunks} c USING unnest(%s::text[]) AS w(id) "
            "WHERE c.id = w.id RETURNING {c_cols}) "
            "INSERT INTO {kept} ({cols}, withdrawn_with) SELECT {cols}, %s FROM gone "
            "WHERE load_key <> %s ON CONFLICT DO NOTHING").format(
                chunks=names["chunks"], kept=names["chunks_sup"], cols=chunk_names,
                c_cols=sql.SQL(", ").join(sql.SQL("c.{}").format(ident(n))
                                          for n in staged.chunk_names)),
            (won_ids, load_key, load_key))
    if staged.chunks is None:
        return part
    if won:
        part.chunk_rows = conn.execute(sql.SQL(
            "INSERT INTO {} ({}) SELECT DISTINCT ON (s.id, s.chunk_index) {} FROM {} s "
            "JOIN unnest(%s::text[], %s::text[]) AS v(id, text_sha256) "
            "ON s.id = v.id AND s.text_sha256 = v.text_sha256 "
            "ORDER BY s.id, s.chunk_index, s.embedded_at DESC").format(
                names["chunks"], chunk_names, s_chunk_names, ident("pg_temp", staged.chunks)),
            ([v[0] for v in won], [v[1] for v in won])).rowcount
    if lost:
        conn.execute(sql.SQL(
            "INSERT INTO {} ({}, withdrawn_with) SELECT DISTINCT ON (s.id, s.chunk_index) "
            "{}, v.holder FROM {} s "
            "JOIN unnest(%s::text[], %s::text[], %s::text[]) AS v(id, text_sha256, holder) "
            "ON s.id = v.id AND s.text_sha256 = v.text_sha256 "
            "ORDER BY s.id, s.chunk_index, s.embedded_at DESC ON CONFLICT DO NOTHING").format(
                names["chunks_sup"], chunk_names, s_chunk_names,
                ident("pg_temp", staged.chunks)),
            ([v[0] for v in lost], [v[1] for v in lost], [v[2] for v in lost]))
    return part


def _upsert(conn, settings: StoreSettings, staged: Staged, lo: int, hi: int, load_key: str
            ) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Upsert the staged rows ``lo <= rn < hi``: a row replaces the stored one only if it is
    a later version (``version_order``); of two versions of one article in the rows (one
    ``rn``: never split by a range), the later one. One statement, whose parts all see the
    table as it was before it: each row replaced is kept under ``load_key``, each row that
    lost under its winner's load key (``load_part``). Returns (id, text_sha256) of the rows
    written, and (id, text_sha256, holder's load key) of the rows kept because they lost."""
    from psycopg import sql

    names = table_names(settings)
    cols = staged.names
    t = {alias: sql.SQL(", ").join(sql.SQL(alias + "{}").format(ident(n)) for n in cols)
         for alias in ("", "o.", "s.", "v.")}
    statement = sql.SQL(
        "WITH src AS (SELECT DISTINCT ON (id) {cols} FROM {stage} "
        "WHERE rn >= %(lo)s AND rn < %(hi)s ORDER BY id, {latest}, position), "
        "old AS (SELECT {v_cols} FROM {target} v JOIN src ON src.id = v.id), "
        "up AS (INSERT INTO {target} AS t ({cols}) SELECT {cols} FROM src "
        "ON CONFLICT (id) DO UPDATE SET {updates} WHERE {excluded} > {stored} "
        "RETURNING t.id, t.text_sha256), "
        "replaced AS (INSERT INTO {kept} ({cols}, withdrawn_with) "
        "SELECT {o_cols}, %(key)s FROM old o JOIN up ON up.id = o.id "
        "WHERE o.load_key <> %(key)s ON CONFLICT DO NOTHING), "
        "lost AS (INSERT INTO {kept} ({cols}, withdrawn_with) "
        "SELECT {s_cols}, o.load_key FROM src s JOIN old o ON o.id = s.id "
        "WHERE NOT EXISTS (SELECT 1 FROM up WHERE up.id = s.id) AND o.load_key <> %(key)s "
        "ON CONFLICT DO NOTHING RETURNING id, text_sha256, withdrawn_with) "
        "SELECT true, id, text_sha256, NULL FROM up UNION ALL "
        "SELECT false, id, text_sha256, withdrawn_with FROM lost").format(
            cols=t[""], v_cols=t["v."], o_cols=t["o."], s_cols=t["s."],
            stage=ident("pg_temp", staged.vectors), latest=latest_first(),
            target=names["vectors"],
            kept=names["sup"],
            updates=sql.SQL(", ").join(sql.SQL("{} = EXCLUDED.{}").format(ident(n), ident(n))
                                       for n in cols if n != "id"),
            excluded=version_order("excluded"), stored=version_order("t"))
    result = conn.execute(statement, {"lo": lo, "hi": hi, "key": load_key}).fetchall()
    return ([(r[1], r[2]) for r in result if r[0]],
            [(r[1], r[2], r[3]) for r in result if not r[0]])

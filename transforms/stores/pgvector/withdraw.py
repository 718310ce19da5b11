"""Undoing a load's rows (``withdraw``): an earlier try of a load redone with another outcome (a
streaming micro-batch), or the load of the run a batch run replaced in its output
(``previous_load``). The versions a load replaced, and those that lost to it, are kept in
``<table>_superseded`` and ``<table>_chunks_superseded`` under the load that would bring them
back, for ``superseded_keep_days`` (``prune``); a withdrawal brings the latest of them back, and
hands the rest on."""
from __future__ import annotations

from typing import Optional

from transforms.stores.base import BatchOutput, StoreLoadFailed
from transforms.stores.pgvector.schema import ident, latest_first, store_tables, table_names
from transforms.stores.pgvector.settings import StoreSettings


def previous_load(conn, settings: StoreSettings, output: BatchOutput, load_key: str
                  ) -> Optional[str]:
    """The load of the run ``output.prefix`` held before this one (the newest other run whose
    load of it is recorded, through the ``output`` index), whose rows this load replaces;
    None when there is none. A newer run's load there means this run is one the output
    replaced (its load came late: it read its files before the newer run published), so it
    is refused: it would withdraw the newer run's rows."""
    from psycopg import sql

    row = conn.execute(sql.SQL(
        "SELECT load_key, run_id FROM {} WHERE output = %s AND load_key <> %s "
        "ORDER BY run_id DESC NULLS LAST LIMIT 1").format(table_names(settings)["loads"]),
        (output.prefix, load_key)).fetchone()
    if row is None:
        return None
    if row[1] is not None and row[1] > output.run_id:
        raise StoreLoadFailed(
            f"run {output.run_id} is older than run {row[1]}, whose load of {output.prefix} "
            "the store holds: the newer run replaced it there, and the older one is not "
            "loaded (it would withdraw the newer run's rows)")
    return str(row[0])


def ids_of(conn, settings: StoreSettings, load_key: str) -> set[str]:
    """Every article ``load_key`` left a trace of: its rows, the versions kept under it
    (it replaced them, or they lost to it), and its own versions kept under other loads,
    through the indexes on ``load_key`` and the kept versions' primary key."""
    from psycopg import sql

    names = table_names(settings)
    return {r[0] for r in conn.execute(sql.SQL(
        "SELECT id FROM {vectors} WHERE load_key = %(k)s UNION "
        "SELECT id FROM {sup} WHERE withdrawn_with = %(k)s UNION "
        "SELECT id FROM {sup} WHERE load_key = %(k)s UNION "
        "SELECT id FROM {chunks_sup} WHERE withdrawn_with = %(k)s").format(**names),
        {"k": load_key}).fetchall()}


def without_row(conn, settings: StoreSettings, ids: list[str]) -> list[str]:
    """Those of ``ids`` the articles' table has no row of."""
    from psycopg import sql

    if not ids:
        return []
    return sorted(r[0] for r in conn.execute(sql.SQL(
        "SELECT w.id FROM unnest(%s::text[]) AS w(id) WHERE NOT EXISTS "
        "(SELECT 1 FROM {} v WHERE v.id = w.id)").format(table_names(settings)["vectors"]),
        (ids,)).fetchall())


class _Withdrawal:
    """The withdrawal of the load ``load_key`` on a connection: its statements, each run on the
    articles' kept versions (``kind`` "") and on their chunks' (``kind`` "chunks")."""

    def __init__(self, conn, settings: StoreSettings, load_key: str):
        self.conn, self.load_key = conn, load_key
        self.names = table_names(settings)
        self.vector_cols, self.chunk_cols = (
            [n for n, _ in table.column_types(1)] for table in store_tables(settings))

    @staticmethod
    def cols(which: list[str], alias: str = ""):
        from psycopg import sql

        return sql.SQL(", ").join(sql.SQL(alias + "{}").format(ident(n)) for n in which)

    def each(self, statement: str, kind: str, params: tuple, **extra) -> None:
        from psycopg import sql

        table, columns = ("sup", self.vector_cols) if kind == "" else ("chunks_sup",
                                                                       self.chunk_cols)
        self.conn.execute(sql.SQL(statement).format(
            kept=self.names[table], main=self.names["vectors" if kind == "" else "chunks"],
            cols=self.cols(columns), s_cols=self.cols(columns, "s."), **extra), params)

    def set_aside_for(self, pairs: tuple[list, list]) -> None:
        """Keep, set aside for each (id, holder) of ``pairs``, the versions this load set
        aside that are not the holder's own, so that they come back when the holder is
        withdrawn in turn."""
        for kind in ("", "chunks"):
            self.each("INSERT INTO {kept} ({cols}, withdrawn_with) SELECT {s_cols}, h.holder "
                      "FROM {kept} s JOIN unnest(%s::text[], %s::text[]) AS h(id, holder) "
                      "ON s.id = h.id AND s.load_key <> h.holder "
                      "WHERE s.withdrawn_with = %s ON CONFLICT DO NOTHING", kind,
                      (*pairs, self.load_key))

    def bring_back(self, ids: list[str]) -> list[str]:
        """Of ``ids``, the articles whose row is this load's: the row and its chunks deleted,
        the latest version kept under the load brought back (with its chunks), the others kept
        under it now kept under that version. Returns their ids."""
        from psycopg import sql

        mine = sorted(r[0] for r in self.conn.execute(sql.SQL(
            "DELETE FROM {} v USING unnest(%s::text[]) AS w(id) WHERE v.id = w.id "
            "AND v.load_key = %s RETURNING v.id").format(self.names["vectors"]),
            (ids, self.load_key)).fetchall())
        if not mine:
            return mine
        self.conn.execute(sql.SQL("DELETE FROM {} c USING unnest(%s::text[]) AS w(id) "
                                  "WHERE c.id = w.id").format(self.names["chunks"]), (mine,))
        best = self.conn.execute(sql.SQL(
            "SELECT DISTINCT ON (s.id) s.id, s.load_key FROM {} s "
            "JOIN unnest(%s::text[]) AS w(id) ON s.id = w.id WHERE s.withdrawn_with = %s "
            "ORDER BY s.id, {}").format(self.names["sup"], latest_first()),
            (mine, self.load_key)).fetchall()
        if best:
            back = ([b[0] for b in best], [b[1] for b in best])
            for kind in ("", "chunks"):
                self.each("INSERT INTO {main} ({cols}) SELECT {s_cols} FROM {kept} s "
                          "JOIN unnest(%s::text[], %s::text[]) AS b(id, load_key) "
                          "ON s.id = b.id AND s.load_key = b.load_key "
                          "WHERE s.withdrawn_with = %s", kind, (*back, self.load_key))
            self.set_aside_for(back)
        return mine

    def hand_over(self, others: list[str]) -> None:
        """The articles ``others``, whose row is another load's: the versions kept under this
        load now kept under the load that holds this load's version (they lost to it)."""
        from psycopg import sql

        held = self.conn.execute(sql.SQL(
            "SELECT DISTINCT ON (s.id) s.id, s.withdrawn_with FROM {} s "
            "JOIN unnest(%s::text[]) AS w(id) ON s.id = w.id WHERE s.load_key = %s "
            "ORDER BY s.id, s.saved_at DESC").format(self.names["sup"]),
            (others, self.load_key)).fetchall()
        if held:
            self.set_aside_for(([h[0] for h in held], [h[1] for h in held]))

    def forget(self, ids: list[str]) -> None:
        """The kept versions of ``ids`` that are this load's or are kept under it."""
        for kind in ("", "chunks"):
            self.each("DELETE FROM {kept} k USING unnest(%s::text[]) AS w(id) WHERE k.id = w.id "
                      "AND (k.withdrawn_with = %s OR k.load_key = %s)", kind,
                      (ids, self.load_key, self.load_key))


def withdraw(conn, settings: StoreSettings, load_key: str, ids: list[str]) -> list[str]:
    """Undo what the load ``load_key`` did to the articles ``ids`` (found through the primary
    keys, never a scan): an earlier try of a load redone with another outcome, or the load
    of the run a batch run replaced in its output:
    - an article whose row is that load's: the row and its chunks are deleted, and the
      latest of the versions kept under ``load_key`` (the one it replaced, or one that lost
      to it since) comes back, with its chunks; the other versions kept under it are now
      kept under the version brought back;
    - an article whose row is another's (a later load replaced this load's version): this
      load's version, if kept under that load, is forgotten, and the versions kept under
      ``load_key`` are kept under that load instead (they lost to it, through this one),
      except that load's own versions (a load never brings back its own earlier attempt);
    Returns the ids of the first kind."""
    if not ids:
        return []
    withdrawal = _Withdrawal(conn, settings, load_key)
    mine = withdrawal.bring_back(ids)
    others = sorted(set(ids) - set(mine))
    if others:
        withdrawal.hand_over(others)
    withdrawal.forget(ids)
    return mine


def prune(conn, settings: StoreSettings) -> None:
    """Forget the kept versions older than ``superseded_keep_days`` (through their
    ``saved_at`` index: nothing is read when none is that old)."""
    from psycopg import sql

    names = table_names(settings)
    for table in ("sup", "chunks_sup"):
        conn.execute(sql.SQL("DELETE FROM {} WHERE saved_at < now() - make_interval("
                             "secs => %s)").format(names[table]),
                     (settings.superseded_keep_days * 86400,))

"""What the database's catalog holds of the pgvector store, read without taking a lock: the
schema pgvector is in, the store's tables, columns and indexes, and who owns them (``Catalog``).
From it: the refusal of a store another role owns part of (``refuse_foreign``), the statements
that create or upgrade in place what is missing (``missing_ddl``), and the type and dimension
of the stored embeddings, which a load's rows must match (``embedding_type``)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from transforms.settings import VectorDtype
from transforms.stores.base import LoadRows, StoreError, StoreLoadFailed
from transforms.stores.base import printable as _printable
from transforms.stores.pgvector.schema import (
    ADDED_COLUMNS,
    PGVECTOR_TYPES,
    ident,
    index_ddl,
    kept_ddl,
    main_ddl,
    store_tables,
)
from transforms.stores.pgvector.settings import StoreSettings


def pgvector_schema(conn) -> Optional[str]:
    """The schema pgvector is installed in (``pg_extension.extnamespace``), None when it is not
    installed in the connection's database: every name of pgvector is qualified with it."""
    row = conn.execute(
        "SELECT n.nspname::text FROM pg_catalog.pg_extension e JOIN pg_catalog.pg_namespace n "
        "ON n.oid = e.extnamespace WHERE e.extname = 'vector'").fetchone()
    return None if row is None else str(row[0])


@dataclasses.dataclass(frozen=True)
class Catalog:
    """What the store's catalog holds of ours, read in one query: the schema pgvector is in (None:
    not installed), whether the store's schema is there, the tables and indexes (by name, in the
    schema), and the columns of the tables (``table.column``)."""

    pgvector_schema: Optional[str]
    schema: bool
    relations: frozenset
    columns: frozenset
    unanalyzed: frozenset = frozenset()  # main tables with no planner statistics (reltuples <= 0)
    # (name, owner) of the tables and indexes of ours whose owner the load does not trust, and
    # (table, trigger, function's owner) of the triggers on them that run an untrusted role's
    # function (``_TRUSTED``)
    foreign: tuple = ()
    foreign_triggers: tuple = ()

    def has(self, what: str) -> bool:
        if what == "extension:vector":
            return self.pgvector_schema is not None
        if what.startswith("schema:"):
            return self.schema
        return what in self.relations


# Whether the role of oid ``{x}`` may own the store's objects, in the eyes of the load's role
# (``me``: current_user): that role itself, a role it is a member of (``pg_has_role``; for a
# superuser it is true of every role, so it is not asked for one), a superuser (who can
# run anything as anyone already), or the role ``store.table_owner`` names. Anyone else who may
# create in the store's schema could have made a table under one of its names before the owner
# did: its triggers, rules, policies, defaults and indexes run with the rights of whoever writes
# to it, and its owner reads every row (CVE-2018-1058's kind, with the table itself as bait).
_TRUSTED = (
    "EXISTS (SELECT 1 FROM pg_catalog.pg_roles o, me WHERE o.oid = {x} AND (o.oid = me.oid "
    "OR o.rolsuper OR (NOT me.rolsuper AND pg_catalog.pg_has_role(me.oid, o.oid, 'MEMBER')) "
    "OR o.rolname = %(table_owner)s))")


def read_catalog(conn, settings: StoreSettings) -> Catalog:
    """The catalog's view of the store's objects (``pg_extension``, ``pg_namespace``,
    ``pg_class``, ``pg_attribute``): no lock of any table is taken, so a load that finds
    everything in place issues no DDL, and waits for nothing a VACUUM, an ANALYZE or a
    ``CREATE INDEX CONCURRENTLY`` holds (a ``CREATE INDEX IF NOT EXISTS`` takes the table's SHARE
    lock before it finds the index there). It also lists what of the store another role owns
    (``Catalog.foreign``: ``refuse_foreign``)."""
    name = settings.table
    tables = [table.name for table in store_tables(settings)] + [
        f"{name}_loads", f"{name}_superseded", f"{name}_chunks_superseded"]
    relations = tables + [n for n, _ in index_ddl(settings)] + [
        f"{table.name}_embedding_hnsw" for table in store_tables(settings)]
    row = conn.execute(
        "WITH me AS (SELECT oid, rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) "
        "SELECT (SELECT n.nspname::text FROM pg_catalog.pg_extension e "
        "JOIN pg_catalog.pg_namespace n ON n.oid = e.extnamespace WHERE e.extname = 'vector'), "
        "EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %(schema)s), "
        "ARRAY(SELECT c.relname::text FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s "
        "AND c.relname = ANY(%(relations)s)), "
        "ARRAY(SELECT c.relname || '.' || a.attname FROM pg_catalog.pg_attribute a "
        "JOIN pg_catalog.pg_class c ON c.oid = a.attrelid "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %(schema)s AND c.relname = ANY(%(tables)s) AND a.attnum > 0 "
        "AND NOT a.attisdropped), "
        "ARRAY(SELECT c.relname::text FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = %(schema)s "
        "AND c.relname = ANY(%(main)s) AND c.reltuples <= 0), "
        "ARRAY(SELECT ARRAY[c.relname::text, pg_catalog.pg_get_userbyid(c.relowner)::text] "
        "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %(schema)s AND c.relname = ANY(%(relations)s) "
        "AND NOT " + _TRUSTED.format(x="c.relowner") + " ORDER BY c.relname), "
        "ARRAY(SELECT ARRAY[c.relname::text, t.tgname::text, CASE WHEN " +
        _TRUSTED.format(x="p.proowner") + " THEN 'a WHEN clause, which may call any role''s "
        "function' ELSE 'its function owned by the role ' || "
        "pg_catalog.pg_get_userbyid(p.proowner)::text END] FROM pg_catalog.pg_trigger t "
        "JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid "
        "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "JOIN pg_catalog.pg_proc p ON p.oid = t.tgfoid "
        "WHERE n.nspname = %(schema)s AND c.relname = ANY(%(tables)s) AND NOT t.tgisinternal "
        "AND (t.tgqual IS NOT NULL OR NOT " + _TRUSTED.format(x="p.proowner") + ") "
        "ORDER BY c.relname, t.tgname)",
        {"schema": settings.schema_name, "relations": relations, "tables": tables,
         "main": tables[:2], "table_owner": settings.table_owner}).fetchone()
    return Catalog(row[0], bool(row[1]), frozenset(row[2]),
                   frozenset(tuple(c.split(".", 1)) for c in row[3]), frozenset(row[4]),
                   tuple(tuple(r) for r in row[5]), tuple(tuple(r) for r in row[6]))


def refuse_foreign(settings: StoreSettings, catalog: Catalog,
                   error: type[StoreError] = StoreLoadFailed) -> None:
    """``error`` (never retried: no later try gets past it) naming the first table or index of
    the store that a role the load does not trust owns (``_TRUSTED``), or the first trigger on a
    table of the store that runs such a role's function; nothing when there is none. Called on
    each reading of the catalog, before anything is written to or read from the store's tables:
    a table someone else made under one of its names before the owner's first load (``CREATE
    TABLE IF NOT EXISTS`` finds it there) would run its owner's code with this role's rights at
    the first write (a trigger, a default) or read (a policy, a view); a trigger another role
    added (the owner granted it ``TRIGGER``, or ``ALL``) likewise."""
    schema = settings.schema_name
    named = ("store.table_owner" if settings.table_owner is None
             else f"store.table_owner ({_printable(settings.table_owner)})")
    if catalog.foreign:
        name, owner = (_printable(x) for x in catalog.foreign[0])
        more = (f" (and {len(catalog.foreign) - 1} more of its tables and indexes)"
                if len(catalog.foreign) > 1 else "")
        raise error(
            f"the store's {schema}.{name}{more} is owned by the role {owner}, which is neither "
            f"this connection's role, a role it is a member of, a superuser nor {named}: "
            "refused before anything is written to or read from it (a role that may create in "
            "the schema can make the store's tables before its owner does; their triggers would "
            "run with this role's rights, and their owner reads every row). If "
            f"{owner} is the store's owner, set store.table_owner to it; else have it (or a "
            "superuser) drop them, and let the owner's next load create them (docs/store.md, "
            "\"Roles and privileges\")")
    if catalog.foreign_triggers:
        table, trigger, why = (_printable(x) for x in catalog.foreign_triggers[0])
        raise error(
            f"the store's table {schema}.{table} has the trigger {trigger}, with {why}: neither "
            f"this connection's role, a role it is a member of, a superuser nor {named} is known "
            "to have written what it runs, so it is refused before anything is written (the "
            "trigger would run with this role's rights; a role granted TRIGGER on the table can "
            "add one). Drop the trigger (a condition belongs inside a trusted role's trigger "
            "function, not in WHEN), and revoke TRIGGER on the store's tables from every role "
            "but their owner (docs/store.md, \"Roles and privileges\")")


def missing_ddl(settings: StoreSettings, catalog: Catalog, dim: int,
                vector_dtype: VectorDtype = "float32") -> list:
    """The statements that create what ``catalog`` lacks, in order: the schema, pgvector (in the
    store's schema), the main tables (pgvector's type named with its schema), the columns a newer
    release added to tables that are there, the kept versions' tables (like the main ones, with
    every column by then), the B-tree indexes. Empty when everything is there: nothing to lock."""
    from psycopg import sql

    schema, name = settings.schema_name, settings.table
    out = [s for what, s in main_ddl(settings, dim, vector_dtype, catalog.pgvector_schema)
           if not catalog.has(what)]

    def columns(suffixes: Sequence[str]) -> None:
        for suffix, column, type_ in ADDED_COLUMNS:
            table = f"{name}{suffix}"
            if suffix in suffixes and catalog.has(table) and (table, column) not in \
                    catalog.columns:
                out.append(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                    ident(schema, table), ident(column),
                    sql.SQL(type_)))  # ours (ADDED_COLUMNS), never input

    columns(("", "_chunks", "_loads"))
    out += [s for what, s in kept_ddl(settings) if not catalog.has(what)]
    columns(("_superseded", "_chunks_superseded"))
    out += [s for what, s in index_ddl(settings) if not catalog.has(what)]
    return out


def embedding_type(conn, settings: StoreSettings, rows: LoadRows, pgvector: str
                   ) -> tuple[str, int]:
    """``vector`` or ``halfvec``, and its oid: the type the store's table was created with,
    whatever the rows' dtype (``sink.vector_dtype`` may change; rows are converted to the
    table's type). A table of another dimension (``model.dimensions`` or the model changed)
    is refused."""
    pgvector_type, oid, dims = stored_embedding_type(conn, settings, pgvector)
    if dims != rows.dim:
        raise StoreLoadFailed(
            f"the store's table {settings.schema_name}.{settings.table} holds "
            f"{pgvector_type}({dims}) vectors, these rows have {rows.dim} dimensions: a "
            "model or model.dimensions change needs a table of its own (store.table)")
    return pgvector_type, oid


def stored_embedding_type(conn, settings: StoreSettings, pgvector: str) -> tuple[str, int, int]:
    """The articles' table's ``embedding`` type: (``vector`` or ``halfvec``, its oid, its
    dimension); ``StoreLoadFailed`` when it is not one of pgvector's, in ``pgvector``, the
    extension's schema (a type of that name in another schema is someone else's)."""
    row = conn.execute(
        "SELECT t.typname::text, n.nspname::text, t.oid, a.atttypmod "
        "FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type t ON t.oid = a.atttypid "
        "JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace "
        "WHERE a.attrelid = %s::pg_catalog.regclass AND a.attname = 'embedding' "
        "AND NOT a.attisdropped",
        (f'"{settings.schema_name}"."{settings.table}"',)).fetchone()
    if row is None:
        raise StoreLoadFailed(f"the store's table {settings.table} has no embedding")
    name, schema, oid, dims = str(row[0]), str(row[1]), int(row[2]), int(row[3])
    if name not in PGVECTOR_TYPES.values() or schema != pgvector:
        raise StoreLoadFailed(
            f"the store's table {settings.schema_name}.{settings.table} holds "
            f"{_printable(schema)}.{_printable(name)} embeddings, not pgvector's vector or "
            f"halfvec (pgvector is in the schema {_printable(pgvector)})")
    return name, oid, dims

"""The store refuses tables it does not own (docs/store.md, "Roles and privileges"): a role that
may create in the store's schema (``public`` before PostgreSQL 15) can make the store's tables and
indexes before the owner's first load does; ``CREATE TABLE IF NOT EXISTS`` then finds them there,
and every write would fire that role's triggers with the loader's rights (and that role reads
every row). So every load and search checks who owns each table and index of the store, and whose
function each trigger on them runs: the connection's role, a role it is a member of, a superuser,
or ``store.table_owner`` (the owner a loader that owns nothing loads for), none else. Nothing is
written, and the other role's code never runs."""
from __future__ import annotations

import numpy as np
import psycopg
import pytest

from tests.store.test_store import DIM
from tests.store.test_store_search_path import _execute, _rows
from transforms.stores.base import StoreError, StoreLoadFailed
from transforms.stores.pgvector import Store, StoreSettings
from transforms.stores.pgvector.catalog import missing_ddl, read_catalog
from transforms.stores.pgvector.rows import vector_dumper
from transforms.stores.pgvector.schema import store_tables

CALLS = "public.hostile_calls"


def _hostile_function(dsn: str, mallory: str) -> None:
    """``public.grab()``, ``mallory``'s trigger function (and a policy's check), which records
    who ran it in ``hostile_calls``, and a schema named after them where it can."""
    _execute(dsn, f"CREATE TABLE {CALLS} (who text)",
             f"GRANT INSERT, SELECT ON {CALLS} TO PUBLIC",
             f"GRANT CREATE, USAGE ON SCHEMA public TO {mallory}")
    _execute(f"{dsn} user={mallory}",
             "CREATE FUNCTION public.grab() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
             f"INSERT INTO {CALLS} VALUES (current_user); "
             "RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END; END $$",
             "CREATE FUNCTION public.grab_check() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN "
             f"INSERT INTO {CALLS} VALUES (current_user); RETURN true; END $$")


def _precreate(dsn: str, mallory: str, settings: StoreSettings) -> list[str]:
    """``mallory`` makes the store's tables and indexes (newsvec's own statements), grants them
    to everyone, and puts ``grab()`` as a trigger on each table. Returns the tables."""
    with psycopg.connect(f"{dsn} user={mallory}", autocommit=True) as conn:
        for statement in missing_ddl(settings, read_catalog(conn, settings), DIM):
            try:
                conn.execute(statement)
            except psycopg.errors.InsufficientPrivilege:  # the schema: there already
                pass
        from transforms.stores.pgvector.schema import index_statement

        for table in store_tables(settings):
            conn.execute(index_statement(settings, table, "vector", "public"))
        tables = [t.name for t in store_tables(settings)] + [
            f"{settings.table}{s}" for s in ("_loads", "_superseded", "_chunks_superseded")]
        for table in tables:
            conn.execute(f"CREATE TRIGGER grab BEFORE INSERT OR UPDATE OR DELETE ON "
                         f"public.{table} FOR EACH ROW EXECUTE FUNCTION public.grab()")
        conn.execute("GRANT ALL ON ALL TABLES IN SCHEMA public TO PUBLIC")
        assert {r[0] for r in conn.execute(
            "SELECT pg_get_userbyid(relowner) FROM pg_class WHERE relname LIKE 'news_vectors%'"
        )} == {mallory}
    return tables


def _calls(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(f"SELECT who FROM {CALLS}")]


def _counts(dsn: str, tables: list[str]) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        return {t: conn.execute(f"SELECT count(*) FROM public.{t}").fetchone()[0]
                for t in tables}


def _owner_role(pg: str, roles) -> str:
    """A store owner that is not a superuser: it may create in ``public``."""
    owner = roles("store_owner")
    _execute(pg, f"GRANT CREATE, USAGE ON SCHEMA public TO {owner}")
    return owner


@pytest.mark.parametrize("who", ["superuser", "owner"])
def test_tables_another_role_made_first_are_refused_before_its_trigger_runs(pg, roles, who,
                                                                            caplog):
    """``mallory`` makes the store's tables and indexes, with a trigger on each, before the
    first load (the attack: a public schema others may create in). The first load, by a
    superuser or by a store owner that is not one, is refused, naming the table and its owner,
    at its first try (a configuration error: ``retry_s`` retries only transient ones); the
    trigger never runs and nothing is written. Pre-fix: the load stored its 2 rows through
    mallory's trigger, which ran as the loader (and mallory could read them)."""
    settings = StoreSettings(enabled=True, retry_s=30)
    mallory = roles("mallory")
    _hostile_function(pg, mallory)
    tables = _precreate(pg, mallory, settings)
    dsn = pg if who == "superuser" else f"{pg} user={_owner_role(pg, roles)}"
    with pytest.raises(StoreLoadFailed, match=rf"public\.news_vectors\b.* owned by the role "
                                              rf"{mallory}\b.*store\.table_owner") as refused:
        Store(settings, dsn).load(_rows(["a", "b"]), "run:1")
    assert "news_vectors" in str(refused.value)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]
    assert _calls(pg) == []
    assert _counts(pg, tables) == dict.fromkeys(tables, 0)


def test_a_search_of_tables_another_role_made_is_refused(pg, roles):
    """A search (a read) of tables ``mallory`` made, with row security whose check runs her
    function as the reader, is refused before it reads them; so is any ``Store.connect()`` (the
    ledger's check reads the store through it). Pre-fix: the search ran ``grab_check()`` as the
    store's owner and returned mallory's row."""
    settings = StoreSettings(enabled=True, retry_s=0)
    mallory = roles("mallory")
    _hostile_function(pg, mallory)
    _precreate(pg, mallory, settings)
    with psycopg.connect(f"{pg} user={mallory}", autocommit=True) as conn:
        conn.execute("DROP TRIGGER grab ON public.news_vectors")
        conn.adapters.register_dumper(np.ndarray, vector_dumper(conn.execute(
            "SELECT 'vector'::regtype::oid").fetchone()[0]))
        conn.execute("INSERT INTO public.news_vectors (id, title, embedding, embedded_at, dt, "
                     "load_key) VALUES ('m', 'mallory', %s, now(), current_date, 'x')",
                     (np.ones(DIM, np.float32),))
        conn.execute("ALTER TABLE public.news_vectors ENABLE ROW LEVEL SECURITY")
        conn.execute("CREATE POLICY grab ON public.news_vectors USING (public.grab_check())")
    store = Store(settings, f"{pg} user={_owner_role(pg, roles)}")
    with pytest.raises(StoreError, match=rf"owned by the role {mallory}\b"):
        store.search(np.ones(DIM), 2)
    with pytest.raises(StoreError, match=rf"owned by the role {mallory}\b"):
        store.connect()
    assert _calls(pg) == []


def _owners_store_open_to_all(pg: str, roles) -> tuple[Store, str]:
    """A store its (non-superuser) owner loaded once, then granted ALL on to everyone (TRIGGER
    included), and ``mallory``, who has her recording function: the store and her name."""
    mallory = roles("mallory")
    _hostile_function(pg, mallory)
    as_owner = f"{pg} user={_owner_role(pg, roles)}"
    store = Store(StoreSettings(enabled=True, retry_s=0), as_owner)
    store.load(_rows(["a", "b"]), "run:1")
    _execute(as_owner, "GRANT ALL ON ALL TABLES IN SCHEMA public TO PUBLIC")
    return store, mallory


def test_a_trigger_another_role_added_to_the_owners_table_is_refused(pg, roles):
    """The owner's tables, but the owner granted ALL on them to everyone (TRIGGER included), and
    ``mallory`` added her trigger to the chunks' table: the next load is refused, naming the
    trigger and its function's owner, and the trigger never runs. Pre-fix: the load ran her
    trigger as the loader."""
    store, mallory = _owners_store_open_to_all(pg, roles)
    _execute(f"{pg} user={mallory}",
             "CREATE TRIGGER grab BEFORE INSERT ON public.news_vectors_chunks "
             "FOR EACH ROW EXECUTE FUNCTION public.grab()")
    with pytest.raises(StoreLoadFailed, match=rf"news_vectors_chunks has the trigger grab, with "
                                              rf"its function owned by the role {mallory}\b"):
        store.load(_rows(["c"], seed=1), "run:2")
    assert _calls(pg) == []
    assert _counts(pg, ["news_vectors", "news_vectors_chunks"]) == {
        "news_vectors": 2, "news_vectors_chunks": 2}


def test_a_trigger_whose_when_clause_calls_another_roles_function_is_refused(pg, roles):
    """As above, but ``mallory``'s trigger runs a superuser's built-in function (trusted) and
    calls her own in its WHEN clause, which PostgreSQL evaluates with the loader's rights before
    the trigger fires: refused, whoever owns the trigger's function. Before: the load ran her
    function as the owner."""
    store, mallory = _owners_store_open_to_all(pg, roles)
    _execute(f"{pg} user={mallory}",
             "CREATE FUNCTION public.spy(text) RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN "
             f"INSERT INTO {CALLS} VALUES (current_user); RETURN false; END $$",
             "CREATE TRIGGER spy AFTER INSERT ON public.news_vectors_loads FOR EACH ROW "
             "WHEN (public.spy('x')) "
             "EXECUTE FUNCTION pg_catalog.suppress_redundant_updates_trigger()")
    with pytest.raises(StoreLoadFailed, match="news_vectors_loads has the trigger spy, with a "
                                              "WHEN clause"):
        store.load(_rows(["c"], seed=1), "run:2")
    assert _calls(pg) == []


def test_a_loader_loads_into_the_owners_tables_as_table_owner_or_member(pg, roles):
    """The setup docs/store.md documents: a store owner (not a superuser) creates the tables at
    the first load, and adds a trigger of its own (allowed: its function is the owner's); a
    loader with only the listed grants, which owns nothing, is refused without
    ``store.table_owner`` (the tables' owner is no role of its own), loads with it set to the
    owner, and loads without it once it is a member of the owner's role. The owner's trigger
    runs each time. Pre-fix: ``store.table_owner`` was an unknown key, and the load without it
    was not refused."""
    owner, loader = _owner_role(pg, roles), roles("loader")
    settings = StoreSettings(enabled=True, retry_s=0)
    Store(settings, f"{pg} user={owner}").load(_rows(["a", "b"]), "run:1")
    _execute(f"{pg} user={owner}",
             "CREATE TABLE public.owner_calls (who text)",
             "GRANT INSERT ON public.owner_calls TO PUBLIC",
             "CREATE FUNCTION public.audit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
             "INSERT INTO public.owner_calls VALUES (current_user); RETURN NEW; END $$",
             "CREATE TRIGGER audit AFTER INSERT ON public.news_vectors_loads "
             "FOR EACH ROW EXECUTE FUNCTION public.audit()",
             f"GRANT SELECT, INSERT, UPDATE, DELETE ON public.news_vectors TO {loader}",
             "GRANT SELECT, INSERT, DELETE ON public.news_vectors_chunks, "
             "public.news_vectors_superseded, public.news_vectors_chunks_superseded "
             f"TO {loader}",
             f"GRANT SELECT, INSERT, UPDATE ON public.news_vectors_loads TO {loader}")
    as_loader = f"{pg} user={loader}"
    with pytest.raises(StoreLoadFailed, match=rf"owned by the role {owner}\b.*set "
                                              r"store\.table_owner"):
        Store(settings, as_loader).load(_rows(["c"], seed=1), "mb:1")
    trusting = StoreSettings(enabled=True, retry_s=0, table_owner=owner)
    assert Store(trusting, as_loader).load(_rows(["c"], seed=1), "mb:1").rows == 1
    assert Store(trusting, as_loader).search(np.ones(DIM), 1)
    _execute(pg, f"GRANT {owner} TO {loader}")
    assert Store(settings, as_loader).load(_rows(["d"], seed=2), "mb:2").rows == 1
    with psycopg.connect(pg) as conn:
        assert [r[0] for r in conn.execute("SELECT who FROM public.owner_calls")] == [
            loader, loader]
        assert [r[0] for r in conn.execute(
            "SELECT id FROM public.news_vectors ORDER BY id")] == ["a", "b", "c", "d"]


def test_table_owner_is_a_role_name_without_control_characters():
    assert StoreSettings(table_owner="Store Owner").table_owner == "Store Owner"
    for bad in ("", "a\nb", "x" * 64):
        with pytest.raises(ValueError):
            StoreSettings(table_owner=bad)

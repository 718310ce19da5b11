"""A rerun replaces its output in the store as in the Parquet (transforms/stores/, ``BatchOutput``;
docs/store.md, "A rerun of a batch output"), on the test PostgreSQL (``pg``, ``store_settings``):

- a rerun whose output no longer holds an article (dead-lettered this time, or gone from the
  corrected input) withdraws it from the store, brings back the version its run had replaced
  where one was kept, says which articles it withdrew and which have no row now;
- the rerun's version replaces its run's even when it is an earlier one;
- a run of another output (another ``{date}``) withdraws nothing of this one's;
- a load of an older run of the output, after a newer one's, never withdraws the newer one's
  rows;
- ``newsvec load --reload`` stores the rows the store refused once the table takes them.

Batch runs use the FAKE engine (tests/fakes.py).
"""
from __future__ import annotations

import datetime as dt
import json

import psycopg
import pyarrow.parquet as pq
import pytest
import yaml
from apache_beam.options.pipeline_options import PipelineOptions

from tests.store.test_store_faults import DAY, chunks, rows, stored
from transforms.stores.base import BatchOutput, LoadRows, StoreLoadFailed
from transforms.stores.pgvector import Store
from transforms.stores.pgvector.schema import _create_statements

T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)
DAY_1 = "gs://b/vectors/dt=2026-12-01"
DAY_2 = "gs://b/vectors/dt=2026-12-02"


def at(minutes: int) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def events(path, ids, future=()):
    """A JSON-lines input of articles ``ids``; those in ``future`` have a ``published_at`` in the
    future, which the parse step dead-letters (``published_at_in_future``)."""
    path.write_text("".join(json.dumps({
        "id": i, "title": f"title {i}", "body": f"body of {i}", "source": "wire",
        **({"published_at": "2099-01-01T00:00:00Z"} if i in future else {})}) + "\n"
        for i in ids))
    return str(path)


def batch_run(config):
    from pipeline.run import run_batch
    from tests.fakes import FakeEngine

    return run_batch(config, PipelineOptions(["--runner=FnApiRunner"]), engine_factory=FakeEngine)


def held(output) -> set[str]:
    from transforms.output.manifest import read_manifest

    manifest = read_manifest(str(output))
    return set(pq.read_table([str(output / f) for f in manifest.vectors])["id"].to_pylist())


def test_a_rerun_withdraws_the_articles_its_output_no_longer_holds(tmp_path, store_settings, pg):
    """Run 1 of the day's output (``.../dt=2026-12-01``) stores e0-e3; the day is rerun and e2 is
    a dead letter this time (its input corrected to a future ``published_at``). The store holds
    what the files hold: e2 is withdrawn, and the summary names it (no earlier version to bring
    back) and the run it replaced. Before, e2 stayed in the store under run 1's key, which no
    file holds any more, and nothing said so."""
    from tests.common import make_config

    day_1 = tmp_path / "vectors" / "dt=2026-12-01"
    first = batch_run(make_config(input=events(tmp_path / "a.jsonl", ["e0", "e1", "e2", "e3"]),
                                  output=str(day_1), store=store_settings))
    assert {i for i, _ in stored(pg)} == {"e0", "e1", "e2", "e3"}
    rerun = batch_run(make_config(input=events(tmp_path / "c.jsonl", ["e0", "e1", "e2", "e3"],
                                               future={"e2"}),
                                  output=str(day_1), store=store_settings))
    assert rerun["counts"]["dead_lettered_by_reason"] == {"published_at_in_future": 1}
    assert {i for i, _ in stored(pg)} == held(day_1) == {"e0", "e1", "e3"}
    assert stored(pg, "DISTINCT load_key, 1") == [(f"run:{rerun['run_id']}", 1)]
    assert rerun["store"]["withdrawn"] == ["e2"]
    assert rerun["store"]["not_restored"] == ["e2"]
    assert rerun["store"]["replaces"] == f"run:{first['run_id']}"
    with psycopg.connect(pg) as conn:
        assert conn.execute("SELECT withdrawn, output FROM news_vectors_loads WHERE load_key = %s",
                            (f"run:{rerun['run_id']}",)).fetchone() == (["e2"], str(day_1))


def test_a_rerun_brings_back_the_version_its_run_had_replaced(store_settings, pg):
    """x: vA in day 1's output (run A), then vB in day 2's (run B1: a later day, so it replaces
    vA). Day 2 is rerun without x (B2): x is vA again, under A's key, with its chunks, and A's y
    stays (another output's). B3 holds x again; then day 1 is rerun without x or y (A2): x stays
    B3's (no longer A's), y has no row (nothing was kept for it), and the summary says so.
    Before, every run's rows stayed: x stayed vB after B2."""
    store = Store(store_settings)
    day_2 = DAY + dt.timedelta(days=1)
    store.load(LoadRows(rows(["x", "y"], text="vA", chunk_count=[2, 1]),
                        chunks({("x", "vA"): 2, ("y", "vA"): 1}), DAY), "run:A",
               output=BatchOutput(DAY_1, "A"))
    store.load(LoadRows(rows(["x", "z"], text="vB", chunk_count=[1, 1]),
                        chunks({("x", "vB"): 1, ("z", "vB"): 1}), day_2), "run:B1",
               output=BatchOutput(DAY_2, "B1"))
    assert stored(pg, "id, text_sha256, load_key") == [
        ("x", "vB", "run:B1"), ("y", "vA", "run:A"), ("z", "vB", "run:B1")]
    b2 = store.load(LoadRows(rows(["z"], text="vB2", chunk_count=[1]), chunks({("z", "vB2"): 1}),
                             day_2), "run:B2", output=BatchOutput(DAY_2, "B2"))
    assert stored(pg, "id, text_sha256, load_key") == [
        ("x", "vA", "run:A"), ("y", "vA", "run:A"), ("z", "vB2", "run:B2")]
    assert stored(pg, "id, chunk_index, text_sha256", "news_vectors_chunks") == [
        ("x", 0, "vA"), ("x", 1, "vA"), ("y", 0, "vA"), ("z", 0, "vB2")]
    assert (b2.replaces, b2.withdrawn, b2.not_restored) == ("run:B1", ("x",), ())
    store.load(LoadRows(rows(["x", "z"], text="vB3"), None, day_2), "run:B3",
               output=BatchOutput(DAY_2, "B3"))
    a2 = store.load(LoadRows(rows(["w"], text="vA2"), None, DAY), "run:A2",
                    output=BatchOutput(DAY_1, "A2"))
    assert stored(pg, "id, text_sha256, load_key") == [
        ("w", "vA2", "run:A2"), ("x", "vB3", "run:B3"), ("z", "vB3", "run:B3")]
    assert (a2.withdrawn, a2.not_restored) == (("y",), ("y",))
    # B3 is rerun without x: the version B3 replaced was A's, gone from the files: no row.
    b4 = store.load(LoadRows(rows(["z"], text="vB4"), None, day_2), "run:B4",
                    output=BatchOutput(DAY_2, "B4"))
    assert stored(pg, "id, text_sha256, load_key") == [
        ("w", "vA2", "run:A2"), ("z", "vB4", "run:B4")]
    assert (b4.withdrawn, b4.not_restored) == (("x",), ("x",))


def test_a_reruns_version_replaces_its_runs_even_when_earlier(store_settings, pg):
    """Run 1 stored x with ``updated_at`` 10:00 (a producer's mistake) and 2 chunks; the rerun's
    corrected input says 09:00, 1 chunk. The files hold only the rerun's x, so the store must too:
    run 1's row is withdrawn before the rerun's rows go in, whatever their order. Before, run 1's
    later-ordered row stayed."""
    store = Store(store_settings)
    store.load(LoadRows(rows(["x"], text="v1", updated_at=at(60), chunk_count=[2]),
                        chunks({("x", "v1"): 2}), DAY), "run:R1",
               output=BatchOutput(DAY_1, "R1"))
    again = store.load(LoadRows(rows(["x"], text="v2", updated_at=at(0), chunk_count=[1]),
                                chunks({("x", "v2"): 1}), DAY), "run:R2",
                       output=BatchOutput(DAY_1, "R2"))
    assert stored(pg, "id, text_sha256, load_key") == [("x", "v2", "run:R2")]
    assert stored(pg, "id, chunk_index, text_sha256", "news_vectors_chunks") == [("x", 0, "v2")]
    assert again.withdrawn == () and again.articles_current == 1


def test_an_older_run_never_withdraws_the_newer_runs_rows(store_settings, pg):
    """R2 (launched after R1: run ids begin with the launch time) published into the output and
    is loaded; R1's load comes late (it read its files before R2 published). It is refused,
    with or without ``reload``, and the store keeps R2's rows; a retry of R2's load changes
    nothing. Before, R1's version of a replaced R2's."""
    store = Store(store_settings)
    store.load(LoadRows(rows(["a", "b"], text="r2"), None, DAY), "run:R2",
               output=BatchOutput(DAY_1, "R2"))
    for reload in (False, True):
        with pytest.raises(StoreLoadFailed, match="run R1 is older than run R2"):
            store.load(LoadRows(rows(["a"], text="r1"), None, DAY), "run:R1",
                       output=BatchOutput(DAY_1, "R1"), reload=reload)
    assert stored(pg, "id, text_sha256, load_key") == [("a", "r2", "run:R2"),
                                                        ("b", "r2", "run:R2")]
    assert store.load(LoadRows(rows(["a", "b"], text="r2"), None, DAY), "run:R2",
                      output=BatchOutput(DAY_1, "R2")).already_loaded


def test_newsvec_load_reload_stores_the_rows_the_table_refused_once_it_takes_them(
        tmp_path, store_settings, pg):
    """A batch run's load meets a CHECK constraint one article breaks: stored without it, named
    in the summary. The owner drops the constraint; ``newsvec load --run-id R`` is a no-op (the
    run is loaded) that says what to run, and ``newsvec load --run-id R --reload`` stores the
    article, its record in ``<table>_loads`` without the rejection. Before, there was no way
    to store it (no ``--reload``: ``newsvec load`` exits 2)."""
    from pipeline.cli import main as cli
    from tests.common import make_config

    config = make_config(input=events(tmp_path / "in.jsonl", ["e0", "e1", "e2", "e3"]),
                         output=str(tmp_path / "out"), store=store_settings)
    with psycopg.connect(pg) as conn:
        for statement in _create_statements(store_settings, config.model.output_dim):
            conn.execute(statement)
        conn.execute("ALTER TABLE news_vectors ADD CONSTRAINT no_e2 CHECK (id <> 'e2')")
    summary = batch_run(config)
    assert [r["id"] for r in summary["store"]["rejected"]] == ["e2"]
    with psycopg.connect(pg) as conn:
        conn.execute("ALTER TABLE news_vectors DROP CONSTRAINT no_e2")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    load = ["load", "--config", str(config_file), "--run-id", summary["run_id"]]
    assert cli(load) == 0
    assert "e2" not in {i for i, _ in stored(pg)}
    assert cli([*load, "--reload"]) == 0
    assert {i for i, _ in stored(pg)} == {"e0", "e1", "e2", "e3"}
    with psycopg.connect(pg) as conn:
        assert conn.execute("SELECT rows, rejected FROM news_vectors_loads WHERE load_key = %s",
                            (f"run:{summary['run_id']}",)).fetchone() == (4, [])

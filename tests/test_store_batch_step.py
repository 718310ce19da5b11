"""The batch store load is a step of the Beam graph (``LoadCommittedRun`` after ``CommitRun``,
transforms/stores/batch.py), on the test PostgreSQL (``pg``, ``store_settings``) with a FAKE
engine: a job launched with nothing waiting on it (as a Flex Template or scheduled launch runs it)
loads the store; the step run again, or ``newsvec load`` after it, changes nothing; a load that
fails fails the job with the Parquet published; a run a newer one replaced loads nothing."""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import pickle

import apache_beam as beam
import psycopg
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.graph import build_batch
from tests.conftest import STORE_DSN_ENV, make_config
from tests.fakes import FakeEngine
from transforms.layout import SUMMARY_FILE, new_run_id
from transforms.manifest import read_manifest, write_manifest
from transforms.stores.pgvector import StoreLoadFailed, StoreSettings


def _events(tmp_path, n: int = 5):
    events = tmp_path / "in.jsonl"
    events.write_text("".join(json.dumps({"id": f"e{i}", "title": f"title {i}",
                                          "body": f"body number {i}"}) + "\n" for i in range(n)))
    return events


def _launch(config, run_id: str) -> None:
    """The job as a Flex Template launch runs it: the graph built and run, nothing after it (no
    ``run_batch`` waiting to do more)."""
    pipeline = beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"]))
    build_batch(pipeline, config, run_id, FakeEngine)
    pipeline.run().wait_until_finish()


def _store(pg) -> tuple[list, list]:
    """Every row of the articles' table and of the loads' table (their load times included)."""
    with psycopg.connect(pg) as conn:
        return (conn.execute("SELECT * FROM news_vectors ORDER BY id").fetchall(),
                conn.execute("SELECT * FROM news_vectors_loads ORDER BY load_key").fetchall())


def _load_step(config, run_id: str, summary: dict) -> None:
    from transforms.stores.batch import LoadCommittedRun

    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as pipeline:
        _ = (pipeline | beam.Create([summary])
             | LoadCommittedRun(config.output, run_id, config.store))


def test_a_batch_job_with_nothing_after_it_loads_the_committed_run(tmp_path, store_settings, pg):
    """Before, the store was loaded by ``run_batch`` after the job: a job launched alone (a Flex
    Template, a scheduled launch) left the store empty."""
    out = tmp_path / "out"
    config = make_config(input=str(_events(tmp_path)), output=str(out), store=store_settings)
    run_id = new_run_id()
    _launch(config, run_id)
    parquet = pq.read_table(sorted((out / "vectors").glob("*.parquet")))
    articles, loads = _store(pg)
    assert sorted(r[0] for r in articles) == sorted(parquet["id"].to_pylist()) == [
        f"e{i}" for i in range(5)]
    assert [r[0] for r in loads] == [f"run:{run_id}"]
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["run_id"] == run_id
    assert summary["store"] == {"kind": "pgvector", "load_key": f"run:{run_id}"}
    # The graph carries the store's settings, never its connection string (read on the worker).
    from transforms.stores.batch import LoadCommittedRun

    assert pg.encode() not in pickle.dumps(LoadCommittedRun(str(out), run_id, store_settings))


def test_the_load_step_run_again_and_newsvec_load_leave_the_store_unchanged(
        tmp_path, store_settings, pg):
    """A retried bundle or a rerun of the step (the same run), then ``newsvec load`` of the run:
    the store is as the job's load left it, row for row, its load time included."""
    from pipeline.load import load_run

    out = tmp_path / "out"
    config = make_config(input=str(_events(tmp_path)), output=str(out), store=store_settings)
    run_id = new_run_id()
    _launch(config, run_id)
    before = _store(pg)
    assert len(before[0]) == 5
    summary = json.loads((out / SUMMARY_FILE).read_text())
    _load_step(config, run_id, summary)
    _load_step(config, run_id, summary)
    assert load_run(config, run_id).already_loaded
    assert _store(pg) == before


def test_a_failed_load_fails_the_job_with_the_parquet_published(tmp_path, monkeypatch, pg):
    """The store cannot be reached: the job fails (``StoreLoadFailed``), its Parquet committed
    and its ``_summary.json`` naming the load key the store lacks; ``newsvec load`` then loads
    it. Before, the job succeeded and loaded nothing."""
    from pipeline.load import load_run
    from tools.emulators import free_port

    out = tmp_path / "out"
    monkeypatch.setenv(STORE_DSN_ENV, f"postgresql://u:hunter2@127.0.0.1:{free_port()}/db")
    config = make_config(input=str(_events(tmp_path)), output=str(out), store=StoreSettings(
        enabled=True, dsn_env=STORE_DSN_ENV, retry_s=0.5))
    run_id = new_run_id()
    with pytest.raises(StoreLoadFailed) as failed:
        _launch(config, run_id)
    assert "hunter2" not in str(failed.value)
    manifest = read_manifest(str(out))
    assert manifest is not None and manifest.run_id == run_id and manifest.state == "committed"
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["store"]["load_key"] == f"run:{run_id}" and summary["counts"]["written"] == 5
    monkeypatch.setenv(STORE_DSN_ENV, pg)
    assert load_run(config, run_id).rows == 5


def test_a_run_that_a_newer_run_replaced_loads_nothing(tmp_path, store_settings, pg):
    """The step of a run that published nothing (CommitRun's ``published: false``), and of one
    whose output a newer run took before its load: nothing is loaded, and the job succeeds (the
    newer run's own load stores the output)."""
    out = tmp_path / "out"
    config = make_config(input=str(_events(tmp_path)), output=str(out), store=store_settings)
    run_id = new_run_id()
    launched = dt.datetime.strptime(run_id[:16], "%Y%m%dT%H%M%SZ")
    newer = (launched + dt.timedelta(hours=1)).strftime("%Y%m%dT%H%M%SZ") + run_id[16:]
    _launch(config.model_copy(update={"store": StoreSettings()}), run_id)  # the store off
    _load_step(config, run_id, {"run_id": run_id, "published": False, "superseded_by": newer})
    manifest = read_manifest(str(out))
    write_manifest(str(out), dataclasses.replace(manifest, run_id=newer))
    _load_step(config, run_id, json.loads((out / SUMMARY_FILE).read_text()))
    with psycopg.connect(pg) as conn:
        table = conn.execute("SELECT to_regclass('public.news_vectors_loads')").fetchone()
        assert table == (None,) or conn.execute(
            "SELECT count(*) FROM news_vectors_loads").fetchone() == (0,)

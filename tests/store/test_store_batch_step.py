"""The batch store load is a step of the Beam graph (``LoadCommittedRun`` after ``CommitRun``,
transforms/stores/batch.py), on the test PostgreSQL (``pg``, ``store_settings``) with a FAKE
engine: a job launched with nothing waiting on it (as a Flex Template or scheduled launch runs it)
loads the store; the step run again, or ``newsvec load`` after it, changes nothing; a load that
fails fails the job with the Parquet published; a run a newer one replaced loads nothing."""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import pickle

import apache_beam as beam
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.graph import build_batch
from tests.common import STORE_DSN_ENV, make_config
from tests.fakes import FakeEngine
from transforms.output.layout import SUMMARY_FILE, new_run_id
from transforms.output.manifest import read_manifest, write_manifest
from transforms.stores.base import StoreLoadFailed
from transforms.stores.pgvector import StoreSettings


def _events(tmp_path, n: int = 5, lines: tuple = ()):
    """``n`` good events, or ``lines`` as they are."""
    events = tmp_path / "in.jsonl"
    events.write_text("".join(line + "\n" for line in lines or (
        json.dumps({"id": f"e{i}", "title": f"title {i}", "body": f"body number {i}"})
        for i in range(n))))
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


def _ids(pg) -> list:
    """The ids in the articles' table (none where it does not exist)."""
    with psycopg.connect(pg) as conn:
        if conn.execute("SELECT to_regclass('public.news_vectors')").fetchone() == (None,):
            return []
        return [r[0] for r in conn.execute("SELECT id FROM news_vectors ORDER BY id")]


def _load_step(config, run_id: str, summary: dict) -> None:
    from transforms.output.summary import RunSummary
    from transforms.stores.batch import LoadCommittedRun

    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as pipeline:
        _ = (pipeline | beam.Create([RunSummary.from_dict(summary)])
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


def test_a_run_whose_every_article_is_a_dead_letter_succeeds_with_the_store_on(
        tmp_path, store_settings, pg):
    """A day whose every event is malformed (or, incrementally, unchanged) commits a run with no
    vector rows. With the store off that job succeeds; with it on, it must succeed too (there is
    nothing to load, and the run replaces the previous run's load of the output)."""
    out = tmp_path / "out"
    config = make_config(input=str(_events(tmp_path, lines=("{not json", "[1, 2]"))),
                         output=str(out), store=store_settings)
    _launch(config, new_run_id())
    manifest = read_manifest(str(out))
    assert manifest is not None and manifest.state == "committed"
    assert _ids(pg) == []


def test_the_load_refuses_vector_files_that_hold_other_rows_than_the_run_committed(
        tmp_path, store_settings, pg):
    """Between CommitRun and the load step (a separate stage on Dataflow: minutes apart under
    autoscaling, or days for ``newsvec load``), a writer of the output prefix replaces the
    committed vectors file with rows of its own. The manifest records the run's counts
    (``counts.written``); the load refuses files that hold another number of rows, naming the
    run, the files and both counts (a replacement with as many rows is not caught: the manifest
    holds no checksum). Before, the forged row was loaded as the run."""
    from transforms.stores.batch import run_rows

    out = tmp_path / "out"
    config = make_config(input=str(_events(tmp_path)), output=str(out), store=store_settings)
    run_id = new_run_id()
    _launch(config.model_copy(update={"store": StoreSettings()}), run_id)  # committed, not loaded
    manifest = read_manifest(str(out))
    assert manifest.counts["written"] == 5
    target = out / manifest.vectors[0]
    table = pq.read_table(target)
    forged = table.slice(0, 1).set_column(
        table.schema.get_field_index("id"), "id", pa.array(["planted"]))
    pq.write_table(forged, target)  # the same name, the same schema, another row
    summary = json.loads((out / SUMMARY_FILE).read_text())
    with pytest.raises(StoreLoadFailed):
        _load_step(config, run_id, summary)
    assert "planted" not in _ids(pg), f"the forged file was loaded as run {run_id}"
    with pytest.raises(StoreLoadFailed) as refused:
        run_rows(str(out), run_id)  # read as the run's rows: 1 row where 5 were committed
    message = str(refused.value)
    assert run_id in message and manifest.vectors[0] in message
    assert "hold 1 rows" in message and "committed 5" in message


def test_the_failed_load_names_a_recovery_command_that_finds_the_run(
        tmp_path, monkeypatch, caplog):
    """A daily config writes ``.../dt={date}``; its load fails (the store unreachable). The
    command the job logs to load it alone must carry the run's output (``--output``): before, it
    was ``newsvec load --config CONFIG --run-id R``, which fills ``{date}`` with yesterday of the
    day it is typed, so run the next day it looked in another day's folder."""
    from tools.emulators import free_port

    day = tmp_path / "out" / "dt=2026-11-30"
    monkeypatch.setenv(STORE_DSN_ENV, f"postgresql://u:pw@127.0.0.1:{free_port()}/db")
    config = make_config(input=str(_events(tmp_path, 2)), output=str(day),
                         store=StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, retry_s=0.2))
    run_id = new_run_id()
    caplog.set_level(logging.INFO, logger="newsvec")
    with pytest.raises(StoreLoadFailed):
        _launch(config, run_id)
    hints = [r.getMessage() for r in caplog.records if "newsvec load" in r.getMessage()]
    assert hints, "no recovery command logged"
    commands = [h[h.index("newsvec load"):] for h in hints]
    assert all(f"--output {day}" in c for c in commands), commands


def _stored(pg) -> dict:
    """``id -> (dt, title)`` of the articles' table."""
    with psycopg.connect(pg) as conn:
        return {r[0]: (r[1], r[2]) for r in conn.execute(
            "SELECT id, dt, title FROM news_vectors ORDER BY id")}


def test_a_run_with_another_date_form_stores_its_input_date_as_dt(tmp_path, store_settings, pg):
    """``output: .../news/{date:%Y/%m/%d}`` (docs/configuration.md) filled with
    ``--input_date 2026-11-30``: the store's rows have dt 2026-11-30, the day the run stands
    for, recorded in its summary (``day``) and read by the load step and by ``newsvec load``.
    Before, dt was the run's launch day (no ``dt=`` folder in the output). A summary without
    ``day`` (written by 0.2) is loaded by the earlier rule: the launch day."""
    from pipeline.config import fill
    from transforms.stores.batch import run_rows

    config = fill(make_config(input=str(_events(tmp_path, 2)),
                              output=str(tmp_path / "news" / "{date:%Y/%m/%d}"),
                              store=store_settings), "2026-11-30")
    out = tmp_path / "news" / "2026" / "11" / "30"
    assert config.output == str(out)
    run_id = new_run_id()
    _launch(config, run_id)
    day = dt.date(2026, 11, 30)
    assert _stored(pg) == {"e0": (day, "title 0"), "e1": (day, "title 1")}
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["day"] == "2026-11-30"
    assert run_rows(str(out), run_id).dt == day  # newsvec load: from the summary, no date given
    del summary["day"]
    (out / SUMMARY_FILE).write_text(json.dumps(summary))
    launched = dt.datetime.strptime(run_id[:8], "%Y%m%d").date()
    assert run_rows(str(out), run_id).dt == launched


def test_a_backfill_stores_the_later_days_version_whatever_run_was_launched_last(
        tmp_path, store_settings, pg):
    """A backfill runs one archive day after another, every run launched the same day; an
    article is in the input of 2026-11-29 and (changed, no ``updated_at``) of 2026-11-30, and the
    later day is run first. The store keeps the 2026-11-30 version (dt then orders them), dt
    being each run's day. Before, both rows had dt = the launch day, so the later-embedded
    2026-11-29 version won."""
    from pipeline.config import fill

    inputs = tmp_path / "in"
    inputs.mkdir()
    for day, title in (("2026-11-29", "older day"), ("2026-11-30", "later day")):
        (inputs / f"{day}.jsonl").write_text(json.dumps(
            {"id": "a", "title": title, "body": f"the body of the {title}"}) + "\n")
    config = make_config(input=str(inputs / "{date}.jsonl"),
                         output=str(tmp_path / "news" / "{date:%Y/%m/%d}"), store=store_settings)
    first = new_run_id()
    _launch(fill(config, "2026-11-30"), first)
    second = new_run_id()
    assert second > first
    _launch(fill(config, "2026-11-29"), second)
    assert _stored(pg) == {"a": (dt.date(2026, 11, 30), "later day")}

"""Review repros (attack-38) against the batch store load step (``LoadCommittedRun``,
transforms/stores/batch.py) on the test PostgreSQL with a FAKE engine. Each test states what a
user relies on; the ones marked in the review report fail on the code as merged."""
from __future__ import annotations

import json

import apache_beam as beam
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.graph import build_batch
from tests.conftest import make_config
from tests.fakes import FakeEngine
from transforms.layout import SUMMARY_FILE, new_run_id
from transforms.manifest import read_manifest
from transforms.stores.pgvector import StoreLoadFailed, StoreSettings


def _events(tmp_path, lines):
    events = tmp_path / "in.jsonl"
    events.write_text("".join(line + "\n" for line in lines))
    return events


def _good(n):
    return [json.dumps({"id": f"e{i}", "title": f"title {i}", "body": f"body number {i}"})
            for i in range(n)]


def _launch(config, run_id: str) -> None:
    pipeline = beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"]))
    build_batch(pipeline, config, run_id, FakeEngine)
    pipeline.run().wait_until_finish()


def _load_step(config, run_id: str, summary: dict) -> None:
    from transforms.stores.batch import LoadCommittedRun

    with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as pipeline:
        _ = (pipeline | beam.Create([summary])
             | LoadCommittedRun(config.output, run_id, config.store))


def _ids(pg) -> list:
    with psycopg.connect(pg) as conn:
        if conn.execute("SELECT to_regclass('public.news_vectors')").fetchone() == (None,):
            return []
        return [r[0] for r in conn.execute("SELECT id FROM news_vectors ORDER BY id")]


def test_a_run_whose_every_article_is_a_dead_letter_succeeds_with_the_store_on(
        tmp_path, store_settings, pg):
    """A day whose every event is malformed (or, incrementally, unchanged) commits a run with no
    vector rows. With the store off that job succeeds; with it on, it must succeed too (there is
    nothing to load, and the run replaces the previous run's load of the output)."""
    out = tmp_path / "out"
    config = make_config(input=str(_events(tmp_path, ["{not json", "[1, 2]"])), output=str(out),
                         store=store_settings)
    _launch(config, new_run_id())  # fails: StoreLoadFailed "run ... wrote no vector files"?
    manifest = read_manifest(str(out))
    assert manifest is not None and manifest.state == "committed"
    assert _ids(pg) == []


def test_the_load_refuses_parquet_that_is_not_what_the_manifest_committed(
        tmp_path, store_settings, pg):
    """Between CommitRun and the load step (a separate stage on Dataflow: minutes apart under
    autoscaling, or days for ``newsvec load``), a writer of the output prefix replaces the
    committed vectors file with rows of its own. The manifest records the run's counts
    (``counts.written``); the load must not store rows the committed run never wrote."""
    from transforms.stores.batch import run_rows

    out = tmp_path / "out"
    config = make_config(input=str(_events(tmp_path, _good(5))), output=str(out),
                         store=store_settings)
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
    try:
        _load_step(config, run_id, summary)
    except Exception:  # pylint: disable=broad-except  # a refusal is the right outcome
        pass
    stored = _ids(pg)
    assert "planted" not in stored, (
        f"the store holds {stored}: the forged file was loaded as run {run_id}")
    with pytest.raises(StoreLoadFailed):
        run_rows(str(out), run_id)  # read as the run's rows: 1 row where 5 were committed


def test_the_failed_load_names_a_recovery_command_that_finds_the_run(
        tmp_path, monkeypatch, caplog):
    """A daily config writes ``.../dt={date}``; its load fails (the store unreachable). What the
    job logs to run, ``newsvec load --config CONFIG --run-id R``, fills ``{date}`` with yesterday
    of the day it is typed: run the next day (the usual case after a night's failure) it looks in
    another day's folder and says the output "does not hold run R". The command named must carry
    the run's output (``--output`` or ``--input_date``)."""
    import logging

    from tests.conftest import STORE_DSN_ENV
    from tools.emulators import free_port

    day = tmp_path / "out" / "dt=2026-11-30"
    monkeypatch.setenv(STORE_DSN_ENV, f"postgresql://u:pw@127.0.0.1:{free_port()}/db")
    config = make_config(input=str(_events(tmp_path, _good(2))), output=str(day),
                         store=StoreSettings(enabled=True, dsn_env=STORE_DSN_ENV, retry_s=0.2))
    run_id = new_run_id()
    caplog.set_level(logging.INFO, logger="newsvec")
    with pytest.raises(StoreLoadFailed):
        _launch(config, run_id)
    hints = [r.getMessage() for r in caplog.records if "newsvec load" in r.getMessage()]
    assert hints, "no recovery command logged"
    commands = [h[h.index("newsvec load"):] for h in hints]
    assert all(str(day) in c or "--input_date 2026-11-30" in c for c in commands), commands[0]

"""The store stays equal to the streaming output's files and ledger records, and ``newsvec ledger
--store`` can tell when it is not: the streaming writer (``_WriteStreamingFn``, called directly
with the store on) against the test PostgreSQL (``pg``, ``store_settings``).

- a micro-batch redone with another outcome (a row in one attempt, a dead letter in the next, or
  the reverse; re-embedded) leaves the store holding what its files hold;
- rows the store refuses are named in the ledger record (``store_rejected``) and counted by the
  ledger;
- ``newsvec ledger --store`` names a stored row that is an older version than the files', a row a
  micro-batch stored that its files do not hold, and checks compacted hours too;
- compaction takes an hour whose files were written before and after ``updated_at``;
- a batch run whose load meets a row the table refuses completes, its summary naming it.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import json

import numpy as np
import psycopg
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.utils.timestamp import Timestamp

from pipeline import compact, ledger
from transforms.sinks import _WriteStreamingFn
from transforms.types import DeadLetter, EmbeddedDoc, Lineage, MicroBatch, NewsEvent, PreparedDoc

DIM = 8
RUN_ID = "20261201T090000Z-0000abcd"
T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)
LATER = T0 + dt.timedelta(days=2)


def doc(event_id: str, message_id: str, text="t", embedded_at=T0, vector=None) -> EmbeddedDoc:
    event = NewsEvent(id=event_id, body="b", published_at=T0).model_copy(
        update={"lineage": Lineage(message_id, T0)})
    prepared = PreparedDoc(event=event, text="b", text_sha256=text, token_ids=(1,),
                           truncated=False)
    if vector is None:
        vector = np.zeros(DIM, np.float32)
        vector[len(event_id) % DIM] = 1
    return EmbeddedDoc.of(prepared, vector, "m", embedded_at)


def letter(event_id: str, message_id: str, reason="embedding_failed") -> DeadLetter:
    return DeadLetter(step="embed", reason=reason, detail="x", payload="{}", payload_bytes=2,
                      event_id=event_id, message_id=message_id)


def micro_batch(rows=(), letters=(), start=T0) -> MicroBatch:
    begin = Timestamp.from_utc_datetime(start)
    return MicroBatch(window_start_us=begin.micros, window_end_us=(begin + 60).micros, pane=0,
                      shard=0, shards=1, rows=tuple(rows), dead_letters=tuple(letters),
                      messages_in=len(rows) + len(letters))


def write(out, settings, batch: MicroBatch):
    fn = _WriteStreamingFn(str(out), RUN_ID, DIM, 16, None, "float32", settings)
    fn.setup()
    (record,) = list(fn.process(batch))
    return record


def stored(dsn: str) -> dict:
    with psycopg.connect(dsn) as conn:
        return {i: (t, e) for i, t, e in conn.execute(
            "SELECT id, text_sha256, embedded_at FROM news_vectors")}


def at(minutes: int) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def test_a_micro_batch_redone_with_another_outcome_leaves_the_store_equal_to_its_files(
        tmp_path, store_settings, pg):
    """The review's sequence: attempt 1 stores x and y; attempt 2 (the timer's work item failed
    after its load and was redone, re-embedding) dead-letters x. Before, the load key was there
    already, so the store kept attempt 1's x (and y), while the files and the ledger record were
    attempt 2's; and an attempt with no rows at all never reached the store."""
    out = tmp_path / "out"
    first = write(out, store_settings, micro_batch([doc("x", "m1"), doc("y", "m2")]))
    assert set(stored(pg)) == {"x", "y"}
    second = write(out, store_settings, micro_batch([doc("y", "m2", embedded_at=at(1))],
                                                    [letter("x", "m1")]))
    assert second.store_load_key == first.store_load_key, "one micro-batch, one load key"
    assert stored(pg) == {"y": ("t", at(1))}, "x is a dead letter in the files"
    assert ledger.check(str(out), store=store_settings).ok
    third = write(out, store_settings, micro_batch([doc("x", "m1", embedded_at=at(2)),
                                                    doc("y", "m2", embedded_at=at(2))]))
    assert stored(pg) == {"x": ("t", at(2)), "y": ("t", at(2))}
    assert third.store_rows == 2
    fourth = write(out, store_settings, micro_batch([], [letter("x", "m1"), letter("y", "m2")]))
    assert stored(pg) == {} and fourth.store_rows == 0
    report = ledger.check(str(out), store=store_settings)
    assert report.ok, report.problems


def test_the_rows_the_store_refuses_are_named_in_the_ledger_record_and_counted(
        tmp_path, store_settings, pg):
    """A row with a NaN vector (one the engine's checks would now dead-letter, here reaching the
    writer anyway): before, the load failed and the micro-batch's bundle with it, for ever."""
    out = tmp_path / "out"
    bad = np.full(DIM, np.nan, np.float32)
    record = write(out, store_settings, micro_batch(
        [doc("x", "m1", vector=bad), doc("y", "m2")],
        [letter("z\x00", "m3", reason="invalid_field")]))  # an id the store could never hold
    assert (record.rows_written, record.store_rows, record.dead_lettered) == (2, 1, 1)
    assert [(r["id"], r["reason"]) for r in record.store_rejected] == [
        ("x", "non_finite_vector")]
    assert set(record.store_rejected[0]) == {"id", "text_sha256", "reason", "detail"}
    assert set(stored(pg)) == {"y"}
    report = ledger.check(str(out), store=store_settings)
    assert report.ok, report.problems
    assert report.totals["store_rejected"] == 1
    assert report.totals["store_rejected_by_reason"] == {"non_finite_vector": 1}


def _load_key(record) -> str:
    start = dt.datetime.fromisoformat(record.window_start.replace("Z", "+00:00"))
    return f"mb:{start:%Y%m%dT%H%M%SZ}:{record.pane}:{record.shard}:{record.digest}"


def test_the_ledger_names_an_older_stored_version_and_a_row_of_a_dead_letter(
        tmp_path, store_settings, pg):
    """Before, ``--store`` checked only that each article of the vectors files was in the store."""
    out = tmp_path / "out"
    write(out, store_settings, micro_batch([doc("x", "m1"), doc("y", "m2")]))
    letters = write(out, store_settings, micro_batch([], [letter("z", "m3")], start=at(1)))
    assert ledger.check(str(out), store=store_settings).ok
    with psycopg.connect(pg) as conn:
        # y is stored as an older version than its file holds (what a load of stale text does)
        conn.execute("UPDATE news_vectors SET text_sha256 = 'older', embedded_at = embedded_at "
                     "- interval '1 hour' WHERE id = 'y'")
        # z, dead-lettered by its micro-batch, has a row under that micro-batch's key (what an
        # earlier attempt that embedded it left behind)
        conn.execute("INSERT INTO news_vectors (id, text_sha256, embedding, embedded_at, dt, "
                     "load_key, model, dim, token_count, truncated, doc_vector, chunk_count) "
                     "VALUES ('z', 't', %s, %s, %s, %s, 'm', %s, 1, false, 'head', 0)",
                     ("[" + ",".join(["0.5"] * DIM) + "]", T0, T0.date(), _load_key(letters),
                      DIM))
    problems = "\n".join(ledger.check(str(out), store=store_settings).problems)
    assert "stored as an older version" in problems and "first: y" in problems, problems
    assert "not in its files" in problems and "first: z" in problems, problems


def test_the_ledger_checks_the_store_over_compacted_hours(tmp_path, store_settings, pg):
    """After ``newsvec compact`` a record's vectors file is gone (its rows are in the hour's
    compacted file). Before, ``--store`` skipped such records: a row missing from the store went
    unseen."""
    out = tmp_path / "out"
    write(out, store_settings, micro_batch([doc("x", "m1"), doc("y", "m2")]))
    write(out, store_settings, micro_batch([doc("w", "m3")], start=at(1)))
    compact.compact_range(str(out), T0, T0 + dt.timedelta(hours=1), 16, lease_s=30,
                          closed_after_s=0, now=LATER)
    assert not list((out / "vectors").rglob("part-*.parquet")), "the hour is compacted"
    report = ledger.check(str(out), store=store_settings)
    assert report.ok and report.totals["store_articles"] == 3, (report.problems, report.totals)
    with psycopg.connect(pg) as conn:
        conn.execute("DELETE FROM news_vectors WHERE id = 'y'")
    problems = ledger.check(str(out), store=store_settings).problems
    assert any("1 articles of the vectors files are not in the store (first: y)" in p
               for p in problems), problems


def test_compaction_takes_an_hour_written_before_and_after_updated_at(tmp_path):
    """An hour whose first micro-batch was written by a release before ``updated_at`` (its
    vectors file lacks the column) and whose next one by a release with it: the compacted file
    holds both, the first's ``updated_at`` null, and the ledger holds."""
    out = tmp_path / "out"
    write(out, None, micro_batch([doc("x", "m1")]))
    (old,) = list((out / "vectors").rglob("*.parquet"))
    table = pq.read_table(old)
    if "updated_at" in table.column_names:
        pq.write_table(table.drop_columns(["updated_at"]), old)
    fixed = dataclasses.replace(doc("y", "m2"), updated_at=at(5))
    write(out, None, micro_batch([fixed], start=at(1)))
    compact.compact_range(str(out), T0, T0 + dt.timedelta(hours=1), 16, lease_s=30,
                          closed_after_s=0, now=LATER)
    (compacted,) = list((out / "vectors").rglob("compacted-*.parquet"))
    got = pq.read_table(compacted)
    assert "updated_at" in got.column_names, "the compacted file has the column"
    assert dict(zip(got["id"].to_pylist(), got["updated_at"].to_pylist(), strict=True)) == {
        "x": None, "y": at(5)}
    assert ledger.check(str(out)).ok


def test_a_batch_run_whose_load_meets_a_row_the_table_refuses_completes_and_names_it(
        tmp_path, store_settings, pg):
    """A FAKE-engine batch run with the store on, into a table whose owner added a CHECK
    constraint that one article breaks: the run completes, the other articles are stored, and
    the summary's ``store`` names the refused one with its reason. Before: StoreLoadFailed, and
    ``newsvec load`` could never load the run."""
    from pipeline.run import run_batch
    from tests.common import make_config
    from tests.fakes import FakeEngine
    from transforms.output.parquet import vector_schema
    from transforms.sinks import to_table
    from transforms.stores.base import LoadRows
    from transforms.stores.pgvector import Store

    events = tmp_path / "in.jsonl"
    events.write_text("".join(json.dumps({"id": f"e{i}", "title": f"title {i}",
                                          "body": f"body number {i}",
                                          "source": "refused" if i == 2 else "wire"}) + "\n"
                              for i in range(4)))
    config = make_config(input=str(events), output=str(tmp_path / "out"), store=store_settings)
    dim = config.model.output_dim
    seed = EmbeddedDoc.of(PreparedDoc(event=NewsEvent(id="seed", body="b"), text="b",
                                      text_sha256="s", token_ids=(1,), truncated=False),
                          np.ones(dim, np.float32) / np.sqrt(dim), "m", T0)
    Store(store_settings).load(LoadRows(to_table([seed], vector_schema(dim)), None, T0.date()),
                               "run:seed")  # creates the tables
    with psycopg.connect(pg) as conn:
        conn.execute("ALTER TABLE news_vectors ADD CONSTRAINT no_wire "
                     "CHECK (source IS DISTINCT FROM 'refused')")
    summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]),
                        engine_factory=FakeEngine)
    assert summary["counts"]["written"] == 4
    assert [(r["id"], r["reason"]) for r in summary["store"]["rejected"]] == [
        ("e2", "refused_by_store")]
    assert summary["store"]["rows"] == 3
    with psycopg.connect(pg) as conn:
        assert sorted(i for (i,) in conn.execute("SELECT id FROM news_vectors")) == [
            "e0", "e1", "e3", "seed"]


# --- a redo brings back what its earlier attempt replaced ----------------------------------------

def test_a_redo_that_withdraws_an_article_brings_back_the_version_it_had_replaced(
        tmp_path, store_settings, pg):
    """x v1 stored by the micro-batch of 09:00; the micro-batch of 11:00 stores x v2 (later, so it
    replaces v1), then is redone and x is a dead letter this time. Its withdrawal brings v1 back
    (the store holds what the files say is current), and its record and ``<table>_loads`` name
    x as withdrawn. Before, x had no row at all while the Parquet's current version was v1, and
    ``ledger --store`` over 11:00 balanced."""
    out = tmp_path / "out"
    first = write(out, store_settings, micro_batch([doc("x", "m1", text="v1")]))
    eleven = at(120)
    write(out, store_settings, micro_batch([doc("x", "m2", text="v2", embedded_at=at(121))],
                                           start=eleven))
    assert stored(pg)["x"][0] == "v2"
    redo = write(out, store_settings, micro_batch([], [letter("x", "m2")], start=eleven))
    assert stored(pg) == {"x": ("v1", T0)}
    with psycopg.connect(pg) as conn:
        assert conn.execute("SELECT load_key FROM news_vectors").fetchall() == [
            (first.store_load_key,)], "the row is v1's again, under the load that stored it"
        assert conn.execute("SELECT withdrawn FROM news_vectors_loads WHERE load_key = %s",
                            (_load_key(redo),)).fetchone() == (["x"],)
    assert redo.store_withdrawn == ["x"]
    report = ledger.check(str(out), store=store_settings)
    assert report.ok and report.totals["store_withdrawn"] == 1, (report.problems, report.totals)
    ranged = ledger.check(str(out), eleven, eleven + dt.timedelta(hours=1), store=store_settings)
    assert ranged.ok, ranged.problems


def _store_rows(ids, **kwargs):
    from tests.store.test_store_faults import rows

    return rows(ids, **kwargs)


def test_a_redo_brings_back_a_batch_runs_version_with_its_chunks(store_settings, pg):
    """A batch run stored x v1 with 2 chunks; a micro-batch stores x v2 with 3; the micro-batch is
    redone without x. x is v1 again, with v1's 2 chunks. Before, x and its chunks were gone."""
    from tests.store.test_store_faults import DAY, chunks
    from tests.store.test_store_faults import stored as store_rows
    from transforms.stores.base import LoadRows
    from transforms.stores.pgvector import Store

    store = Store(store_settings)
    store.load(LoadRows(_store_rows(["x"], text="v1", chunk_count=[2]), chunks({("x", "v1"): 2}),
                        DAY), "run:20261201T000000Z-00000001")
    v2 = _store_rows(["x", "y"], text="v2", embedded_at=at(5), chunk_count=[3, 1])
    store.load(LoadRows(v2, chunks({("x", "v2"): 3, ("y", "v2"): 1}, at(5)), DAY), "mb:m2",
               ids=["x", "y"])
    assert store_rows(pg, "id, chunk_index, text_sha256", "news_vectors_chunks")[:3] == [
        ("x", 0, "v2"), ("x", 1, "v2"), ("x", 2, "v2")]
    redo = store.load(LoadRows(_store_rows(["y"], text="v2", embedded_at=at(6), chunk_count=[1]),
                               chunks({("y", "v2"): 1}, at(6)), DAY), "mb:m2", ids=["x", "y"])
    assert store_rows(pg) == [("x", "v1"), ("y", "v2")]
    assert store_rows(pg, "id, chunk_index, text_sha256", "news_vectors_chunks") == [
        ("x", 0, "v1"), ("x", 1, "v1"), ("y", 0, "v2")]
    assert list(redo.withdrawn) == ["x"]
    assert store_rows(pg, "id, load_key") == [("x", "run:20261201T000000Z-00000001"),
                                              ("y", "mb:m2")]


def test_a_redo_brings_back_the_latest_version_that_lost_to_it(store_settings, pg):
    """x: v1 (micro-batch m1), then v3 (m2, replaces v1), then v2 from micro-batch m4 and z's v2
    from a batch run, both older than m2's rows, so they lose. m2 is redone without x and z: each
    gets the latest version the files hold, v2 (m4's, the run's), not v1 and not nothing."""
    from tests.store.test_store_faults import DAY
    from tests.store.test_store_faults import stored as store_rows
    from transforms.stores.base import LoadRows
    from transforms.stores.pgvector import Store

    store = Store(store_settings)
    store.load(LoadRows(_store_rows(["x", "z"], text="v1"), None, DAY), "mb:m1", ids=["x", "z"])
    store.load(LoadRows(_store_rows(["x", "z"], text="v3", updated_at=at(30)), None, DAY),
               "mb:m2", ids=["x", "z"])
    store.load(LoadRows(_store_rows(["x"], text="v2", updated_at=at(20)), None, DAY), "mb:m4",
               ids=["x"])
    store.load(LoadRows(_store_rows(["z"], text="v2", updated_at=at(20)), None, DAY),
               "run:20261201T000000Z-00000001")
    assert store_rows(pg) == [("x", "v3"), ("z", "v3")], "v2 lost to v3"
    store.load(LoadRows(_store_rows(["w"]), None, DAY), "mb:m2", ids=["x", "z", "w"])
    assert store_rows(pg, "id, text_sha256, load_key") == [
        ("w", "a", "mb:m2"), ("x", "v2", "mb:m4"), ("z", "v2", "run:20261201T000000Z-00000001")]
    # m4 redone without x: the version v2 had replaced comes back (v1, kept under m2, then m4)
    store.load(LoadRows(_store_rows(["q"]), None, DAY), "mb:m4", ids=["x", "q"])
    assert store_rows(pg, "id, text_sha256, load_key") == [
        ("q", "a", "mb:m4"), ("w", "a", "mb:m2"), ("x", "v1", "mb:m1"),
        ("z", "v2", "run:20261201T000000Z-00000001")]


def test_a_redo_whose_version_a_later_load_replaced_leaves_the_later_one(store_settings, pg):
    """x: v1 (m1), v2 (m2), v3 (m3). m2 redone without x: x stays v3 (m3's); then m3 redone
    without x: x is v1, the latest version left in the files (m2's v2 was withdrawn). Before:
    x had no row after m3's redo."""
    from tests.store.test_store_faults import DAY
    from tests.store.test_store_faults import stored as store_rows
    from transforms.stores.base import LoadRows
    from transforms.stores.pgvector import Store

    store = Store(store_settings)
    for key, text, minute in (("mb:m1", "v1", 0), ("mb:m2", "v2", 10), ("mb:m3", "v3", 20)):
        store.load(LoadRows(_store_rows(["x"], text=text, updated_at=at(minute)), None, DAY), key,
                   ids=["x"])
    store.load(LoadRows(_store_rows(["y"]), None, DAY), "mb:m2", ids=["x", "y"])
    assert store_rows(pg, "id, text_sha256, load_key") == [("x", "v3", "mb:m3"),
                                                           ("y", "a", "mb:m2")]
    store.load(LoadRows(_store_rows(["z"]), None, DAY), "mb:m3", ids=["x", "z"])
    assert store_rows(pg, "id, text_sha256, load_key") == [
        ("x", "v1", "mb:m1"), ("y", "a", "mb:m2"), ("z", "a", "mb:m3")]


def test_the_versions_kept_for_a_redo_are_pruned(store_settings, pg):
    """A load keeps the row it replaces (and its chunks) in ``<table>_superseded``
    (``_chunks_superseded``), a micro-batch's and a batch run's alike (a rerun of the run's output
    may withdraw it: docs/store.md); what is older than ``superseded_keep_days`` is deleted by the
    next load."""
    from tests.store.test_store_faults import DAY, chunks
    from transforms.stores.base import LoadRows
    from transforms.stores.pgvector import Store

    def kept() -> tuple:
        with psycopg.connect(pg) as conn:
            return tuple(conn.execute(f"SELECT count(*) FROM news_vectors{t}_superseded")
                         .fetchone()[0] for t in ("", "_chunks"))

    store = Store(store_settings)
    store.load(LoadRows(_store_rows(["x"], text="v1", chunk_count=[2]), chunks({("x", "v1"): 2}),
                        DAY), "mb:m1", ids=["x"])
    assert kept() == (0, 0), "a new article replaces nothing"
    store.load(LoadRows(_store_rows(["x"], text="v2", updated_at=at(1), chunk_count=[1]),
                        chunks({("x", "v2"): 1}), DAY), "mb:m2", ids=["x"])
    assert kept() == (1, 2)
    store.load(LoadRows(_store_rows(["x"], text="v3", updated_at=at(2), chunk_count=[1]),
                        chunks({("x", "v3"): 1}), DAY), "run:20261201T000000Z-00000001")
    assert kept() == (2, 3), "the batch load kept what it replaced"
    with psycopg.connect(pg) as conn:
        conn.execute("UPDATE news_vectors_superseded SET saved_at = saved_at - interval '8 days'")
        conn.execute("UPDATE news_vectors_chunks_superseded "
                     "SET saved_at = saved_at - interval '8 days'")
    store.load(LoadRows(_store_rows(["y"]), None, DAY), "mb:m3", ids=["y"])
    assert kept() == (0, 0)


def test_the_ledger_names_an_article_a_redo_withdrew_that_a_file_holds_and_the_store_lacks(
        tmp_path, store_settings, pg):
    """The sequence of the first test, but redone after ``superseded_keep_days`` (the version it
    had replaced is forgotten, so nothing can bring it back): x has no row while the file of
    09:00 holds it. ``ledger --store`` over 11:00 alone names x, the window that withdrew it
    and the file that holds it. Before, it balanced."""
    out = tmp_path / "out"
    write(out, store_settings, micro_batch([doc("x", "m1", text="v1")]))
    eleven = at(120)
    write(out, store_settings, micro_batch([doc("x", "m2", text="v2", embedded_at=at(121))],
                                           start=eleven))
    with psycopg.connect(pg) as conn:
        if conn.execute("SELECT to_regclass('news_vectors_superseded')").fetchone()[0]:
            conn.execute("UPDATE news_vectors_superseded "
                         "SET saved_at = saved_at - interval '8 days'")
    write(out, store_settings, micro_batch([], [letter("x", "m2")], start=eleven))
    assert "x" not in stored(pg)
    problems = "\n".join(ledger.check(str(out), eleven, eleven + dt.timedelta(hours=1),
                                      store=store_settings).problems)
    assert "1 articles that a redone micro-batch withdrew have no row" in problems, problems
    assert "first: x, withdrawn in window 2026-12-01T11:00:00Z" in problems, problems
    assert "held by vectors/dt=2026-12-01/hour=09/" in problems, problems


def test_the_ledger_reads_no_embeddings_from_the_vectors_files(tmp_path, store_settings, pg):
    """``ledger --store`` reads the columns it compares, file by file: here a vectors file whose
    embeddings cannot be read at all (their pages overwritten) is checked all the same. Before,
    it read every file whole (400,000 rows of 768 dimensions: 2.4 GB, with a dict per row)."""
    out = tmp_path / "out"
    record = write(out, store_settings, micro_batch([doc("x", "m1"), doc("y", "m2")]))
    path = out / record.vectors_file
    metadata = pq.ParquetFile(path).metadata
    with open(path, "r+b") as f:
        for group in range(metadata.num_row_groups):
            for i in range(metadata.num_columns):
                column = metadata.row_group(group).column(i)
                if column.path_in_schema.startswith("embedding"):
                    start = column.dictionary_page_offset or column.data_page_offset
                    f.seek(start)
                    f.write(b"\xff" * column.total_compressed_size)
    with pytest.raises((OSError, ValueError)):  # the embeddings cannot be read
        pq.read_table(path)
    report = ledger.check(str(out), store=store_settings)
    assert report.ok and report.totals["store_articles"] == 2, report.problems
    with psycopg.connect(pg) as conn:
        conn.execute("DELETE FROM news_vectors WHERE id = 'y'")
    assert any("1 articles of the vectors files are not in the store (first: y)" in p
               for p in ledger.check(str(out), store=store_settings).problems)


def test_a_micro_batch_loaded_into_the_store_is_counted_for_the_dashboard(
        tmp_path, store_settings, pg):
    """``store_loads``, ``store_rows_loaded`` and ``micro_batch_rows``: the Beam metrics that
    configs/monitoring/dashboard.json charts, emitted by a real (local) pipeline's writer."""
    import apache_beam as beam
    from apache_beam.metrics.metric import MetricsFilter
    from apache_beam.testing.test_pipeline import TestPipeline

    from transforms.metrics import NAMESPACE

    fn = _WriteStreamingFn(str(tmp_path / "out"), RUN_ID, DIM, 16, None, "float32",
                           store_settings)
    pipeline = TestPipeline(runner="DirectRunner")
    _ = (pipeline | beam.Create([micro_batch([doc("a", "m1"), doc("b", "m2")])])
         | beam.ParDo(fn))
    result = pipeline.run()
    result.wait_until_finish()

    def query(name: str) -> dict:
        return result.metrics().query(MetricsFilter().with_namespace(NAMESPACE).with_name(name))

    assert sum(c.committed for c in query("store_loads")["counters"]) == 1
    assert sum(c.committed for c in query("store_rows_loaded")["counters"]) == 2
    assert sum(c.committed for c in query("store_load_failures")["counters"]) == 0
    (sizes,) = query("micro_batch_rows")["distributions"]
    assert (sizes.committed.count, sizes.committed.max) == (1, 2)
    assert set(stored(pg)) == {"a", "b"}

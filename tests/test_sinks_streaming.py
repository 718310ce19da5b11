"""Streaming sinks on a TestStream: files land under dt=/hour= of the window start, one file per
window and pane (a late pane never overwrites the on-time file), with safe names, and nothing
half-written or temporary is left where readers look.

Runner: BundleBasedDirectRunner, streaming (see tests/test_dedup_streaming.py).
"""
import dataclasses
import datetime as dt
import json
import re

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms import trigger, window
from apache_beam.transforms.window import IntervalWindow, TimestampedValue
from apache_beam.utils.timestamp import Duration, Timestamp

from transforms import sinks
from transforms.metrics import DEAD_LETTER_NAMESPACE, NAMESPACE
from transforms.schema import (DeadLetter, EmbeddedDoc, Lineage, NewsEvent, PreparedDoc,
                               vector_schema)
from transforms.sinks import (WriteWindowedDeadLetters, WriteWindowedVectors, partition_path,
                              to_table, window_file_name)

RUN_ID = "20261201T093000Z-1a2b3c4d"
T0 = dt.datetime(2026, 12, 1, 9, 59, tzinfo=dt.timezone.utc)  # start of the first window
BASE = Timestamp.from_utc_datetime(T0)
SAFE_PATH = re.compile(r"^[A-Za-z0-9._=/-]+$")
FILE_NAME = re.compile(  # group 1: the pane index
    r"^part-" + RUN_ID + r"-\d{8}T\d{6}Z-(\d{3})-\d{5}-of-\d{5}\.(parquet|jsonl)$")


def at(seconds: float) -> Timestamp:
    return BASE + seconds


def row(event_id: str) -> EmbeddedDoc:
    # A hostile source and an old published_at: neither may show in a path.
    event = NewsEvent(id=event_id, body="x", source="../../etc",
                      published_at=dt.datetime(2001, 1, 1, tzinfo=dt.timezone.utc))
    doc = PreparedDoc(event=event, text="x", text_sha256="0" * 64, token_ids=(101, 7, 102),
                      truncated=False)
    return EmbeddedDoc(doc=doc, embedding=np.ones(384, np.float32) / np.sqrt(384), model="fake@0",
                       embedded_at=dt.datetime(2026, 12, 1, 10, 5, tzinfo=dt.timezone.utc))


def letter(event_id: str) -> DeadLetter:
    return DeadLetter(step="parse", reason="invalid_json", detail="x", payload="../../etc, [x]",
                      payload_bytes=15, event_id=event_id)


def stream(make) -> TestStream:
    """Window 09:59 gets an on-time pane (a, b) and a late pane (late); 10:00 one pane (c)."""
    return (TestStream()
            .advance_watermark_to(at(0))
            .add_elements([TimestampedValue(make("a"), at(30)),     # 09:59:30
                           TimestampedValue(make("b"), at(31)),
                           TimestampedValue(make("c"), at(90))])    # 10:00:30
            .advance_watermark_to(at(200))                          # both windows fire on time
            .add_elements([TimestampedValue(make("late"), at(45))])  # late, within the lateness
            .advance_watermark_to_infinity())


def windowed(pcoll):
    return pcoll | beam.WindowInto(
        window.FixedWindows(60), trigger=trigger.AfterWatermark(late=trigger.AfterCount(1)),
        accumulation_mode=trigger.AccumulationMode.DISCARDING,
        allowed_lateness=Duration(seconds=600))


def run(make, sink, test_stream=stream):
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    _ = windowed(p | test_stream(make)) | sink
    result = p.run()
    result.wait_until_finish()
    return result


def counter(result, namespace: str, name: str) -> int:
    found = result.metrics().query(MetricsFilter().with_namespace(namespace).with_name(name))
    return sum(c.committed for c in found["counters"])


def files(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


def check_layout(tmp_path, subdir: str, suffix: str) -> dict:
    """The files under <subdir>/, by partition: safe names, no temp files, nothing elsewhere."""
    by_partition = {}
    for path in files(tmp_path):
        rel = path.relative_to(tmp_path).as_posix()
        assert SAFE_PATH.match(rel) and not set("[], ") & set(rel), rel
        assert rel.startswith(f"{subdir}/"), f"a file outside {subdir}/: {rel}"  # _temp/ is empty
        partition, name = rel[len(subdir) + 1:].rsplit("/", 1)
        assert FILE_NAME.match(name) and name.endswith(suffix), name
        by_partition.setdefault(partition, []).append(path)
    return by_partition


def test_partition_path_is_the_window_start_in_utc():
    start = Timestamp.from_utc_datetime(dt.datetime(2026, 12, 31, 23, 59, tzinfo=dt.timezone.utc))
    assert partition_path(IntervalWindow(start, start + 60)) == "dt=2026-12-31/hour=23"
    assert partition_path(IntervalWindow(at(60), at(120))) == "dt=2026-12-01/hour=10"
    with pytest.raises(ValueError):
        partition_path(window.GlobalWindow())


def test_file_names_differ_by_pane_and_run():
    w = IntervalWindow(at(0), at(60))
    names = {window_file_name(run_id, w, pane, 0, 1, ".parquet")
             for run_id in (RUN_ID, "20261201T093000Z-ffffffff") for pane in (0, 1)}
    assert len(names) == 4
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    assert window_file_name(RUN_ID, w, 1, 0, 1, ".parquet") == \
        f"part-{RUN_ID}-20261201T095900Z-001-00000-of-00001.parquet"


def test_unsafe_run_id_or_unwindowed_input_fails_at_construction():
    with pytest.raises(ValueError, match="run_id"):
        WriteWindowedVectors("out", "a b[0]", dim=384)
    with pytest.raises(ValueError, match="window"):
        with TestPipeline(runner="BundleBasedDirectRunner") as p:
            _ = p | beam.Create([row("a")]) | WriteWindowedVectors("out", RUN_ID, dim=384)


def test_vectors_one_file_per_window_and_pane_under_the_window_hour(tmp_path):
    run(row, WriteWindowedVectors(str(tmp_path), RUN_ID, dim=384, row_group_rows=1))

    by_partition = check_layout(tmp_path, "vectors", ".parquet")
    assert sorted(by_partition) == ["dt=2026-12-01/hour=09", "dt=2026-12-01/hour=10"]
    ids_by_pane = {}
    for partition, paths in by_partition.items():
        for path in paths:
            assert pq.read_schema(path) == vector_schema(384)
            table = pq.read_table(path)
            pane = int(FILE_NAME.match(path.name).group(1))
            ids_by_pane[(partition, pane)] = sorted(table["id"].to_pylist())
            metadata = pq.ParquetFile(path).metadata
            assert metadata.num_row_groups == table.num_rows  # row_group_rows=1
            assert metadata.row_group(0).column(0).compression == "ZSTD"
    assert ids_by_pane == {("dt=2026-12-01/hour=09", 0): ["a", "b"],   # on time
                           ("dt=2026-12-01/hour=09", 1): ["late"],     # late pane: its own file
                           ("dt=2026-12-01/hour=10", 0): ["c"]}


def test_dead_letters_one_jsonl_per_window_and_pane_under_the_window_hour(tmp_path):
    run(letter, WriteWindowedDeadLetters(str(tmp_path), RUN_ID))

    by_partition = check_layout(tmp_path, "dead_letter", ".jsonl")
    ids_by_pane = {}
    for partition, paths in by_partition.items():
        for path in paths:
            lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
            assert all(line["reason"] == "invalid_json" for line in lines)
            pane = int(FILE_NAME.match(path.name).group(1))
            ids_by_pane[(partition, pane)] = sorted(line["event_id"] for line in lines)
    assert ids_by_pane == {("dt=2026-12-01/hour=09", 0): ["a", "b"],
                           ("dt=2026-12-01/hour=09", 1): ["late"],
                           ("dt=2026-12-01/hour=10", 0): ["c"]}


def test_rows_and_dead_letters_are_counted_as_written(tmp_path):
    # One window, one pane, so one bundle per write step: Beam 2.77's BundleBasedDirectRunner keeps
    # only a step's first bundle's metrics per executor thread (see tests/test_dedup_streaming.py),
    # so the runs above (two bundles: on time, late) would under-count here, not in the sink.
    def one_pane(make):
        return (TestStream().advance_watermark_to(at(0))
                .add_elements([TimestampedValue(make(i), at(10)) for i in "abc"])
                .advance_watermark_to_infinity())

    rows = run(row, WriteWindowedVectors(str(tmp_path), RUN_ID, 384), one_pane)
    letters = run(letter, WriteWindowedDeadLetters(str(tmp_path), RUN_ID), one_pane)
    assert counter(rows, NAMESPACE, "rows_written") == 3
    assert counter(letters, NAMESPACE, "dead_lettered") == 3
    assert counter(letters, DEAD_LETTER_NAMESPACE, "invalid_json") == 3


def test_a_file_that_fails_midway_is_never_visible_under_vectors(tmp_path):
    # row_group_rows=1: row "a" is written as a row group, then the bad row raises in to_table.
    bad = dataclasses.replace(row("bad"), embedding=np.ones(383, np.float32))

    def poisoned(make):
        return (TestStream().advance_watermark_to(at(0))
                .add_elements([TimestampedValue(row("a"), at(10)), TimestampedValue(bad, at(11))])
                .advance_watermark_to_infinity())

    with pytest.raises(Exception, match="383 dimensions"):
        run(row, WriteWindowedVectors(str(tmp_path), RUN_ID, 384, row_group_rows=1), poisoned)
    assert files(tmp_path) == []  # not under vectors/, and the temp file was deleted
    assert (tmp_path / "_temp" / RUN_ID).is_dir()  # it was written there


def test_every_parquet_visible_while_writing_is_complete(tmp_path, monkeypatch):
    # to_table runs between row groups (row_group_rows=1): each call looks at vectors/ as a reader
    # would, mid-write. A file written in place would show there without its footer.
    unreadable, calls = [], []

    def looking_to_table(rows, schema):
        calls.append(len(rows))
        for path in files(tmp_path / "vectors"):
            try:
                pq.read_metadata(path)
            except Exception as e:  # noqa: BLE001 -- any failure to read is the finding
                unreadable.append((path.name, repr(e)))
        return original(rows, schema)

    original = sinks.to_table
    monkeypatch.setattr(sinks, "to_table", looking_to_table)
    run(row, WriteWindowedVectors(str(tmp_path), RUN_ID, dim=384, row_group_rows=1))
    assert calls == [1, 1, 1, 1] and unreadable == []


def test_pubsub_lineage_columns_are_filled_for_streamed_events_only():
    published = dt.datetime(2026, 12, 1, 10, 0, 1, tzinfo=dt.timezone.utc)
    streamed = row("s")
    streamed = dataclasses.replace(streamed, doc=dataclasses.replace(
        streamed.doc, event=streamed.doc.event.model_copy(update={"lineage": Lineage(
            message_id="m1", publish_time=published, attributes=(("k", "v"),))})))
    table = to_table([streamed, row("f")], vector_schema(384))
    assert table["pubsub_message_id"].to_pylist() == ["m1", None]
    assert table["pubsub_publish_time"].to_pylist() == [published, None]
    assert table["pubsub_attributes"].to_pylist() == [[("k", "v")], None]

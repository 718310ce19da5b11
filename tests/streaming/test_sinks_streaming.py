"""The streaming sink (WriteStreaming): each micro-batch becomes its vectors file, its
dead-letter file and its ledger record, under dt=/hour= of the window start, with safe names fixed
by window, pane and shard (a late pane never overwrites the on-time file, a retry rewrites the same
names), and nothing half-written or temporary is left where readers look.

The sink takes micro-batches as data (their window travels with them), so these tests build them
directly; windowing and grouping are tested in test_windowing.py and test_dedup_streaming.py.
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
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.transforms import window
from apache_beam.transforms.window import IntervalWindow
from apache_beam.utils.timestamp import Timestamp

from pipeline import ledger
from transforms import sinks
from transforms.metrics import DEAD_LETTER_NAMESPACE, NAMESPACE
from transforms.output.layout import PartFileName, partition_path
from transforms.output.parquet import vector_schema
from transforms.sinks import WriteStreaming, to_table
from transforms.types import (
    DeadLetter,
    EmbeddedDoc,
    LedgerRecord,
    Lineage,
    MicroBatch,
    NewsEvent,
    PreparedDoc,
)

RUN_ID = "20261201T093000Z-1a2b3c4d"
T0 = dt.datetime(2026, 12, 1, 9, 59, tzinfo=dt.timezone.utc)  # start of the first window
BASE = Timestamp.from_utc_datetime(T0)
SAFE_PATH = re.compile(r"^[A-Za-z0-9._=/-]+$")
FILE_NAME = re.compile(  # group 1: the pane index
    r"^part-\d{8}T\d{6}Z-(\d{3})-\d{5}-of-\d{5}-[0-9a-f]{16}\.(parquet|jsonl|json)$")


def at(seconds: float) -> Timestamp:
    return BASE + seconds


def row(event_id: str) -> EmbeddedDoc:
    # A hostile source and an old published_at: neither may show in a path.
    event = NewsEvent(id=event_id, body="x", source="../../etc",
                      published_at=dt.datetime(2001, 1, 1, tzinfo=dt.timezone.utc))
    doc = PreparedDoc(event=event, text="x", text_sha256="0" * 64, token_ids=(101, 7, 102),
                      truncated=False)
    return EmbeddedDoc.of(doc, np.ones(384, np.float32) / np.sqrt(384), "fake@0",
                          dt.datetime(2026, 12, 1, 10, 5, tzinfo=dt.timezone.utc))


def letter(event_id: str, reason="invalid_json") -> DeadLetter:
    return DeadLetter(step="parse", reason=reason, detail="x", payload="../../etc, [x]",
                      payload_bytes=15, event_id=event_id)


def micro_batch(start_s: float, pane=0, shard=0, rows=(), letters=(), duplicates=0,
                extra_in=0) -> MicroBatch:
    return MicroBatch(window_start_us=at(start_s).micros, window_end_us=at(start_s + 60).micros,
                      pane=pane, shard=shard, shards=2, rows=tuple(rows),
                      dead_letters=tuple(letters), duplicates=duplicates,
                      messages_in=len(rows) + len(letters) + duplicates + extra_in)


BATCHES = [  # window 09:59: an on-time pane and a late one; 10:00 one pane on another shard
    micro_batch(0, rows=[row("a"), row("b")], letters=[letter("bad")], duplicates=1),
    micro_batch(0, pane=1, rows=[row("late")]),
    micro_batch(60, shard=1, rows=[row("c")], letters=[letter("x", "no_text")]),
]


def write(tmp_path, batches=BATCHES, row_group_rows=16384, run_id=RUN_ID, signature=None):
    p = TestPipeline(runner="BundleBasedDirectRunner")
    _ = (p | beam.Create(batches)
         | WriteStreaming(str(tmp_path), run_id, dim=384, row_group_rows=row_group_rows,
                             signature=signature))
    result = p.run()
    result.wait_until_finish()
    return result


def counter(result, namespace: str, name: str) -> int:
    found = result.metrics().query(MetricsFilter().with_namespace(namespace).with_name(name))
    return sum(c.committed for c in found["counters"])


def files(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


def layout(tmp_path) -> dict:
    """{(subdir, partition, pane, shard): path} of every file: safe names, nothing elsewhere."""
    found = {}
    for path in files(tmp_path):
        rel = path.relative_to(tmp_path).as_posix()
        assert SAFE_PATH.match(rel) and not set("[], ") & set(rel), rel
        subdir, partition, name = (rel.split("/", 1)[0], rel.split("/", 1)[1].rsplit("/", 1)[0],
                                   path.name)
        assert subdir in ("vectors", "dead_letter", "ledger"), f"a file elsewhere: {rel}"
        match = FILE_NAME.match(name)
        assert match, name
        shard = PartFileName.parse(name).shard
        found[(subdir, partition, int(match.group(1)), shard)] = path
    return found

def test_partition_path_is_the_window_start_in_utc():
    start = Timestamp.from_utc_datetime(dt.datetime(2026, 12, 31, 23, 59, tzinfo=dt.timezone.utc))
    assert partition_path(IntervalWindow(start, start + 60)) == "dt=2026-12-31/hour=23"
    assert partition_path(IntervalWindow(at(60), at(120))) == "dt=2026-12-01/hour=10"
    with pytest.raises(ValueError):
        partition_path(window.GlobalWindow())


def test_file_names_differ_by_pane_and_messages_not_by_launch():
    w = IntervalWindow(at(0), at(60))
    names = {PartFileName.for_window(w, pane, 0, 1, digest, ".parquet").file_name()
             for digest in ("0" * 16, "f" * 16) for pane in (0, 1)}
    assert len(names) == 4
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    assert PartFileName.for_window(w, 1, 0, 1, "0123456789abcdef", ".parquet").file_name() == \
        "part-20261201T095900Z-001-00000-of-00001-0123456789abcdef.parquet"
    batch = micro_batch(0, rows=[row("a"), row("b")], letters=[letter("x")])
    assert sinks.micro_batch_digest(batch) == sinks.micro_batch_digest(
        dataclasses.replace(batch, rows=batch.rows[::-1])), "the messages, not their order"
    assert sinks.micro_batch_digest(batch) != sinks.micro_batch_digest(
        micro_batch(0, rows=[row("a"), row("c")], letters=[letter("x")]))


def test_a_file_name_parses_back_to_its_parts():
    """The sinks write names and the ledger reads them with one type: a round trip, whatever the
    pane (a job with more than 999 late panes of a window); and the names of earlier releases."""
    w = IntervalWindow(at(0), at(60))
    for pane, shard in ((0, 3), (1234, 0)):
        name = PartFileName.for_window(w, pane, shard, 4, "00112233445566ff", ".jsonl")
        assert PartFileName.parse(name.file_name()) == name
        assert PartFileName.parse("vectors/dt=2026-12-01/hour=09/" + name.file_name()) == name
    earlier = PartFileName.parse(f"part-{RUN_ID}-20261201T095900Z-001-00002-of-00004.parquet")
    assert (earlier.run_id, earlier.digest, earlier.pane, earlier.shard) == (RUN_ID, None, 1, 2)
    assert PartFileName.parse(f"part-{RUN_ID}-00000-of-00004.parquet") is None  # a batch file


def test_unsafe_run_id_fails_at_construction():
    with pytest.raises(ValueError, match="run_id"):
        WriteStreaming("out", "a b[0]", dim=384)


def test_each_micro_batch_is_one_set_of_files_under_its_window_hour(tmp_path):
    write(tmp_path, row_group_rows=1)
    found = layout(tmp_path)
    h09, h10 = "dt=2026-12-01/hour=09", "dt=2026-12-01/hour=10"
    assert sorted(found) == sorted([
        ("vectors", h09, 0, 0), ("dead_letter", h09, 0, 0), ("ledger", h09, 0, 0),
        ("vectors", h09, 1, 0), ("ledger", h09, 1, 0),  # the late pane: files of its own
        ("vectors", h10, 0, 1), ("dead_letter", h10, 0, 1), ("ledger", h10, 0, 1)])
    ids = {key: sorted(pq.read_table(path)["id"].to_pylist())
           for key, path in found.items() if key[0] == "vectors"}
    assert ids == {("vectors", h09, 0, 0): ["a", "b"], ("vectors", h09, 1, 0): ["late"],
                   ("vectors", h10, 0, 1): ["c"]}
    for key, path in found.items():
        if key[0] == "vectors":
            assert pq.read_schema(path) == vector_schema(384)
            metadata = pq.ParquetFile(path).metadata
            assert metadata.num_row_groups == metadata.num_rows  # row_group_rows=1
            assert metadata.row_group(0).column(0).compression == "ZSTD"
    record = LedgerRecord.from_json(found[("ledger", h09, 0, 0)].read_text())
    assert (record.messages_in, record.rows_written, record.dead_lettered, record.duplicates) == \
        (4, 2, 1, 1)
    assert record.dead_lettered_by_reason == {"invalid_json": 1} and record.balances()
    assert (record.window_start == "2026-12-01T09:59:00Z"
            and record.window_end == "2026-12-01T10:00:00Z")
    assert record.vectors_file == found[("vectors", h09, 0, 0)].relative_to(tmp_path).as_posix()
    assert record.dead_letter_file == found[("dead_letter", h09, 0, 0)].relative_to(
        tmp_path).as_posix()
    assert LedgerRecord.from_json(found[("ledger", h09, 1, 0)].read_text()).dead_letter_file is None
    letters = [json.loads(line)
               for line in found[("dead_letter", h10, 0, 1)].read_text().splitlines()]
    assert [d["reason"] for d in letters] == ["no_text"]
    assert ledger.check(str(tmp_path)).ok


def test_a_retried_micro_batch_rewrites_the_same_files(tmp_path):
    write(tmp_path)
    first = {p.relative_to(tmp_path) for p in files(tmp_path)}
    write(tmp_path)
    assert {p.relative_to(tmp_path) for p in files(tmp_path)} == first
    report = ledger.check(str(tmp_path))
    assert report.ok and report.totals["rows_written"] == 4, "no row counted twice"


def test_rows_and_dead_letters_are_counted_as_written(tmp_path):
    # One micro-batch, so one bundle: Beam 2.77's BundleBasedDirectRunner keeps only a step's first
    # bundle's metrics per executor thread (see tests/streaming/test_dedup_streaming.py).
    result = write(tmp_path, [BATCHES[0]])
    assert counter(result, NAMESPACE, "rows_written") == 2
    assert counter(result, NAMESPACE, "dead_lettered") == 1
    assert counter(result, DEAD_LETTER_NAMESPACE, "invalid_json") == 1


def test_a_file_that_fails_midway_is_never_visible_and_gets_no_ledger_record(tmp_path):
    # row_group_rows=1: row "a" is written as a row group, then the bad row raises in to_table.
    bad = dataclasses.replace(row("bad"), embedding=np.ones(383, np.float32))
    with pytest.raises(Exception, match="383 dimensions"):
        write(tmp_path, [micro_batch(0, rows=[row("a"), bad])], row_group_rows=1)
    assert files(tmp_path) == []  # not under vectors/, no ledger record, the temp file deleted
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
    write(tmp_path, row_group_rows=1)
    assert calls == [1, 1, 1, 1] and unreadable == []


def test_the_ledger_command_names_what_does_not_add_up(tmp_path):
    write(tmp_path)
    found = layout(tmp_path)
    h09 = "dt=2026-12-01/hour=09"
    found[("vectors", h09, 1, 0)].unlink()  # a data file lost
    record_path = found[("ledger", "dt=2026-12-01/hour=10", 0, 1)]
    record = LedgerRecord.from_json(record_path.read_text())
    record_path.write_text(dataclasses.replace(record, messages_in=3).to_json())  # off by one
    (tmp_path / "vectors" / h09 / found[("vectors", h09, 0, 0)].name.replace("-000-", "-007-")
     ).write_bytes(found[("vectors", h09, 0, 0)].read_bytes())  # a file no record names
    report = ledger.check(str(tmp_path))
    assert not report.ok
    text = "\n".join(report.problems)
    assert "window 2026-12-01T09:59:00Z (pane 1, shard 0" in text and "is missing" in text
    assert "window 2026-12-01T10:00:00Z (pane 0, shard 1" in text and "does not balance" in text
    assert "-007-" in text and "has no ledger record" in text
    assert len(report.problems) == 3
    # A range that leaves the broken windows out is clean; the command exits 1 on the whole.
    assert ledger.main(["--output", str(tmp_path)]) == 1
    assert not ledger.check(str(tmp_path), dt.datetime(2026, 12, 1, 11, tzinfo=dt.timezone.utc),
                            dt.datetime(2026, 12, 1, 12, tzinfo=dt.timezone.utc)).problems


def test_pubsub_lineage_columns_are_filled_for_streamed_events_only():
    published = dt.datetime(2026, 12, 1, 10, 0, 1, tzinfo=dt.timezone.utc)
    streamed = row("s")
    streamed = dataclasses.replace(streamed, lineage=Lineage(
        message_id="m1", publish_time=published, attributes=(("k", "v"),)))
    table = to_table([streamed, row("f")], vector_schema(384))
    assert table["pubsub_message_id"].to_pylist() == ["m1", None]
    assert table["pubsub_publish_time"].to_pylist() == [published, None]
    assert table["pubsub_attributes"].to_pylist() == [[("k", "v")], None]


def test_an_embedded_row_carries_only_output_columns_through_the_shuffles():
    """After embedding, what the dedup shuffle and the sinks' batches carry is the row, not the
    document: a 100 KB body, its prepared text and its token ids are left behind, so the encoded
    row is the size of its vector whatever the article's length."""
    from apache_beam.coders import registry

    body = "A long article. " * 6_400  # 100 KB
    event = NewsEvent(id="long", body=body, title="t", url="https://example.com/a")
    doc = PreparedDoc(event=event, text=body, text_sha256="0" * 64,
                      token_ids=tuple(range(100, 356)), truncated=True)
    embedded = EmbeddedDoc.of(doc, np.ones(384, np.float32) / np.sqrt(384), "fake@0",
                              dt.datetime(2026, 12, 1, 10, 5, tzinfo=dt.timezone.utc))
    encoded = registry.get_coder(EmbeddedDoc).encode(embedded)
    assert len(encoded) < 8 * 1024, f"{len(encoded)} bytes for a 1.5 KB vector"  # pickled: ~3.6 KB
    # lineage: the pubsub_* columns; minhash, story_facts: columns of keys/ (128 x 4 bytes; a few)
    columns = set(vector_schema(384).names) | {"lineage", "chunks", "minhash", "story_facts"}
    assert {f.name for f in dataclasses.fields(EmbeddedDoc)} <= columns


# Exactly once across launches and retries (issue 21, sections 3 and 4).

def data_files(root) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in files(root)
                  if not p.relative_to(root).as_posix().startswith("ledger/"))


def test_a_micro_batch_redone_by_another_launch_replaces_its_files(tmp_path):
    """After ``--update`` or a restart from a snapshot, the new job redoes the micro-batches the
    old one wrote but did not commit. Before, their files were named by each launch's run id: two
    sets of rows, two ledger records, and the ledger said balanced over doubled totals."""
    write(tmp_path, signature="sig")
    once = ledger.check(str(tmp_path))
    before = data_files(tmp_path)
    write(tmp_path, run_id="20261201T110000Z-5ec0dd0b", signature="sig")  # the launch after
    again = ledger.check(str(tmp_path))
    assert again.ok, again.problems
    assert again.totals == once.totals, "no row, record or dead letter counted twice"
    assert data_files(tmp_path) == before, "the same files, replaced"
    assert again.totals["records"] == len(BATCHES) and again.totals["rows_written"] == 4


def test_a_retry_whose_outcome_differs_leaves_nothing_of_the_first_attempt(tmp_path):
    """Attempt 1 embedded both articles; attempt 2 (another engine, say) dead-letters them. Before,
    attempt 2 wrote only the kinds it had rows for: attempt 1's vectors and keys stayed, and the
    nightly incremental job trusted those keys."""
    first = micro_batch(0, rows=[row("a"), row("b")])
    write(tmp_path, [first], signature="sig")
    assert {name.split("/")[0] for name in data_files(tmp_path)} == {"vectors", "keys"}
    second = dataclasses.replace(first, rows=(), dead_letters=(
        letter("a", "embedding_failed"), letter("b", "embedding_failed")))
    write(tmp_path, [second], signature="sig")
    assert {name.split("/")[0] for name in data_files(tmp_path)} == {"dead_letter"}, \
        data_files(tmp_path)
    report = ledger.check(str(tmp_path))
    assert report.ok, report.problems
    assert (report.totals["rows_written"], report.totals["dead_lettered"]) == (0, 2)


def test_the_ledger_checks_the_key_index(tmp_path):
    write(tmp_path, signature="sig")
    assert ledger.check(str(tmp_path)).ok
    keys = sorted((tmp_path / "keys").rglob("*.parquet"))
    assert len(keys) == 3, "one key file per micro-batch with rows"
    stray = keys[0].with_name(keys[0].name.replace("-000-", "-007-"))
    stray.write_bytes(keys[0].read_bytes())  # keys no record names
    keys[1].unlink()  # keys a record names, lost
    text = "\n".join(ledger.check(str(tmp_path)).problems)
    assert "-007-" in text and "has no ledger record" in text
    assert f"{keys[1].name} is missing" in text


def test_the_ledger_finds_a_message_written_twice(tmp_path):
    """Rows of one Pub/Sub message in two files (as two launches of an earlier release wrote
    after an update) are found however the files are named."""
    def streamed(event_id, message_id):
        return dataclasses.replace(row(event_id), lineage=Lineage(
            message_id=message_id, publish_time=None))

    write(tmp_path, [micro_batch(0, rows=[streamed("a", "m1"), streamed("b", "m2")]),
                     micro_batch(0, pane=1, rows=[streamed("a", "m1")])])
    report = ledger.check(str(tmp_path))
    assert not report.ok
    assert any("message m1 is written twice" in p for p in report.problems), report.problems
    assert not any("m2" in p for p in report.problems)


def test_the_ledger_finds_a_message_dead_lettered_twice_or_both_a_row_and_a_dead_letter(tmp_path):
    """Dedup applies to documents, never to dead letters: an invalid message read again (after a
    drain and replay, a snapshot restore or a subscription seek) is dead-lettered in a second
    micro-batch. Each record balances, and before, the ledger counted it twice without a word;
    the same for a message that is a row in one micro-batch and a dead letter in another."""
    def streamed(event_id, message_id):
        return dataclasses.replace(row(event_id), lineage=Lineage(
            message_id=message_id, publish_time=None))

    def lettered(event_id, message_id):
        return dataclasses.replace(letter(event_id), message_id=message_id)

    write(tmp_path, [
        micro_batch(0, rows=[streamed("a", "m1")], letters=[lettered("bad", "m2")]),
        micro_batch(0, pane=1, letters=[lettered("bad", "m2"), lettered("a", "m1"),
                                        lettered("other", "m3")])])
    report = ledger.check(str(tmp_path))
    assert not report.ok
    twice = sorted(p.split(":")[0] for p in report.problems if "is written twice" in p)
    assert twice == ["message m1 is written twice", "message m2 is written twice"], \
        report.problems
    assert not any("m3" in p for p in report.problems)


def test_the_ledger_names_a_dead_letter_file_line_that_is_not_a_dead_letter(tmp_path):
    write(tmp_path, [micro_batch(0, letters=[letter("bad")])])
    [path] = (tmp_path / "dead_letter").rglob("*.jsonl")
    path.write_bytes(b'{"truncated\n')
    report = ledger.check(str(tmp_path))
    assert any("holds a line that is not a dead letter" in p for p in report.problems), \
        report.problems


def test_a_ledger_record_of_a_newer_release_is_read_without_its_new_fields(tmp_path):
    """Each release adds record fields (store_rejected, store_withdrawn...): a job rolled back to
    an older release, or an older ``newsvec ledger``, must still read the newer records."""
    write(tmp_path, [micro_batch(0, rows=[row("a")])])
    [path] = (tmp_path / "ledger").rglob("*.json")
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "a_field_of_a_later_release": [1, 2]}) + "\n")
    assert LedgerRecord.from_json(path.read_text()).rows_written == 1
    report = ledger.check(str(tmp_path))
    assert report.ok, report.problems


@pytest.mark.parametrize("field, value", [
    ("window_start", "not a time"), ("window_start", 5), ("messages_in", "5"), ("pane", None),
    ("rows_written", -1), ("dead_lettered_by_reason", {"invalid_json": "1"}),
    ("dead_lettered_by_language", {"en": []}), ("vectors_file", 7), ("store_rejected", "x")])
def test_a_ledger_record_with_a_field_of_the_wrong_kind_is_named_not_a_traceback(
        tmp_path, field, value):
    """A record edited by hand or torn by a tool (a count as a string, a window that is no time)
    is named as not a ledger record: before, the command failed with a traceback (a TypeError
    summing it, a ValueError reading its window) and checked nothing else."""
    write(tmp_path, [micro_batch(0, rows=[row("a")], letters=[letter("bad")])])
    [path] = (tmp_path / "ledger").rglob("*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    report = ledger.check(str(tmp_path))
    assert any("is not a ledger record" in p and field in p for p in report.problems), \
        report.problems


def test_a_ledger_record_naming_a_file_outside_its_folder_is_named_and_the_rest_checked(
        tmp_path):
    """A record whose file is ``../../../etc/passwd`` is refused, never followed; before, the
    refusal ended the whole check (a traceback), so no other window was checked."""
    write(tmp_path)
    path = sorted((tmp_path / "ledger").rglob("*.json"))[0]
    path.write_text(json.dumps({**json.loads(path.read_text()),
                                "vectors_file": "../../../etc/passwd"}))
    report = ledger.check(str(tmp_path))
    assert any("is not a ledger record" in p and "refused, not followed" in p
               for p in report.problems), report.problems
    assert report.records and all(r.vectors_file != "../../../etc/passwd" for r in report.records)

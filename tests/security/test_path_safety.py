"""No field of an event (id, source, language, url, published_at) nor of its Pub/Sub message can
steer where a file is written: with the adversarial corpus (../, absolute paths, NUL, shell
metacharacters, very long strings, far-past and future dates) every file lands under the output
prefix, under vectors/, dead_letter/ or keys/ (or is the summary), every path component is
[A-Za-z0-9._=-]+, and streaming partitions dt=/hour= are those of the window.

(a) the batch pipeline: the run tests/input/test_adversarial.py makes (shared, real vLLM);
(b) the streaming graph (Parse -> WindowByEventTime -> PrepareText -> DropDuplicatesStreaming ->
    GroupMicroBatches -> Embed -> WriteStreaming) on a TestStream of Pub/Sub messages, with a
    FAKE embedding model (paths do not depend on vectors), on BundleBasedDirectRunner.
"""
from __future__ import annotations

import collections
import datetime as dt
import json
import re
from pathlib import Path

import apache_beam as beam
import pyarrow.parquet as pq
import pytest
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Timestamp

from pipeline.graph import embed_and_write_streaming
from tests.adversarial import ALL_CASES, BY_NAME, DUPLICATE, NOW, ROW, Case, event_id
from tests.fakes import FakeEngine
from tests.input.test_adversarial import PREPARE_REASONS, corpus_batch_run, corpus_config
from transforms.output.layout import PartFileName
from transforms.parse import ParseEvents

SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9._=-]+$")
PARTITION = re.compile(r"^dt=(\d{4}-\d{2}-\d{2})/hour=(\d{2})$")
RUN_ID = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{8}$")
WINDOW_S = 60
LATENESS_S = 600
# Hostile attributes on every message: kept as lineage, never a path. (A control character in an
# attribute dead-letters its message: tests/input/test_parse.py.)
ATTRIBUTES = {"../../x": "/abs/path", "name": "a;b;$(id)", "dt": "1999-01-01", "hour": "99"}


def all_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def check_component(part: str, where: str) -> None:
    assert SAFE_COMPONENT.match(part) and part not in (".", ".."), \
        f"unsafe component {part!r} in {where}"


# ---- (a) batch ----

@pytest.fixture(scope="module")
def batch_run():
    return corpus_batch_run()


def test_batch_writes_only_under_the_output_prefix_with_safe_names(batch_run):
    root, out, summary = batch_run
    assert RUN_ID.match(summary["run_id"])
    for path in all_files(root):
        rel_root = path.relative_to(root).as_posix()
        if rel_root == "in/adversarial.jsonl":  # the input
            continue
        assert rel_root.startswith("a/b/out/"), f"a file outside the output prefix: {rel_root}"
        rel = path.relative_to(out).as_posix()
        for part in rel.split("/"):
            check_component(part, rel)
        top = rel.split("/")[0]
        assert top in ("vectors", "dead_letter", "keys", "_summary.json", "_manifest.json"), rel
        if not top.startswith("_"):
            assert rel.count("/") == 1, f"batch output is flat under {top}/: {rel}"
            assert path.name.startswith(f"part-{summary['run_id']}-"), rel
    # Every directory too (an empty one named after an event would be a steer as well).
    for path in sorted(p for p in out.rglob("*") if p.is_dir()):
        for part in path.relative_to(out).parts:
            check_component(part, str(path))
    names = {p.relative_to(out).parts[0] for p in all_files(out)}
    assert names == {"vectors", "dead_letter", "keys", "_summary.json", "_manifest.json"}


def test_batch_hostile_values_did_reach_the_output_as_data(batch_run):
    """The paths above are safe although the hostile values went all the way through (so the
    check is not passing on an empty run)."""
    _, out, _ = batch_run
    table = pq.read_table(sorted((out / "vectors").glob("*.parquet")))
    ids = set(table["id"].to_pylist())
    assert {"../../etc/passwd", "C:\\Windows\\System32\\drivers\\etc\\hosts"} <= ids
    assert "/abs/path/../../etc" in table["source"].to_pylist()
    assert "en/../../x" in table["language"].to_pylist()


# ---- (b) streaming ----

STREAM_CASES = ALL_CASES
T0 = Timestamp.from_utc_datetime(NOW.replace(second=0))  # a window start: publish times follow


def message_id(i: int) -> str:
    return f"msg-{i:04d}"


def publish_time(i: int) -> Timestamp:
    return T0 + 5 + (i % 50)  # all within [T0, T0 + 60): one window by publish time


def messages() -> list[TimestampedValue]:
    return [TimestampedValue(
        PubsubMessage(c.payload, dict(ATTRIBUTES), message_id=message_id(i),
                      publish_time=publish_time(i)), publish_time(i))
        for i, c in enumerate(STREAM_CASES)]


def expected_event_time(case: Case, i: int) -> Timestamp:
    """docs/streaming.md: published_at, unless more than the allowed lateness before the publish
    time (then the publish time). Computed here from the payload, independently of windowing.py."""
    published = publish_time(i)
    raw = json.loads(case.payload.decode("utf-8"))
    if not raw.get("published_at"):
        return published
    at = dt.datetime.fromisoformat(raw["published_at"].upper())
    if published.to_utc_datetime(has_tz=True) - at > dt.timedelta(seconds=LATENESS_S):
        return published
    return Timestamp.from_utc_datetime(at.astimezone(dt.timezone.utc))


def partition_of(t: Timestamp) -> str:
    """dt=/hour= of the start of the fixed window holding t (windows start at multiples of
    WINDOW_S since the epoch)."""
    size = WINDOW_S * 1_000_000
    start = Timestamp(micros=t.micros - t.micros % size).to_utc_datetime(has_tz=True)
    return f"dt={start:%Y-%m-%d}/hour={start:%H}"


@pytest.fixture(scope="module")
def streaming_run(tmp_path_factory):
    from transforms.settings import StreamingSettings

    root = tmp_path_factory.mktemp("streaming")
    out = root / "a" / "b" / "out"
    config = corpus_config(output=str(out), streaming=StreamingSettings(
        window_s=WINDOW_S, allowed_lateness_s=LATENESS_S, max_wait_s=5, batch_shards=2))
    stream = (TestStream().advance_watermark_to(T0 - 3600)
              .add_elements(messages())
              .advance_watermark_to_infinity())
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embed_and_write_streaming(p | stream, config, "20261201T000000Z-0badc0de",
                              engine_factory=FakeEngine)
    p.run().wait_until_finish()
    return root, out


def stream_outputs(out: Path):
    """(rows as (message id, id, title, partition), dead letters as (letter, partition))."""
    rows, letters = [], []
    for path in all_files(out / "vectors"):
        partition = path.parent.relative_to(out / "vectors").as_posix()
        t = pq.read_table(path)
        rows += [(m, i, title, partition) for m, i, title in zip(
            t["pubsub_message_id"].to_pylist(), t["id"].to_pylist(), t["title"].to_pylist(),
            strict=True)]
    for path in all_files(out / "dead_letter"):
        partition = path.parent.relative_to(out / "dead_letter").as_posix()
        letters += [(json.loads(line), partition)
                    for line in path.read_bytes().split(b"\n") if line]
    return rows, letters


def test_streaming_writes_only_under_the_output_prefix_with_safe_names(streaming_run):
    root, out = streaming_run
    files = all_files(root)
    assert files, "the streaming run wrote nothing"
    for path in files:
        rel_root = path.relative_to(root).as_posix()
        assert rel_root.startswith("a/b/out/"), f"a file outside the output prefix: {rel_root}"
        rel = path.relative_to(out).as_posix()
        for part in rel.split("/"):
            check_component(part, rel)
        top, partition, name = (rel.split("/", 1)[0], rel.rsplit("/", 1)[0].split("/", 1)[-1],
                                path.name)
        assert top in ("vectors", "dead_letter", "ledger", "keys"), \
            f"{rel}: nothing left in _temp/ or elsewhere"
        assert PARTITION.match(partition), rel
        assert PartFileName.parse(name) is not None and PartFileName.parse(name).digest, rel
    for path in sorted(p for p in out.rglob("*") if p.is_dir()):
        for part in path.relative_to(out).parts:
            check_component(part, str(path))


def test_streaming_partitions_are_those_of_the_window(streaming_run):
    _, out = streaming_run
    rows, letters = stream_outputs(out)
    index = {message_id(i): (c, i) for i, c in enumerate(STREAM_CASES)}
    assert rows and letters
    for m, _, _, partition in rows:
        case, i = index[m]
        assert partition == partition_of(expected_event_time(case, i)), (case.name, partition)
    for letter, partition in letters:
        case, i = index[letter["message_id"]]
        # Parse dead letters have no event time: their publish time's window.
        t = (expected_event_time(case, i) if letter["step"] in ("prepare_text", "embed")
             else publish_time(i))
        assert partition == partition_of(t), (case.name, partition)
    # The corpus's near-future row lands in its own (later) window: partitions do follow the
    # window, and a date far in the past does not make one.
    future = BY_NAME["published_within_skew_but_wallclock_beyond"]
    assert {p for m, _, _, p in rows if index[m][0] is future} == {
        partition_of(expected_event_time(future, STREAM_CASES.index(future)))}
    assert not any(p.startswith("dt=0001") or p.startswith("dt=1969") for *_, p in rows)


def test_streaming_accounts_for_every_message(streaming_run):
    """Pub/Sub carries the payloads that cannot be JSON Lines lines too: every message is a row, a
    dead letter with its reason, or a duplicate."""
    _, out = streaming_run
    rows, letters = stream_outputs(out)
    index = {message_id(i): c for i, c in enumerate(STREAM_CASES)}
    by_message = collections.Counter(m for m, *_ in rows)
    assert all(n == 1 for n in by_message.values())
    problems = []
    for letter, _ in letters:
        case = index[letter["message_id"]]
        if letter["reason"] != case.expected:
            problems.append(
                f"{case.name}: dead letter {letter['reason']}, expected {case.expected}")
        if case.expected in PREPARE_REASONS:
            assert letter["event_id"] == event_id(case)
    lettered = {letter["message_id"] for letter, _ in letters}
    for m, case in index.items():
        if case.expected not in (ROW, DUPLICATE) and m not in lettered:
            problems.append(f"{case.name}: no dead letter, expected {case.expected}"
                            + (" (became a row)" if m in by_message else ""))
        if case.expected == ROW and m not in by_message and event_id(case) != "dup-1":
            problems.append(f"{case.name}: no row")
    assert not problems, "\n".join(problems)
    # The three copies of dup-1 (two identical) leave exactly one row: the last published.
    dup_rows = [r for r in rows if r[1] == "dup-1"]
    assert (len(dup_rows) == 1
            and dup_rows[0][2] == json.loads(BY_NAME["dup_original"].payload)["title"])
    n_dups = sum(c.expected == DUPLICATE for c in STREAM_CASES)
    assert len(rows) + len(letters) + n_dups == len(STREAM_CASES)
    assert "pretty_printed_multiline" in {index[m].name for m in by_message}


def test_streaming_survives_a_date_whose_utc_instant_is_year_0():
    """published_at "0001-01-01T00:00:00+01:00" is valid RFC 3339, but its UTC instant (year 0)
    overflows Python's datetime: parse dead-letters it (no reader or store could hold it), and
    WindowByEventTime, given such an event anyway (built here without validation), still windows
    it by its publish time instead of failing the job (on Dataflow: a bundle retried for ever)."""
    from apache_beam.testing.util import assert_that, equal_to

    from transforms.types import Lineage, NewsEvent
    from transforms.windowing import WindowByEventTime

    case = BY_NAME["published_year_1_positive_offset"]
    published = T0 + 5
    raw = json.loads(case.payload)
    unchecked = NewsEvent.model_construct(
        id="unchecked", body=raw["body"],
        published_at=dt.datetime.fromisoformat(raw["published_at"]),
        lineage=Lineage("m-2", published.to_utc_datetime(has_tz=True)))
    stream = (TestStream().advance_watermark_to(T0)
              .add_elements([TimestampedValue(PubsubMessage(case.payload, {}, message_id="m-1",
                                                            publish_time=published), published)])
              .advance_watermark_to_infinity())
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    parsed = p | stream | ParseEvents()
    assert_that(parsed.dead_letter | beam.Map(lambda d: (d.message_id, d.reason)),
                equal_to([("m-1", "invalid_field")]), label="dead-lettered at parse")
    unchecked_at_publish = (p | beam.Create([unchecked])
                            | beam.Map(lambda e: TimestampedValue(e, published)))
    seen = ((parsed.events, unchecked_at_publish) | beam.Flatten()
            | WindowByEventTime(WINDOW_S, LATENESS_S)
            | beam.Map(lambda e, t=beam.DoFn.TimestampParam: (e.id, t)))
    assert_that(seen, equal_to([("unchecked", published)]), label="windowed")
    p.run().wait_until_finish()

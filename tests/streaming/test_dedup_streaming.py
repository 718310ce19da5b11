"""Streaming dedup on a TestStream: GroupMicroBatches then DropDuplicatesStreaming. Redeliveries
within the horizon are dropped and counted in their micro-batch, and a key is forgotten once the
watermark passes its horizon (the state is bounded). Input is in fixed 10 s windows (default
trigger: each window fires once, at its end); each kept copy is reported with the end of the window
it arrived in.

Runner: BundleBasedDirectRunner, the local runner that executes TestStream with user state and
event-time timers. DirectRunner would pick it too for a TestStream, but only after a check for
Prism (a download, which fails offline); naming it skips that.
"""
import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import FixedWindows, TimestampedValue

from transforms.dedup import DropDuplicatesStreaming, state_layout_for
from transforms.microbatch import GroupMicroBatches
from transforms.types import DeadLetter, MicroBatch, NewsEvent, PreparedDoc, Reason, Step


def doc(id_: str, sha: str) -> PreparedDoc:
    return PreparedDoc(event=NewsEvent(id=id_, body="x"), text="x", text_sha256=sha,
                       token_ids=(101, 1, 102), truncated=False)


def stream(*steps) -> TestStream:
    """steps: a list of (doc, t_seconds) adds one bundle, processed in list order; a number
    advances the watermark to it. Ends with the watermark at infinity."""
    ts = TestStream()
    for step in steps:
        if isinstance(step, list):
            ts.add_elements([TimestampedValue(doc_, t) for doc_, t in step])
        else:
            ts.advance_watermark_to(step)
    return ts.advance_watermark_to_infinity()


def run_dedup(test_stream: TestStream, expected, windowed_s=10, expected_duplicates=None,
              key="id", shards=4, **dedup_args):
    """Runs the stream in fixed windows through GroupMicroBatches and DropDuplicatesStreaming, and
    asserts the (id, text_sha256, window end) of each kept document and, if given, the duplicates
    counted in the micro-batches."""
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    docs = p | test_stream | beam.WindowInto(FixedWindows(windowed_s))
    no_letters = docs | "NoLetters" >> beam.Filter(lambda _: False)
    batches = ((docs, no_letters) | GroupMicroBatches(key, shards)
               | DropDuplicatesStreaming(key=key, **dedup_args))
    kept = batches | "Kept" >> beam.FlatMap(
        lambda b: [(d.event.id, d.text_sha256, b.window_end_us // 1_000_000) for d in b.docs])
    assert_that(kept, equal_to(expected), label="kept")
    if expected_duplicates is not None:
        def counted(per_batch):
            assert sum(per_batch) == expected_duplicates, per_batch

        assert_that(batches | beam.Map(lambda b: b.duplicates), counted, label="duplicates")
    result = p.run()
    result.wait_until_finish()
    return result


def test_redeliveries_in_later_firings_are_dropped():
    run_dedup(
        stream([(doc("a", "copy0"), 0), (doc("b", "b"), 5)], 12, [(doc("a", "copy1"), 13)],
               30, [(doc("a", "copy2"), 31)]),
        expected=[("a", "copy0", 10), ("b", "b", 10)])  # the first copy, from window [0, 10)


def test_duplicates_are_counted_in_their_micro_batch():
    run_dedup(stream([(doc("a", "c0"), 0), (doc("a", "c1"), 1), (doc("a", "c2"), 2),
                      (doc("b", "b"), 3)], 12, [(doc("a", "c3"), 13)]),
              expected=[("a", "c2", 10), ("b", "b", 10)], expected_duplicates=3)


def test_copies_in_one_firing_keep_the_last_published():
    import datetime as dt

    def published(id_, sha, day):
        return PreparedDoc(event=NewsEvent(id=id_, body="x", published_at=dt.datetime(
            2026, 11, day, tzinfo=dt.timezone.utc)), text="x", text_sha256=sha,
            token_ids=(101, 1, 102), truncated=False)

    run_dedup(stream([(published("a", "old", 1), 0), (published("a", "update", 2), 1)]),
              expected=[("a", "update", 10)])


@pytest.mark.parametrize("horizon_s, expected", [
    (60, [("a", "first", 10), ("a", "again", 220)]),  # expires at 10 + 60 < watermark 200
    (300, [("a", "first", 10)]),                       # expires at 310 > 210: still a duplicate
])
def test_a_key_is_forgotten_once_the_watermark_passes_its_horizon(horizon_s, expected):
    # This is the bounded-state test: nothing but the prune timer removes a key from "seen", so
    # the second "a" passes at horizon 60 only because the timer fired and dropped the key; the
    # horizon-300 case is the same stream with the timer not yet due.
    run_dedup(stream([(doc("a", "first"), 0)], 200, [(doc("a", "again"), 210)]),
              expected=expected, horizon_s=horizon_s)


def test_shards_do_not_split_a_key():
    run_dedup(stream([(doc(f"id{i}", str(i)), 0) for i in range(20)] + [(doc("id7", "again"), 3)]),
              # one firing: the batch rule picks id7's survivor (same date: greater text hash)
              expected=[(f"id{i}", "again" if i == 7 else str(i), 10) for i in range(20)],
              expected_duplicates=1, shards=4)


def test_text_hash_key_drops_the_same_text_under_another_id():
    run_dedup(stream([(doc("a", "same"), 0), (doc("b", "same"), 1), (doc("c", "other"), 2)]),
              expected=[("b", "same", 10), ("c", "other", 10)], key="text_sha256",
              expected_duplicates=1)


def test_unknown_key_or_empty_horizon_fails_at_construction():
    with pytest.raises(ValueError, match="dedup key"):
        DropDuplicatesStreaming(key="url")
    with pytest.raises(ValueError, match="horizon_s"):
        DropDuplicatesStreaming(horizon_s=0)
    with pytest.raises(ValueError, match="shards"):
        GroupMicroBatches(shards=0)


def letter(message_id: str) -> DeadLetter:
    return DeadLetter(step=Step.PARSE, reason=Reason.INVALID_JSON, detail="x", payload="{",
                      payload_bytes=1, message_id=message_id)


def micro_batch_summary(batch: MicroBatch) -> tuple:
    """(window end s, kept ids, dead letters, duplicates, messages_in); checks the ledger's
    balance on the way."""
    assert batch.messages_in == len(batch.docs) + len(batch.dead_letters) + batch.duplicates, batch
    return (batch.window_end_us // 1_000_000, tuple(sorted(d.event.id for d in batch.docs)),
            len(batch.dead_letters), batch.duplicates, batch.messages_in)


def test_a_micro_batch_of_duplicates_or_of_dead_letters_alone_comes_out_whole():
    # One shard, so each window is one micro-batch. The second is all duplicates (its documents
    # are regrouped from verdicts that all say "dropped"); the third has no documents at all
    # (nothing to ask about: it passes straight through). Both must come out, balanced.
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    items = p | stream([(doc("a", "a0"), 0), (doc("b", "b0"), 1), (letter("m1"), 2)], 12,
                       [(doc("a", "a1"), 13), (doc("b", "b1"), 14)], 22,
                       [(letter("m2"), 23)]) | beam.WindowInto(FixedWindows(10))
    docs = items | "Docs" >> beam.Filter(lambda i: isinstance(i, PreparedDoc))
    letters = items | "Letters" >> beam.Filter(lambda i: isinstance(i, DeadLetter))
    batches = (docs, letters) | GroupMicroBatches("id", shards=1) | DropDuplicatesStreaming()
    assert_that(batches | beam.Map(micro_batch_summary), equal_to([
        (10, ("a", "b"), 1, 0, 3), (20, (), 0, 2, 2), (30, (), 1, 0, 1)]))
    p.run().wait_until_finish()


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_runs_on_the_fn_api_runner(state):
    # The portable runner (the Fn API, as Dataflow's runner v2) runs the per-key state, its timers
    # and the regroup too. Bounded input: which micro-batch keeps "a" and "b" is the runner's
    # order, so the test counts: each key kept once, every copy counted, every micro-batch out and
    # balanced. per_shard: this runner fires timers at whole milliseconds, and the prune of the
    # code before set its timer again for ever (the test never ended).
    def mb(start_s, shard, docs=(), letters=()):
        return shard, MicroBatch(window_start_us=start_s * 10**6,
                                 window_end_us=(start_s + 10) * 10**6, pane=0, shard=shard,
                                 shards=2, docs=tuple(docs),
                                 dead_letters=tuple(letters), messages_in=len(docs) + len(letters))

    keyed = [mb(0, 0, [doc("a", "1"), doc("b", "1"), doc("a", "2")]), mb(0, 1, [doc("c", "1")]),
             mb(10, 0, [doc("a", "3"), doc("b", "3")]), mb(20, 0, letters=[letter("m")])]
    with TestPipeline(runner="FnApiRunner") as p:
        batches = (p | beam.Create(keyed)
                   | beam.Map(lambda kb: TimestampedValue(kb, kb[1].window_end_us / 1e6 - 1e-6))
                   | DropDuplicatesStreaming(state=state))
        summaries = batches | beam.Map(micro_batch_summary)

        def counted(rows):
            assert sorted(i for row in rows for i in row[1]) == ["a", "b", "c"], rows
            assert sum(row[3] for row in rows) == 3, rows
            assert sorted((row[0], row[4]) for row in rows) == [(10, 1), (10, 3), (20, 2), (30, 1)]

        assert_that(summaries, counted)


def test_a_micro_batch_reads_the_same_state_whatever_the_number_of_keys_held():
    # Through the benchmark's modeled state store (each cell encoded bytes): the state a
    # micro-batch reads and writes, in cells and bytes, is the same with 100 or 10,000 keys held.
    # The same helper shows the design before growing with the keys held.
    from tools.dedup_state_model import DESIGNS, measure

    now = {r["keys_held"]: r for r in measure(DESIGNS["PerKeyState (now)"], [100, 10_000],
                                              batches=3, docs=20)}
    for figure in ("state_reads", "bytes_decoded", "bytes_encoded"):
        assert now[100][figure] == now[10_000][figure], (figure, now)
    before = {r["keys_held"]: r for r in measure(DESIGNS["PerShardDictDedup (before)"],
                                                 [100, 10_000], batches=3, docs=20)}
    assert before[10_000]["bytes_decoded"] > 50 * before[100]["bytes_decoded"], before


@pytest.mark.parametrize("horizon_s, expected", [
    (60, [("a", "copy0", 10), ("b", "b", 10), ("a", "again", 220)]),
    (300, [("a", "copy0", 10), ("b", "b", 10)]),
])
def test_the_local_runners_per_shard_layout_keeps_the_same_rules(horizon_s, expected):
    # The layout the local runner gets (state_layout_for): redeliveries in later firings dropped,
    # copies in one firing counted, a key forgotten once the watermark passes its horizon.
    run_dedup(stream([(doc("a", "copy0"), 0), (doc("a", "copy"), 1), (doc("b", "b"), 5)], 12,
                     [(doc("a", "copy1"), 13)], 200, [(doc("a", "again"), 210)]),
              expected=expected, expected_duplicates=2 + (horizon_s == 300),
              state="per_shard", horizon_s=horizon_s)


def test_the_layout_follows_the_runner():
    assert state_layout_for(beam.Pipeline(runner="BundleBasedDirectRunner").runner) == "per_shard"
    assert state_layout_for(beam.Pipeline(runner="DirectRunner").runner) == "per_shard"
    assert state_layout_for(beam.Pipeline(runner="FnApiRunner").runner) == "per_key"
    with pytest.raises(ValueError, match="state"):
        DropDuplicatesStreaming(state="per_window")

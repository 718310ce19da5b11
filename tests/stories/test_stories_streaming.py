"""Same-story copies in streaming (transforms/stories.py ``MarkStoriesStreaming``): a copy in a
later micro-batch, in another shard or in the same micro-batch is marked with its original's
story; two micro-batches at once never make two articles copies of each other; a story is
forgotten after ``near_duplicates.horizon_s`` of event time; ``action: skip`` counts the copies
in the micro-batch's ledger.

Both state layouts: per band key (Dataflow's, on the FnApiRunner and on the local runner with
TestStream) and the local runner's one state. No engine: the step runs before the embedding.
"""
from __future__ import annotations

import datetime as dt
import random

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.testing.util import assert_that
from apache_beam.transforms.window import TimestampedValue

from tools.near_copies import copy_of
from transforms.settings import NearDuplicateSettings
from transforms.state_coders import HeldStoriesCoder, StateSchemaError
from transforms.stories import MarkStoriesStreaming
from transforms.types import LedgerRecord, MicroBatch, NewsEvent, PreparedDoc

_UTC = dt.timezone.utc
BASE = [
    "The central bank raised its main interest rate by a quarter of a point on Thursday, the "
    "third rise this year, saying that inflation in services had proved stickier than it had "
    "expected. Markets had priced in the move. The governor said further rises could not be "
    "ruled out if wage growth stayed above four percent. Sterling rose against the dollar "
    "after the announcement, and the yield on two-year government bonds reached its highest "
    "level since the spring. Mortgage lenders are expected to pass on the rise within days.",
    "A record crowd watched the home side come from two goals down to win the cup final in "
    "extra time. The winning goal came from a substitute who had been on the pitch for only "
    "four minutes. The visiting manager complained about the referee's decision to allow the "
    "equaliser, saying the ball had crossed the line before the cross. Both clubs will play "
    "in Europe next season. Police said the celebrations in the city centre passed off "
    "peacefully, with only a handful of arrests for minor offences late in the evening.",
    "The software company said it would cut nine hundred jobs, about six percent of its staff, "
    "as it shifts spending towards its cloud business. The cuts will fall mostly on its sales "
    "teams in Europe and North America. Shares rose five percent in early trading. Analysts "
    "said the move showed the firm was under pressure to protect its margins after two "
    "quarters of slowing growth. Unions said they had not been consulted and would seek "
    "talks with management about redundancy terms and retraining for affected workers.",
]


def doc(id_: str, text: str, minute: int) -> PreparedDoc:
    published = dt.datetime(2026, 12, 1, 9, minute, tzinfo=_UTC)
    return PreparedDoc(event=NewsEvent(id=id_, body=text, published_at=published), text=text,
                       text_sha256=id_, token_ids=(101, 102), truncated=False)


def copy(text: str, seed: int) -> str:
    return copy_of(text, "light", random.Random(seed))[0]


def mb(start_s: int, shard: int, docs) -> MicroBatch:
    return MicroBatch(window_start_us=start_s * 10**6, window_end_us=(start_s + 60) * 10**6,
                      pane=0, shard=shard, shards=4, docs=tuple(docs), messages_in=len(docs))


def marks_of(batches) -> dict:
    return {d.id: (d.story_id, d.near_duplicate_of) for b in batches for d in b.docs}


def run_batches(batches, settings: NearDuplicateSettings, state: str, check) -> None:
    """Each micro-batch at the end of its window; ``check(marks by id, near_duplicates summed,
    micro-batches out)`` runs on what comes out (per_key: on the FnApiRunner, Dataflow's API)."""
    runner = "FnApiRunner" if state == "per_key" else "BundleBasedDirectRunner"
    with TestPipeline(runner=runner, options=PipelineOptions(streaming=state != "per_key")) as p:
        out = (p | beam.Create(batches)
               | beam.Map(lambda b: TimestampedValue(b, b.window_end_us / 1e6 - 1e-6))
               | MarkStoriesStreaming(settings, state=state))
        assert_that(out, lambda out: check(
            marks_of(out), sum(b.near_duplicates for b in out), len(out)))


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_copies_in_later_micro_batches_other_shards_and_the_same_one(state):
    batches = [mb(0, 0, [doc("a", BASE[0], 0), doc("b", BASE[1], 1)]),
               mb(60, 1, [doc("a-copy", copy(BASE[0], 1), 2),
                          doc("c", BASE[2], 3), doc("c-copy", copy(BASE[2], 2), 4)]),
               mb(120, 2, [doc("a-copy-2", copy(BASE[0], 3), 5)])]

    def check(marks, skipped, n):
        assert marks["a"] == ("a", None) and marks["b"] == ("b", None)
        assert marks["c"] == ("c", None)
        assert marks["a-copy"] == ("a", "a")
        assert marks["c-copy"] == ("c", "c")  # within one micro-batch
        assert marks["a-copy-2"][0] == "a" and marks["a-copy-2"][1] in {"a", "a-copy"}
        assert n == 3 and skipped == 0

    run_batches(batches, NearDuplicateSettings(), state, check)


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_two_micro_batches_at_once_never_make_two_articles_copies_of_each_other(state):
    # The same window, two shards, the copy's micro-batch first: the earlier published is never
    # marked a copy of the later one, whichever micro-batch reaches a band key first.
    batches = [mb(0, 1, [doc("late", copy(BASE[1], 4), 30)]),
               mb(0, 0, [doc("early", BASE[1], 10)])]

    def check(marks, skipped, n):
        # "late" reached a band key before "early" is its own story there (an article published
        # earlier but seen later is missed, never made a copy of a later one).
        assert marks["early"] == ("early", None)
        assert marks["late"] in {("early", "early"), ("late", None)}

    run_batches(batches, NearDuplicateSettings(), state, check)


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_skip_counts_the_close_copies_in_the_micro_batch(state):
    exact = "(Reuters) - " + BASE[2]  # a verbatim reprint
    # A near-verbatim reprint with a number the original does not have: a copy, not skipped
    numbered = BASE[2].replace("six percent", "6 percent")
    settings = NearDuplicateSettings(action="skip", skip_threshold=0.7)
    batches = [mb(0, 0, [doc("c", BASE[2], 0)]),
               mb(60, 1, [doc("c-reprint", exact, 1), doc("c-rewrite", copy(BASE[2], 5), 2),
                          doc("a", BASE[0], 3), doc("c-numbered", numbered, 4)])]

    def check(marks, skipped, n):
        assert set(marks) == {"c", "c-rewrite", "a", "c-numbered"}
        assert skipped == 1 and marks["c-rewrite"] == ("c", "c")
        assert marks["c-numbered"] == ("c", "c")

    run_batches(batches, settings, state, check)


def test_a_skipped_copy_balances_the_ledger_record():
    record = LedgerRecord(run_id="r", window_start="2026-12-01T09:00:00Z",
                          window_end="2026-12-01T09:01:00Z", pane=0, shard=0, shards=1,
                          messages_in=3, rows_written=1, dead_lettered=0,
                          dead_lettered_by_reason={}, duplicates=1, late_reassigned=0,
                          vectors_file=None, dead_letter_file=None, written_at="x",
                          near_duplicates=1)
    assert record.balances()
    assert not LedgerRecord.from_json(record.to_json().replace(
        '"near_duplicates": 1', '"near_duplicates": 0')).balances()


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
@pytest.mark.parametrize("horizon_s, marked", [(120, False), (3600, True)])
def test_a_story_is_forgotten_after_the_horizon(state, horizon_s, marked):
    settings = NearDuplicateSettings(horizon_s=horizon_s)
    first = mb(0, 0, [doc("a", BASE[0], 0)])
    later = mb(600, 1, [doc("a-copy", copy(BASE[0], 6), 11)])
    stream = (TestStream()
              .add_elements([TimestampedValue(first, 59)])
              .advance_watermark_to(400)
              .add_elements([TimestampedValue(later, 659)])
              .advance_watermark_to_infinity())
    want = ("a", "a") if marked else ("a-copy", None)

    def check(out):
        assert marks_of(out)["a-copy"] == want

    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    out = p | stream | MarkStoriesStreaming(settings, state=state)
    assert_that(out, check)
    p.run().wait_until_finish()


def test_the_held_stories_coder_reads_its_version_1_bytes():
    # The layout of version 1, written out by hand: a later release must still read these bytes.
    held = [("evt-1", "evt-0", [1_796_000_000_000_000, 1_795_999_000_000_000],
             1_796_003_600_000_000, b"\x01\x02\x03\x04"),
            ("ключ", "ключ", None, 5, b"")]
    head = ('[["evt-1","evt-0",[1796000000000000,1795999000000000],1796003600000000,4],'
            '["ключ","ключ",null,5,0]]').encode()
    version_1 = b"H\x01" + len(head).to_bytes(4, "little") + head + b"\x01\x02\x03\x04"
    coder = HeldStoriesCoder()
    assert coder.encode(held) == version_1  # entries without a version or facts: as version 1
    # Read as version 2's entries, their version and facts unknown (None)
    assert coder.decode(version_1) == [(*entry, None, None) for entry in held]
    # Another shape (a rank of one number, a negative length) is refused, not read half.
    for odd in ('[["a","a",5,5,0]]', '[["a","a",null,5,-1]]', '[["a","a",null,5]]'):
        value = b"H\x01" + len(odd).to_bytes(4, "little") + odd.encode()
        with pytest.raises(StateSchemaError):
            coder.decode(value)


def test_the_held_stories_coder_reads_its_version_2_bytes():
    # Version 2 adds each entry's version (a short text hash) and facts, after its signature.
    held = [("evt-1", "evt-0", [1_796_000_000_000_000, 1_795_999_000_000_000],
             1_796_003_600_000_000, b"\x01\x02", "ab12", b"\x05\x00\x00\x09"),
            ("k", "k", None, 5, b"", None, None)]
    head = ('[["evt-1","evt-0",[1796000000000000,1795999000000000],1796003600000000,2,"ab12",4],'
            '["k","k",null,5,0,null,null]]').encode()
    version_2 = (b"H\x02" + len(head).to_bytes(4, "little") + head
                 + b"\x01\x02" + b"\x05\x00\x00\x09")
    coder = HeldStoriesCoder()
    assert coder.encode(held) == version_2
    assert coder.decode(version_2) == held
    for odd in ('[["a","a",null,5,0,7,null]]', '[["a","a",null,5,0,null,-1]]',
                '[["a","a",null,5,0,null]]'):
        value = b"H\x02" + len(odd).to_bytes(4, "little") + odd.encode()
        with pytest.raises(StateSchemaError):
            coder.decode(value)


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_a_backdated_reprint_does_not_become_the_original_in_streaming(state):
    # Streaming ranks by the Pub/Sub publish time, which a publisher cannot backdate: a reprint
    # claiming 1971, published to the topic an hour after the wire original, is its copy.
    from transforms.types import Lineage

    def sent(id_, text, published, minutes_later):
        d = doc(id_, text, 0)
        lineage = Lineage(message_id=id_, publish_time=dt.datetime(2026, 12, 1, 9, minutes_later,
                                                                   tzinfo=_UTC))
        event = d.event.model_copy(update={"published_at": published, "lineage": lineage})
        return PreparedDoc(event=event, text=d.text, text_sha256=id_, token_ids=(101, 102),
                           truncated=False)

    batches = [mb(0, 0, [sent("wire", BASE[1], dt.datetime(2026, 12, 1, 9, tzinfo=_UTC), 0)]),
               mb(60, 1, [sent("reprint", BASE[1] + " (reprinted)",
                               dt.datetime(1971, 1, 1, tzinfo=_UTC), 59)])]

    def check(marks, skipped, n):
        assert marks["wire"] == ("wire", None)
        assert marks["reprint"] == ("wire", "wire")

    run_batches(batches, NearDuplicateSettings(), state, check)

"""Group micro-batches (streaming): windowed documents and dead letters -> one ``MicroBatch`` per
event-time window, firing (pane) and shard.

This grouping is the streaming micro-batch: the windows' trigger (``FixedEventTimeWindows``) fires
it ``max_wait_s`` after a pane's first element, when the window closes, and once per late element,
so batches fill up under load and wait at most ``max_wait_s`` when traffic is light. Every message
that reaches it is in exactly one micro-batch, as a document or a dead letter, which is what makes
each micro-batch's ledger balance on its own.

It is also the only step that checks lateness: its output carries the window and pane as data, in
the global window, so nothing downstream (dedup, embedding, writing) can drop what it accepted.
Documents are sharded by their dedup key (``dedup.shard_of``), so all copies of a key meet in one
shard's dedup state; dead letters by their message (or event) id.

The grouping key is the shard AND the window's start, though a grouping is per window anyway: the
local runners keep every window's trigger state for as long as its key lives (Beam Python's trigger
driver never drops it after the allowed lateness) and copy a key's whole state at each of its
bundles, so with the shard alone as key, each micro-batch cost more than the one before
(``python -m benchmarks.uptime``). On Dataflow the two keys group the same.
"""
from __future__ import annotations

import apache_beam as beam
from apache_beam.transforms import window
from apache_beam.utils.timestamp import Timestamp

from transforms.dedup import DedupKey, dedup_key_function, shard_of
from transforms.types import DeadLetter, MicroBatch, PreparedDoc
from transforms.windowing import windowed_by_publish_time


def _letter_shard_by(letter: DeadLetter) -> str:
    return letter.message_id or letter.event_id or letter.payload


class _ToMicroBatchFn(beam.DoFn):
    def __init__(self, shards: int, allowed_lateness_s: float):
        self._shards, self._lateness = shards, allowed_lateness_s

    def _reassigned(self, doc: PreparedDoc) -> bool:
        lineage = doc.event.lineage
        if lineage is None or lineage.publish_time is None:
            return False
        return windowed_by_publish_time(doc.event, Timestamp.from_utc_datetime(
            lineage.publish_time), self._lateness)

    def process(self, shard_items, win=beam.DoFn.WindowParam, pane=beam.DoFn.PaneInfoParam):
        (shard, _), items = shard_items
        items = list(items)
        docs = tuple(i for i in items if isinstance(i, PreparedDoc))
        letters = tuple(i for i in items if isinstance(i, DeadLetter))
        yield shard, MicroBatch(
            window_start_us=win.start.micros, window_end_us=win.end.micros, pane=pane.index,
            shard=shard, shards=self._shards, docs=docs, dead_letters=letters,
            messages_in=len(items), late_reassigned=sum(map(self._reassigned, docs)))


class GroupMicroBatches(beam.PTransform):
    """(windowed PreparedDoc, windowed DeadLetter) -> (shard, MicroBatch) in the global window, with
    the timestamp of its window's end."""

    def __init__(self, key: DedupKey = "id", shards: int = 4, allowed_lateness_s: float = 600):
        super().__init__()
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards!r}")
        self._key_fn, self._shards = dedup_key_function(key), shards
        self._lateness = allowed_lateness_s

    def expand(self, docs_and_letters):
        docs, letters = docs_and_letters
        key_fn, shards = self._key_fn, self._shards
        keyed_docs = docs | "ShardDocs" >> beam.Map(
            lambda d, w=beam.DoFn.WindowParam: ((shard_of(key_fn(d), shards), w.start.micros), d))
        keyed_letters = letters | "ShardDeadLetters" >> beam.Map(
            lambda letter, w=beam.DoFn.WindowParam: (
                (shard_of(_letter_shard_by(letter), shards), w.start.micros), letter))
        return ((keyed_docs, keyed_letters)
                | "Flatten" >> beam.Flatten()
                | "GroupPerWindowAndShard" >> beam.GroupByKey()
                | "ToMicroBatch" >> beam.ParDo(_ToMicroBatchFn(shards, self._lateness)
                                              ).with_output_types(tuple[int, MicroBatch])
                | "GlobalWindow" >> beam.WindowInto(window.GlobalWindows()))

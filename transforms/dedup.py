"""Drop duplicates: keep one PreparedDoc per key, and count the rest.

The key is the event id (default) or the text hash.
- Batch (``DropDuplicates``): one per key within a run. Which copy survives is deterministic: the
  one published last (an update supersedes the original), then the greatest text hash.
- Streaming (``DropDuplicatesStreaming``): one per key within a horizon of event time. The FIRST
  copy seen survives: a stream cannot hold a document back waiting for a later copy.
"""
from __future__ import annotations

import datetime as dt
import zlib

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms import window
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Duration, Timestamp

from transforms.metrics import DUPLICATES
from transforms.schema import PreparedDoc

KEYS = {
    "id": lambda doc: doc.event.id,
    "text_sha256": lambda doc: doc.text_sha256,
}
_EPOCH = dt.datetime.min.replace(tzinfo=dt.timezone.utc)


def survivor_rank(doc: PreparedDoc):
    return (doc.event.published_at or _EPOCH, doc.text_sha256, doc.event.id)


def _keep_one(keyed):
    _, docs = keyed
    docs = list(docs)
    if len(docs) > 1:
        DUPLICATES.inc(len(docs) - 1)
    return max(docs, key=survivor_rank)


class DropDuplicates(beam.PTransform):
    """PreparedDoc -> PreparedDoc, one per key. Batch (bounded) input; streaming uses state instead."""

    def __init__(self, key: str = "id"):
        super().__init__()
        if key not in KEYS:
            raise ValueError(f"dedup key must be one of {sorted(KEYS)}, got {key!r}")
        self._key_fn = KEYS[key]

    def expand(self, docs):
        return (docs
                | "KeyByDedupKey" >> beam.WithKeys(self._key_fn)
                | "GroupByDedupKey" >> beam.GroupByKey()
                | "KeepOne" >> beam.Map(_keep_one))


class _KeepFirstPerShard(beam.DoFn):
    """Per shard, in the global window: the dedup keys kept within the horizon, each with its expiry
    (event time). A key not seen before is kept; a key seen before is dropped and counted. A
    watermark timer prunes expired keys, so the state holds one horizon of keys, not the job's life.
    """

    SEEN = ReadModifyWriteStateSpec("seen", PickleCoder())  # {dedup key: expiry in micros}
    PRUNE = TimerSpec("prune", TimeDomain.WATERMARK)

    def __init__(self, key_fn, horizon_s: float):
        super().__init__()
        self._key_fn, self._horizon = key_fn, Duration(seconds=horizon_s)

    def process(self, shard_docs, timestamp=beam.DoFn.TimestampParam,
                seen_state=beam.DoFn.StateParam(SEEN), prune=beam.DoFn.TimerParam(PRUNE)):
        _, docs = shard_docs
        seen = seen_state.read() or {}
        expiry = (timestamp + self._horizon).micros
        # Within one firing, the batch rule picks the survivor (the last published); across
        # firings, the copy kept first stays.
        for doc in sorted(docs, key=survivor_rank, reverse=True):
            key = self._key_fn(doc)
            if key in seen:
                DUPLICATES.inc()
                continue
            seen[key] = expiry
            yield doc
        if seen:
            seen_state.write(seen)
            prune.set(Timestamp(micros=min(seen.values())))

    @on_timer(PRUNE)
    def prune(self, fired=beam.DoFn.TimestampParam, seen_state=beam.DoFn.StateParam(SEEN),
              prune=beam.DoFn.TimerParam(PRUNE)):
        seen = {k: e for k, e in (seen_state.read() or {}).items() if e > fired.micros}
        if seen:
            seen_state.write(seen)
            prune.set(Timestamp(micros=min(seen.values())))
        else:
            seen_state.clear()


class DropDuplicatesStreaming(beam.PTransform):
    """Windowed PreparedDoc -> PreparedDoc for unbounded input (Pub/Sub redeliveries, republished
    articles): a doc whose key was already kept within ``horizon_s`` seconds of event time is
    dropped and counted in ``duplicates``.

    Docs are grouped per shard of the dedup key in the caller's windows, so the input's trigger
    decides when a group fires (FixedEventTimeWindows: every max_wait_s, and at the window's end):
    this grouping is also the streaming micro-batch. The state lives per shard in the global window
    (a fixed window would forget keys at its edges), so the output is in the global window with
    the group's timestamp (its window's end): the caller windows again afterwards. Per shard and
    firing, one stateful call handles the whole group, which keeps the bundle count low.
    """

    def __init__(self, key: str = "id", horizon_s: float = 3600, shards: int = 4):
        super().__init__()
        if key not in KEYS:
            raise ValueError(f"dedup key must be one of {sorted(KEYS)}, got {key!r}")
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s!r}")
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards!r}")
        self._key_fn, self._horizon_s, self._shards = KEYS[key], horizon_s, shards

    def expand(self, docs):
        key_fn, shards = self._key_fn, self._shards
        return (docs
                | "ShardByDedupKey" >> beam.Map(
                    lambda d: (zlib.crc32(key_fn(d).encode("utf-8")) % shards, d)
                ).with_output_types(tuple[int, PreparedDoc])
                | "GroupPerShard" >> beam.GroupByKey()
                | "GlobalWindow" >> beam.WindowInto(window.GlobalWindows())
                | "KeepFirstWithinHorizon" >> beam.ParDo(
                    _KeepFirstPerShard(key_fn, self._horizon_s)))

"""Drop duplicates: keep one document per key, and count the rest.

The key is the event id (default) or the text hash.
- Batch (``DropDuplicates``): one vector row per key within a run, after embedding (a grouping is a
  barrier in a batch job: before the embedding it would keep the GPU idle while every article is
  prepared; after it, preparing and embedding run at once, and a duplicate costs its embedding).
  Which copy survives is deterministic: the one published last (an update supersedes the
  original), then the greatest text hash. The count of dropped copies is an output of its own, for
  the run's ledger.
- Streaming (``DropDuplicatesStreaming``): one per key within a horizon of event time, applied to
  each ``MicroBatch``. The FIRST copy seen survives: a stream cannot hold a document back waiting
  for a later copy.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import zlib
from typing import Callable, Literal, get_args

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.coders import PickleCoder
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Duration, Timestamp

from transforms.metrics import DUPLICATES

DedupKey = Literal["id", "text_sha256"]  # the config's ``dedup.key``
# Documents (PreparedDoc, streaming) and vector rows (EmbeddedDoc, batch) both have these.
DEDUP_KEY_FUNCTIONS: dict[str, Callable] = {
    "id": lambda doc: doc.id,
    "text_sha256": lambda doc: doc.text_sha256,
}
assert set(DEDUP_KEY_FUNCTIONS) == set(get_args(DedupKey))


def dedup_key_function(key: DedupKey) -> Callable:
    """The function that gives a document's dedup key. The config validates ``dedup.key``; this
    is the one check for callers that build the transforms without a config (tests, tools)."""
    if key not in DEDUP_KEY_FUNCTIONS:
        raise ValueError(f"dedup key must be one of {sorted(DEDUP_KEY_FUNCTIONS)}, got {key!r}")
    return DEDUP_KEY_FUNCTIONS[key]
DUPLICATES_TAG = "duplicates"
_EARLIEST = dt.datetime.min.replace(tzinfo=dt.timezone.utc)  # ranks a doc without published_at


def shard_of(key: str, shards: int) -> int:
    """Stable across processes (Python's str hash is not), so a retry shards the same, and every
    copy of a dedup key meets in one shard."""
    return zlib.crc32(key.encode("utf-8")) % shards


def survivor_rank(doc):
    return (doc.published_at or _EARLIEST, doc.text_sha256, doc.id)


def _keep_one(keyed):
    _, docs = keyed
    docs = list(docs)
    if len(docs) > 1:
        DUPLICATES.inc(len(docs) - 1)
        yield pvalue.TaggedOutput(DUPLICATES_TAG, len(docs) - 1)
    yield max(docs, key=survivor_rank)


class DropDuplicates(beam.PTransform):
    """EmbeddedDoc -> EmbeddedDoc, one per key (main output ``docs``), and the number of copies
    dropped per key (``duplicates`` output). Batch (bounded) input."""

    def __init__(self, key: DedupKey = "id"):
        super().__init__()
        self._key_fn = dedup_key_function(key)

    def expand(self, docs):
        return (docs
                | "KeyByDedupKey" >> beam.WithKeys(self._key_fn)
                | "GroupByDedupKey" >> beam.GroupByKey()
                | "KeepOne" >> beam.FlatMap(_keep_one).with_outputs(DUPLICATES_TAG, main="docs"))


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

    def process(self, shard_batch, timestamp=beam.DoFn.TimestampParam,
                seen_state=beam.DoFn.StateParam(SEEN), prune=beam.DoFn.TimerParam(PRUNE)):
        _, batch = shard_batch
        seen = seen_state.read() or {}
        expiry = (timestamp + self._horizon).micros
        kept = []
        # Within one firing, the batch rule picks the survivor (the last published); across
        # firings, the copy kept first stays.
        for doc in sorted(batch.docs, key=survivor_rank, reverse=True):
            key = self._key_fn(doc)
            if key in seen:
                continue
            seen[key] = expiry
            kept.append(doc)
        dropped = len(batch.docs) - len(kept)
        DUPLICATES.inc(dropped)
        if seen:
            seen_state.write(seen)
            prune.set(Timestamp(micros=min(seen.values())))
        yield dataclasses.replace(batch, docs=tuple(kept), duplicates=batch.duplicates + dropped)

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
    """(shard, MicroBatch) -> MicroBatch without the documents whose key was already kept within
    ``horizon_s`` seconds of event time (Pub/Sub redeliveries, republished articles); each drop is
    counted in the micro-batch's ``duplicates`` (its ledger) and in the ``duplicates`` metric.

    The state lives per shard in the global window (a fixed window would forget keys at its edges),
    which is where ``GroupMicroBatches`` puts its output; every copy of a key is in the same shard
    (``shard_of``). One stateful call per micro-batch keeps the bundle count low.
    """

    def __init__(self, key: DedupKey = "id", horizon_s: float = 3600):
        super().__init__()
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s!r}")
        self._key_fn, self._horizon_s = dedup_key_function(key), horizon_s

    def expand(self, keyed_batches):
        return keyed_batches | "KeepFirstWithinHorizon" >> beam.ParDo(
            _KeepFirstPerShard(self._key_fn, self._horizon_s))

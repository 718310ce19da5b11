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
from apache_beam.coders import BooleanCoder, StrUtf8Coder, TupleCoder, VarIntCoder
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import (
    BagStateSpec,
    ReadModifyWriteStateSpec,
    TimerSpec,
    on_timer,
)
from apache_beam.utils.timestamp import Duration, Timestamp

from transforms.metrics import DUPLICATES
from transforms.settings import DedupKey
from transforms.state import RegroupFn, by_batch, ms_ceiling
from transforms.state_coders import SeenKeysCoder
from transforms.types import BatchId, MicroBatch

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
SURVIVORS_TAG = "survivors"  # (dropped id, kept id) where they differ
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
    kept = max(docs, key=survivor_rank)
    if len(docs) > 1:
        DUPLICATES.inc(len(docs) - 1)
        yield pvalue.TaggedOutput(DUPLICATES_TAG, len(docs) - 1)
        for doc in docs:  # the same text under another id (dedup.key text_sha256)
            if doc.id != kept.id:
                yield pvalue.TaggedOutput(SURVIVORS_TAG, (doc.id, kept.id))
    yield kept


class DropDuplicates(beam.PTransform):
    """EmbeddedDoc -> EmbeddedDoc, one per key (main output ``docs``), the number of copies
    dropped per key (``duplicates`` output), and (dropped id, kept id) where a copy under another
    id was dropped (``survivors``: ``dedup.key: text_sha256``). Batch (bounded) input."""

    def __init__(self, key: DedupKey = "id"):
        super().__init__()
        self._key_fn = dedup_key_function(key)

    def expand(self, docs):
        return (docs
                | "KeyByDedupKey" >> beam.WithKeys(self._key_fn)
                | "GroupByDedupKey" >> beam.GroupByKey()
                | "KeepOne" >> beam.FlatMap(_keep_one).with_outputs(DUPLICATES_TAG, SURVIVORS_TAG,
                                                                     main="docs"))


StateLayout = Literal["per_key", "per_shard"]
# Runners that run newsvec's streaming graph locally, in this process: BundleBasedDirectRunner
# (DirectRunner picks it for streaming when it does not use Prism).
_LOCAL_STREAMING_RUNNERS = ("BundleBasedDirectRunner", "SwitchingDirectRunner", "DirectRunner")


def state_layout_for(runner) -> StateLayout:
    """``per_key`` (the default: Dataflow, the portable runners) or ``per_shard`` on the local
    streaming runner. BundleBasedDirectRunner keeps an entry per state key it has ever seen, never
    removed, and walks all of them each time it looks for due timers (about 6 us a key, measured:
    0.6 s at 100,000 keys), so with a state key per dedup key a long local run slows down with its
    age. Its runs hold few keys, and one dict per shard costs it little."""
    return "per_shard" if type(runner).__name__ in _LOCAL_STREAMING_RUNNERS else "per_key"


Verdict = tuple[str, bool]  # (dedup key, kept)
_REQUESTS, _HEADERS = "requests", "headers"



class _AskPerKey(beam.DoFn):
    """(shard, MicroBatch) -> the micro-batch with one candidate per dedup key (its ``header``),
    and one verdict request per candidate; a micro-batch without documents goes straight out.

    Within a firing, the batch rule picks the candidate (the last published: ``survivor_rank``);
    the other copies in the micro-batch are counted as duplicates here, in memory."""

    def __init__(self, key_fn):
        super().__init__()
        self._key_fn = key_fn

    def process(self, shard_batch):
        _, batch = shard_batch
        candidates: dict[str, object] = {}
        for doc in sorted(batch.docs, key=survivor_rank, reverse=True):
            candidates.setdefault(self._key_fn(doc), doc)
        in_batch = len(batch.docs) - len(candidates)
        DUPLICATES.inc(in_batch)
        header = dataclasses.replace(batch, docs=tuple(candidates.values()),
                                     duplicates=batch.duplicates + in_batch)
        if not candidates:
            yield header
            return
        bid = batch.batch_id
        yield pvalue.TaggedOutput(_HEADERS, (bid, header))
        for key in candidates:
            yield pvalue.TaggedOutput(_REQUESTS, (key, bid))


class _KeepFirstPerShard(beam.DoFn):
    """Per shard, in the global window: the dedup keys kept within the horizon, each with its expiry
    (event time). A key not seen before is kept; a key seen before is dropped and counted. A
    watermark timer prunes expired keys, so the state holds one horizon of keys, not the job's life.

    The local runner's layout (``state_layout_for``): it reads and writes the shard's whole dict
    per micro-batch, so its cost grows with the keys held (benchmarks/dedup.py).
    """

    SEEN = ReadModifyWriteStateSpec("seen", SeenKeysCoder())  # {dedup key: expiry in micros}
    PRUNE = TimerSpec("prune", TimeDomain.WATERMARK)

    def __init__(self, key_fn, horizon_s: float):
        super().__init__()
        self._key_fn, self._horizon = key_fn, Duration(seconds=horizon_s)

    def process(self, shard_batch, timestamp=beam.DoFn.TimestampParam,
                seen_state=beam.DoFn.StateParam(SEEN), prune=beam.DoFn.TimerParam(PRUNE)):
        _, batch = shard_batch
        seen = seen_state.read() or {}
        expiry = ms_ceiling(timestamp + self._horizon).micros
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


class _KeepFirstPerKey(beam.DoFn):
    """Per dedup key, in the global window: (key, batch id) -> (batch id, (key, kept)).

    A key not held is kept and held until the event time of the micro-batch that kept it plus the
    horizon; a key held is dropped (its expiry is not refreshed). A watermark timer at the expiry
    forgets the key, so the state holds one horizon of keys. Each request reads and writes only its
    own key's state: the cost of a micro-batch does not grow with the number of keys held. The
    timer's watermark hold is at the expiry, in the future, so it does not hold the watermark back.
    """

    EXPIRY = ReadModifyWriteStateSpec("expiry", VarIntCoder())  # micros; absent: not held
    FORGET = TimerSpec("forget", TimeDomain.WATERMARK)

    def __init__(self, horizon_s: float):
        super().__init__()
        self._horizon = Duration(seconds=horizon_s)

    def process(self, request, timestamp=beam.DoFn.TimestampParam,
                expiry=beam.DoFn.StateParam(EXPIRY), forget=beam.DoFn.TimerParam(FORGET)):
        key, bid = request
        held = expiry.read() is not None
        if not held:
            until = ms_ceiling(timestamp + self._horizon)
            expiry.write(until.micros)
            forget.set(until)
        yield bid, (key, not held)

    @on_timer(FORGET)
    def forget(self, expiry=beam.DoFn.StateParam(EXPIRY)):
        expiry.clear()


class _Regroup(RegroupFn):
    """Per batch id: the header (a MicroBatch of candidates) and one verdict per candidate, in any
    order -> the MicroBatch with the kept candidates (in the header's order) and the dropped ones
    added to ``duplicates``, once all are in; then its state is cleared (``RegroupFn``: the
    header awaits a verdict per candidate).
    Every element of a micro-batch carries its timestamp, and the last one to arrive is being
    processed when the micro-batch goes out, so the output is never behind the watermark.
    """

    VERDICTS = BagStateSpec("verdicts", TupleCoder((StrUtf8Coder(), BooleanCoder())))
    process = RegroupFn.processing(VERDICTS)

    def __init__(self, key_fn):
        super().__init__()
        self._key_fn = key_fn

    def awaits(self, header: MicroBatch) -> int:
        return len(header.docs)

    def complete(self, header: MicroBatch, verdicts: list):
        kept_keys = {key for key, kept in verdicts if kept}
        kept = tuple(doc for doc in header.docs if self._key_fn(doc) in kept_keys)
        dropped = len(header.docs) - len(kept)
        DUPLICATES.inc(dropped)
        yield dataclasses.replace(header, docs=kept, duplicates=header.duplicates + dropped)


class DropDuplicatesStreaming(beam.PTransform):
    """(shard, MicroBatch) -> MicroBatch without the documents whose key was already kept within
    ``horizon_s`` seconds of event time (Pub/Sub redeliveries, republished articles); each drop is
    counted in the micro-batch's ``duplicates`` (its ledger) and in the ``duplicates`` metric.

    The state is kept per dedup key (``_KeepFirstPerKey``), in the global window (a fixed window
    would forget keys at its edges), which is where ``GroupMicroBatches`` puts its output: a
    micro-batch costs one small state read per document, whatever the number of keys held. Its
    documents fan out to their keys as small verdict requests, and ``_Regroup`` puts the
    micro-batch together again by its id (window start, pane, shard), so it is embedded and written
    whole and every message stays in its ledger. Its cost on Dataflow: docs/streaming.md.

    ``state="per_shard"`` keeps the layout before it, one ``{key: expiry}`` dict per shard, for the
    local runner (``state_layout_for``); the semantics are the same.
    """

    def __init__(self, key: DedupKey = "id", horizon_s: float = 3600,
                 state: StateLayout = "per_key"):
        super().__init__()
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s!r}")
        if state not in get_args(StateLayout):
            raise ValueError(f"state must be one of {get_args(StateLayout)}, got {state!r}")
        self._key_fn, self._horizon_s, self._state = dedup_key_function(key), horizon_s, state

    def expand(self, keyed_batches):
        if self._state == "per_shard":
            return keyed_batches | "KeepFirstWithinHorizon" >> beam.ParDo(
                _KeepFirstPerShard(self._key_fn, self._horizon_s)).with_output_types(MicroBatch)
        asked = keyed_batches | "AskPerKey" >> beam.ParDo(_AskPerKey(self._key_fn)).with_outputs(
            _REQUESTS, _HEADERS, main="without_docs").with_output_types(
            MicroBatch, requests=tuple[str, BatchId], headers=tuple[BatchId, MicroBatch])
        verdicts = asked[_REQUESTS] | "KeepFirstPerKey" >> beam.ParDo(
            _KeepFirstPerKey(self._horizon_s)).with_output_types(tuple[BatchId, Verdict])
        regrouped = by_batch("HeadersAndVerdicts", asked[_HEADERS], verdicts) | "Regroup" >> (
            beam.ParDo(_Regroup(self._key_fn)).with_output_types(MicroBatch))
        return ((asked.without_docs, regrouped)
                | "AllMicroBatches" >> beam.Flatten().with_output_types(MicroBatch))

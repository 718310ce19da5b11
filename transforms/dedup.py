"""Drop duplicates: keep one PreparedDoc per key, and count the rest.

The key is the event id (default) or the text hash.
- Batch (``DropDuplicates``): one per key within a run. Which copy survives is deterministic: the
  one published last (an update supersedes the original), then the greatest text hash.
- Streaming (``DropDuplicatesStreaming``): one per key within a horizon of event time. The FIRST
  copy seen survives: a stream cannot hold a document back waiting for a later copy.
"""
from __future__ import annotations

import datetime as dt

import apache_beam as beam
from apache_beam.coders import BooleanCoder
from apache_beam.transforms import window
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import ReadModifyWriteStateSpec, TimerSpec, on_timer

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


class _KeepFirstWithinHorizon(beam.DoFn):
    """Per key: emit the first doc, drop the rest until the watermark passes its time + horizon.

    The timer that clears "seen" is what bounds the state: a key costs state for one horizon, not
    for the life of the job. It is set once, from the kept doc, so a stream of redeliveries does
    not keep a key alive forever.
    """

    SEEN = ReadModifyWriteStateSpec("seen", BooleanCoder())
    EXPIRY = TimerSpec("expiry", TimeDomain.WATERMARK)

    def __init__(self, horizon_s: float):
        super().__init__()
        self._horizon_s = horizon_s

    def process(self, keyed, timestamp=beam.DoFn.TimestampParam,
                seen=beam.DoFn.StateParam(SEEN), expiry=beam.DoFn.TimerParam(EXPIRY)):
        _, doc = keyed
        if seen.read():
            DUPLICATES.inc()
            return
        seen.write(True)
        expiry.set(timestamp + self._horizon_s)
        yield doc

    @on_timer(EXPIRY)
    def forget(self, seen=beam.DoFn.StateParam(SEEN)):
        seen.clear()


class DropDuplicatesStreaming(beam.PTransform):
    """PreparedDoc -> PreparedDoc for unbounded input (Pub/Sub redeliveries, republished articles).

    Drops a doc whose key was already kept within ``horizon_s`` seconds of event time, counting it
    in ``duplicates``. Unlike the batch DropDuplicates, the FIRST copy wins, not the last published.

    The state lives in the global window (a fixed window would forget keys at its edges), so the
    output is in the global window: the caller windows afterwards. Elements keep their timestamps.
    """

    def __init__(self, key: str = "id", horizon_s: float = 3600):
        super().__init__()
        if key not in KEYS:
            raise ValueError(f"dedup key must be one of {sorted(KEYS)}, got {key!r}")
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be positive, got {horizon_s!r}")
        self._key_fn = KEYS[key]
        self._horizon_s = horizon_s

    def expand(self, docs):
        key_fn = self._key_fn
        return (docs
                | "GlobalWindow" >> beam.WindowInto(window.GlobalWindows())
                # A Map, not beam.WithKeys: WithKeys infers Tuple[Any, Any] and drops a declared
                # type, and the stateful DoFn needs the str key coder (deterministic) declared.
                | "KeyByDedupKey" >> beam.Map(lambda doc: (key_fn(doc), doc)).with_output_types(
                    tuple[str, PreparedDoc])
                | "KeepFirstWithinHorizon" >> beam.ParDo(_KeepFirstWithinHorizon(self._horizon_s)))

"""Drop duplicates: keep one PreparedDoc per key within a run, and count the rest.

The key is the event id (default) or the text hash. Which copy survives is deterministic: the one
published last (an update supersedes the original), then the greatest text hash.
"""
from __future__ import annotations

import datetime as dt

import apache_beam as beam

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

"""A MODELED state store, and the streaming dedup's designs driven through it: the state one
micro-batch reads and writes against the number of keys held, with no runner (each state cell is
encoded bytes; a read decodes them with the state spec's coder, a write encodes). Used by
benchmarks/dedup.py (the figures) and tests/streaming/test_dedup_streaming.py (the same state
whatever the keys held)."""
from __future__ import annotations

import collections
import datetime as dt
import functools
import gc
import inspect
import statistics
import time
from typing import Any

import apache_beam as beam
from apache_beam import pvalue
from apache_beam.transforms.core import _StateDoFnParam, _TimerDoFnParam
from apache_beam.transforms.userstate import (
    BagStateSpec,
)
from apache_beam.utils.timestamp import Duration, Timestamp

from transforms.dedup import (
    _HEADERS,
    _REQUESTS,
    _AskPerKey,
    _KeepFirstPerKey,
    _KeepFirstPerShard,
    _Regroup,
    dedup_key_function,
)
from transforms.types import MicroBatch, NewsEvent, PreparedDoc

MODEL_NOTE = ("MODELED state store: each state cell is encoded bytes; a read decodes them with the "
              "state spec's coder, a write encodes (the least work any runner's state backend "
              "does; no runner, no state round trips)")
HORIZON_S = 3600.0
T0 = Timestamp(seconds=1_796_000_000)  # 2026-12-01T...: micro-batch i is at T0 + i s


# The design before, and the local runner's still (transforms.dedup.state_layout_for).
PerShardDictDedup = _KeepFirstPerShard


class ModeledStateStore:
    """State cells as encoded bytes, per (step, state name) and key; timers as a timestamp per
    (step, timer name) and key. Counts the cells read and the bytes decoded and encoded."""

    def __init__(self):
        self.cells: dict[tuple[str, str], dict[Any, Any]] = collections.defaultdict(dict)
        self.timers: dict[tuple[str, str], dict[Any, int]] = collections.defaultdict(dict)
        self.reads = self.bytes_decoded = self.bytes_encoded = 0

    def call(self, step: str, method, key, element=None, timestamp=None) -> list:
        """Calls a DoFn's process (with ``element``) or timer method for ``key``, binding its
        state, timer and timestamp parameters; returns what it yields."""
        kwargs: dict[str, Any] = {}
        for name, default in _param_defaults(method.__func__):
            if isinstance(default, _StateDoFnParam):
                spec = default.state_spec
                cells = self.cells[(step, spec.name)]
                kind = _Bag if isinstance(spec, BagStateSpec) else _Cell
                kwargs[name] = kind(self, cells, key, spec.coder)
            elif isinstance(default, _TimerDoFnParam):
                kwargs[name] = _Timer(self.timers[(step, default.timer_spec.name)], key)
            elif default is beam.DoFn.TimestampParam:
                kwargs[name] = timestamp
        args = () if element is None else (element,)
        return list(method(*args, **kwargs) or ())


@functools.cache
def _param_defaults(function) -> tuple:
    """(name, default) of a DoFn method's parameters: looked up once, as a runner does."""
    return tuple((name, p.default) for name, p in inspect.signature(function).parameters.items())


class _Cell:
    def __init__(self, store: ModeledStateStore, cells: dict, key, coder):
        self._store, self._cells, self._key, self._coder = store, cells, key, coder

    def read(self):
        encoded = self._cells.get(self._key)
        self._store.reads += 1
        if encoded is None:
            return None
        self._store.bytes_decoded += len(encoded)
        return self._coder.decode(encoded)

    def write(self, value) -> None:
        encoded = self._coder.encode(value)
        self._store.bytes_encoded += len(encoded)
        self._cells[self._key] = encoded

    def clear(self) -> None:
        self._cells.pop(self._key, None)


class _Bag(_Cell):
    def read(self):
        self._store.reads += 1
        encoded = self._cells.get(self._key, [])
        self._store.bytes_decoded += sum(map(len, encoded))
        return [self._coder.decode(e) for e in encoded]

    def add(self, value) -> None:
        encoded = self._coder.encode(value)
        self._store.bytes_encoded += len(encoded)
        self._cells.setdefault(self._key, []).append(encoded)

    def write(self, value) -> None:
        raise TypeError("a bag has no write")


class _Timer:
    def __init__(self, timers: dict, key):
        self._timers, self._key = timers, key

    def set(self, timestamp: Timestamp, dynamic_timer_tag: str = "") -> None:
        self._timers[self._key] = timestamp.micros

    def clear(self, dynamic_timer_tag: str = "") -> None:
        self._timers.pop(self._key, None)


def _key(i: int) -> str:
    return f"{i:032x}"  # every key the same length, so byte counts compare across runs


def _doc(key: str, copy: int) -> PreparedDoc:
    text = f"{key} copy {copy}: " + "a news article of about two thousand characters. " * 40
    return PreparedDoc(
        event=NewsEvent(id=key, body=text,
                        published_at=dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)),
        text=text, text_sha256=f"{key}{copy:032x}", token_ids=tuple(range(101, 357)),
        truncated=True)


def _micro_batch(index: int, docs: int, held: list[str]) -> MicroBatch:
    """90% new keys, 5% redeliveries of held keys, 5% second copies of this batch's new keys."""
    copies = max(1, docs // 20)
    new = [_key(10**12 + index * docs + j) for j in range(docs - 2 * copies)]
    redelivered = [held[(index * 7919 + j * 104729) % len(held)] for j in range(copies)]
    batch_docs = ([_doc(k, 0) for k in new] + [_doc(k, 1) for k in redelivered]
                  + [_doc(k, 1) for k in new[:copies]])
    window_start = T0.micros + index * 1_000_000
    return MicroBatch(window_start_us=window_start, window_end_us=window_start + 1_000_000, pane=0,
                      shard=0, shards=1, docs=tuple(batch_docs), messages_in=len(batch_docs))


class _Design:
    """A dedup design in a steady state of ``held`` keys held, in one modeled store."""

    name = ""

    def __init__(self, held: int, kept_per_batch: int):
        self.store = ModeledStateStore()
        self.held = collections.deque(_key(i) for i in range(held))  # oldest first
        # As if kept by earlier micro-batches: groups of the keys one micro-batch keeps share an
        # expiry, the oldest group first.
        self.expiry = {k: T0.micros + 1 + i // kept_per_batch for i, k in enumerate(self.held)}

    def micro_batch(self, batch: MicroBatch, timestamp: Timestamp) -> MicroBatch:
        raise NotImplementedError

    def expire(self, oldest: list[str], watermark: Timestamp) -> None:
        raise NotImplementedError

    def step(self, batch: MicroBatch) -> MicroBatch:
        """One micro-batch, then the watermark passes the expiry of the oldest keys held (those
        one earlier micro-batch kept: as many as a micro-batch keeps)."""
        timestamp = Timestamp(micros=batch.window_end_us) - Duration(micros=1)
        out = self.micro_batch(batch, timestamp)
        for doc in out.docs:
            self.held.append(doc.event.id)
            self.expiry[doc.event.id] = (timestamp + Duration(seconds=HORIZON_S)).micros
        expiry = self.expiry[self.held[0]]
        oldest = []
        while self.expiry[self.held[0]] == expiry:
            oldest.append(self.held.popleft())
        self.expire(oldest, Timestamp(micros=expiry))
        for k in oldest:
            del self.expiry[k]
        return out


class _PerShardDict(_Design):
    name = "PerShardDictDedup (before)"

    def __init__(self, held: int, kept_per_batch: int):
        super().__init__(held, kept_per_batch)
        self.fn = PerShardDictDedup(dedup_key_function("id"), HORIZON_S)
        seen = {k: self.expiry[k] for k in self.held}
        self.store.cells[("dedup", "seen")][0] = PerShardDictDedup.SEEN.coder.encode(seen)
        self.store.timers[("dedup", "prune")][0] = min(seen.values())

    def micro_batch(self, batch, timestamp):
        (out,) = self.store.call("dedup", self.fn.process, 0, (0, batch), timestamp)
        return out

    def expire(self, oldest, watermark):
        self.store.call("dedup", self.fn.prune, 0, timestamp=watermark)


class _PerKeyState(_Design):
    name = "PerKeyState (now)"

    def __init__(self, held: int, kept_per_batch: int):
        super().__init__(held, kept_per_batch)
        self.ask = _AskPerKey(dedup_key_function("id"))
        self.keep = _KeepFirstPerKey(HORIZON_S)
        self.regroup = _Regroup(dedup_key_function("id"))
        coder = _KeepFirstPerKey.EXPIRY.coder
        cells = self.store.cells[("keep", "expiry")]
        timers = self.store.timers[("keep", "forget")]
        for k in self.held:
            cells[k] = coder.encode(self.expiry[k])
            timers[k] = self.expiry[k]

    def micro_batch(self, batch, timestamp):
        asked = list(self.ask.process((0, batch)))
        by_tag = collections.defaultdict(list)
        for out in asked:
            by_tag[out.tag if isinstance(out, pvalue.TaggedOutput) else None].append(
                out.value if isinstance(out, pvalue.TaggedOutput) else out)
        if by_tag[None]:
            return by_tag[None][0]
        ((bid, header),) = by_tag[_HEADERS]
        verdicts = [verdict for key, request_bid in by_tag[_REQUESTS]
                    for verdict in self.store.call("keep", self.keep.process, key,
                                                   (key, request_bid), timestamp)]
        outs = self.store.call("regroup", self.regroup.process, bid, (bid, header))
        for verdict in verdicts:
            outs += self.store.call("regroup", self.regroup.process, bid, verdict)
        (out,) = outs
        return out

    def expire(self, oldest, watermark):
        timers = self.store.timers[("keep", "forget")]
        for k in oldest:
            assert timers.pop(k) == watermark.micros
            self.store.call("keep", self.keep.forget, k)


DESIGNS = {d.name: d for d in (_PerShardDict, _PerKeyState)}


def measure(design: type[_Design], held: list[int], batches: int, docs: int = 100) -> list[dict]:
    """For each number of keys ``held``: ``batches`` micro-batches (after one warm-up), the models
    taking turns micro-batch by micro-batch so that a noisy machine slows them alike; per
    micro-batch, the medians of wall seconds, state cells read, bytes decoded and encoded.

    The modeled store lives in this process, where a runner's state backend would not: it is
    moved out of the garbage collector's sight (``gc.freeze``) once built, so that collections
    triggered by the DoFns' own objects do not walk a million held keys."""
    copies = max(1, docs // 20)
    models = [design(n, docs - 2 * copies) for n in held]
    gc.collect()
    gc.freeze()
    try:
        per_batch: list[list[tuple]] = [[] for _ in models]
        for i in range(batches + 1):
            for model, n, figures in zip(models, held, per_batch, strict=True):
                batch = _micro_batch(i, docs, [model.held[j] for j in range(min(1000, n))])
                store = model.store
                before = (store.reads, store.bytes_decoded, store.bytes_encoded)
                start = time.perf_counter()
                out = model.step(batch)
                seconds = time.perf_counter() - start
                # A check, not a timing: the new keys are kept, every copy is counted.
                assert (len(out.docs), out.duplicates) == (docs - 2 * copies, 2 * copies), (
                    design.name, len(out.docs), out.duplicates)
                assert len(model.held) == n, "the micro-batches outlived the keys held: hold more"
                if i:
                    figures.append((seconds, store.reads - before[0],
                                    store.bytes_decoded - before[1],
                                    store.bytes_encoded - before[2]))
    finally:
        gc.unfreeze()
    rows = []
    for n, figures in zip(held, per_batch, strict=True):
        seconds, reads, decoded, encoded = map(statistics.median, zip(*figures, strict=True))
        rows.append({"design": design.name, "keys_held": n, "docs": docs, "batches": batches,
                     "ms_per_micro_batch": seconds * 1e3, "state_reads": reads,
                     "bytes_decoded": decoded, "bytes_encoded": encoded})
    del models
    gc.collect()
    return rows

"""A streaming output written by the real streaming writer (``WriteStreaming`` on Beam's local
runner) from micro-batches made here, as GroupMicroBatches and the embedding would make them, but
with FAKE embeddings (random unit vectors: no engine runs). For tests and benchmarks of what reads
or rewrites a streaming output (the ledger, compaction), not of the embedding."""
from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Iterable, Optional

import apache_beam as beam
import numpy as np
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.utils.timestamp import Timestamp

from transforms.sinks import WriteStreaming
from transforms.types import (
    ChunkRow,
    DeadLetter,
    EmbeddedDoc,
    Lineage,
    MicroBatch,
    NewsEvent,
    PreparedDoc,
)

RUN_ID = "20261201T093000Z-5eed0000"
MODEL = "fake@0"
SIGNATURE = '{"fake": true}'  # an embedding signature: the writer then writes keys/
START = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)


def _row(message_id: str, rng: np.random.Generator, dim: int, chunks: int) -> EmbeddedDoc:
    event = NewsEvent(id=f"doc-{message_id}", title=f"title {message_id}", body="body",
                      source="wire", published_at=START,
                      lineage=Lineage(message_id, START + dt.timedelta(seconds=1)))
    vector = rng.standard_normal(dim).astype(np.float32)
    vector /= np.linalg.norm(vector)
    doc = PreparedDoc(event=event, text="body", text_sha256=f"{int(message_id):064x}",
                      token_ids=(101, 7, 102), truncated=False)
    embedded_at = START + dt.timedelta(minutes=1)
    rows = tuple(ChunkRow(id=event.id, chunk_id=f"{event.id}-{i}", chunk_index=i,
                          chunk_count=chunks, token_start=i, token_end=i + 1, char_start=i,
                          char_end=i + 1, chunk_sha256="0" * 64, text_sha256=doc.text_sha256,
                          model=MODEL, embedding=vector, embedded_at=embedded_at)
                 for i in range(chunks))
    return EmbeddedDoc.of(doc, vector, MODEL, embedded_at, chunks=rows)


def micro_batches(messages: int, start: dt.datetime = START, windows: int = 8, shards: int = 2,
                  window_s: int = 60, dim: int = 384, chunks: int = 0, seed: int = 0,
                  first_id: int = 0) -> list[MicroBatch]:
    """``messages`` spread over ``windows`` windows of ``window_s`` from ``start`` and ``shards``
    shards, one micro-batch each (every third window also has a late pane): one message in 20 is
    a dead letter and one in 25 a duplicate."""
    rng = np.random.default_rng(seed)
    slots = [(w, pane, s) for w in range(windows) for pane in ((0, 1) if w % 3 == 2 else (0,))
             for s in range(shards)]
    per_slot: list[list[int]] = [[] for _ in slots]
    for n in range(messages):
        per_slot[n % len(slots)].append(first_id + n)
    out = []
    for (w, pane, shard), ids in zip(slots, per_slot, strict=True):
        if not ids:
            continue
        window_start = Timestamp.from_utc_datetime(start) + w * window_s
        letters = [DeadLetter(step="parse", reason="invalid_json", detail="x", payload="{",
                              payload_bytes=1, message_id=str(i)) for i in ids if i % 20 == 19]
        duplicates = sum(1 for i in ids if i % 25 == 24 and i % 20 != 19)
        rows = [_row(str(i), rng, dim, chunks) for i in ids
                if i % 20 != 19 and not (i % 25 == 24)]
        out.append(MicroBatch(window_start_us=window_start.micros,
                              window_end_us=(window_start + window_s).micros, pane=pane,
                              shard=shard, shards=shards, rows=tuple(rows),
                              dead_letters=tuple(letters), duplicates=duplicates,
                              messages_in=len(ids)))
    return out


def write(output: str, batches: Iterable[MicroBatch], row_group_rows: int = 16384,
          dim: int = 384, signature: Optional[str] = SIGNATURE, run_id: str = RUN_ID) -> None:
    """Write the micro-batches through the real streaming writer, on Beam's local runner."""
    p = TestPipeline(runner="BundleBasedDirectRunner")
    _ = (p | beam.Create(list(batches))
         | WriteStreaming(output, run_id, dim=dim, row_group_rows=row_group_rows,
                             signature=signature))
    p.run().wait_until_finish()


def with_pane(batch: MicroBatch, pane: int) -> MicroBatch:
    return dataclasses.replace(batch, pane=pane)

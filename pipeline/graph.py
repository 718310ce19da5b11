"""The pipeline graphs, box by box as in README.md's diagram. Each box is a PTransform in transforms/.

Batch:      files -> ReadJsonLines -> Parse -> PrepareText -> DropDuplicates -> Embed -> WriteVectors
Streaming:  Pub/Sub -> Parse -> WindowByEventTime -> PrepareText -> DropDuplicatesStreaming (the
              micro-batch grouping) -> (re)window -> Embed -> WriteWindowedVectors
Both:       every dead letter -> WriteDeadLetters (per window when streaming)
"""
from __future__ import annotations

from typing import Optional

import apache_beam as beam
from apache_beam.ml.inference.base import ModelHandler

from pipeline.config import Config
from transforms.dedup import DropDuplicates, DropDuplicatesStreaming
from transforms.embed import EmbedWithVLLM
from transforms.parse import ParseEvents
from transforms.read import ReadJsonLines
from transforms.sinks import (WriteDeadLetters, WriteVectors, WriteWindowedDeadLetters,
                              WriteWindowedVectors)
from transforms.text import PrepareText
from transforms.windowing import FixedEventTimeWindows, WindowByEventTime


def _parse(payloads, config: Config):
    return payloads | "Parse" >> ParseEvents(
        max_payload_bytes=config.parse.max_payload_bytes,
        max_future_skew_s=config.parse.max_future_skew_s,
        dead_letter_payload_bytes=config.sink.dead_letter_payload_bytes)


def _prepare(events, config: Config):
    return events | "PrepareText" >> PrepareText(
        config.model, max_text_chars=config.text.max_text_chars,
        dead_letter_payload_bytes=config.sink.dead_letter_payload_bytes)


def _embed(docs, config: Config, handler: Optional[ModelHandler]):
    return docs | "Embed" >> EmbedWithVLLM(
        config.model, dead_letter_payload_bytes=config.sink.dead_letter_payload_bytes,
        handler=handler)


def embed_and_write(payloads, config: Config, run_id: str,
                    handler: Optional[ModelHandler] = None) -> dict:
    """Batch: raw payloads (bytes) -> Parquet vectors and JSON Lines dead letters."""
    parsed = _parse(payloads, config)
    prepared = _prepare(parsed.events, config)
    unique = prepared.docs | "DropDuplicates" >> DropDuplicates(config.dedup.key)
    embedded = _embed(unique, config, handler)
    vectors = embedded.embedded | "WriteVectors" >> WriteVectors(
        config.output, run_id, config.model.dim, config.sink.row_group_rows)
    dead_letters = ((parsed.dead_letter, prepared.dead_letter, embedded.dead_letter)
                    | "CollectDeadLetters" >> beam.Flatten()
                    | "WriteDeadLetters" >> WriteDeadLetters(config.output, run_id))
    return {"vectors": vectors, "dead_letters": dead_letters}


def build_batch(pipeline: beam.Pipeline, config: Config, run_id: str,
                handler: Optional[ModelHandler] = None) -> dict:
    """Batch: JSON Lines files (optionally gzip) matched by config.input."""
    if not config.input:
        raise ValueError("batch mode needs an input glob: set input in the config or pass --input")
    payloads = pipeline | "ReadJsonLines" >> ReadJsonLines(config.input,
                                                           config.parse.max_payload_bytes)
    return embed_and_write(payloads, config, run_id, handler)


def embed_and_write_streaming(messages, config: Config, run_id: str,
                              handler: Optional[ModelHandler] = None) -> dict:
    """Streaming: Pub/Sub messages -> per-window Parquet vectors and dead letters."""
    s = config.streaming
    windows = dict(window_s=s.window_s, allowed_lateness_s=s.allowed_lateness_s,
                   max_wait_s=s.max_wait_s)
    parsed = _parse(messages, config)
    events = parsed.events | "WindowByEventTime" >> WindowByEventTime(**windows)
    prepared = _prepare(events, config)
    # DropDuplicatesStreaming groups per shard in the windows above, whose trigger fires when the
    # window closes or max_wait has passed: that group is the micro-batch (full under load, at
    # most max_wait old when traffic is light). RunInference's BatchElements then cuts it into
    # token-budget batches.
    unique = (prepared.docs
              | "DropDuplicates" >> DropDuplicatesStreaming(config.dedup.key, s.dedup_horizon_s,
                                                            s.batch_shards)
              | "Rewindow" >> FixedEventTimeWindows(**windows))
    embedded = _embed(unique, config, handler)
    vectors = embedded.embedded | "WriteVectors" >> WriteWindowedVectors(
        config.output, run_id, config.model.dim, config.sink.row_group_rows)
    dead_letters = (
        [parsed.dead_letter | "WindowParseDeadLetters" >> FixedEventTimeWindows(**windows),
         prepared.dead_letter | "WindowPrepareDeadLetters" >> FixedEventTimeWindows(**windows),
         embedded.dead_letter | "WindowEmbedDeadLetters" >> FixedEventTimeWindows(**windows)]
        | "CollectDeadLetters" >> beam.Flatten()
        | "WriteDeadLetters" >> WriteWindowedDeadLetters(config.output, run_id))
    return {"vectors": vectors, "dead_letters": dead_letters}


def build_streaming(pipeline: beam.Pipeline, config: Config, run_id: str,
                    handler: Optional[ModelHandler] = None) -> dict:
    """Streaming: a Pub/Sub subscription; message data is the batch input's news event JSON."""
    if not config.streaming.subscription:
        raise ValueError("streaming needs a subscription: set streaming.subscription or pass "
                         "--subscription")
    messages = (pipeline
                | "ReadPubSub" >> beam.io.ReadFromPubSub(
                    subscription=config.streaming.subscription, with_attributes=True)
                | "DropHeartbeats" >> beam.Filter(_not_a_heartbeat))
    return embed_and_write_streaming(messages, config, run_id, handler)


HEARTBEAT_ATTRIBUTE = "newsvec_heartbeat"


def _not_a_heartbeat(message) -> bool:
    """Heartbeats (messages with this attribute) only keep an idle subscription's pulls, and so the
    local runner's watermark, moving; they are not news and are not counted."""
    return HEARTBEAT_ATTRIBUTE not in (message.attributes or {})

"""The pipeline graph, box by box as in README.md's diagram. Each box is a PTransform in transforms/.

    payloads -> Parse -> PrepareText -> DropDuplicates -> Embed -> WriteVectors
                  \\___________\\_________________________\\_____-> WriteDeadLetters
"""
from __future__ import annotations

from typing import Optional

import apache_beam as beam
from apache_beam import coders
from apache_beam.ml.inference.base import ModelHandler

from pipeline.config import Config
from transforms.dedup import DropDuplicates
from transforms.embed import EmbedWithVLLM
from transforms.parse import ParseEvents
from transforms.sinks import WriteDeadLetters, WriteVectors
from transforms.text import PrepareText


def embed_and_write(payloads, config: Config, run_id: str,
                    handler: Optional[ModelHandler] = None) -> dict:
    """Raw payloads (bytes) -> Parquet vectors and JSON Lines dead letters under config.output."""
    dl_bytes = config.sink.dead_letter_payload_bytes
    parsed = payloads | "Parse" >> ParseEvents(
        max_payload_bytes=config.parse.max_payload_bytes,
        max_future_skew_s=config.parse.max_future_skew_s,
        dead_letter_payload_bytes=dl_bytes)
    prepared = parsed.events | "PrepareText" >> PrepareText(
        config.model, max_text_chars=config.text.max_text_chars,
        dead_letter_payload_bytes=dl_bytes)
    unique = prepared.docs | "DropDuplicates" >> DropDuplicates(config.dedup.key)
    embedded = unique | "Embed" >> EmbedWithVLLM(
        config.model, dead_letter_payload_bytes=dl_bytes, handler=handler)
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
    payloads = pipeline | "ReadJsonLines" >> beam.io.ReadFromText(
        config.input, coder=coders.BytesCoder())
    return embed_and_write(payloads, config, run_id, handler)

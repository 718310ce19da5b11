"""The pipeline graphs, box by box as in README.md's diagram. Each box is a PTransform in
transforms/.

Batch:      files -> ReadJsonLines (fans out its lines) -> Parse -> PrepareText
              -> SkipUnchanged (with incremental.previous_outputs: ReadKeys) -> MarkStories
              -> Embed (EmbedSkippingCopies with near_duplicates.action skip) -> DropDuplicates
              (-> MarkRows with action mark) -> WriteVectors, WriteKeys, WriteChunks (chunks mode),
              WriteDeadLetters (into the run's staging folder) -> CommitRun
              -> LoadCommittedRun (with the store on: the published run into the store)
Streaming:  Pub/Sub -> Parse -> WindowByEventTime -> PrepareText -> GroupMicroBatches (with every
              dead letter so far) -> DropDuplicatesStreaming -> MarkStoriesStreaming
              -> EmbedStreaming
              -> WriteStreaming (vectors, keys, dead letters, the store with it on, and a ledger
              record per micro-batch)

Each step is labelled with the name of its class, so the job graph on Dataflow reads like this.
"""
from __future__ import annotations

from typing import Optional

import apache_beam as beam

from pipeline.config import Config, signature_of
from transforms.commit import CommitRun, Tally, tally
from transforms.dedup import (
    SURVIVORS_TAG,
    DropDuplicates,
    DropDuplicatesStreaming,
    state_layout_for,
)
from transforms.embed import Embed, EmbedStreaming
from transforms.engines.base import EngineFactory
from transforms.engines.devices import resolved_dtype
from transforms.engines.model import model_folder, model_label
from transforms.engines.model_files import model_content_hash
from transforms.incremental import (
    SKIPPED_FROM,
    UNCHANGED,
    ReadKeys,
    SkipUnchanged,
)
from transforms.metrics import CountDone
from transforms.microbatch import GroupMicroBatches
from transforms.output.layout import (
    CHUNKS_DIR,
    DEAD_LETTER_DIR,
    KEYS_DIR,
    VECTORS_DIR,
    staging_prefix,
)
from transforms.output.summary import RunSummary
from transforms.parse import ParseEvents
from transforms.read import ReadJsonLines
from transforms.sinks import (
    WriteChunks,
    WriteDeadLetters,
    WriteKeys,
    WriteStreaming,
    WriteVectors,
)
from transforms.stores.base import batch_load_key
from transforms.stores.batch import LoadCommittedRun, run_day
from transforms.stories import (
    COPIES_SKIPPED,
    MARKS,
    PREVIOUS_ORIGINALS,
    EmbedSkippingCopies,
    MarkRows,
    MarkStories,
    MarkStoriesStreaming,
    signature_version,
    similarity_band,
)
from transforms.text import PrepareText
from transforms.types import DEAD_LETTER
from transforms.windowing import WindowByEventTime


def _parse(payloads, config: Config):
    return payloads | "Parse" >> ParseEvents(
        max_payload_bytes=config.parse.max_payload_bytes,
        max_future_skew_s=config.parse.max_future_skew_s,
        dead_letter_payload_bytes=config.sink.dead_letter_payload_bytes)


def prepare_text(config: Config) -> PrepareText:
    """The PrepareText step of a config (``newsvec check-model`` prepares its sample with it)."""
    return PrepareText(
        config.model, chunking=config.chunking, max_text_chars=config.text.max_text_chars,
        dead_letter_payload_bytes=config.sink.dead_letter_payload_bytes,
        unicode_form=config.text.unicode_form,
        max_unknown_token_ratio=config.text.max_unknown_token_ratio,
        max_title_chars=config.text.max_title_chars,
        prepare_budget_s=config.text.prepare_budget_s)


def _prepare(events, config: Config):
    return events | "PrepareText" >> prepare_text(config)


def _embed_settings(config: Config, engine_factory) -> dict:
    return dict(chunking=config.chunking, store_chunk_text=config.sink.store_chunk_text,
                dead_letter_payload_bytes=config.sink.dead_letter_payload_bytes,
                engine_factory=engine_factory)


def summary_base(config: Config, run_id: str) -> RunSummary:
    """What run ``run_id``'s ``_summary.json`` says about its settings, the day it stands for (its
    rows' dt in the store: ``--input_date``, not the launch day) and, with the store on, the key
    the store holds it under once LoadCommittedRun ran (CommitRun adds the counts)."""
    model_path = model_folder(config.model)
    stories = config.near_duplicates
    return RunSummary(
        near_duplicates={**stories.model_dump(), "signature_version": signature_version(stories)},
        input=config.input, output=config.output,
        vectors={"dim": config.model.output_dim, "vector_dtype": config.sink.vector_dtype},
        chunking=config.chunking.model_dump(), text=config.text.model_dump(),
        incremental={**config.incremental.model_dump(),
                     "embedding_signature": signature_of(config)},
        model={**config.model.model_dump(), "resolved_path": model_path,
               "label": model_label(config.model, model_path),
               "resolved_dtype": resolved_dtype(config.model),
               "content_sha256": model_content_hash(model_path) or None},
        day=run_day(config.output, run_id, config.filled_day).isoformat(),
        store=({"kind": config.store.kind, "load_key": batch_load_key(run_id)}
               if config.store.enabled else None))


def embed_and_write(payloads, config: Config, run_id: str,
                    engine_factory: Optional[EngineFactory] = None):
    """Batch: raw payloads (bytes) -> Parquet vectors (and chunks), the key index and JSON Lines
    dead letters, staged, then checked and published by CommitRun, and with the store on loaded
    into it by LoadCommittedRun. Returns the summary (a PCollection of one dict)."""
    parsed = _parse(payloads, config)
    prepared = _prepare(parsed.events, config)
    docs, stories = prepared.docs, config.near_duplicates
    tallies = [tally(payloads, Tally.IN)]
    done = [parsed.dead_letter, prepared.dead_letter]
    skipped_from = key_files = marks = earlier = None
    if config.incremental.previous_outputs:
        docs, unchanged, skipped_from, key_files = _skip_unchanged(docs, config)
        tallies.append(tally(unchanged, Tally.UNCHANGED))
        done.append(unchanged)
    if stories.enabled:  # against each other and the previous outputs' signatures
        marked = docs | "MarkStories" >> MarkStories(stories, key_files)
        marks, earlier = marked[MARKS], marked[PREVIOUS_ORIGINALS]
        docs = marked["docs"]  # signed whole: with action mark, the embedding waits for nothing
    rows, embed_letters, copies = _embed(docs, config, engine_factory, marks, earlier)
    done += [rows, embed_letters]
    if copies is not None:  # action skip: the copies left out, counted
        tallies += _copies_tallies(copies)
        done.append(copies)
    unique = rows | "DropDuplicates" >> DropDuplicates(config.dedup.key)
    vector_rows = unique.docs
    if stories.enabled:  # after the embedding (action mark: no barrier before it)
        vector_rows = vector_rows | "MarkRows" >> MarkRows(marks, unique[SURVIVORS_TAG])
    files, chunk_rows = _write_staged(
        vector_rows, (parsed.dead_letter, prepared.dead_letter, embed_letters), config, run_id)
    # Articles done, for the progress bar and Dataflow's metrics.
    _ = tuple(done) | "CollectDone" >> beam.Flatten() | "CountDone" >> CountDone()
    tallies += _row_tallies(unique.duplicates, vector_rows, chunk_rows)
    return _commit_and_load(payloads.pipeline, config, run_id, files, tallies,
                            skipped_from, key_files)


def _skip_unchanged(docs, config: Config):
    """Incremental: (the documents to embed, the unchanged ones, the previous outputs they were
    skipped for, ``ReadKeys``'s ``KeyFiles``)."""
    key_files = docs.pipeline | "ReadKeys" >> ReadKeys(
        config.incremental.previous_outputs, config.output, config.incremental.may_be_absent)
    label = model_label(config.model, model_folder(config.model))
    skipped = docs | "SkipUnchanged" >> SkipUnchanged(key_files, label, signature_of(config))
    return skipped["docs"], skipped[UNCHANGED], skipped[SKIPPED_FROM], key_files


def _embed(docs, config: Config, engine_factory, marks, earlier):
    """(vector rows, the embedder's dead letters, the copies action skip left out or None)."""
    def embed() -> Embed:
        return Embed(config.model, **_embed_settings(config, engine_factory))

    # No grouping between preparing and embedding: in a batch job it would be a barrier, every
    # article prepared before the first is embedded. Duplicates are dropped from the vector rows.
    stories = config.near_duplicates
    if not (stories.enabled and stories.action == "skip"):
        embedded = docs | "Embed" >> embed()
        return embedded.embedded, embedded.dead_letter, None
    # The copies' marks are needed before the embedding.
    embedded = docs | "EmbedSkippingCopies" >> EmbedSkippingCopies(embed, marks, stories, earlier)
    return embedded["embedded"], embedded[DEAD_LETTER], embedded[COPIES_SKIPPED]


def _copies_tallies(copies) -> list:
    """The copies action skip left out: counted, and by similarity band."""
    return [tally(copies, Tally.NEAR_DUPLICATES),
            copies | "SkippedBySimilarity" >> beam.Map(
                lambda copy: (f"{Tally.NEAR_DUPLICATES}:{similarity_band(copy[1])}", 1))]


def _row_tallies(duplicates, vector_rows, chunk_rows) -> list:
    return [tally(duplicates, Tally.DUPLICATES, lambda n: n),
            tally(vector_rows, Tally.ROWS),
            tally(vector_rows, Tally.TRUNCATED, lambda row: int(row.truncated)),
            tally(chunk_rows, Tally.CHUNKS)]


def _write_staged(vector_rows, dead_letters: tuple, config: Config, run_id: str):
    """The writers, into the run's staging folder: (the written files by folder, for CommitRun,
    the chunk rows)."""
    stories = config.near_duplicates
    minhash_version = signature_version(stories) if stories.enabled else None
    staging = staging_prefix(config.output, run_id)
    rows = config.sink.row_group_rows
    dim, vector_dtype = config.model.output_dim, config.sink.vector_dtype
    files = {VECTORS_DIR: vector_rows | "WriteVectors" >> WriteVectors(
                 staging, run_id, dim, rows, vector_dtype),
             KEYS_DIR: vector_rows | "WriteKeys" >> WriteKeys(
                 staging, run_id, signature_of(config), rows, minhash_version)}
    chunk_rows = vector_rows | "ChunkRows" >> beam.FlatMap(lambda row: row.chunks)
    if config.chunking.mode != "head":
        files[CHUNKS_DIR] = chunk_rows | "WriteChunks" >> WriteChunks(
            staging, run_id, dim, rows, vector_dtype)
    files[DEAD_LETTER_DIR] = (dead_letters
                              | "CollectDeadLetters" >> beam.Flatten()
                              | "WriteDeadLetters" >> WriteDeadLetters(staging, run_id))
    return files, chunk_rows


def _commit_and_load(pipeline, config: Config, run_id: str, files: dict, tallies: list,
                     skipped_from, key_files):
    """CommitRun, after the writes; with the store on, LoadCommittedRun after it."""
    committed = pipeline | "CommitRun" >> CommitRun(
        config.output, run_id, summary_base(config, run_id), files=files, tallies=tallies,
        skipped_from=skipped_from, key_files=key_files, lease_s=config.sink.commit_lease_s)
    if config.store.enabled:
        committed | "LoadCommittedRun" >> LoadCommittedRun(config.output, run_id, config.store)
    return committed


def build_batch(pipeline: beam.Pipeline, config: Config, run_id: str,
                engine_factory: Optional[EngineFactory] = None):
    """Batch: JSON Lines files (optionally gzip) matched by config.input."""
    if not config.input:
        raise ValueError("batch mode needs an input glob: set input in the config or pass --input")
    payloads = pipeline | "ReadJsonLines" >> ReadJsonLines(config.input,
                                                           config.parse.max_payload_bytes)
    return embed_and_write(payloads, config, run_id, engine_factory)


def embed_and_write_streaming(messages, config: Config, run_id: str,
                              engine_factory: Optional[EngineFactory] = None):
    """Streaming: Pub/Sub messages -> per-micro-batch Parquet vectors, dead letters and ledger
    records. Returns the ledger records (a PCollection of ``LedgerRecord``)."""
    s = config.streaming
    parsed = _parse(messages, config)
    by_event_time = WindowByEventTime(window_s=s.window_s, allowed_lateness_s=s.allowed_lateness_s,
                                      max_wait_s=s.max_wait_s)
    events = parsed.events | "WindowByEventTime" >> by_event_time
    parse_letters = parsed.dead_letter | "WindowParseDeadLetters" >> by_event_time.windows
    prepared = _prepare(events, config)
    letters = ((parse_letters, prepared.dead_letter)
               | "CollectDeadLetters" >> beam.Flatten())
    # The only grouping: it fires when the window closes or max_wait_s after a pane's first
    # element (full batches under load, at most max_wait_s old when traffic is light), and after it
    # the window is data, in the global window: nothing downstream can drop a late element.
    batches = ((prepared.docs, letters)
               | "GroupMicroBatches" >> GroupMicroBatches(config.dedup.key, s.batch_shards,
                                                          s.allowed_lateness_s)
               | "DropDuplicatesStreaming" >> DropDuplicatesStreaming(
                   config.dedup.key, s.dedup_horizon_s,
                   state=state_layout_for(messages.pipeline.runner)))
    stories = config.near_duplicates
    if stories.enabled:
        batches = batches | "MarkStoriesStreaming" >> MarkStoriesStreaming(
            stories, state=state_layout_for(messages.pipeline.runner))
    embedded = batches | "EmbedStreaming" >> EmbedStreaming(
        config.model, **_embed_settings(config, engine_factory))
    # The step's name says when it loads the store too (docs/dataflow.md: an --update that turns the
    # store on or off maps one name to the other).
    writer = "WriteAndLoadStreaming" if config.store.enabled else "WriteStreaming"
    return embedded | writer >> WriteStreaming(
        config.output, run_id, config.model.output_dim, config.sink.row_group_rows,
        signature=signature_of(config), vector_dtype=config.sink.vector_dtype,
        store=config.store,
        minhash_version=signature_version(stories) if stories.enabled else None)


def build_streaming(pipeline: beam.Pipeline, config: Config, run_id: str,
                    engine_factory: Optional[EngineFactory] = None):
    """Streaming: a Pub/Sub subscription; message data is the batch input's news event JSON."""
    if not config.streaming.subscription:
        raise ValueError("streaming needs a subscription: set streaming.subscription or pass "
                         "--subscription")
    messages = (pipeline
                | "ReadPubSub" >> beam.io.ReadFromPubSub(
                    subscription=config.streaming.subscription, with_attributes=True)
                | "DropHeartbeats" >> beam.Filter(_not_a_heartbeat))
    return embed_and_write_streaming(messages, config, run_id, engine_factory)


HEARTBEAT_ATTRIBUTE = "newsvec_heartbeat"


def _not_a_heartbeat(message) -> bool:
    """Heartbeats (messages with this attribute) only keep an idle subscription's pulls, and so the
    local runner's watermark, moving; they are not news and are not counted."""
    return HEARTBEAT_ATTRIBUTE not in (message.attributes or {})

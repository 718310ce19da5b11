"""Embed only what is new or changed: the key index, and the step that skips what it holds.

Every output that newsvec writes holds a key index beside its vectors: ``keys/`` (batch:
``keys/part-<run_id>-*.parquet``, published with the run; streaming: one file per micro-batch
under ``keys/dt=…/hour=…/``), one row per article written, ``key_schema``. An article's key is
``sha256(id, text_sha256, model label, embedding signature)``: the signature holds every setting
that changes its vectors (``embedding_signature``), so a new model, a new token limit or new
chunking settings embed again, and a corrected text (another ``text_sha256``) does too.

A batch run given ``incremental.previous_outputs`` (globs of output prefixes, its own output never
among them) reads their keys once, when it runs (``ReadKeys``: each batch output through its
committed manifest, a ``Snapshot``), broadcast to the workers as a side input, and
``SkipUnchanged`` counts the articles whose key is there as ``unchanged`` instead of embedding
them: ``in = written + dead_lettered + duplicates + unchanged``. It also says which snapshots it
skipped articles for; the commit (``transforms.commit``) publishes only if each still holds the
run that was read, so an article counted unchanged is always in a committed output.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from typing import Optional

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam import pvalue
from apache_beam.io.filesystems import FileSystems

from transforms.chunking import ChunkingSettings
from transforms.layout import KEYS_DIR, MANIFEST_FILE, join_path
from transforms.manifest import COMMITTED, read_manifest
from transforms.model import ModelSettings
from transforms.schema import EmbeddedDoc, PreparedDoc

UNCHANGED = "unchanged"
SKIPPED_FROM = "skipped_from"
_LOG = logging.getLogger(__name__)



def embedding_signature(model: ModelSettings, chunking: ChunkingSettings) -> str:
    """The settings besides the model's files that decide an article's vectors (the dtype aside:
    bfloat16 and float32 vectors agree to a cosine of 0.9999)."""
    settings = {"max_tokens": model.max_tokens, "normalize": model.normalize,
                "document_prefix": model.document_prefix, "mode": chunking.mode}
    if chunking.mode == "chunks":
        settings.update(chunking=chunking.chunk_recipe(model.max_tokens, model.document_prefix),
                        doc_vector=chunking.doc_vector)
    return json.dumps(settings, sort_keys=True)


def embedding_key(doc_id: str, text_sha256: str, model_label: str, signature: str) -> str:
    """32 hex: the same article, text, model and settings give the same key in every run."""
    key = "\0".join((doc_id, text_sha256, model_label, signature))
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class KeysTable:
    """Vector rows -> a table of their keys (``key_schema``) under the embedding signature they
    were made with: the rows of ``keys/``."""

    signature: str

    def __call__(self, rows: list[EmbeddedDoc], schema: pa.Schema) -> pa.Table:
        return pa.table({
            "key": [embedding_key(r.id, r.text_sha256, r.model, self.signature) for r in rows],
            "id": [r.id for r in rows],
            "text_sha256": [r.text_sha256 for r in rows],
        }, schema=schema)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One previous output as a run read its keys: a batch output's committed run, or a streaming
    output (``run_id`` None: no manifest, and no file of it is ever withdrawn, only replaced by the
    same micro-batch)."""

    prefix: str
    run_id: Optional[str]

    def still_holds(self) -> bool:
        """Whether the output still holds what was read: the same run, committed."""
        if self.run_id is None:
            return True
        current = read_manifest(self.prefix)
        return current is not None and current.state == COMMITTED and current.run_id == self.run_id


@dataclasses.dataclass(frozen=True)
class KnownKeys:
    """The keys of the previous outputs, each with the snapshot that holds it."""

    snapshots: tuple[Snapshot, ...]
    index: dict  # key -> position of its snapshot in ``snapshots``


class SnapshotUnavailable(RuntimeError):
    """A previous output could not be read whole: its publish did not settle in time."""


class SnapshotChanged(RuntimeError):
    """A previous output that this run skipped articles for was republished while it ran."""


def _normal(path: str) -> str:
    path = path.rstrip("/")
    return path if FileSystems.get_scheme(path) else os.path.abspath(path)


def output_prefixes(pattern: str, own_output: str) -> list[str]:
    """The output prefixes a ``previous_outputs`` glob matches (those with a manifest or a key
    index), the run's own output left out (a rerun replaces its output: skipping what it held would
    drop it). Matched when the keys are read, not at launch."""
    own = _normal(own_output)
    pattern = pattern.rstrip("/")
    found = set()
    for result in FileSystems.match([f"{pattern}/{MANIFEST_FILE}", f"{pattern}/{KEYS_DIR}/**"]):
        for match in result.metadata_list:
            prefix = (match.path[:-len(MANIFEST_FILE) - 1] if match.path.endswith(MANIFEST_FILE)
                      else match.path.split(f"/{KEYS_DIR}/", 1)[0])
            if _normal(prefix) != own:
                found.add(prefix)
    return sorted(found)


def _keys_of(paths: list[str]) -> list[str]:
    keys: list[str] = []
    for path in paths:
        with FileSystems.open(path) as f:
            keys += pq.read_table(f, columns=["key"]).column(0).to_pylist()
    return keys


class _ReadSnapshotFn(beam.DoFn):
    """Output prefix -> (Snapshot, its keys). A batch output is read through its committed manifest:
    the files the manifest names, then the manifest again; if a rerun published in between (a file
    gone, another run id), it reads again. A publish in progress is waited for."""

    def __init__(self, attempts: int = 120, wait_s: float = 5.0):
        self._attempts, self._wait_s = attempts, wait_s

    def process(self, prefix: str):
        for _ in range(self._attempts):
            before = read_manifest(prefix)
            if before is None:  # a streaming output: files per micro-batch, never withdrawn
                paths = [m.path for m in FileSystems.match([join_path(prefix, KEYS_DIR, "**")])[0]
                         .metadata_list if m.path.endswith(".parquet")]
                yield Snapshot(prefix, None), _keys_of(paths)
                return
            if before.state == COMMITTED:
                try:
                    keys = _keys_of([join_path(prefix, p) for p in before.keys])
                except (IOError, OSError) as exc:
                    _LOG.info("%s changed while its keys were read (%s); reading again", prefix,
                              exc)
                    keys = None
                after = read_manifest(prefix)
                if keys is not None and after == before:
                    yield Snapshot(prefix, before.run_id), keys
                    return
            time.sleep(self._wait_s)
        raise SnapshotUnavailable(f"{prefix}: no committed run could be read whole in "
                                  f"{self._attempts * self._wait_s:.0f} s (a publish in progress "
                                  f"that never settled?)")


def _known_keys(read: list) -> KnownKeys:
    snapshots = tuple(snapshot for snapshot, _ in read)
    return KnownKeys(snapshots, {key: i for i, (_, keys) in enumerate(read) for key in keys})


class ReadKeys(beam.PTransform):
    """``incremental.previous_outputs`` -> one ``KnownKeys`` (a PCollection of one), read when the
    job runs: each output through its committed manifest, so that a rerun of that output
    publishing meanwhile neither breaks the read nor leaves keys of files it has removed."""

    def __init__(self, previous_outputs: list[str], own_output: str):
        super().__init__()
        self._patterns, self._own = list(previous_outputs), own_output

    def expand(self, pbegin):
        own = self._own
        return (pbegin
                | "Patterns" >> beam.Create(self._patterns).with_output_types(str)
                | "Outputs" >> beam.FlatMap(lambda pattern: output_prefixes(pattern, own))
                | "OnePerOutput" >> beam.Distinct()
                | "ReadSnapshot" >> beam.ParDo(_ReadSnapshotFn())
                | "All" >> beam.combiners.ToList()
                | "KnownKeys" >> beam.Map(_known_keys))


class _SkipFn(beam.DoFn):
    def __init__(self, model_label: str, signature: str):
        self._label, self._signature = model_label, signature

    def start_bundle(self):
        self._reported: set[int] = set()  # snapshots already named in this bundle

    def process(self, doc: PreparedDoc, known: KnownKeys):
        source = known.index.get(embedding_key(doc.id, doc.text_sha256, self._label,
                                               self._signature))
        if source is None:
            yield doc
            return
        yield pvalue.TaggedOutput(UNCHANGED, doc.id)
        if source not in self._reported:  # once a bundle, not once an article
            self._reported.add(source)
            yield pvalue.TaggedOutput(SKIPPED_FROM, known.snapshots[source])


class SkipUnchanged(beam.PTransform):
    """PreparedDoc -> the documents to embed (main output), the ids of those already embedded with
    these settings (``unchanged``), and the snapshots they were found in, once each
    (``skipped_from``: the commit checks that each still holds them), given ``ReadKeys``'s
    ``KnownKeys``. Returns them as a dict by those names."""

    def __init__(self, known_keys, model_label: str, signature: str):
        super().__init__()
        self._known, self._fn = known_keys, _SkipFn(model_label, signature)

    def expand(self, docs):
        out = docs | "Skip" >> beam.ParDo(self._fn, pvalue.AsSingleton(self._known)).with_outputs(
            UNCHANGED, SKIPPED_FROM, main="docs")
        skipped_from = out[SKIPPED_FROM] | "OncePerSnapshot" >> beam.Distinct()
        return {"docs": out.docs, UNCHANGED: out[UNCHANGED], SKIPPED_FROM: skipped_from}

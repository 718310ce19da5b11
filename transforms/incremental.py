"""Embed only what is new or changed: the key index, and the step that skips what it holds.

Every output that newsvec writes holds a key index beside its vectors: ``keys/`` (batch:
``keys/part-<run_id>-*.parquet``, published with the run; streaming: one file per micro-batch
under ``keys/dt=…/hour=…/``), one row per article written, ``key_schema``. An article's key is
``sha256(id, text_sha256, model label, embedding signature)``: the signature holds every setting
that changes its vectors (``embedding_signature``), so a new model, a new token limit or new
chunking settings embed again, and a corrected text (another ``text_sha256``) does too.

A batch run given ``incremental.previous_outputs`` (globs of output prefixes, its own output never
among them) reads their keys once (a set, broadcast to the workers as a side input: about 100 bytes
a key) and ``SkipUnchanged`` counts the articles whose key is there as ``unchanged`` instead of
embedding them: ``in = written + dead_lettered + duplicates + unchanged``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import apache_beam as beam
import pyarrow as pa
from apache_beam import pvalue
from apache_beam.io.filesystems import FileSystems

from transforms.chunking import ChunkingSettings
from transforms.layout import KEYS_DIR
from transforms.model import ModelSettings
from transforms.schema import EmbeddedDoc, PreparedDoc

UNCHANGED = "unchanged"


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


def key_files(previous_outputs: list[str], own_output: str) -> list[str]:
    """The key index files of every output prefix matched by ``previous_outputs``, the run's own
    output left out (a rerun replaces its output: skipping what it held would drop it)."""
    own = _normal(own_output)
    patterns = [p.rstrip("/") + f"/{KEYS_DIR}/**" for p in previous_outputs]
    found = set()
    for result in FileSystems.match(patterns):
        for match in result.metadata_list:
            prefix = _normal(match.path.split(f"/{KEYS_DIR}/", 1)[0])
            if prefix != own and match.path.endswith(".parquet"):
                found.add(match.path)
    return sorted(found)


def _normal(path: str) -> str:
    path = path.rstrip("/")
    return path if FileSystems.get_scheme(path) else os.path.abspath(path)


class ReadKeys(beam.PTransform):
    """Key index files -> one set of their keys (a PCollection of one set; empty if no file)."""

    def __init__(self, files: list[str]):
        super().__init__()
        self._files = files

    def expand(self, pbegin):
        keys = pbegin | "KeyFiles" >> beam.Create(self._files).with_output_types(str)
        if self._files:
            keys = (keys
                    | "ReadKeyFiles" >> beam.io.parquetio.ReadAllFromParquet(columns=["key"])
                    | "Key" >> beam.Map(lambda row: row["key"]))
        return keys | "KeySet" >> beam.combiners.ToSet()


class _SkipFn(beam.DoFn):
    def __init__(self, model_label: str, signature: str):
        self._label, self._signature = model_label, signature

    def process(self, doc: PreparedDoc, known: set):
        if embedding_key(doc.id, doc.text_sha256, self._label, self._signature) in known:
            yield pvalue.TaggedOutput(UNCHANGED, doc.id)
        else:
            yield doc


class SkipUnchanged(beam.PTransform):
    """PreparedDoc -> the documents to embed (main output) and the ids of those already embedded
    with these settings (``unchanged`` output), given the set of known keys (``ReadKeys``)."""

    def __init__(self, known_keys, model_label: str, signature: str):
        super().__init__()
        self._known, self._fn = known_keys, _SkipFn(model_label, signature)

    def expand(self, docs):
        return docs | "Skip" >> beam.ParDo(self._fn, pvalue.AsSingleton(self._known)).with_outputs(
            UNCHANGED, main="docs")

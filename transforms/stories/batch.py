"""Batch marking (``MarkStories``): the run's articles signed without their sources' boilerplate,
then, with the signatures of ``incremental.previous_outputs`` (their ``keys/`` hold each
article's signature, story and facts), marked in order on one worker: previous outputs first,
then the run's articles by ``published_at`` (none: last), then id. The marks join the rows after
the embedding (action ``mark``: ``MarkRows``), or the documents before it (``skip``:
``transforms.stories.skip``).
"""
from __future__ import annotations

import dataclasses
import logging
import urllib.parse
from typing import Any, Iterable, Optional

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam import pvalue

from transforms.output.layout import open_output_file
from transforms.settings import NearDuplicateSettings
from transforms.stories.boilerplate import LearnBoilerplate
from transforms.stories.facts import Facts
from transforms.stories.index import (
    Held,
    StoryIndex,
    StoryMark,
    micros,
    story_rank,
)
from transforms.stories.sign import Signed, holds_boilerplate, sign
from transforms.stories.signature import from_bytes, signature_version

_LOG = logging.getLogger(__name__)


def with_signed(doc, signed: Signed):
    """A document with its signature and facts (``keys/``'s ``minhash`` and ``story_facts``),
    its ``published_at`` among them."""
    facts = signed.facts
    if facts is not None:
        facts = dataclasses.replace(facts, published_us=micros(doc.event.published_at))
    return dataclasses.replace(doc, minhash=signed.minhash,
                               story_facts=None if facts is None else facts.to_bytes())


def facts_of(item) -> Optional[Facts]:
    return Facts.from_bytes(getattr(item, "story_facts", None))


def source_of(doc) -> Optional[str]:
    """Whose boilerplate a document may hold: its ``source`` ("s:" and it), else its URL's host
    ("h:" and it: never a source's); None (an article of no known publisher: nothing of it is
    taken for boilerplate) without either."""
    event = doc.event
    if event.source:
        return f"s:{event.source}"
    host = urllib.parse.urlsplit(event.url or "").hostname
    return f"h:{host}" if host else None


ENTRIES = "entries"


class _SignFn(beam.DoFn):
    """PreparedDoc -> the document signed whole (main output), and what the marking needs of it,
    in plain values that cost little to move (``entries``: (source, id, text hash,
    ``story_rank``, signature, facts bytes, block keys bytes, text))."""

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def process(self, doc):
        (signed,) = sign([doc.text], [None], self._settings)
        doc = with_signed(doc, signed)
        yield doc
        yield pvalue.TaggedOutput(ENTRIES, (
            source_of(doc), doc.id, doc.text_sha256, story_rank(doc), doc.minhash,
            doc.story_facts, signed.block_keys.astype("<u8").tobytes(), doc.text))


class _CutFn(beam.DoFn):
    """An entry of ``_SignFn`` -> (``story_rank``, id, signature, text hash, facts bytes): the
    text signed again without its source's boilerplate where it holds some (``boilerplate``:
    source -> sorted keys, a side input), else as signed whole (most are signed once)."""

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def process(self, entry, boilerplate):
        source, id_, sha, rank, minhash, facts, keys, text = entry
        cut = boilerplate.get(source)
        if holds_boilerplate(np.frombuffer(keys, dtype="<u8").astype(np.uint64), cut):
            (again,) = sign([text], [cut], self._settings)
            before = Facts.from_bytes(facts)
            minhash = again.minhash
            facts = None if again.facts is None else dataclasses.replace(
                again.facts,
                published_us=None if before is None else before.published_us).to_bytes()
        yield rank, id_, minhash, sha, facts


_PREVIOUS_COLUMNS = {"id": pa.string(), "story_id": pa.string(), "minhash": pa.binary(),
                     "minhash_version": pa.string()}
_PREVIOUS_OPTIONAL = {"story_facts": pa.binary(), "text_sha256": pa.string()}


def previous_signatures(files, version: str) -> Iterable[tuple]:
    """(id, story id, signature, facts bytes or None, text hash or None) of every article in the
    previous outputs' key files (a ``transforms.incremental.KeyFiles``) whose signature has
    ``version``; rows without one (written before stories were kept, or with near duplicates
    off, or another version) are passed over, and a file whose columns are not of newsvec's
    types (written by hand) is passed over with a warning."""
    wanted = list(_PREVIOUS_COLUMNS)
    for snapshot, paths in zip(files.snapshots, files.files, strict=True):
        for path in paths:
            with open_output_file(snapshot.prefix, path) as f:
                parquet = pq.ParquetFile(f)
                schema = parquet.schema_arrow
                if not set(wanted) <= set(schema.names):
                    continue
                if any(schema.field(name).type != kind for name, kind in
                       _PREVIOUS_COLUMNS.items()):
                    _LOG.warning("%s: keys/ columns not of newsvec's types: its signatures are "
                                 "passed over", path)
                    continue
                optional = [name for name, kind in _PREVIOUS_OPTIONAL.items()
                            if name in schema.names and schema.field(name).type == kind]
                for batch in parquet.iter_batches(columns=wanted + optional):
                    values = dict(zip(wanted + optional, (column.to_pylist()
                                                          for column in batch.columns),
                                      strict=True))
                    none = [None] * batch.num_rows
                    for id_, story, minhash, made_with, facts, sha in zip(
                            *(values[name] for name in wanted), values.get("story_facts", none),
                            values.get("text_sha256", none), strict=True):
                        if minhash is not None and made_with == version:
                            yield id_, story or id_, minhash, facts, sha


PREVIOUS_ORIGINALS = "previous_originals"


def find_stories(entries: list[tuple], previous,
                 settings: NearDuplicateSettings) -> Iterable[Any]:
    """The marks of a run's articles, given as (``story_rank``, id, signature, text hash, facts
    bytes) (or without the last two), by (id, text hash) (by id without one): two versions of
    an article in one run are marked each on its own, and each is held (versions of equal rank
    in the order of their hashes, whatever order they came in). The previous outputs' articles
    are held first (but a signature of another length than ``num_perm``, which would fail the
    comparison: a keys/ row written by hand); their ids that a mark names are also given out
    (``PREVIOUS_ORIGINALS``: such an original has a row in its output)."""
    index = StoryIndex(settings)
    size = settings.num_perm * 4
    earlier: set[str] = set()
    for id_, story, minhash, *more in previous:
        if len(minhash) == size:  # another length is no signature of this version (planted)
            index.hold(Held(id_, story, from_bytes(minhash),
                            version=more[1] if len(more) > 1 else None,
                            facts=Facts.from_bytes(more[0]) if more else None))
            earlier.add(id_)
    named: set[str] = set()
    for rank, id_, minhash, *more in sorted(entries, key=lambda entry: (entry[0], entry[3:4])):
        version = more[0] if more else None
        facts = Facts.from_bytes(more[1]) if len(more) > 1 else None
        mark = index.mark(id_, None if minhash is None else from_bytes(minhash), rank,
                          version=version, facts=facts)
        if facts is not None and facts.whole is not None:  # signed without boilerplate
            mark = dataclasses.replace(mark, signed=(minhash, more[1]))
        if mark.near_duplicate_of in earlier and mark.near_duplicate_of not in named:
            named.add(mark.near_duplicate_of)
            yield pvalue.TaggedOutput(PREVIOUS_ORIGINALS, (mark.near_duplicate_of, True))
        yield ((id_, version) if more else id_), mark


def with_mark(item, mark: Optional[StoryMark]):
    """A document or row with its story; a row's chunk rows follow it."""
    if mark is None:
        return item
    fields = mark.columns
    chunks = getattr(item, "chunks", ())
    if chunks and hasattr(chunks[0], "story_id"):  # a row's ChunkRows (a document's are spans)
        return dataclasses.replace(item, chunks=tuple(
            dataclasses.replace(chunk, **fields) for chunk in chunks), **fields)
    return dataclasses.replace(item, **fields)


MARKS = "marks"


class MarkStories(beam.PTransform):
    """Batch: PreparedDoc -> the documents signed whole (``docs``: what is embedded, waiting for
    nothing), each one's mark, ``((id, text hash), StoryMark)`` (``marks``: the mark of a
    document signed again without boilerplate carries that signature, for its row), found
    against each other and against the previous outputs' signatures (``key_files``:
    ``ReadKeys``'s ``KeyFiles``, or None), and the previous outputs' articles a mark names
    (``previous_originals``: (id, True)).

    Each document is signed whole, and its blocks counted per source (``LearnBoilerplate``);
    one that holds its source's boilerplate is signed again without it (``CutBoilerplate``,
    which waits for every article to be prepared). The marking moves plain values (``_SignFn``'s
    entries), not documents. Every signature of the run goes to one worker
    (``find_stories``), and its index holds about 6 KB an article (measured: 120 MB for 20,000
    previous articles held), 6 GB for a million: keep ``incremental.previous_outputs`` to the
    days that matter."""

    def __init__(self, settings: NearDuplicateSettings, key_files=None):
        super().__init__()
        self._settings, self._key_files = settings, key_files

    def expand(self, docs):
        settings, version = self._settings, signature_version(self._settings)
        signed = docs | "Sign" >> beam.ParDo(_SignFn(settings)).with_outputs(ENTRIES,
                                                                              main="docs")
        entries = signed[ENTRIES]
        boilerplate = (entries
                       | "BlockKeys" >> beam.FlatMap(
                           lambda entry: [] if entry[0] is None else [(entry[0], (
                               entry[1], np.frombuffer(entry[6], dtype="<u8").astype(np.uint64)
                           ))])
                       | "LearnBoilerplate" >> beam.CombinePerKey(
                           LearnBoilerplate(settings.boilerplate_min_docs)))
        if self._key_files is not None:
            previous = self._key_files | "PreviousSignatures" >> beam.FlatMap(
                previous_signatures, version)
        else:
            previous = docs.pipeline | "NoPreviousOutputs" >> beam.Create([])
        marks = (entries
                 | "CutBoilerplate" >> beam.ParDo(_CutFn(settings), pvalue.AsDict(boilerplate))
                 | "AllSignatures" >> beam.combiners.ToList()
                 | "FindStories" >> beam.FlatMap(
                     lambda entries, held: find_stories(entries, held, settings),
                     pvalue.AsList(previous)).with_outputs(PREVIOUS_ORIGINALS, main=MARKS))
        return {"docs": signed.docs, MARKS: marks[MARKS],
                PREVIOUS_ORIGINALS: marks[PREVIOUS_ORIGINALS]}


def _surviving(mark: Optional[StoryMark], row, marks, survivors) -> Optional[StoryMark]:
    """``mark`` with the ids ``DropDuplicates`` dropped (the same text under another id, with
    ``dedup.key: text_sha256``) replaced by the id that has the row: a copy never names an
    article without a row. A row marked a copy of its own dropped twin takes the twin's mark."""
    if mark is None or not survivors:
        return mark
    near = mark.near_duplicate_of
    if near is not None and survivors.get(near, near) == row.id:
        twin = marks.get((near, row.text_sha256))
        if twin is None or not twin.is_copy:
            return StoryMark(row.id)
        mark = twin
        near = twin.near_duplicate_of
    return StoryMark(survivors.get(mark.story_id, mark.story_id),
                     None if near is None else survivors.get(near, near), mark.similarity)


def _mark_row(row, marks, survivors):
    mark = marks.get((row.id, row.text_sha256))
    if mark is not None and mark.signed is not None:  # signed again without boilerplate: keys/
        row = dataclasses.replace(row, minhash=mark.signed[0], story_facts=mark.signed[1])
    return with_mark(row, _surviving(mark, row, marks, survivors))


class MarkRows(beam.PTransform):
    """Batch: vector rows (and their chunk rows) with their articles' marks (action ``skip``: the
    same marks the documents took), the ids ``DropDuplicates`` dropped replaced by their
    survivors' (``survivors``: (dropped id, kept id)); a row embedded from its document signed
    whole takes the signature it was marked with (``StoryMark.signed``)."""

    def __init__(self, marks, survivors):
        super().__init__()
        self._marks, self._survivors = marks, survivors

    def expand(self, rows):
        return rows | "WithStory" >> beam.Map(_mark_row, pvalue.AsDict(self._marks),
                                              pvalue.AsDict(self._survivors))

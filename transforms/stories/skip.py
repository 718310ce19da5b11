"""Action ``skip`` (batch): the copies a mark says may be left out are held back before the
embedding (``SkipCopies``) and counted ``near_duplicates``, by similarity band
(``similarity_band``), but where their original has no row (the embedder dead-lettered it, and no
previous output holds it): then they are embedded after all (``RescueCopies``), and one of them
kept per story (``KeepOneRescued``). ``EmbedSkippingCopies`` is the whole chain, one box of the
batch graph.
"""
from __future__ import annotations

from typing import Callable, Optional

import apache_beam as beam
from apache_beam import pvalue

from transforms.metrics import NEAR_DUPLICATES
from transforms.settings import NearDuplicateSettings
from transforms.stories.batch import with_mark
from transforms.stories.index import _UNDATED, micros, skipped
from transforms.types import DEAD_LETTER

COPIES_SKIPPED = "near_duplicates"


class _SkipCopiesFn(beam.DoFn):
    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def process(self, doc, marks):
        mark = marks.get((doc.id, doc.text_sha256))
        if skipped(mark, self._settings):
            yield pvalue.TaggedOutput(COPIES_SKIPPED, with_mark(doc, mark))
            return
        yield with_mark(doc, mark)


class SkipCopies(beam.PTransform):
    """Batch, action ``skip``: the documents to embed, with their marks (main output ``docs``),
    and the copies skippable (``transforms.stories.index.Rules.skippable``), held back
    (``near_duplicates``: then ``RescueCopies``). It waits for every article's mark: the embedding
    starts once every article is prepared."""

    def __init__(self, marks, settings: NearDuplicateSettings):
        super().__init__()
        self._marks, self._settings = marks, settings

    def expand(self, docs):
        return docs | "SkipCopies" >> beam.ParDo(
            _SkipCopiesFn(self._settings), pvalue.AsDict(self._marks)).with_outputs(
            COPIES_SKIPPED, main="docs")


def _rescue(keyed):
    _, grouped = keyed
    copies = list(grouped["copies"])
    if any(grouped["failed"]) and not any(grouped["written"]) and not any(grouped["earlier"]):
        # The original has no row (a version of it dead-lettered, none embedded, none in a
        # previous output): its copies are embedded after all (``KeepOneRescued`` keeps one).
        yield from copies
        return
    NEAR_DUPLICATES.inc(len(copies))
    for copy in copies:
        yield pvalue.TaggedOutput(COPIES_SKIPPED, (copy.id, copy.similarity))


class RescueCopies(beam.PTransform):
    """Batch, action ``skip``: the copies ``SkipCopies`` held back, the embedder's dead letters, its
    rows and the previous outputs' originals the marks name -> the copies whose original has no
    row, the embedder having dead-lettered it and no previous output holding it (main output
    ``rescued``: to embed after all, so that the story keeps a row), and (id, similarity) of the
    others (``near_duplicates``: counted, not embedded). A dead letter of an original that also
    has a row (another version of it, embedded now or in a previous output) rescues nothing."""

    def __init__(self, dead_letters, embedded, previous_originals):
        super().__init__()
        self._letters, self._embedded = dead_letters, embedded
        self._earlier = previous_originals

    def expand(self, held_back):
        copies = held_back | "ByOriginal" >> beam.Map(lambda doc: (doc.near_duplicate_of, doc))
        failed = (self._letters
                  | "DeadLetteredIds" >> beam.Filter(lambda letter: letter.event_id is not None)
                  | "ById" >> beam.Map(lambda letter: (letter.event_id, True)))
        written = self._embedded | "EmbeddedIds" >> beam.Map(lambda row: (row.id, True))
        return ({"copies": copies, "failed": failed, "written": written, "earlier": self._earlier}
                | "CopiesAndFailures" >> beam.CoGroupByKey()
                | "Rescue" >> beam.FlatMap(_rescue).with_outputs(COPIES_SKIPPED, main="rescued"))


def _rescued_rank(row) -> tuple:
    published = micros(row.published_at)
    return (_UNDATED if published is None else published, row.id, row.text_sha256)


def _keep_one(keyed):
    _, rows = keyed
    rows = sorted(rows, key=_rescued_rank)
    yield rows[0]
    NEAR_DUPLICATES.inc(len(rows) - 1)
    for row in rows[1:]:
        yield pvalue.TaggedOutput(COPIES_SKIPPED, (row.id, row.similarity))


class KeepOneRescued(beam.PTransform):
    """Batch, action ``skip``: the rescued copies as embedded -> per original, the first of them in
    ``story_rank`` order (main output ``rows``: the story's row), and (id, similarity) of the
    others (``near_duplicates``, as the copies skip leaves out). All were embedded, so that one
    that fails too leaves the others; in order, so that a retried bundle keeps the same one."""

    def expand(self, rescued_rows):
        return (rescued_rows
                | "ByOriginal" >> beam.Map(lambda row: (row.near_duplicate_of, row))
                | "PerOriginal" >> beam.GroupByKey()
                | "KeepFirst" >> beam.FlatMap(_keep_one).with_outputs(COPIES_SKIPPED, main="rows"))


SIMILARITY_BANDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)


def similarity_band(similarity: Optional[float]) -> str:
    """The band a skipped copy's similarity falls in, as ``"0.90-0.95"`` (``"0.99-1.00"``: 1
    included)."""
    edges = (0.0, *SIMILARITY_BANDS, 1.0)
    low = max(edge for edge in edges[:-1] if (similarity or 0.0) >= edge)
    return f"{low:.2f}-{edges[edges.index(low) + 1]:.2f}"


class EmbedSkippingCopies(beam.PTransform):
    """Batch, action ``skip``: PreparedDoc (with ``MarkStories``' ``marks``) -> the vector rows of
    the documents but the copies skippable (``embedded``), the embedder's dead letters
    (``dead_letter``), and (id, similarity) of each copy left out (``near_duplicates``). A copy
    whose original the embedder failed, and that no previous output holds
    (``previous_originals``), is embedded after all, one per story.

    ``embed`` makes the embedding step (``transforms.embed.Embed`` with the run's settings); it is
    applied twice, to the documents and to the rescued copies. The chain: ``SkipCopies`` ->
    ``Embed`` -> ``RescueCopies`` -> ``EmbedRescued`` -> ``KeepOneRescued``, and the outputs of
    both embeddings flattened."""

    def __init__(self, embed: Callable[[], beam.PTransform], marks,
                 settings: NearDuplicateSettings, previous_originals):
        super().__init__()
        self._embed, self._marks, self._settings = embed, marks, settings
        self._earlier = previous_originals

    def expand(self, docs):
        skipping = docs | "SkipCopies" >> SkipCopies(self._marks, self._settings)
        embedded = skipping.docs | "Embed" >> self._embed()
        # A copy whose original the embedder failed is embedded after all.
        rescue = skipping[COPIES_SKIPPED] | "RescueCopies" >> RescueCopies(
            embedded.dead_letter, embedded.embedded, self._earlier)
        again = rescue.rescued | "EmbedRescued" >> self._embed()
        kept = again.embedded | "KeepOneRescued" >> KeepOneRescued()  # one row per story
        return {"embedded": ((embedded.embedded, kept.rows)
                             | "AllEmbedded" >> beam.Flatten()),
                DEAD_LETTER: ((embedded.dead_letter, again.dead_letter)
                              | "AllEmbedDeadLetters" >> beam.Flatten()),
                COPIES_SKIPPED: ((rescue[COPIES_SKIPPED], kept[COPIES_SKIPPED])
                                 | "AllCopiesSkipped" >> beam.Flatten())}

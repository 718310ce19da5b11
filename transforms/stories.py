"""Same-story copies: which article a reprint (a wire story with a new headline, a byline, a
trimmed last paragraph, a fixed typo) is a copy of, so that every row names its story.

A text's signature is a MinHash (rensa's R-MinHash, in Rust) of its character shingles: the text
NFKC-folded, case-folded and without whitespace, cut into every run of ``shingle_chars``
characters. Shingles of characters need no word segmentation, so Japanese and English are
treated alike. The shingles are hashed here, in numpy (a rolling polynomial hash, 64 bits), and
handed to rensa as hashes: building a Python string per shingle cost more than the MinHash
itself (benchmarks/near_duplicates.py).

Two signatures' share of equal values estimates the Jaccard similarity of the two shingle sets.
Candidates are found by LSH: the signature cut into ``bands`` bands, two texts candidates when
one band is equal (``band_keys``); a candidate is a copy when its estimated similarity reaches
``threshold``. The banding is written here, not taken from rensa's index, because streaming keeps
its state per band key (``MarkStoriesStreaming``) and batch must cut the same bands.

An article's mark (``StoryMark``): ``story_id`` is the story of the article it copies (the most
similar one held; its own id if none), ``near_duplicate_of`` that article's id and ``similarity``
the estimate. Every article is held, copies too, under its story: a copy of a copy joins the
first one's story.

- Batch (``MarkStories``): the run's signatures, and those of ``incremental.previous_outputs``
  (their ``keys/`` hold each article's signature and story), go to one worker and are marked in
  order: previous outputs first, then the run's articles by ``published_at`` (none: last), then
  id. The marks join the rows after the embedding (action ``mark``), or the documents before it
  (``skip``: the copies at ``skip_threshold`` are not embedded and are counted
  ``near_duplicates``; the embedding waits for every article to be prepared).
- Streaming (``MarkStoriesStreaming``): per band key, the articles held within
  ``near_duplicates.horizon_s`` of event time, forgotten by a timer.
"""
from __future__ import annotations

import dataclasses
import hashlib
import unicodedata
from typing import Iterable, Optional

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
from apache_beam import pvalue

try:
    import rensa
except ImportError:  # pragma: no cover - an install without the dependency
    rensa = None

from transforms.metrics import NEAR_DUPLICATES
from transforms.output.layout import open_output_file
from transforms.settings import NearDuplicateSettings

_PRIME = np.uint64(0x100000001B3)  # the FNV prime: odd, so the rolling hash mixes every bit
_SPACE = {ord(c): None for c in " \t\n\r\f\v\u00a0\u3000\u2028\u2029\u200b"}


def signature_version(settings: NearDuplicateSettings) -> str:
    """What two signatures must share to be compared: the MinHash algorithm's version and the
    settings that shape a signature. Kept beside each signature (``keys/``)."""
    algorithm = getattr(getattr(rensa, "RMinHash", None), "ALGORITHM_VERSION", "none")
    return (f"rensa-r{algorithm}-k{settings.shingle_chars}-p{settings.num_perm}"
            f"-s{settings.seed}")


def shingle_text(text: str) -> str:
    """The text a signature is taken of: NFKC (full-width digits and letters folded), case
    folded, whitespace removed (re-spaced copies stay equal)."""
    return unicodedata.normalize("NFKC", text).casefold().translate(_SPACE)


def shingle_hashes(text: str, shingle_chars: int) -> np.ndarray:
    """One 64-bit hash per run of ``shingle_chars`` characters of ``shingle_text(text)``; a shorter
    text is one shingle; an empty one has none."""
    folded = shingle_text(text)
    codes = np.frombuffer(folded.encode("utf-32-le", "surrogatepass"),
                          dtype=np.uint32).astype(np.uint64)
    if codes.size == 0:
        return codes
    k = min(shingle_chars, codes.size)
    n = codes.size - k + 1
    hashes = np.zeros(n, dtype=np.uint64)
    for i in range(k):
        hashes = hashes * _PRIME + codes[i:i + n]
    return hashes


def signatures(texts: list[str], settings: NearDuplicateSettings) -> list[Optional[np.ndarray]]:
    """The signature (``num_perm`` uint32) of each text; None for a text with no shingle."""
    if rensa is None:
        raise RuntimeError("near_duplicates needs the rensa package (pip install newsvec)")
    hashes = [shingle_hashes(text, settings.shingle_chars) for text in texts]
    kept = [h for h in hashes if h.size]
    out: list[Optional[np.ndarray]] = [None] * len(texts)
    if not kept:
        return out
    offsets = np.zeros(len(kept) + 1, dtype=np.uint64)
    offsets[1:] = np.cumsum([h.size for h in kept])
    matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(
        np.concatenate(kept), offsets, settings.num_perm, settings.seed)
    rows = iter(np.asarray(matrix.to_rows(), dtype=np.uint32))
    for i, h in enumerate(hashes):
        if h.size:
            out[i] = next(rows)
    return out


def band_keys(signature: np.ndarray, settings: NearDuplicateSettings) -> list[str]:
    """The signature's LSH band keys, ``<band>:<16 hex>`` (band b: values ``b*band_rows`` up to
    ``(b+1)*band_rows``): two signatures sharing one are candidates."""
    rows = settings.band_rows
    return [f"{b}:{_digest(signature[b * rows:(b + 1) * rows])}" for b in range(settings.bands)]


def _digest(values: np.ndarray) -> str:
    return hashlib.blake2b(values.tobytes(), digest_size=8).hexdigest()


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """The estimated Jaccard similarity of two signatures: their share of equal values."""
    return float(np.count_nonzero(a == b)) / a.size


@dataclasses.dataclass(frozen=True)
class StoryMark:
    """An article's story: ``story_id`` (its own id if it copies nothing held), the article it
    copies (``near_duplicate_of``) and their estimated ``similarity`` (None where it copies
    nothing)."""

    story_id: str
    near_duplicate_of: Optional[str] = None
    similarity: Optional[float] = None

    @property
    def is_copy(self) -> bool:
        return self.near_duplicate_of is not None


@dataclasses.dataclass(frozen=True)
class Held:
    """An article held for matching: its id, story and signature."""

    id: str
    story_id: str
    signature: np.ndarray


def best_match(signature: np.ndarray, candidates: Iterable[Held], threshold: float,
               own_id: str) -> Optional[StoryMark]:
    """The mark of the most similar candidate at ``threshold`` or above (the first held of equal
    ones), or None. A candidate with the article's own id (another version of it) is not a
    copy."""
    best: Optional[Held] = None
    best_sim = -1.0
    for held in candidates:
        if held.id == own_id:
            continue
        sim = similarity(signature, held.signature)
        if sim >= threshold and sim > best_sim:
            best, best_sim = held, sim
    if best is None:
        return None
    return StoryMark(best.story_id, best.id, round(best_sim, 6))


class StoryIndex:
    """Articles held in memory, by band key: the batch marking and the local runner's state."""

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings
        self._by_band: dict[str, list[Held]] = {}
        self._by_id: dict[str, Held] = {}
        self._marks: dict[str, StoryMark] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def story_of(self, article_id: str) -> Optional[str]:
        mark = self._marks.get(article_id)
        return mark.story_id if mark else None

    def mark(self, article_id: str, signature: Optional[np.ndarray]) -> StoryMark:
        """The article's mark against what is held (never itself: another version of it, from a
        previous output, is not a copy), then held under its story. An id marked before by this
        index (the same article twice in a run) keeps its first mark."""
        known = self._marks.get(article_id)
        if known is not None:
            return known
        if signature is None:
            mark = StoryMark(article_id)
        else:
            keys = band_keys(signature, self._settings)
            seen: dict[int, Held] = {}
            for key in keys:
                for held in self._by_band.get(key, ()):
                    seen.setdefault(id(held), held)
            mark = best_match(signature, seen.values(), self._settings.threshold,
                              article_id) or StoryMark(article_id)
            self.hold(Held(article_id, mark.story_id, signature), keys)
        self._marks[article_id] = mark
        return mark

    def hold(self, held: Held, keys: Optional[list[str]] = None) -> None:
        """Holds an article marked before (a previous output's), under its story."""
        if held.id in self._by_id:
            return
        self._by_id[held.id] = held
        for key in keys or band_keys(held.signature, self._settings):
            self._by_band.setdefault(key, []).append(held)


# --- Batch ------------------------------------------------------------------------------------

_NO_TIME = float("inf")


def story_rank(doc) -> tuple:
    """The order articles are marked in, the earliest first: by ``published_at`` (none: after every
    dated one; streaming: its Pub/Sub publish time), then id. The first of a story is its
    original; a copy is only ever marked a copy of an article earlier in this order."""
    when = doc.published_at or _publish_time(doc)
    return (when.timestamp() if when is not None else _NO_TIME, doc.id)


def _publish_time(doc):
    lineage = getattr(doc.event, "lineage", None)
    return getattr(lineage, "publish_time", None)


class Sign:
    """PreparedDoc -> the same with its text's signature (``minhash``: uint32 little-endian)."""

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def __call__(self, doc):
        (signature,) = signatures([doc.text], self._settings)
        return dataclasses.replace(doc, minhash=None if signature is None else to_bytes(signature))


def to_bytes(signature: np.ndarray) -> bytes:
    return signature.astype("<u4").tobytes()


def from_bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u4")


def previous_signatures(files, version: str) -> Iterable[tuple[str, str, bytes]]:
    """(id, story id, signature) of every article in the previous outputs' key files (a
    ``transforms.incremental.KeyFiles``) whose signature has ``version``; rows without one
    (written before stories were kept, or with near duplicates off, or another version) are
    passed over."""
    wanted = ["id", "story_id", "minhash", "minhash_version"]
    for snapshot, paths in zip(files.snapshots, files.files, strict=True):
        for path in paths:
            with open_output_file(snapshot.prefix, path) as f:
                parquet = pq.ParquetFile(f)
                if not set(wanted) <= set(parquet.schema_arrow.names):
                    continue
                for batch in parquet.iter_batches(columns=wanted):
                    columns = [column.to_pylist() for column in batch.columns]
                    for id_, story, minhash, made_with in zip(*columns, strict=True):
                        if minhash is not None and made_with == version:
                            yield id_, story or id_, minhash


def find_stories(entries: list[tuple[tuple, str, Optional[bytes]]], previous,
                 settings: NearDuplicateSettings) -> Iterable[tuple[str, StoryMark]]:
    """The marks of a run's articles, given as (``story_rank``, id, signature): the previous
    outputs' articles held first, then the run's marked in rank order."""
    index = StoryIndex(settings)
    for id_, story, minhash in previous:
        index.hold(Held(id_, story, from_bytes(minhash)))
    for _, id_, minhash in sorted(entries, key=lambda entry: entry[0]):
        yield id_, index.mark(id_, None if minhash is None else from_bytes(minhash))


def with_mark(item, mark: Optional[StoryMark]):
    """A document or row with its story; a row's chunk rows follow it."""
    if mark is None:
        return item
    fields = dataclasses.asdict(mark)
    chunks = getattr(item, "chunks", ())
    if chunks and hasattr(chunks[0], "story_id"):  # a row's ChunkRows (a document's are spans)
        return dataclasses.replace(item, chunks=tuple(
            dataclasses.replace(chunk, **fields) for chunk in chunks), **fields)
    return dataclasses.replace(item, **fields)


MARKS, COPIES_SKIPPED = "marks", "near_duplicates"


class MarkStories(beam.PTransform):
    """Batch: PreparedDoc -> the documents with their signatures (``docs``) and each one's mark,
    ``(id, StoryMark)`` (``marks``), found against each other and against the previous outputs'
    signatures (``key_files``: ``ReadKeys``'s ``KeyFiles``, or None). Every signature of the run
    goes to one worker (``find_stories``): about 600 bytes an article, 0.6 GB for a million."""

    def __init__(self, settings: NearDuplicateSettings, key_files=None):
        super().__init__()
        self._settings, self._key_files = settings, key_files

    def expand(self, docs):
        settings, version = self._settings, signature_version(self._settings)
        signed = docs | "Sign" >> beam.Map(Sign(settings))
        if self._key_files is not None:
            previous = self._key_files | "PreviousSignatures" >> beam.FlatMap(
                lambda files: list(previous_signatures(files, version)))
        else:
            previous = docs.pipeline | "NoPreviousOutputs" >> beam.Create([])
        marks = (signed
                 | "RankAndSignature" >> beam.Map(lambda d: (story_rank(d), d.id, d.minhash))
                 | "AllSignatures" >> beam.combiners.ToList()
                 | "FindStories" >> beam.FlatMap(
                     lambda entries, held: find_stories(entries, held, settings),
                     pvalue.AsList(previous)))
        return {"docs": signed, MARKS: marks}


def _mark_row(row, marks):
    return with_mark(row, marks.get(row.id))


class MarkRows(beam.PTransform):
    """Batch, action ``mark``: vector rows (and their chunk rows) with their articles' marks."""

    def __init__(self, marks):
        super().__init__()
        self._marks = marks

    def expand(self, rows):
        return rows | "WithStory" >> beam.Map(_mark_row, pvalue.AsDict(self._marks))


class _SkipCopiesFn(beam.DoFn):
    def __init__(self, skip_threshold: float):
        self._skip = skip_threshold

    def process(self, doc, marks):
        mark = marks.get(doc.id)
        if mark is not None and mark.is_copy and mark.similarity >= self._skip:
            NEAR_DUPLICATES.inc()
            yield pvalue.TaggedOutput(COPIES_SKIPPED, doc.id)
            return
        yield with_mark(doc, mark)


class SkipCopies(beam.PTransform):
    """Batch, action ``skip``: the documents to embed, with their marks (main output ``docs``),
    and the ids of the copies at ``skip_threshold`` or above, not embedded (``near_duplicates``).
    It waits for every article's mark: the embedding starts once every article is prepared."""

    def __init__(self, marks, skip_threshold: float):
        super().__init__()
        self._marks, self._skip = marks, skip_threshold

    def expand(self, docs):
        return docs | "SkipCopies" >> beam.ParDo(
            _SkipCopiesFn(self._skip), pvalue.AsDict(self._marks)).with_outputs(
            COPIES_SKIPPED, main="docs")

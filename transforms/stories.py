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

import collections
import dataclasses
import datetime as dt
import hashlib
import unicodedata
from typing import Any, Iterable, Optional

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
from apache_beam import pvalue
from apache_beam.coders import FloatCoder, NullableCoder, StrUtf8Coder, TupleCoder, VarIntCoder
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import (
    BagStateSpec,
    ReadModifyWriteStateSpec,
    TimerSpec,
    on_timer,
)
from apache_beam.utils.timestamp import Duration, Timestamp

try:
    import rensa
except ImportError:  # pragma: no cover - an install without the dependency
    rensa = None

from transforms.dedup import ms_ceiling, regroup
from transforms.metrics import NEAR_DUPLICATES, NEAR_DUPLICATES_MARKED
from transforms.output.layout import open_output_file
from transforms.settings import NearDuplicateSettings
from transforms.state_coders import HeldStoriesCoder, MicroBatchCoder
from transforms.types import BatchId, MicroBatch

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
    """An article held for matching: its id, story, signature and ``story_rank`` (None: before
    any article, as a previous output's)."""

    id: str
    story_id: str
    signature: np.ndarray
    rank: Optional[tuple] = None


def best_match(signature: np.ndarray, candidates: Iterable[Held], threshold: float,
               own_id: str, rank: Optional[tuple] = None,
               estimate=None) -> Optional[StoryMark]:
    """The mark of the most similar candidate at ``threshold`` or above (the first held of equal
    ones), or None. A candidate with the article's own id (another version of it) is not a
    copy, nor one later in ``story_rank`` than ``rank``: an article is only a copy of an earlier
    one, so two can never be copies of each other, whatever order they are held in."""
    best: Optional[Held] = None
    best_sim = -1.0
    for held in candidates:
        if held.id == own_id or (rank is not None and held.rank is not None
                                 and held.rank >= rank):
            continue
        sim = (estimate or similarity)(signature, held.signature)
        if sim >= threshold and sim > best_sim:
            best, best_sim = held, sim
    if best is None:
        return None
    return StoryMark(best.story_id, best.id, round(best_sim, 6))


def skipped(mark: Optional[StoryMark], settings: NearDuplicateSettings) -> bool:
    """Whether action ``skip`` leaves the article of this mark out (not embedded, no row)."""
    return (settings.action == "skip" and mark is not None and mark.is_copy
            and (mark.similarity or 0) >= settings.skip_threshold)


class StoryIndex:
    """Articles held in memory, by band key: the batch marking and the local runner's state."""

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings
        self._by_band: dict[str, list[Held]] = {}
        self._by_id: dict[str, Held] = {}
        self._versions: dict[tuple[str, Optional[str]], StoryMark] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def mark(self, article_id: str, signature: Optional[np.ndarray],
             rank: Optional[tuple] = None, found: Optional[StoryMark] = None,
             version: Optional[str] = None) -> StoryMark:
        """The article's mark against what is held (never itself: another version of it, from a
        previous output, is not a copy), then held under its story. An id marked before by this
        index with the same ``version`` (the same article twice in a run) keeps its first mark;
        another version (batch: its text's hash, an article updated within the run) is marked on
        its own. A copy that action
        ``skip`` leaves out is not held: a later copy names an article that has a row.
        ``found``: a match found elsewhere (streaming: in the band keys' state), taken if more
        similar."""
        known = self._versions.get((article_id, version))
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
            match = best_match(signature, seen.values(), self._settings.threshold,
                               article_id, rank)
            if found is not None and (match is None
                                      or (found.similarity or 0) > (match.similarity or 0)):
                match = found
            mark = match or StoryMark(article_id)
            if not skipped(mark, self._settings):
                self.hold(Held(article_id, mark.story_id, signature, rank), keys)
        self._versions[(article_id, version)] = mark
        return mark

    def hold(self, held: Held, keys: Optional[list[str]] = None) -> None:
        """Holds an article marked before (a previous output's), under its story. A band key
        holds at most ``MAX_HELD_PER_BAND`` articles, the first held (the earliest: articles are
        held in ``story_rank`` order), as the streaming state does: a band value thousands of
        texts share (a template, a story reprinted all day) would make the marking quadratic."""
        if held.id in self._by_id:
            return
        self._by_id[held.id] = held
        for key in keys or band_keys(held.signature, self._settings):
            cell = self._by_band.setdefault(key, [])
            if len(cell) < MAX_HELD_PER_BAND:
                cell.append(held)


# --- Batch ------------------------------------------------------------------------------------

_UNDATED = 1 << 62  # after every date


def story_rank(doc) -> tuple[int, int, str]:
    """The order articles are marked in, the earliest first, as (micros, micros, id): streaming,
    by when newsvec could first see them, the Pub/Sub publish time (a publisher cannot backdate
    it), then ``published_at`` (the messages of one publish request share a publish time);
    batch (no publish time), by ``published_at`` (the publisher's word: within a run, a
    backdated reprint becomes its story's original); undated, after every dated one; then id.
    The first of a story is its original; a copy is only ever marked a copy of an article earlier
    in this order."""
    published, seen = _micros(doc.published_at), _micros(_publish_time(doc))
    if seen is not None:
        return (seen, _UNDATED if published is None else published, doc.id)
    return (_UNDATED if published is None else published, 0, doc.id)


def _micros(when) -> Optional[int]:
    return None if when is None else (when - _EPOCH) // dt.timedelta(microseconds=1)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


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


def find_stories(entries: list[tuple], previous,
                 settings: NearDuplicateSettings) -> Iterable[tuple[Any, StoryMark]]:
    """The marks of a run's articles, given as (``story_rank``, id, signature) or (``story_rank``,
    id, signature, text hash): by id, or with a text hash by (id, text hash), so that two
    versions of an article in one run are marked each on its own (versions of equal rank in the
    order of their hashes, whatever order they came in). The previous
    outputs' articles held first (but a signature of another length than ``num_perm``, which
    would fail the comparison: a keys/ row written by hand), then the run's marked in rank
    order."""
    index = StoryIndex(settings)
    size = settings.num_perm * 4
    for id_, story, minhash in previous:
        if len(minhash) == size:  # another length is no signature of this version (planted)
            index.hold(Held(id_, story, from_bytes(minhash)))
    for rank, id_, minhash, *version in sorted(entries, key=lambda entry: (entry[0], entry[3:])):
        mark = index.mark(id_, None if minhash is None else from_bytes(minhash), rank,
                          version=version[0] if version else None)
        yield ((id_, version[0]) if version else id_), mark


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
    ``((id, text hash), StoryMark)`` (``marks``), found against each other and against the
    previous outputs' signatures (``key_files``: ``ReadKeys``'s ``KeyFiles``, or None). Every
    signature of the run goes to one worker (``find_stories``), and its index holds about 6 KB an
    article (measured: 120 MB for 20,000 previous articles held), 6 GB for a million: keep
    ``incremental.previous_outputs`` to the days that matter."""

    def __init__(self, settings: NearDuplicateSettings, key_files=None):
        super().__init__()
        self._settings, self._key_files = settings, key_files

    def expand(self, docs):
        settings, version = self._settings, signature_version(self._settings)
        signed = docs | "Sign" >> beam.Map(Sign(settings))
        if self._key_files is not None:
            previous = self._key_files | "PreviousSignatures" >> beam.FlatMap(
                previous_signatures, version)
        else:
            previous = docs.pipeline | "NoPreviousOutputs" >> beam.Create([])
        marks = (signed
                 | "RankAndSignature" >> beam.Map(
                     lambda d: (story_rank(d), d.id, d.minhash, d.text_sha256))
                 | "AllSignatures" >> beam.combiners.ToList()
                 | "FindStories" >> beam.FlatMap(
                     lambda entries, held: find_stories(entries, held, settings),
                     pvalue.AsList(previous)))
        return {"docs": signed, MARKS: marks}


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
    return with_mark(row, _surviving(marks.get((row.id, row.text_sha256)), row, marks, survivors))


class MarkRows(beam.PTransform):
    """Batch: vector rows (and their chunk rows) with their articles' marks (action ``skip``: the
    same marks the documents took), the ids ``DropDuplicates`` dropped replaced by their
    survivors' (``survivors``: (dropped id, kept id))."""

    def __init__(self, marks, survivors):
        super().__init__()
        self._marks, self._survivors = marks, survivors

    def expand(self, rows):
        return rows | "WithStory" >> beam.Map(_mark_row, pvalue.AsDict(self._marks),
                                              pvalue.AsDict(self._survivors))


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
    and the copies at ``skip_threshold`` or above, held back (``near_duplicates``: then
    ``RescueCopies``). It waits for every article's mark: the embedding starts once every article
    is prepared."""

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
    if any(grouped["failed"]) and not any(grouped["written"]):
        # The original has no row (a version of it dead-lettered, none embedded): its copies are
        # embedded after all (``KeepOneRescued`` keeps one row of them).
        yield from copies
        return
    NEAR_DUPLICATES.inc(len(copies))
    for copy in copies:
        yield pvalue.TaggedOutput(COPIES_SKIPPED, copy.id)


class RescueCopies(beam.PTransform):
    """Batch, action ``skip``: the copies ``SkipCopies`` held back, the embedder's dead letters and
    its rows -> the copies whose original has no row, the embedder having dead-lettered it (main
    output ``rescued``: to embed after all, so that the story keeps a row), and the ids of the
    others (``near_duplicates``: counted, not embedded). A dead letter of an original that also
    has a row (another version of it, embedded) rescues nothing."""

    def __init__(self, dead_letters, embedded):
        super().__init__()
        self._letters, self._embedded = dead_letters, embedded

    def expand(self, held_back):
        copies = held_back | "ByOriginal" >> beam.Map(lambda doc: (doc.near_duplicate_of, doc))
        failed = (self._letters
                  | "DeadLetteredIds" >> beam.Filter(lambda letter: letter.event_id is not None)
                  | "ById" >> beam.Map(lambda letter: (letter.event_id, True)))
        written = self._embedded | "EmbeddedIds" >> beam.Map(lambda row: (row.id, True))
        return ({"copies": copies, "failed": failed, "written": written}
                | "CopiesAndFailures" >> beam.CoGroupByKey()
                | "Rescue" >> beam.FlatMap(_rescue).with_outputs(COPIES_SKIPPED, main="rescued"))


def _rescued_rank(row) -> tuple:
    micros = _micros(row.published_at)
    return (_UNDATED if micros is None else micros, row.id, row.text_sha256)


def _keep_one(keyed):
    _, rows = keyed
    rows = sorted(rows, key=_rescued_rank)
    yield rows[0]
    NEAR_DUPLICATES.inc(len(rows) - 1)
    for row in rows[1:]:
        yield pvalue.TaggedOutput(COPIES_SKIPPED, row.id)


class KeepOneRescued(beam.PTransform):
    """Batch, action ``skip``: the rescued copies as embedded -> per original, the first of them in
    ``story_rank`` order (main output ``rows``: the story's row), and the ids of the others
    (``near_duplicates``, as the copies skip leaves out). All were embedded, so that one that
    fails too leaves the others; in order, so that a retried bundle keeps the same one."""

    def expand(self, rescued_rows):
        return (rescued_rows
                | "ByOriginal" >> beam.Map(lambda row: (row.near_duplicate_of, row))
                | "PerOriginal" >> beam.GroupByKey()
                | "KeepFirst" >> beam.FlatMap(_keep_one).with_outputs(COPIES_SKIPPED, main="rows"))


# --- Streaming --------------------------------------------------------------------------------

MAX_HELD_PER_BAND = 64
"""The most articles one band key holds (the earliest in ``story_rank``): a band value that many
texts share (a short boilerplate text, a story reprinted hundreds of times) stays a small cell."""

Verdict = tuple[str, Optional[str], Optional[str], Optional[float]]  # _doc_key, story, of, sim
_REQUESTS, _HEADERS = "requests", "headers"


def _rank_of(entry) -> tuple:
    id_, _, rank, _, _ = entry
    return (-1, -1, id_) if rank is None else (*rank, id_)  # None: before every article


def _keep_held(held: list, held_state, forget) -> None:
    """Writes the entries a band key (or the local runner's one state) still holds, its timer at
    the earliest expiry; none left, clears it."""
    if held:
        held_state.write(held)
        forget.set(Timestamp(micros=min(entry[3] for entry in held)))
    else:
        held_state.clear()


def _doc_key(doc_id: str, text_sha256: str) -> str:
    """A document's key in the verdicts: its id and text hash (two versions of an article in one
    micro-batch are marked each on its own, as in batch)."""
    return f"{doc_id}\0{text_sha256}"


def band_signature(minhash: bytes) -> bytes:
    """What the streaming state holds of a signature: the low 8 bits of each value (b-bit
    MinHash, Li and König): 128 bytes instead of 512 in each of the ``bands`` entries of an
    article. Two unequal values agree in their low byte 1 time in 256; ``band_similarity``
    corrects for it."""
    return from_bytes(minhash).astype(np.uint8).tobytes()


_CHANCE = 1 / 256


def band_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """The estimated Jaccard similarity of two ``band_signature``s (as uint8 arrays): their share
    of equal bytes, less what chance gives."""
    agree = float(np.count_nonzero(a == b)) / a.size
    return max(0.0, (agree - _CHANCE) / (1 - _CHANCE))


def _best_held(entries, short: bytes, rank: tuple, threshold: float):
    """The best match among a band key's entries for a ``band_signature``."""
    mine = np.frombuffer(short, dtype=np.uint8)
    # An entry of another length (a state written with other settings, or planted) is passed
    # over, as a previous output's signature of another length is in batch; a rank of None is
    # before every article (as a previous output's).
    held = (Held(id_, story, np.frombuffer(sig, dtype=np.uint8),
                 None if held_rank is None else (*held_rank, id_))
            for id_, story, held_rank, _, sig in entries if len(sig) == len(short))
    return best_match(mine, held, threshold, rank[-1], rank, band_similarity)


class _AskBands(beam.DoFn):
    """MicroBatch -> its documents signed (a header, by batch id) and one request per document and
    band key; a micro-batch with no signed document goes out as it is, its documents their own
    stories."""

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def process(self, batch):
        sign = Sign(self._settings)
        docs = tuple(sign(doc) for doc in batch.docs)
        signed = [doc for doc in docs if doc.minhash is not None]
        if not signed:
            yield decide(dataclasses.replace(batch, docs=docs), [], self._settings)
            return
        bid = batch.batch_id
        yield pvalue.TaggedOutput(_HEADERS, (bid, dataclasses.replace(batch, docs=docs)))
        for doc in signed:
            rank = list(story_rank(doc)[:2])
            short = band_signature(doc.minhash)
            for key in band_keys(from_bytes(doc.minhash), self._settings):
                yield pvalue.TaggedOutput(_REQUESTS, (key, (bid, doc.id, rank, short,
                                                            doc.text_sha256)))


class _MatchPerBand(beam.DoFn):
    """Per band key, in the global window: the articles held with this band value within the
    horizon (``HeldStoriesCoder``). A request is answered with the most similar article held
    that is earlier in ``story_rank`` (a verdict), and its article is held under that article's
    story (or its own), until the event time of its micro-batch plus the horizon; a watermark
    timer forgets it then. Each request reads and writes its own band key only: a micro-batch
    costs the same whatever the number of stories held."""

    HELD = ReadModifyWriteStateSpec("held", HeldStoriesCoder())
    FORGET = TimerSpec("forget", TimeDomain.WATERMARK)

    def __init__(self, settings: NearDuplicateSettings):
        self._settings, self._threshold = settings, settings.threshold
        self._horizon = Duration(seconds=settings.horizon_s)

    def process(self, request, timestamp=beam.DoFn.TimestampParam,
                held_state=beam.DoFn.StateParam(HELD), forget=beam.DoFn.TimerParam(FORGET)):
        _, (bid, doc_id, pair, short, text_sha256) = request
        held = held_state.read() or []
        mark = _best_held(held, short, (*pair, doc_id), self._threshold)
        if not skipped(mark, self._settings) and all(entry[0] != doc_id for entry in held):
            expiry = ms_ceiling(timestamp + self._horizon).micros
            held.append((doc_id, mark.story_id if mark else doc_id, list(pair), expiry, short))
            _keep_held(sorted(held, key=_rank_of)[:MAX_HELD_PER_BAND], held_state, forget)
        key = _doc_key(doc_id, text_sha256)
        yield bid, ((key, mark.story_id, mark.near_duplicate_of, mark.similarity) if mark
                    else (key, None, None, None))

    @on_timer(FORGET)
    def forget(self, fired=beam.DoFn.TimestampParam, held_state=beam.DoFn.StateParam(HELD),
               forget=beam.DoFn.TimerParam(FORGET)):
        _keep_held([entry for entry in held_state.read() or [] if entry[3] > fired.micros],
                   held_state, forget)


def _best_verdicts(verdicts: Iterable[Verdict]) -> dict[str, StoryMark]:
    """Per document, the most similar article its band keys found, under the story its band keys
    hold that article in. A band key holds an article under the story it found there: one where
    its own original was not held holds it as a story of its own. So of the stories given for the
    article, one other than the article itself is taken (the one most bands gave)."""
    by_doc: dict[str, list[tuple[str, str, float]]] = {}
    for doc_id, story, of, sim in verdicts:
        if of is not None and sim is not None:
            by_doc.setdefault(doc_id, []).append((story or of, of, sim))
    found = {}
    for doc_id, matches in by_doc.items():
        _, of, sim = max(matches, key=lambda match: match[2])
        stories = collections.Counter(story for story, held, _ in matches if held == of)
        rooted = [story for story, _ in stories.most_common() if story != of]
        found[doc_id] = StoryMark(rooted[0] if rooted else of, of, sim)
    return found


def decide(batch, verdicts: Iterable[Verdict], settings: NearDuplicateSettings):
    """The micro-batch with each document's mark: the best of what the band keys found (earlier
    micro-batches) and of its earlier documents in this micro-batch (marked in ``story_rank``
    order, as in batch); action ``skip`` leaves the copies at ``skip_threshold`` out, counted in
    ``near_duplicates``."""
    found = _best_verdicts(verdicts)
    index = StoryIndex(settings)
    marks: dict[str, StoryMark] = {}
    story_of: dict[str, str] = {}  # of the documents marked so far, by id
    for doc in sorted(batch.docs, key=lambda d: (story_rank(d), d.text_sha256)):
        signature = None if doc.minhash is None else from_bytes(doc.minhash)
        key = _doc_key(doc.id, doc.text_sha256)
        cross = found.get(key)
        if cross is not None and cross.near_duplicate_of in story_of:  # earlier in this batch
            cross = dataclasses.replace(cross, story_id=story_of[cross.near_duplicate_of])
        marks[key] = index.mark(doc.id, signature, story_rank(doc), cross,
                                version=doc.text_sha256)
        story_of.setdefault(doc.id, marks[key].story_id)
    kept, left_out = [], 0
    for doc in batch.docs:
        mark = marks[_doc_key(doc.id, doc.text_sha256)]
        if skipped(mark, settings):
            left_out += 1
            continue
        if mark.is_copy:
            NEAR_DUPLICATES_MARKED.inc()
        kept.append(with_mark(doc, mark))
    NEAR_DUPLICATES.inc(left_out)
    return dataclasses.replace(batch, docs=tuple(kept),
                               near_duplicates=batch.near_duplicates + left_out)


_VERDICT_CODER = TupleCoder((StrUtf8Coder(), NullableCoder(StrUtf8Coder()),
                             NullableCoder(StrUtf8Coder()), NullableCoder(FloatCoder())))


class _Regroup(beam.DoFn):
    """Per batch id: the header (the signed micro-batch) and one verdict per document and band, in
    any order -> the micro-batch marked (``decide``) once all are in; then its state is cleared.
    ``PENDING`` counts what is still missing (``transforms.dedup.regroup``: the header awaits a
    verdict per signed document and band)."""

    HEADER = ReadModifyWriteStateSpec("header", MicroBatchCoder())
    VERDICTS = BagStateSpec("verdicts", _VERDICT_CODER)
    PENDING = ReadModifyWriteStateSpec("pending", VarIntCoder())

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def process(self, element, header_state=beam.DoFn.StateParam(HEADER),
                verdicts=beam.DoFn.StateParam(VERDICTS),
                pending_state=beam.DoFn.StateParam(PENDING)):
        _, item = element
        bands = self._settings.bands
        complete = regroup(
            item, lambda header: sum(doc.minhash is not None for doc in header.docs) * bands,
            header_state, verdicts, pending_state)
        if complete is not None:
            yield decide(*complete, self._settings)


class _MarkInOneState(beam.DoFn):
    """The local runner's layout (``transforms.dedup.state_layout_for``): every micro-batch through
    one state, the articles held within the horizon in one list, marked by the same rules.
    Its cost grows with the articles held: for local runs only."""

    HELD = ReadModifyWriteStateSpec("held", HeldStoriesCoder())
    FORGET = TimerSpec("forget", TimeDomain.WATERMARK)

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings
        self._horizon = Duration(seconds=settings.horizon_s)

    def process(self, keyed, timestamp=beam.DoFn.TimestampParam,
                held_state=beam.DoFn.StateParam(HELD), forget=beam.DoFn.TimerParam(FORGET)):
        _, batch = keyed
        sign = Sign(self._settings)
        batch = dataclasses.replace(batch, docs=tuple(sign(doc) for doc in batch.docs))
        held = held_state.read() or []
        verdicts = []
        for doc in batch.docs:
            if doc.minhash is None:
                continue
            mark = _best_held(held, band_signature(doc.minhash), story_rank(doc),
                              self._settings.threshold)
            if mark is not None:
                verdicts.append((_doc_key(doc.id, doc.text_sha256), mark.story_id,
                                 mark.near_duplicate_of, mark.similarity))
        marked = decide(batch, verdicts, self._settings)
        known = {entry[0] for entry in held}
        expiry = ms_ceiling(timestamp + self._horizon).micros
        for doc in marked.docs:  # those left out (action skip) are not held
            if doc.minhash is not None and doc.id not in known:
                held.append((doc.id, doc.story_id or doc.id, list(story_rank(doc)[:2]), expiry,
                             band_signature(doc.minhash)))
        if held:
            _keep_held(held, held_state, forget)
        yield marked

    @on_timer(FORGET)
    def forget(self, fired=beam.DoFn.TimestampParam, held_state=beam.DoFn.StateParam(HELD),
               forget=beam.DoFn.TimerParam(FORGET)):
        _keep_held([entry for entry in held_state.read() or [] if entry[3] > fired.micros],
                   held_state, forget)


class MarkStoriesStreaming(beam.PTransform):
    """MicroBatch -> the micro-batch with each document's story (and, action ``skip``, without the
    close copies, counted ``near_duplicates`` in its ledger). The state is kept per LSH band key
    (``_MatchPerBand``), in the global window, each article held ``near_duplicates.horizon_s`` of
    event time: a document asks each of its band keys, and ``_Regroup`` puts the micro-batch
    together again by its id (as ``DropDuplicatesStreaming`` does), so it is embedded and written
    whole. ``state="per_shard"``: the local runner's layout, one state for all
    (``_MarkInOneState``)."""

    def __init__(self, settings: NearDuplicateSettings, state: str = "per_key"):
        super().__init__()
        self._settings, self._state = settings, state

    def expand(self, batches):
        settings = self._settings
        if self._state == "per_shard":
            return (batches
                    | "OneState" >> beam.Map(lambda batch: (0, batch)).with_output_types(
                        tuple[int, MicroBatch])
                    | "MarkInOneState" >> beam.ParDo(_MarkInOneState(settings))
                    .with_output_types(MicroBatch))
        asked = batches | "AskBands" >> beam.ParDo(_AskBands(settings)).with_outputs(
            _REQUESTS, _HEADERS, main="without_signatures").with_output_types(
            MicroBatch, requests=tuple[str, tuple[BatchId, str, list, bytes, str]],
            headers=tuple[BatchId, MicroBatch])
        verdicts = asked[_REQUESTS] | "MatchPerBand" >> beam.ParDo(
            _MatchPerBand(settings)).with_input_types(tuple[str, Any]).with_output_types(
            tuple[BatchId, Any])
        regrouped = ((asked[_HEADERS], verdicts)
                     | "HeadersAndVerdicts" >> beam.Flatten().with_output_types(
                         tuple[BatchId, Any])
                     | "Regroup" >> beam.ParDo(_Regroup(settings)).with_output_types(MicroBatch))
        return ((asked.without_signatures, regrouped)
                | "AllMicroBatches" >> beam.Flatten().with_output_types(MicroBatch))

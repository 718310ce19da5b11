"""Streaming marking (``MarkStoriesStreaming``): each micro-batch's documents signed without their
sources' boilerplate (learned within the horizon), then marked against the articles held within
``near_duplicates.horizon_s`` of event time, by the batch rules.

Dataflow's layout (``per_key``), in two rounds of the same pattern as the dedup state: a request
per key, state per key, the micro-batch regrouped by its id.
- ``_AskSources`` sends each source of the micro-batch its documents' block keys;
  ``_LearnPerSource`` counts them in the source's ``BlockCounts`` and answers with each
  document's boilerplate; ``_CutRegroup`` signs the micro-batch once every source has answered.
- ``_AskBands`` sends one request per signed document and LSH band key; ``_MatchPerBand`` answers
  with the best article held there and holds the document (``HeldStoriesCoder``); ``_Regroup``
  marks the micro-batch (``decide``) once every verdict is in.
Each request reads and writes its own key's state: a micro-batch costs the same whatever the
number of stories held. A band key decides alone, before the micro-batch does: it holds a
document under the story it found there, and holds one that the micro-batch then skips (two
limits of state per key in a graph without cycles; docs/output.md).

The local runner's layout (``per_shard``: ``_MarkLocally``): one state for everything, an index
by band key in memory (``StoryIndex``), the state written as what each micro-batch adds; read
back only when the runner starts the step afresh.
"""
from __future__ import annotations

import collections
import dataclasses
import struct
import threading
import uuid
from typing import Any, Iterable, Optional

import apache_beam as beam
import numpy as np
from apache_beam import pvalue
from apache_beam.coders import (
    BytesCoder,
    FloatCoder,
    NullableCoder,
    StrUtf8Coder,
    TupleCoder,
    VarIntCoder,
)
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import (
    BagStateSpec,
    ReadModifyWriteStateSpec,
    TimerSpec,
    on_timer,
)
from apache_beam.utils.timestamp import Duration, Timestamp

from transforms.metrics import NEAR_DUPLICATES, NEAR_DUPLICATES_MARKED
from transforms.settings import NearDuplicateSettings
from transforms.state import RegroupFn, by_batch, ms_ceiling
from transforms.state_coders import HeldStoriesCoder
from transforms.stories.batch import facts_of, source_of, with_mark, with_signed
from transforms.stories.boilerplate import BlockCounts, id_hash
from transforms.stories.facts import Facts
from transforms.stories.index import (
    MAX_HELD_PER_BAND,
    Held,
    Rules,
    StoryIndex,
    StoryMark,
    best_match,
    skipped,
    story_rank,
)
from transforms.stories.sign import sign
from transforms.stories.signature import (
    band_keys,
    band_signature,
    band_similarity,
    from_bytes,
    to_bytes,
)
from transforms.types import BatchId, MicroBatch

Verdict = tuple[str, Optional[str], Optional[str], Optional[float]]  # _doc_key, story, of, sim
_REQUESTS, _HEADERS = "requests", "headers"
_SKIPPABLE = "\x01"  # ends a verdict's document key where the copy is skippable


def _rank_of(entry) -> tuple:
    id_, _, rank, *_ = entry
    return (-1, -1, id_) if rank is None else (*rank, id_)  # None: before every article


def _keep_held(held: list, held_state, forget) -> None:
    """Writes the entries a band key still holds, its timer at the earliest expiry; none left,
    clears it."""
    if held:
        held_state.write(held)
        forget.set(Timestamp(micros=min(entry[3] for entry in held)))
    else:
        held_state.clear()


def _doc_key(doc_id: str, text_sha256: str) -> str:
    """A document's key in the verdicts: its id and text hash (two versions of an article in one
    micro-batch are marked each on its own, as in batch)."""
    return f"{doc_id}\0{text_sha256}"


def _version(text_sha256: Optional[str]) -> Optional[str]:
    """What the state keeps of a version: 16 hex of its text's hash."""
    return None if text_sha256 is None else text_sha256[:16]


def _versioned(article_id: Optional[str], version: Optional[str]) -> Optional[str]:
    """An article's id and version in one string ("id\0version"; the id alone without one): a
    verdict's original (a 0.4 verdict names the id alone) and a story record's key."""
    return article_id if article_id is None or version is None else f"{article_id}\0{version}"


def _pack(short: bytes, facts: Optional[bytes]) -> bytes:
    """A band request's signature with the document's facts after it (the request keeps 0.4's
    shape, so a job updates in place; a request of 0.4 carries no facts)."""
    return short + (facts or b"")


def _held_of(entry, size: int) -> Optional[Held]:
    """A state entry as a ``Held`` (its signature as uint8); None for one of another length (a
    state written with other settings, or planted): passed over, as a previous output's
    signature of another length is in batch."""
    id_, story, rank, expiry, sig, *more = entry
    if len(sig) != size:
        return None
    return Held(id_, story, np.frombuffer(sig, dtype=np.uint8),
                None if rank is None else (*rank, id_),
                more[0] if more else None,
                Facts.from_bytes(more[1]) if len(more) > 1 else None, expiry)


def _best_held(entries, short: bytes, rank: tuple, rules: Rules,
               facts: Optional[Facts] = None) -> Optional[StoryMark]:
    """The best match among a band key's entries for a ``band_signature`` (``short``) of the
    article of ``rank``."""
    held = (h for h in (_held_of(entry, len(short)) for entry in entries) if h is not None)
    return best_match(np.frombuffer(short, dtype=np.uint8), held, rules, rank[-1], rank, facts,
                      band_similarity)


class _AskSources(beam.DoFn):
    """MicroBatch -> its documents signed whole, as a header (by batch id), and, per source of its
    documents, their block keys (``(source, (batch id, [(doc key, id hash, keys bytes)]))``); one
    without a document of a known publisher goes out signed."""

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def process(self, batch):
        signed = sign([doc.text for doc in batch.docs], [None] * len(batch.docs), self._settings)
        batch = dataclasses.replace(batch, docs=tuple(
            with_signed(doc, s) for doc, s in zip(batch.docs, signed, strict=True)))
        per_source: dict[str, list] = collections.defaultdict(list)
        for doc, s in zip(batch.docs, signed, strict=True):
            source = source_of(doc)
            if source is not None:
                per_source[source].append((_doc_key(doc.id, doc.text_sha256), id_hash(doc.id),
                                           s.block_keys.astype("<u8").tobytes()))
        if not per_source:  # no document of a known publisher (or none): nothing to cut
            yield batch
            return
        yield pvalue.TaggedOutput(_HEADERS, (batch.batch_id, batch))
        for source, docs in per_source.items():
            yield pvalue.TaggedOutput(_REQUESTS, (source, (batch.batch_id, docs)))


def _keys(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u8").astype(np.uint64)


def _boilerplate_of(boilerplate: np.ndarray, keys: bytes) -> bytes:
    """Those of a document's block ``keys`` that are its source's ``boilerplate``."""
    mine = _keys(keys)
    return mine[np.isin(mine, boilerplate)].astype("<u8").tobytes()


class _LearnPerSource(beam.DoFn):
    """Per source, in the global window: the blocks its articles held within the horizon
    (``BlockCounts``). A request's documents are counted, then answered each with its blocks that
    are boilerplate now (``(batch id, (doc key, keys bytes))``). A watermark timer drops the
    table once the source has been quiet for the horizon."""

    COUNTS = ReadModifyWriteStateSpec("blocks", BytesCoder())
    QUIET = TimerSpec("quiet", TimeDomain.WATERMARK)

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def process(self, request, timestamp=beam.DoFn.TimestampParam,
                counts_state=beam.DoFn.StateParam(COUNTS), quiet=beam.DoFn.TimerParam(QUIET)):
        _, (bid, docs) = request
        settings = self._settings
        counts = BlockCounts.from_bytes(counts_state.read() or b"", settings.boilerplate_min_docs)
        now = int(timestamp.micros // 10**6)
        for _, article, keys in docs:
            counts.add(article, _keys(keys), now)
        counts.forget(now - int(settings.horizon_s), settings.boilerplate_max_blocks)
        counts_state.write(counts.to_bytes())
        quiet.set(Timestamp(micros=ms_ceiling(
            timestamp + Duration(seconds=settings.horizon_s)).micros))
        boilerplate = counts.boilerplate()
        yield bid, [(key, _boilerplate_of(boilerplate, keys)) for key, _, keys in docs]

    @on_timer(QUIET)
    def quiet(self, counts_state=beam.DoFn.StateParam(COUNTS)):
        counts_state.clear()


class _CutRegroup(RegroupFn):
    """Per batch id: the header and one answer per source, in any order -> the micro-batch, its
    documents signed without their boilerplate, once all are in."""

    VERDICTS = BagStateSpec("answers", TupleCoder((StrUtf8Coder(), BytesCoder())))
    process = RegroupFn.processing(VERDICTS)

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def awaits(self, header: MicroBatch) -> int:
        return _sources_in(header)

    def arrival(self, item, verdicts):
        if isinstance(item, MicroBatch):
            return item, self.awaits(item)
        for cut in item[:-1]:  # one source's answers count as one arrival
            verdicts.add(tuple(cut))
        return item[-1], 0

    def complete(self, header: MicroBatch, verdicts: list):
        yield sign_batch(header, verdicts, self._settings)


def _sources_in(batch: MicroBatch) -> int:
    return len({source_of(doc) for doc in batch.docs} - {None})


def sign_batch(batch: MicroBatch, cuts: Iterable[tuple[str, bytes]],
               settings: NearDuplicateSettings) -> MicroBatch:
    """The micro-batch (its documents signed whole) with each document that ``cuts`` names
    (doc key, its boilerplate block keys) signed again without those blocks."""
    cut = {key: np.sort(_keys(keys)) for key, keys in cuts if keys}
    again = [doc for doc in batch.docs if _doc_key(doc.id, doc.text_sha256) in cut]
    if not again:
        return batch
    signed = dict(zip((id(doc) for doc in again), sign(
        [doc.text for doc in again], [cut[_doc_key(doc.id, doc.text_sha256)] for doc in again],
        settings), strict=True))
    return dataclasses.replace(batch, docs=tuple(
        with_signed(doc, signed[id(doc)]) if id(doc) in signed else doc for doc in batch.docs))


class _AskBands(beam.DoFn):
    """A signed MicroBatch -> a header (by batch id) and one request per signed document and band
    key; a micro-batch with no signed document goes out marked (each its own story)."""

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def process(self, batch):
        signed = [doc for doc in batch.docs if doc.minhash is not None]
        if not signed:
            yield decide(batch, [], self._settings)
            return
        bid = batch.batch_id
        yield pvalue.TaggedOutput(_HEADERS, (bid, batch))
        for doc in signed:
            rank = list(story_rank(doc)[:2])
            short = _pack(band_signature(doc.minhash), doc.story_facts)
            for key in band_keys(from_bytes(doc.minhash), self._settings):
                yield pvalue.TaggedOutput(_REQUESTS, (key, (bid, doc.id, rank, short,
                                                            doc.text_sha256)))


class _MatchPerBand(beam.DoFn):
    """Per band key, in the global window: the articles held with this band value within the
    horizon (``HeldStoriesCoder``). A request is answered with the most similar article held
    that the rules take for its original (a verdict), and its article (this version of it) is
    held under that article's story (or its own), until the event time of its micro-batch plus
    the horizon; a watermark timer forgets it then."""

    HELD = ReadModifyWriteStateSpec("held", HeldStoriesCoder())
    FORGET = TimerSpec("forget", TimeDomain.WATERMARK)

    def __init__(self, settings: NearDuplicateSettings):
        self._settings, self._rules = settings, Rules(settings)
        self._horizon = Duration(seconds=settings.horizon_s)

    def process(self, request, timestamp=beam.DoFn.TimestampParam,
                held_state=beam.DoFn.StateParam(HELD), forget=beam.DoFn.TimerParam(FORGET)):
        _, (bid, doc_id, pair, packed, text_sha256) = request
        size = self._settings.num_perm
        short, facts_bytes = packed[:size], packed[size:] or None
        facts = Facts.from_bytes(facts_bytes)
        held = held_state.read() or []
        mark = _best_held(held, short, (*pair, doc_id), self._rules, facts)
        version = _version(text_sha256)
        if not skipped(mark, self._settings) and all(
                (entry[0], (entry[5:6] or (None,))[0]) != (doc_id, version) for entry in held):
            expiry = ms_ceiling(timestamp + self._horizon).micros
            held.append((doc_id, mark.story_id if mark else doc_id, list(pair), expiry, short,
                         version, facts_bytes))
            _keep_held(sorted(held, key=_rank_of)[:MAX_HELD_PER_BAND], held_state, forget)
        key = _doc_key(doc_id, text_sha256) + (_SKIPPABLE if mark and mark.skippable else "")
        yield bid, ((key, mark.story_id, _versioned(mark.near_duplicate_of, mark.of_version),
                     mark.similarity) if mark else (key, None, None, None))

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
    by_doc: dict[str, list[tuple[str, str, float, bool]]] = {}
    for key, story, of, sim in verdicts:
        if of is not None and sim is not None:
            doc_key = key.rstrip(_SKIPPABLE)
            by_doc.setdefault(doc_key, []).append(
                (story or of.partition("\0")[0], of, sim, key.endswith(_SKIPPABLE)))
    found = {}
    for doc_key, matches in by_doc.items():
        _, of, sim, skippable = max(matches, key=lambda match: match[2])
        of_id, _, of_version = of.partition("\0")
        stories = collections.Counter(story for story, held, *_ in matches if held == of)
        rooted = [story for story, _ in stories.most_common() if story != of_id]
        found[doc_key] = StoryMark(rooted[0] if rooted else of_id, of_id, sim, skippable,
                                   of_version or None)
    return found


def decide(batch, verdicts: Iterable[Verdict], settings: NearDuplicateSettings,
           index: Optional[StoryIndex] = None, expiry: Optional[int] = None,
           now: Optional[int] = None):
    """The micro-batch with each document's mark: the best of what the band keys found (earlier
    micro-batches) and of what ``index`` holds (its earlier documents in this micro-batch; the
    local runner's: every article held), marked in ``story_rank`` order, as in batch; action
    ``skip`` leaves the skippable copies out, counted in ``near_duplicates``."""
    return decide_and_skip(batch, verdicts, settings, index, expiry, now)[0]


def decide_and_skip(batch, verdicts: Iterable[Verdict], settings: NearDuplicateSettings,
                    index: Optional[StoryIndex] = None, expiry: Optional[int] = None,
                    now: Optional[int] = None
                    ) -> tuple[MicroBatch, list[tuple[Any, StoryMark]], dict[str, StoryMark]]:
    """``decide``'s micro-batch, (document, mark) of each document skip left out, and every
    document's mark by its key."""
    found = _best_verdicts(verdicts)
    index = index if index is not None else StoryIndex(settings)
    marks: dict[str, StoryMark] = {}
    story_of: dict[str, str] = {}  # of the documents marked so far, by id
    for doc in sorted(batch.docs, key=lambda d: (story_rank(d), d.text_sha256)):
        signature = None if doc.minhash is None else from_bytes(doc.minhash)
        key = _doc_key(doc.id, doc.text_sha256)
        cross = found.get(key)
        if cross is not None and cross.near_duplicate_of in story_of:  # earlier in this batch
            cross = dataclasses.replace(cross, story_id=story_of[cross.near_duplicate_of])
        marks[key] = index.mark(doc.id, signature, story_rank(doc), cross,
                                version=doc.text_sha256, facts=facts_of(doc), expiry=expiry,
                                now=now)
        story_of.setdefault(doc.id, marks[key].story_id)
    kept, left_out = [], []
    for doc in batch.docs:
        mark = marks[_doc_key(doc.id, doc.text_sha256)]
        if skipped(mark, settings):
            left_out.append((doc, mark))
            continue
        if mark.is_copy:
            NEAR_DUPLICATES_MARKED.inc()
        kept.append(with_mark(doc, mark))
    NEAR_DUPLICATES.inc(len(left_out))
    return dataclasses.replace(batch, docs=tuple(kept),
                               near_duplicates=batch.near_duplicates + len(left_out)), \
        left_out, marks


_VERDICT_CODER = TupleCoder((StrUtf8Coder(), NullableCoder(StrUtf8Coder()),
                             NullableCoder(StrUtf8Coder()), NullableCoder(FloatCoder())))


class _Regroup(RegroupFn):
    """Per batch id: the header (the signed micro-batch) and one verdict per document and band, in
    any order -> the micro-batch marked (``decide``) once all are in; then its state is cleared
    (``RegroupFn``: the header awaits a verdict per signed document and band)."""

    VERDICTS = BagStateSpec("verdicts", _VERDICT_CODER)
    process = RegroupFn.processing(VERDICTS)

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings

    def awaits(self, header: MicroBatch) -> int:
        return sum(doc.minhash is not None for doc in header.docs) * self._settings.bands

    def complete(self, header: MicroBatch, verdicts: list):
        yield from _ask_originals(*decide_and_skip(header, verdicts, self._settings))


# --- per band key: what the band keys could not know -------------------------------------------

_ORIGINALS, _ASKING = "originals", "asking"
_HELD_AS, _SKIPPED_AS, _ASKED = "R", "S", "Q"
_RECORD_CODER = TupleCoder((StrUtf8Coder(), StrUtf8Coder(), NullableCoder(StrUtf8Coder())))


def _ask_originals(batch: MicroBatch, left_out: list, marks: dict[str, StoryMark]):
    """A marked micro-batch -> per document signed, a record of its story by its id and version
    (``_ORIGINALS``; a document skip left out: that it was, and as a copy of what); per copy
    whose original is in an earlier micro-batch, a question to that original's id and version;
    the micro-batch as a header by batch id when it asks (``_ASKING``), else as it is."""
    for doc, mark in left_out:
        yield pvalue.TaggedOutput(_ORIGINALS, (
            _versioned(doc.id, _version(doc.text_sha256)),
            (_SKIPPED_AS, mark.story_id, mark.near_duplicate_of)))
    here, asked = {doc.id for doc in batch.docs}, 0
    for doc in batch.docs:
        key = _doc_key(doc.id, doc.text_sha256)
        if doc.minhash is not None and doc.story_id is not None:
            yield pvalue.TaggedOutput(_ORIGINALS, (_versioned(doc.id, _version(doc.text_sha256)),
                                                   (_HELD_AS, doc.story_id, None)))
        mark = marks.get(key)
        if mark is not None and mark.is_copy and mark.near_duplicate_of not in here:
            asked += 1
            yield pvalue.TaggedOutput(_ORIGINALS, (
                _versioned(mark.near_duplicate_of, mark.of_version),
                (_ASKED, batch.batch_id, key)))
    if asked:
        yield pvalue.TaggedOutput(_ASKING, (batch.batch_id, (batch, asked)))
    else:
        yield batch


class _StoryPerArticle(beam.DoFn):
    """Per article id and version, in the global window: the story its micro-batch decided for
    it (or that skip left it out, and as a copy of what), for the horizon. A question is answered
    with what is recorded (``(batch id, (doc key, kind, story, of))``; kind None: nothing). One
    asked before its original's record is in (the original's micro-batch still being decided)
    waits for it, until the watermark passes the question's time; then it is answered with
    nothing, and the copy keeps what its band keys found."""

    RECORD = ReadModifyWriteStateSpec("record", _RECORD_CODER)
    WAITING = BagStateSpec("waiting", TupleCoder((VarIntCoder(), VarIntCoder(), VarIntCoder(),
                                                   StrUtf8Coder())))
    FORGET = TimerSpec("forget", TimeDomain.WATERMARK)
    GIVE_UP = TimerSpec("give_up", TimeDomain.WATERMARK)

    def __init__(self, settings: NearDuplicateSettings):
        self._horizon = Duration(seconds=settings.horizon_s)

    def process(self, element, timestamp=beam.DoFn.TimestampParam,
                record=beam.DoFn.StateParam(RECORD), waiting=beam.DoFn.StateParam(WAITING),
                forget=beam.DoFn.TimerParam(FORGET), give_up=beam.DoFn.TimerParam(GIVE_UP)):
        _, item = element
        if item[0] != _ASKED:
            record.write(tuple(item))
            forget.set(Timestamp(micros=ms_ceiling(timestamp + self._horizon).micros))
            yield from _answers(waiting, tuple(item))
            give_up.clear()
            return
        _, bid, doc_key = item
        known = record.read()
        if known is not None:
            yield tuple(bid), (doc_key, *known)
            return
        waiting.add((*bid, doc_key))
        give_up.set(timestamp)

    @on_timer(GIVE_UP)
    def give_up(self, waiting=beam.DoFn.StateParam(WAITING)):
        yield from _answers(waiting, (None, None, None))

    @on_timer(FORGET)
    def forget(self, record=beam.DoFn.StateParam(RECORD)):
        record.clear()


def _answers(waiting, known: tuple):
    """The answers to the questions waiting, each with ``known``; the questions cleared."""
    asked = list(waiting.read())
    waiting.clear()
    for *bid, doc_key in asked:
        yield tuple(bid), (doc_key, *known)


_ANSWER_CODER = TupleCoder((StrUtf8Coder(), NullableCoder(StrUtf8Coder()),
                            NullableCoder(StrUtf8Coder()), NullableCoder(StrUtf8Coder())))


class _Resolve(RegroupFn):
    """Per batch id: the header (a marked micro-batch, and how many questions it asked) and one
    answer per question -> the micro-batch with each copy in the story its original's
    micro-batch decided (a band key held the original under the story it found there), and a
    copy of an article skip left out naming that article's original (which has a row;
    similarity unknown: null)."""

    VERDICTS = BagStateSpec("answers", _ANSWER_CODER)
    process = RegroupFn.processing(VERDICTS)

    def arrival(self, item, verdicts):
        return tuple(item) if isinstance(item[0], MicroBatch) else (item, 0)

    def complete(self, header: MicroBatch, verdicts: list):
        yield resolve(header, verdicts)


def resolve(batch: MicroBatch, answers: Iterable[tuple]) -> MicroBatch:
    """The micro-batch's copies in their originals' decided stories (see ``_Resolve``); a copy of
    a copy within it follows its original."""
    told = {doc_key: (kind, story, of) for doc_key, kind, story, of in answers}
    story_of: dict[str, str] = {}
    docs = {}
    for doc in sorted(batch.docs, key=lambda d: (story_rank(d), d.text_sha256)):
        kind, story, of = told.get(_doc_key(doc.id, doc.text_sha256), (None, None, None))
        if kind == _HELD_AS and story:
            doc = dataclasses.replace(doc, story_id=story)
        elif kind == _SKIPPED_AS and story and of:
            doc = dataclasses.replace(doc, story_id=story, near_duplicate_of=of, similarity=None)
        elif doc.near_duplicate_of in story_of:
            doc = dataclasses.replace(doc, story_id=story_of[doc.near_duplicate_of])
        story_of.setdefault(doc.id, doc.story_id or doc.id)
        docs[_doc_key(doc.id, doc.text_sha256)] = doc
    return dataclasses.replace(batch, docs=tuple(
        docs[_doc_key(doc.id, doc.text_sha256)] for doc in batch.docs))


# --- the local runner's layout ----------------------------------------------------------------

class _Local:
    """What ``_MarkLocally`` holds in memory between micro-batches: the index, the sources'
    block counts and their boilerplate as last written, and how many writes of its state it has
    made (``generation``)."""

    def __init__(self, settings: NearDuplicateSettings):
        self.index = StoryIndex(settings, track_added=True)
        self.sources: dict[str, BlockCounts] = {}
        self.written: dict[str, bytes] = {}  # each source's boilerplate keys, as in the state
        self.generation = 0


_LOCAL: collections.OrderedDict[str, _Local] = collections.OrderedDict()
_LOCAL_LOCK = threading.Lock()
LOCAL_STATES = 4
"""The local layouts' states a process holds in memory, the most recently used: a local run (or
a test session) runs a few pipelines; a state dropped is read back from the runner's state."""


class _MarkLocally(beam.DoFn):
    """The local runner's layout (``transforms.dedup.state_layout_for``): every micro-batch through
    one state, marked by the same rules as the per key layout. The articles held and the
    sources' block counts live in memory (``_Local``, at most ``LOCAL_STATES`` a process), found
    again by the token the state holds (a name and the generation of its last write); the state
    itself is written as what each micro-batch adds (a bag of held entries) and, where a
    source's boilerplate changed, the sources' boilerplate keys; it is read back only when this
    process does not hold its generation (a fresh step, a retried bundle): the articles held and
    the boilerplate come back, the counts of blocks not yet boilerplate start again. So a
    micro-batch costs what its documents cost, whatever the number of stories held. The timer
    forgets what is past the horizon in one pass, an eighth of the horizon after the earliest
    expiry; an article past its expiry is never matched meanwhile."""

    HELD = BagStateSpec("held", HeldStoriesCoder())
    SOURCES = ReadModifyWriteStateSpec("sources", BytesCoder())
    TOKEN = ReadModifyWriteStateSpec("token", StrUtf8Coder())
    FORGET_AT = ReadModifyWriteStateSpec("forget_at", VarIntCoder())
    FORGET = TimerSpec("forget", TimeDomain.WATERMARK)

    def __init__(self, settings: NearDuplicateSettings):
        self._settings = settings
        self._horizon = Duration(seconds=settings.horizon_s)
        self._slack = Duration(seconds=settings.horizon_s / 8)

    def _local(self, token_state, held_state, sources_state) -> tuple[str, _Local]:
        token = token_state.read()
        name, _, generation = (token or f"{uuid.uuid4().hex}:0").partition(":")
        with _LOCAL_LOCK:
            local = _LOCAL.get(name)
            if local is not None:
                _LOCAL.move_to_end(name)
        if local is not None and local.generation == int(generation):
            return name, local
        local = _Local(self._settings)  # a fresh step: read the state back
        for entries in held_state.read():
            for entry in entries:
                held = _full_held(entry, self._settings.num_perm)
                if held is not None:
                    local.index.hold(held)
        local.index.take_added()
        local.written = _read_sources(sources_state.read())
        local.sources = {source: BlockCounts.known(keys, self._settings.boilerplate_min_docs)
                         for source, keys in local.written.items()}
        local.generation = int(generation)
        with _LOCAL_LOCK:
            _LOCAL[name] = local
            while len(_LOCAL) > LOCAL_STATES:
                _LOCAL.popitem(last=False)
        return name, local

    @staticmethod
    def _written(name: str, local: _Local, token_state, sources_state) -> None:
        """The token written; the sources' boilerplate too where it changed."""
        local.generation += 1
        now = {source: counts.boilerplate().astype("<u8").tobytes()
               for source, counts in local.sources.items()}
        if now != local.written:
            sources_state.write(_write_sources(now))
            local.written = now
        token_state.write(f"{name}:{local.generation}")

    def process(self, keyed, timestamp=beam.DoFn.TimestampParam,
                held_state=beam.DoFn.StateParam(HELD),
                sources_state=beam.DoFn.StateParam(SOURCES),
                token_state=beam.DoFn.StateParam(TOKEN),
                forget_at=beam.DoFn.StateParam(FORGET_AT), forget=beam.DoFn.TimerParam(FORGET)):
        _, batch = keyed
        settings = self._settings
        name, local = self._local(token_state, held_state, sources_state)
        now_s = int(timestamp.micros // 10**6)
        signed = sign([doc.text for doc in batch.docs], [None] * len(batch.docs), settings)
        batch = dataclasses.replace(batch, docs=tuple(
            with_signed(doc, s) for doc, s in zip(batch.docs, signed, strict=True)))
        known: list[tuple[Any, str, np.ndarray]] = []
        for doc, s in zip(batch.docs, signed, strict=True):
            source = source_of(doc)
            if source is not None:
                known.append((doc, source, s.block_keys))
        for doc, source, keys in known:  # counted first: a footer in this micro-batch counts
            counts = local.sources.setdefault(source, BlockCounts(settings.boilerplate_min_docs))
            counts.add(id_hash(doc.id), keys, now_s)
        boilerplate = {source: local.sources[source].boilerplate() for _, source, _ in known}
        cuts = [(_doc_key(doc.id, doc.text_sha256),
                 _boilerplate_of(boilerplate[source], keys.astype("<u8").tobytes()))
                for doc, source, keys in known]
        expiry = ms_ceiling(timestamp + self._horizon).micros
        marked = decide(sign_batch(batch, cuts, settings), [], settings, local.index, expiry,
                        now=timestamp.micros)
        added = local.index.take_added()
        if added:
            held_state.add([_entry_of(held) for held in added])
            if forget_at.read() is None:
                at = Timestamp(micros=expiry) + self._slack
                forget.set(at)
                forget_at.write(at.micros)
        self._written(name, local, token_state, sources_state)
        yield marked

    @on_timer(FORGET)
    def forget(self, fired=beam.DoFn.TimestampParam, held_state=beam.DoFn.StateParam(HELD),
               sources_state=beam.DoFn.StateParam(SOURCES),
               token_state=beam.DoFn.StateParam(TOKEN),
               forget_at=beam.DoFn.StateParam(FORGET_AT), forget=beam.DoFn.TimerParam(FORGET)):
        name, local = self._local(token_state, held_state, sources_state)
        kept = local.index.forget(fired.micros)
        held_state.clear()
        forget_at.clear()
        if kept:
            held_state.add([_entry_of(held) for held in kept])
            at = Timestamp(micros=min(held.expiry or 0 for held in kept)) + self._slack
            forget.set(at)
            forget_at.write(at.micros)
        for counts in local.sources.values():
            counts.forget(int(fired.micros // 10**6 - self._settings.horizon_s),
                          self._settings.boilerplate_max_blocks)
        self._written(name, local, token_state, sources_state)


def _entry_of(held: Held) -> tuple:
    """A held article as a state entry (its full signature: the local layout's)."""
    rank = None if held.rank is None else list(held.rank[:2])
    return (held.id, held.story_id, rank, held.expiry or 0, to_bytes(held.signature),
            held.version, None if held.facts is None else held.facts.to_bytes())


def _full_held(entry, num_perm: int) -> Optional[Held]:
    """A local layout's state entry as a ``Held`` (None for a signature of another length)."""
    id_, story, rank, expiry, sig, version, facts = entry
    if len(sig) != num_perm * 4:
        return None
    return Held(id_, story, from_bytes(sig), None if rank is None else (*rank, id_), version,
                Facts.from_bytes(facts), expiry)


def _write_sources(sources: dict[str, bytes]) -> bytes:
    """Each source's name and boilerplate keys (uint64 little-endian), one after another."""
    return b"".join(struct.pack("<II", len(name := source.encode("utf-8", "surrogatepass")),
                                len(keys)) + name + keys for source, keys in sources.items())


def _read_sources(data: Optional[bytes]) -> dict[str, bytes]:
    sources: dict[str, bytes] = {}
    at = 0
    data = data or b""
    while at + 8 <= len(data):
        n, m = struct.unpack_from("<II", data, at)
        at += 8
        sources[data[at:at + n].decode("utf-8", "surrogatepass")] = data[at + n:at + n + m]
        at += n + m
    return sources


class MarkStoriesStreaming(beam.PTransform):
    """MicroBatch -> the micro-batch with each document's story (and, action ``skip``, without the
    skippable copies, counted ``near_duplicates`` in its ledger); see the module.
    ``state="per_shard"``: the local runner's layout, one state for all (``_MarkLocally``)."""

    def __init__(self, settings: NearDuplicateSettings, state: str = "per_key"):
        super().__init__()
        self._settings, self._state = settings, state

    def expand(self, batches):
        settings = self._settings
        if self._state == "per_shard":
            return (batches
                    | "OneState" >> beam.Map(lambda batch: (0, batch)).with_output_types(
                        tuple[int, MicroBatch])
                    | "MarkInOneState" >> beam.ParDo(_MarkLocally(settings))
                    .with_output_types(MicroBatch))
        sources = batches | "AskSources" >> beam.ParDo(_AskSources(settings)).with_outputs(
            _REQUESTS, _HEADERS, main="signed").with_output_types(
            MicroBatch, requests=tuple[str, Any], headers=tuple[BatchId, MicroBatch])
        answers = sources[_REQUESTS] | "LearnPerSource" >> beam.ParDo(
            _LearnPerSource(settings)).with_input_types(tuple[str, Any]).with_output_types(
            tuple[BatchId, Any])
        cut = (by_batch("HeadersAndSources", sources[_HEADERS], answers)
               | "CutBoilerplate" >> beam.ParDo(_CutRegroup(settings)).with_output_types(
                   MicroBatch))
        signed = (sources.signed, cut) | "AllSigned" >> beam.Flatten().with_output_types(
            MicroBatch)
        asked = signed | "AskBands" >> beam.ParDo(_AskBands(settings)).with_outputs(
            _REQUESTS, _HEADERS, main="without_signatures").with_output_types(
            MicroBatch, requests=tuple[str, tuple[BatchId, str, list, bytes, str]],
            headers=tuple[BatchId, MicroBatch])
        verdicts = asked[_REQUESTS] | "MatchPerBand" >> beam.ParDo(
            _MatchPerBand(settings)).with_input_types(tuple[str, Any]).with_output_types(
            tuple[BatchId, Any])
        regrouped = by_batch("HeadersAndVerdicts", asked[_HEADERS], verdicts) | "Regroup" >> (
            beam.ParDo(_Regroup(settings)).with_outputs(_ORIGINALS, _ASKING, main="marked")
            .with_output_types(MicroBatch, originals=tuple[str, Any], asking=tuple[BatchId, Any]))
        answers = regrouped[_ORIGINALS] | "StoryPerArticle" >> beam.ParDo(
            _StoryPerArticle(settings)).with_input_types(tuple[str, Any]).with_output_types(
            tuple[BatchId, Any])
        resolved = by_batch("HeadersAndAnswers", regrouped[_ASKING], answers) | "Resolve" >> (
            beam.ParDo(_Resolve()).with_output_types(MicroBatch))
        return ((asked.without_signatures, regrouped.marked, resolved)
                | "AllMicroBatches" >> beam.Flatten().with_output_types(MicroBatch))

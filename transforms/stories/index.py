"""Which held article a text copies: the rules of a copy (``Rules``), the articles held in memory
by LSH band key (``StoryIndex``: batch's marking and the local runner's streaming state), and the
order articles are marked in (``story_rank``).

An article's mark (``StoryMark``): ``story_id`` is the story of the article it copies (the most
similar one held; its own id if none), ``near_duplicate_of`` that article's id and ``similarity``
the estimate. Every version of every article is held, copies too, under its story: a copy of a
copy joins the first one's story, and a reprint of an article's update finds the update.

A held article is a copy's original when:
- their estimated similarity reaches ``threshold`` (both signatures are of the texts without
  their sources' boilerplate, each with at least ``min_shingles`` shingles of its own);
- it is earlier in ``story_rank``, and within ``horizon_s`` before it (batch: by
  ``published_at``; streaming holds an article that long);
- where either is short (``short_chars``), both are, and they differ trivially
  (``transforms.stories.facts``).
Action ``skip`` leaves a copy out where, beyond that, the similarity reaches ``skip_threshold``,
the copy has ``skip_min_shingles`` shingles of its own, and its numbers are all its original's.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Callable, Iterable, Optional

import numpy as np

from transforms.settings import NearDuplicateSettings
from transforms.stories.facts import Facts, numbers_kept, trivial_difference
from transforms.stories.signature import band_keys, band_similarity, similarity, units

MAX_HELD_PER_BAND = 64
"""The most articles one band key holds (the earliest in ``story_rank``): a band value that many
texts share (a short template, a story reprinted hundreds of times) stays a small cell."""


@dataclasses.dataclass(frozen=True)
class StoryMark:
    """An article's story: ``story_id`` (its own id if it copies nothing held), the article it
    copies (``near_duplicate_of``) and their estimated ``similarity`` (None where it copies
    nothing); ``skippable``: action ``skip`` may leave it out (``Rules.skippable``);
    ``of_version``: which version of that article it copies, where known."""

    story_id: str
    near_duplicate_of: Optional[str] = None
    similarity: Optional[float] = None
    skippable: bool = False
    of_version: Optional[str] = None  # the version (text hash) of the article it copies
    signed: Optional[tuple] = None  # batch: (minhash, facts) it was marked with, where cut

    @property
    def is_copy(self) -> bool:
        return self.near_duplicate_of is not None

    @property
    def columns(self) -> dict:
        """The story columns of a row (``transforms.types.STORY_FIELDS``)."""
        return {"story_id": self.story_id, "near_duplicate_of": self.near_duplicate_of,
                "similarity": self.similarity}


@dataclasses.dataclass(frozen=True)
class Held:
    """An article held for matching: its id, story, signature, ``story_rank`` (None: before any
    article, as a previous output's), version (its text's hash: every version of an article is
    held), ``Facts`` (None: unknown, as in a signature written before them) and expiry (micros,
    streaming)."""

    id: str
    story_id: str
    signature: np.ndarray
    rank: Optional[tuple] = None
    version: Optional[str] = None
    facts: Optional[Facts] = None
    expiry: Optional[int] = None


_UNDATED = 1 << 62  # after every date


class Rules:
    """What makes a held article a copy's original, and the copy skippable (see the module)."""

    def __init__(self, settings: NearDuplicateSettings):
        self.settings = settings
        self.threshold = settings.threshold
        self._horizon_us = int(settings.horizon_s * 1e6)

    def in_order(self, rank: Optional[tuple], held: Held) -> bool:
        """Whether ``held`` comes before an article of ``rank`` (a rank of None: before every
        article, as a previous output's) and within the horizon of it (where both are dated: a
        previous output's article by the ``published_at`` its facts hold)."""
        if rank is None:
            return True
        if held.rank is None:
            published = None if held.facts is None else held.facts.published_us
            first = _UNDATED if published is None else published
        elif held.rank >= rank:
            return False
        else:
            first = held.rank[0]
        then = rank[0]
        return first >= _UNDATED or then >= _UNDATED or then - first <= self._horizon_us

    def _short(self, facts: Optional[Facts]) -> bool:
        return (facts is not None and facts.short is not None
                and units(facts.short) <= self.settings.short_chars)

    def confirms(self, facts: Optional[Facts], held: Optional[Facts]) -> bool:
        """Whether two texts at the threshold are copies by their facts: where either is short,
        both are kept (short, or a little longer: ``transforms.stories.sign.CARRIED``) and differ
        trivially."""
        if not (self._short(facts) or self._short(held)):
            return True
        return (facts is not None and held is not None and facts.short is not None
                and held.short is not None and trivial_difference(facts.short, held.short))

    def skippable(self, sim: float, facts: Optional[Facts], held: Optional[Facts],
                  whole_sim: Callable[[], float]) -> bool:
        """Whether action ``skip`` may leave the copy out: the similarity, the copy's own length,
        its numbers all its original's, and, where boilerplate was cut from either, the whole
        texts as similar (``whole_sim``): a cut never makes a copy skippable."""
        skip = self.settings.skip_threshold
        return (sim >= skip and facts is not None
                and facts.shingles >= self.settings.skip_min_shingles
                and numbers_kept(facts, held)
                and ((facts.whole is None and (held is None or held.whole is None))
                     or whole_sim() >= skip))


def best_match(signature: np.ndarray, candidates: Iterable[Held], rules: Rules, own_id: str,
               rank: Optional[tuple] = None, facts: Optional[Facts] = None,
               estimate: Optional[Callable] = None) -> Optional[StoryMark]:
    """The mark of the most similar candidate that ``rules`` take for the original (the first
    held of equal ones), or None. A candidate with the article's own id (another version of it)
    is not one, nor one later in ``story_rank``: an article is only a copy of an earlier one, so
    two can never be copies of each other, whatever order they are held in."""
    best: Optional[Held] = None
    best_sim = -1.0
    for held in candidates:
        if held.id == own_id or not rules.in_order(rank, held):
            continue
        sim = (estimate or similarity)(signature, held.signature)
        if sim >= rules.threshold and sim > best_sim and rules.confirms(facts, held.facts):
            best, best_sim = held, sim
    if best is None:
        return None
    found = best
    return StoryMark(found.story_id, found.id, round(best_sim, 6), rules.skippable(
        best_sim, facts, found.facts,
        lambda: band_similarity(_whole(signature, facts), _whole(found.signature, found.facts))),
        found.version)


def _whole(signature: np.ndarray, facts: Optional[Facts]) -> np.ndarray:
    """The low bytes of a text's whole signature: its facts' (where something was cut), else its
    own signature's (uint32 values, or already their low bytes)."""
    if facts is not None and facts.whole is not None:
        return np.frombuffer(facts.whole, dtype=np.uint8)
    return signature if signature.dtype == np.uint8 else signature.astype(np.uint8)


def skipped(mark: Optional[StoryMark], settings: NearDuplicateSettings) -> bool:
    """Whether action ``skip`` leaves the article of this mark out (not embedded, no row)."""
    return settings.action == "skip" and mark is not None and mark.is_copy and mark.skippable


class StoryIndex:
    """Articles held in memory, by band key: the batch marking and the local runner's state."""

    def __init__(self, settings: NearDuplicateSettings, track_added: bool = False):
        self._settings = settings
        self.rules = Rules(settings)
        self._by_band: dict[str, list[Held]] = {}
        self._held: dict[tuple[str, Optional[str]], Held] = {}
        self._marks: dict[tuple[str, Optional[str]], StoryMark] = {}
        self._added: Optional[list[Held]] = [] if track_added else None

    def __len__(self) -> int:
        return len(self._held)

    def mark(self, article_id: str, signature: Optional[np.ndarray],
             rank: Optional[tuple] = None, found: Optional[StoryMark] = None,
             version: Optional[str] = None, facts: Optional[Facts] = None,
             expiry: Optional[int] = None, now: Optional[int] = None) -> StoryMark:
        """The article's mark against what is held (never itself: another version of it is not a
        copy), then held under its story. A version marked before by this index (the same
        article twice) keeps its first mark; another version (an article updated) is marked and
        held on its own. A copy that action ``skip`` leaves out is not held: a later copy names
        an article that has a row. ``found``: a match found elsewhere (streaming: in the band
        keys' state), taken if more similar."""
        known = self._marks.get((article_id, version))
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
            candidates = (held for held in seen.values()
                          if now is None or held.expiry is None or held.expiry > now)
            match = best_match(signature, candidates, self.rules, article_id, rank, facts)
            if found is not None and (match is None
                                      or (found.similarity or 0) > (match.similarity or 0)):
                match = found
            mark = match or StoryMark(article_id)
            if not skipped(mark, self._settings):
                self.hold(Held(article_id, mark.story_id, signature, rank, version, facts,
                               expiry), keys)
        self._marks[(article_id, version)] = mark
        return mark

    def hold(self, held: Held, keys: Optional[list[str]] = None) -> None:
        """Holds a version of an article (a previous output's: marked before), under its story.
        A band key holds at most ``MAX_HELD_PER_BAND`` articles, the first held (the earliest:
        articles are held in ``story_rank`` order), as the streaming state does: a band value
        thousands of texts share would make the marking quadratic."""
        if (held.id, held.version) in self._held:
            return
        self._held[(held.id, held.version)] = held
        if self._added is not None:
            self._added.append(held)
        for key in keys or band_keys(held.signature, self._settings):
            cell = self._by_band.setdefault(key, [])
            if len(cell) < MAX_HELD_PER_BAND:
                cell.append(held)

    def held(self) -> Iterable[Held]:
        return self._held.values()

    def take_added(self) -> list[Held]:
        """The articles held since the last call (with ``track_added``)."""
        added, self._added = self._added or [], ([] if self._added is not None else None)
        return added

    def forget(self, before: int) -> list[Held]:
        """Drops the articles whose expiry is at or before ``before`` (micros); returns those
        kept."""
        kept = [held for held in self._held.values()
                if held.expiry is None or held.expiry > before]
        if len(kept) < len(self._held):
            self._held, self._by_band, self._marks = {}, {}, {}
            for held in kept:
                self.hold(held)
            self.take_added()
        return kept


def story_rank(doc) -> tuple[int, int, str]:
    """The order articles are marked in, the earliest first, as (micros, micros, id): streaming,
    by when newsvec could first see them, the Pub/Sub publish time (a publisher cannot backdate
    it), then ``published_at`` (the messages of one publish request share a publish time);
    batch (no publish time), by ``published_at`` (the publisher's word: within a run and the
    horizon, a backdated reprint becomes its story's original); undated, after every dated one;
    then id. The first of a story is its original; a copy is only ever marked a copy of an
    article earlier in this order."""
    published, seen = micros(doc.published_at), micros(_publish_time(doc))
    if seen is not None:
        return (seen, _UNDATED if published is None else published, doc.id)
    return (_UNDATED if published is None else published, 0, doc.id)


def micros(when) -> Optional[int]:
    return None if when is None else (when - _EPOCH) // dt.timedelta(microseconds=1)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def _publish_time(doc):
    lineage = getattr(doc.event, "lineage", None)
    return getattr(lineage, "publish_time", None)

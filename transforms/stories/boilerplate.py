"""A source's boilerplate, learned from its articles: the blocks (a title line, a sentence) that
at least ``boilerplate_min_docs`` different articles of one source share.

A publisher ends every article with the same disclaimer, opens it with the same newsletter header,
closes a press release with the same "About the company" paragraph. Counted as evidence of a copy,
such text made a source's short articles one story: 50 briefs of 400 characters with a 600-character
footer estimated 0.4-0.6 similar to each other. A block is boilerplate when articles of different
ids of its source hold it; a story that a source republishes under that many ids is taken as
boilerplate too (its copies are then each their own story: shown apart, never hidden), while the
same story in different sources (a wire story and its reprints) is never cut, however many print it.

``BlockCounts`` counts, per block key (``transforms.stories.signature.Shingled.keys``), the
different articles (a CRC-32 of the id: the versions of an article count once) that hold it, up
to ``min_docs``. Batch counts a run's articles exactly (``LearnBoilerplate``, a CombineFn per
source); streaming keeps one table per source within the horizon, at most ``max_blocks`` keys
(the least recently seen that are not boilerplate go first), encoded as numpy arrays.
"""
from __future__ import annotations

import struct
import zlib
from typing import Iterable, Optional

import apache_beam as beam
import numpy as np

_HEAD = struct.Struct("<BBI")  # version, min_docs, rows
_VERSION = 1


def id_hash(article_id: str) -> int:
    """A nonzero 32-bit hash of an article's id."""
    return zlib.crc32(article_id.encode("utf-8", "surrogatepass")) or 1


class BlockCounts:
    """Per block key, the different articles that hold it (up to ``min_docs`` id hashes, 0: a free
    slot) and when it was last seen (seconds). Rows sorted by key."""

    def __init__(self, min_docs: int, keys: Optional[np.ndarray] = None,
                 ids: Optional[np.ndarray] = None, seen: Optional[np.ndarray] = None):
        self.min_docs = min_docs
        self.keys = np.zeros(0, dtype=np.uint64) if keys is None else keys
        self.ids = np.zeros((0, min_docs), dtype=np.uint32) if ids is None else ids
        self.seen = np.zeros(0, dtype=np.uint32) if seen is None else seen
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # articles, keys, seen
        self._added: list[tuple[int, np.ndarray, int]] = []  # one article's: added by add

    @classmethod
    def known(cls, keys: bytes, min_docs: int) -> "BlockCounts":
        """A table whose ``keys`` (uint64 little-endian) are boilerplate already (read back from
        a state that kept only those)."""
        known = np.unique(np.frombuffer(keys, dtype="<u8").astype(np.uint64))
        ids = np.arange(1, known.size * min_docs + 1, dtype=np.uint32).reshape(-1, min_docs)
        return cls(min_docs, known, ids, np.zeros(known.size, dtype=np.uint32))

    def __len__(self) -> int:
        self._settle()
        return int(self.keys.size)

    def add(self, article: int, keys: np.ndarray, now: int = 0) -> None:
        """Counts one article (``id_hash``) as holding ``keys`` (block keys, 0s ignored)."""
        if keys.size:
            self._added.append((article, keys, now))
            if len(self._added) >= 1024:
                self._settle()

    def boilerplate(self) -> np.ndarray:
        """The keys at least ``min_docs`` articles hold (sorted)."""
        self._settle()
        return self.keys[self.ids[:, -1] != 0] if self.keys.size else self.keys

    def merge(self, other: "BlockCounts") -> None:
        other._settle()
        for slot in range(other.min_docs):
            held = other.ids[:, slot] != 0
            self._pending.append((other.ids[held, slot], other.keys[held], other.seen[held]))
        self._settle()

    def forget(self, before: int, max_blocks: int) -> None:
        """Drops the keys last seen before ``before``, then, beyond ``max_blocks``, those not
        boilerplate that were seen least recently."""
        self._settle()
        keep = self.seen >= before
        if np.count_nonzero(keep) > max_blocks:
            full = self.ids[:, -1] != 0
            order = np.lexsort((-self.seen.astype(np.int64), ~full))  # boilerplate, then newest
            keep = np.zeros_like(keep)
            keep[order[:max_blocks]] = True
            keep &= self.seen >= before
        if not keep.all():
            self.keys, self.ids, self.seen = self.keys[keep], self.ids[keep], self.seen[keep]

    def _settle(self) -> None:
        """Folds the articles added into the rows: new keys appended (then sorted), an article
        added to a known key's free slot when the key does not hold it yet."""
        if self._added:
            added, self._added = self._added, []
            sizes = [keys.size for _, keys, _ in added]
            self._pending.append((np.repeat(np.array([a for a, _, _ in added], np.uint32), sizes),
                                  np.concatenate([keys for _, keys, _ in added]),
                                  np.repeat(np.array([t for _, _, t in added], np.uint32), sizes)))
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        articles, keys, seen = (np.concatenate(column) for column in zip(*pending, strict=True))
        articles, keys, seen = articles[keys != 0], keys[keys != 0], seen[keys != 0]
        order = np.lexsort((articles, keys))
        keys, articles, seen = keys[order], articles[order], seen[order]
        at = np.searchsorted(self.keys, keys)
        known = at < self.keys.size
        known[known] = self.keys[at[known]] == keys[known]
        for i in np.flatnonzero(known):  # blocks seen before: the shared ones
            row = self.ids[at[i]]
            self.seen[at[i]] = max(self.seen[at[i]], seen[i])
            if row[-1] == 0 and articles[i] not in row:
                row[np.argmax(row == 0)] = articles[i]
        new = ~known
        if new.any():
            keys, articles, seen = keys[new], articles[new], seen[new]
            pair = np.ones(keys.size, dtype=bool)  # sorted by key, then article: one of each
            pair[1:] = (keys[1:] != keys[:-1]) | (articles[1:] != articles[:-1])
            keys, articles, seen = keys[pair], articles[pair], seen[pair]
            first = np.ones(keys.size, dtype=bool)
            first[1:] = keys[1:] != keys[:-1]
            starts = np.flatnonzero(first)
            group = np.cumsum(first) - 1
            rank = np.arange(keys.size) - starts[group]  # an article's place among its key's
            ids = np.zeros((starts.size, self.min_docs), dtype=np.uint32)
            held = rank < self.min_docs
            ids[group[held], rank[held]] = articles[held]
            latest = np.maximum.reduceat(seen, starts)
            all_keys = np.concatenate([self.keys, keys[starts]])
            order = np.argsort(all_keys, kind="stable")
            self.keys = all_keys[order]
            self.ids = np.concatenate([self.ids, ids])[order]
            self.seen = np.concatenate([self.seen, latest])[order]

    def to_bytes(self) -> bytes:
        self._settle()
        return b"".join((_HEAD.pack(_VERSION, self.min_docs, self.keys.size),
                         self.keys.astype("<u8").tobytes(), self.ids.astype("<u4").tobytes(),
                         self.seen.astype("<u4").tobytes()))

    @classmethod
    def from_bytes(cls, data: bytes, min_docs: int) -> "BlockCounts":
        """The table ``to_bytes`` wrote; a table of another version, shape or ``min_docs`` (the
        setting changed across an update) is started afresh."""
        if len(data) >= _HEAD.size:
            version, docs, rows = _HEAD.unpack_from(data)
            size = rows * (8 + 4 * docs + 4)
            if version == _VERSION and docs == min_docs and len(data) == _HEAD.size + size:
                at = _HEAD.size
                keys = np.frombuffer(data, "<u8", rows, at).astype(np.uint64)
                at += 8 * rows
                ids = np.frombuffer(data, "<u4", rows * docs, at).astype(np.uint32)
                at += 4 * rows * docs
                seen = np.frombuffer(data, "<u4", rows, at).astype(np.uint32)
                return cls(min_docs, keys, ids.reshape(rows, docs), seen)
        return cls(min_docs)


class LearnBoilerplate(beam.CombineFn):
    """(article id, block keys) of one source -> its boilerplate keys (sorted uint64), counted
    exactly over a batch run."""

    def __init__(self, min_docs: int):
        self._min_docs = min_docs

    def create_accumulator(self) -> BlockCounts:
        return BlockCounts(self._min_docs)

    def add_input(self, counts: BlockCounts, element) -> BlockCounts:
        article, keys = element
        counts.add(id_hash(article), keys)
        return counts

    def merge_accumulators(self, accumulators: Iterable[BlockCounts]) -> BlockCounts:
        accumulators = iter(accumulators)
        merged = next(accumulators)
        for counts in accumulators:
            merged.merge(counts)
        return merged

    def extract_output(self, counts: BlockCounts) -> np.ndarray:
        return counts.boilerplate()

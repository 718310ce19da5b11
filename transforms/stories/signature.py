"""A text's signature: a MinHash (rensa's R-MinHash, in Rust) of its character shingles, taken of
the text without its source's boilerplate.

The text is NFKC-folded, case-folded and stripped of whitespace, then cut into every run of
``shingle_chars`` characters. Shingles of characters need no word segmentation, so Japanese and
English are treated alike. The shingles are hashed here, in numpy (a polynomial hash, 64 bits,
computed from prefix sums), and handed to rensa as hashes: building a Python string per shingle
cost more than the MinHash itself (benchmarks/near_duplicates.py).

The text is also cut into blocks (its title line and its sentences), each with a key (the sum of
its shingles' hashes). A block that many articles of one source share (a footer, a disclaimer, a
newsletter header: ``transforms.stories.boilerplate``) is left out of the signature, and a text
with fewer than ``min_shingles`` distinct shingles left has no signature: too little of its own to
be anyone's copy.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import unicodedata
from typing import Optional

import numpy as np

try:
    import rensa
except ImportError:  # pragma: no cover - an install without the dependency
    rensa = None

from transforms.settings import NearDuplicateSettings

_PRIME = 0x100000001B3  # the FNV prime: odd, so the polynomial hash mixes every bit (and inverts)
_MASK = (1 << 64) - 1
# Where a block ends: after a sentence's last mark (followed by a space: "U.S." and "2.5" stay
# whole), after a CJK one, and at a line break (the title's end). The end is marked with a NUL,
# which prepared text never holds and which no folding step changes or removes.
_ENDS = ((". ", ".\0"), ("! ", "!\0"), ("? ", "?\0"), ("。", "。\0"), ("！", "！\0"),
         ("？", "？\0"), ("\n", "\0"))
_SAMPLE = 128  # shingles sampled to count a long text's distinct ones
WIDE_UNITS = 3
"""What a CJK character (kana, Han, Hangul: from U+2E80) counts for in a text's length, against 1
for a letter: a Japanese text says in 100 characters about what an English one says in 300."""
_WIDE = 0x2E80


def signature_version(settings: NearDuplicateSettings) -> str:
    """What two signatures must share to be compared: the MinHash algorithm's version and the
    settings that shape a signature. Kept beside each signature (``keys/``)."""
    algorithm = getattr(getattr(rensa, "RMinHash", None), "ALGORITHM_VERSION", "none")
    return (f"rensa-r{algorithm}-k{settings.shingle_chars}-p{settings.num_perm}"
            f"-s{settings.seed}")


def units(text: str) -> int:
    """A text's length as ``Shingled.units`` counts it: no whitespace, ``WIDE_UNITS`` a CJK
    character."""
    folded = "".join(text.split())
    return len(folded) + (WIDE_UNITS - 1) * sum(ch >= "\u2e80" for ch in folded)


def _fold(text: str) -> str:
    """NFKC (full-width digits and letters folded) and case folded; whitespace stays."""
    return unicodedata.normalize("NFKC", text).casefold()


def shingle_text(text: str) -> str:
    """The text a signature is taken of: ``_fold``, whitespace removed (re-spaced copies stay
    equal)."""
    return "".join(_fold(text).split()).replace("\u200b", "")


@functools.lru_cache(maxsize=4)
def _powers(size: int) -> tuple[np.ndarray, np.ndarray]:
    """(P^i, P^-i) mod 2^64 for i < ``size`` (uint64: numpy's products wrap as the hash does)."""
    inverse = pow(_PRIME, -1, 1 << 64)
    up, down = np.empty(size, dtype=np.uint64), np.empty(size, dtype=np.uint64)
    up[0] = down[0] = 1
    if size > 1:
        up[1:] = _PRIME
        down[1:] = inverse
        np.cumprod(up, out=up)
        np.cumprod(down, out=down)
    return up, down


def _powers_for(n: int) -> tuple[np.ndarray, np.ndarray]:
    size = 4096
    while size < n:
        size *= 4
    return _powers(size)


@dataclasses.dataclass(frozen=True)
class Shingled:
    """A text's shingle hashes (one per start, over ``shingle_text``), its blocks' spans in those
    folded characters (``starts``, ``ends``), their keys (``keys``: 0 for a block shorter than
    a shingle, which has no shingle of its own) and their lengths in ``units`` (``WIDE_UNITS``
    for a CJK character)."""

    hashes: np.ndarray
    k: int
    starts: np.ndarray
    ends: np.ndarray
    keys: np.ndarray
    units: np.ndarray

    @property
    def block_keys(self) -> np.ndarray:
        """The keys of the blocks long enough to have one (what boilerplate is counted over)."""
        return self.keys[self.keys != 0]

    def without(self, boilerplate: Optional[np.ndarray]) -> np.ndarray:
        """The hashes of the shingles that touch no block whose key is in ``boilerplate`` (sorted
        uint64)."""
        if boilerplate is None or not boilerplate.size or not self.hashes.size:
            return self.hashes
        cut = np.isin(self.keys, boilerplate) & (self.keys != 0)
        if not cut.any():
            return self.hashes
        n = self.hashes.size
        edges = np.zeros(n + 1, dtype=np.int64)
        np.add.at(edges, np.clip(self.starts[cut] - self.k + 1, 0, n), 1)
        np.add.at(edges, np.clip(self.ends[cut], 0, n), -1)
        return self.hashes[np.cumsum(edges[:n]) == 0]


def _with_ends(text: str) -> str:
    """``text`` with a NUL at the end of each block."""
    for end, with_mark in _ENDS:
        if end in text:
            text = text.replace(end, with_mark)
    return text


def blocks(text: str) -> list[str]:
    """``text``'s blocks, as ``shingle`` cuts it (those with no character but whitespace left
    out)."""
    return [block for block in _with_ends(text).split("\0") if shingle_text(block)]


_ASCII_SPACE = bytes(c for c in range(128) if chr(c).isspace())
_ASCII_ENDS = tuple((end.encode(), mark.encode()) for end, mark in _ENDS if end.isascii())


def _folded_codes(text: str) -> np.ndarray:
    """The code points (uint64) of ``shingle_text(_with_ends(text))``; an ASCII text's by bytes'
    own methods (NFKC leaves ASCII as it is, case folding lowers it), which cost a tenth."""
    if text.isascii():
        data = text.encode("ascii")
        for end, mark in _ASCII_ENDS:
            data = data.replace(end, mark)
        data = data.lower().translate(None, _ASCII_SPACE)
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint64)
    folded = shingle_text(_with_ends(text))
    return np.frombuffer(folded.encode("utf-32-le", "surrogatepass"),
                         dtype=np.uint32).astype(np.uint64)


def shingle(text: str, shingle_chars: int) -> Shingled:
    """``text``'s shingles and blocks (see ``Shingled``); a text shorter than a shingle is one
    shingle (and no block); an empty one has none."""
    codes = _folded_codes(text)
    at = np.flatnonzero(codes == 0)
    if at.size:
        codes = np.delete(codes, at) if at.size > 64 else codes[codes != 0]
    n = codes.size
    empty = np.zeros(0, dtype=np.int64)
    if n == 0:
        return Shingled(codes, shingle_chars, empty, empty, np.zeros(0, dtype=np.uint64), empty)
    k = min(shingle_chars, n)
    up, down = _powers_for(n)
    weighted = codes * down[:n]
    prefix = np.zeros(n + 1, dtype=np.uint64)
    np.cumsum(weighted, out=prefix[1:])
    hashes = (prefix[k:] - prefix[:n - k + 1]) * up[k - 1:n]
    if not at.size:  # one block
        ends, starts = np.array([n]), np.array([0])
    else:  # in the folded text; no empty block
        ends = np.unique(np.append(at - np.arange(at.size), n))
        ends = ends[ends > 0]
        starts = np.concatenate(([0], ends[:-1]))
    # A block's key: the polynomial hash of its folded text with every digit taken as 0 (a
    # publisher's "Updated 09:14, 7 December" line is one block whatever its time), for a block
    # with a shingle inside it; 0 (no key) for a shorter one. The digits' part of the prefix
    # sums is taken out at the blocks' ends only.
    masked = prefix[ends] - prefix[starts]
    digits = np.flatnonzero((codes >= 0x31) & (codes <= 0x39))
    if digits.size:
        taken = np.zeros(digits.size + 1, dtype=np.uint64)
        np.cumsum((codes[digits] - np.uint64(0x30)) * down[digits], out=taken[1:])
        masked -= (taken[np.searchsorted(digits, ends)] - taken[np.searchsorted(digits, starts)])
    keys = masked * up[ends - 1]
    keys[ends - starts < shingle_chars] = 0
    units = ends - starts
    if not text.isascii():
        wide = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(codes >= _WIDE, out=wide[1:])
        units = units + (WIDE_UNITS - 1) * (wide[ends] - wide[starts])
    return Shingled(hashes, k, starts, ends, keys, units)


def shingle_hashes(text: str, shingle_chars: int) -> np.ndarray:
    """One 64-bit hash per run of ``shingle_chars`` characters of ``shingle_text(text)``; a shorter
    text is one shingle; an empty one has none."""
    return shingle(text, shingle_chars).hashes


def distinct_at_least(hashes: np.ndarray, n: int) -> bool:
    """Whether ``hashes`` hold at least ``n`` distinct values: exactly for a short text, from
    ``_SAMPLE`` evenly spaced ones for a longer (a long text of a few shingles repeated has too
    few)."""
    if hashes.size < n:
        return False
    if hashes.size > _SAMPLE:
        if np.unique(hashes[::hashes.size // _SAMPLE]).size >= n:
            return True
    return np.unique(hashes).size >= n


def minhashes(hash_sets: list[np.ndarray], settings: NearDuplicateSettings
              ) -> list[Optional[np.ndarray]]:
    """The signature (``num_perm`` uint32) of each set of shingle hashes; None for an empty one."""
    if rensa is None:
        raise RuntimeError("near_duplicates needs the rensa package (pip install newsvec)")
    kept = [h for h in hash_sets if h.size]
    out: list[Optional[np.ndarray]] = [None] * len(hash_sets)
    if not kept:
        return out
    offsets = np.zeros(len(kept) + 1, dtype=np.uint64)
    offsets[1:] = np.cumsum([h.size for h in kept])
    matrix = rensa.RMinHash.digest_matrix_from_flat_token_hashes(
        np.concatenate(kept), offsets, settings.num_perm, settings.seed)
    rows = iter(np.asarray(matrix.to_rows(), dtype=np.uint32))
    for i, h in enumerate(hash_sets):
        if h.size:
            out[i] = next(rows)
    return out


def signatures(texts: list[str], settings: NearDuplicateSettings) -> list[Optional[np.ndarray]]:
    """The signature of each whole text (nothing cut); None for a text with no shingle."""
    return minhashes([shingle_hashes(text, settings.shingle_chars) for text in texts], settings)


def band_keys(signature: np.ndarray, settings: NearDuplicateSettings) -> list[str]:
    """The signature's LSH band keys, ``<band>:<16 hex>`` (band b: values ``b*band_rows`` up to
    ``(b+1)*band_rows``, as little-endian bytes): two signatures sharing one are candidates."""
    data, size = signature.astype("<u4").tobytes(), 4 * settings.band_rows
    blake2b = hashlib.blake2b
    return [f"{b}:{blake2b(data[b * size:(b + 1) * size], digest_size=8).hexdigest()}"
            for b in range(settings.bands)]


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """The estimated Jaccard similarity of two signatures: their share of equal values."""
    return float(np.count_nonzero(a == b)) / a.size


def to_bytes(signature: np.ndarray) -> bytes:
    return signature.astype("<u4").tobytes()


def from_bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u4")


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

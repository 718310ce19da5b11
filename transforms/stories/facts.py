"""What a copy must keep of its original beyond shared shingles: the facts a MinHash cannot see.

Two short texts that differ in one word share most of their shingles: "Fed raises rates by 25 basis
points" and "Fed cuts rates by 25 basis points" estimate 0.54, "Man arrested after stabbing" and
"Woman arrested after stabbing" 0.95 ("man" is inside "woman"). So a short text (at most
``short_chars`` characters of its own, boilerplate cut) is a copy only of another short text from
which it differs trivially (``trivial_difference``): in case, punctuation, width, a spelling
variant or typo of a long word, or a wire prefix, byline or dateline added at its start or end;
never in a number, a name or any other word.

And a copy is left out of the embedding (action ``skip``) only when its numbers are all its
original's (``numbers``): a reprint whose toll, score or price changed is a marked copy, with a
row of its own.

``Facts`` is what is kept of a text for both: its numbers (action ``skip``) and, for a short text,
the text itself (case folded); it travels as bytes (``to_bytes``) in ``keys/`` and in the streaming
state.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import struct
import zlib
from typing import Optional

_NUMBER = re.compile(r"\d+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
# A token: a run of letters of a script with spaces between words, a number, or one CJK
# character (Japanese and Chinese have no spaces: a character is the unit a word is changed by).
_TOKEN = re.compile(r"\d+(?:[.,:/]\d+)*|[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]"
                    r"|[^\W\d_\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")
AFFIX_CHARS = 24  # the most characters a prefix or suffix (wire credit, byline) may add
_VARIANT_CHARS = 6  # a word this long may differ by one edit (centre/center, a typo)

_HEADER = struct.Struct("<BHH")  # version and flags, numbers, shingles
_VERSION = 1


HEAD_CHARS = 40  # a dateline or credit at a text's start: "NEW YORK, Jan 5 (AFP) -"


def numbers(text: str) -> tuple[int, ...]:
    """The distinct runs of digits of a (NFKC-folded) text, thousands separators dropped ("1,000"
    and "1000" alike; "2.5" is 2 and 5), each as a CRC-32, sorted; a number only in its first
    ``HEAD_CHARS`` characters (a dateline's date, an "Updated 09:14" line) is not one of its
    facts."""
    found = [(match.start(), match.group()) for match in
             _NUMBER.finditer(_THOUSANDS.sub("", text))]
    later = {number for start, number in found if start >= HEAD_CHARS}
    return tuple(sorted(zlib.crc32(number.encode("ascii", "replace")) for number in later))


@dataclasses.dataclass(frozen=True)
class Facts:
    """A text's numbers (None: not kept, action ``mark``), for a short text the text itself
    (``_fold``ed; None for a longer one), and how many shingles of its own it was signed with
    (at most 65,535)."""

    numbers: Optional[tuple[int, ...]] = None
    short: Optional[str] = None
    shingles: int = 0

    def to_bytes(self) -> bytes:
        values = self.numbers or ()
        flags = (self.numbers is not None) | (self.short is not None) << 1
        return b"".join((_HEADER.pack(_VERSION << 2 | flags, len(values),
                                      min(self.shingles, 0xFFFF)),
                         struct.pack(f"<{len(values)}I", *values),
                         (self.short or "").encode("utf-8", "surrogatepass")))

    @classmethod
    def from_bytes(cls, data: Optional[bytes]) -> Optional["Facts"]:
        """The facts, or None for none or for bytes of another version or shape (written by a
        later release, or planted): a text without facts is never skipped, nor a short copy."""
        if not data or len(data) < _HEADER.size:
            return None
        head, count, shingles = _HEADER.unpack_from(data)
        end = _HEADER.size + 4 * count
        if head >> 2 != _VERSION or len(data) < end:
            return None
        values = struct.unpack_from(f"<{count}I", data, _HEADER.size)
        try:
            short = bytes(data[end:]).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return None
        return cls(tuple(values) if head & 1 else None, short if head & 2 else None, shingles)


def numbers_kept(copy: Optional[Facts], original: Optional[Facts]) -> bool:
    """Whether every number of ``copy`` is one of ``original``'s (both known)."""
    if copy is None or original is None or copy.numbers is None or original.numbers is None:
        return False
    return set(copy.numbers) <= set(original.numbers)


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` becomes ``b`` by one insertion, deletion, substitution or swap of
    neighbours."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return a == b
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    i = next((i for i in range(len(short)) if short[i] != long_[i]), len(short))
    return short[i:] == long_[i + 1:]


def _variant(a: str, b: str) -> bool:
    """A spelling variant or typo: words of letters, the longer at least ``_VARIANT_CHARS`` long
    (Iran and Iraq are not variants), one edit apart."""
    return (max(len(a), len(b)) >= _VARIANT_CHARS and min(len(a), len(b)) >= _VARIANT_CHARS - 1
            and a.isalpha() and b.isalpha() and _one_edit(a, b))


def _as_variants(words: list[str], other: list[str]) -> list[str]:
    known = set(other)
    same = {}
    for word in set(words) - known:
        variants = [them for them in known if _variant(word, them)]
        if len(variants) == 1:
            same[word] = variants[0]
    return [same.get(word, word) for word in words]


def trivial_difference(a: str, b: str) -> bool:
    """Whether two short texts (``_fold``ed) say the same: their tokens equal but for spelling
    variants, and for tokens only one of them has, at its start or end (a wire credit,
    a byline), of at most ``AFFIX_CHARS`` characters a side with no number among them. A first or
    last word changed ("Trump wins" / "Haley wins") is a change, not an affix."""
    x, y = tokens(a), tokens(b)
    if not x or not y:
        return False
    # A word of one that the other lacks, a spelling variant of one word of the other, is taken
    # as that word (both ways: the same verdict whichever text comes first)
    y = _as_variants(y, x)
    x = _as_variants(x, y)
    affix = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, x, y, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        at_edge = (i1 == 0 and j1 == 0) or (i2 == len(x) and j2 == len(y))
        if not at_edge or op == "replace":  # a word changed, or added within the text
            return False
        added = x[i1:i2] + y[j1:j2]
        if any(token[0].isdigit() for token in added):
            return False
        affix += sum(map(len, added))
        if affix > 2 * AFFIX_CHARS:
            return False
    # The texts' own words, not the affixes, must hold most of both
    return sum(map(len, x)) + sum(map(len, y)) >= 4 * affix

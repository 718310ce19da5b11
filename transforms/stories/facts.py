"""What a copy must keep of its original beyond shared shingles: the facts a MinHash cannot see.

Two short texts that differ in one word share most of their shingles: "Fed raises rates by 25 basis
points" and "Fed cuts rates by 25 basis points" estimate 0.54, "Man arrested after stabbing" and
"Woman arrested after stabbing" 0.95 ("man" is inside "woman"). So a short text (at most
``short_chars`` characters of its own, boilerplate cut) is a copy only of another short text from
which it differs trivially (``trivial_difference``): in case, punctuation, width, house style
("U.S."/"US", "cease-fire"/"ceasefire"), a spelling variant or typo of a long lower-case word, or a
wire credit added at its start or end; never in a number, a name, a negation or any other word.

And a copy is left out of the embedding (action ``skip``) only when its numbers are all its
original's (``numbers``: of the whole text, dates and times aside): a reprint whose toll, score or
price changed is a marked copy, with a row of its own.

``Facts`` is what is kept of a text for both: its numbers (action ``skip``), for a short text the
text itself, its ``published_at`` and, where its source's boilerplate was cut, the low bytes of
its whole text's signature; it travels as bytes (``to_bytes``) in ``keys/`` and in the streaming
state.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import struct
import unicodedata
import zlib
from typing import Optional

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_KANJI_NUMBER = "〇零一二三四五六七八九十百千万億兆"
# Dates and times are not facts of a story (a dateline, an "Updated 09:14 GMT" line): left out.
_MONTH = (r"(?:jan|feb|mar|apr|may|jun|jul|aug|sep|sept|oct|nov|dec)[a-z]*\.?")
_DATES = re.compile(
    rf"\b\d{{1,2}}:\d{{2}}(?::\d{{2}})?\b|\b\d{{4}}-\d{{2}}-\d{{2}}\b"
    rf"|\b{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?\b(?:,?\s+\d{{4}}\b)?"
    rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}\b(?:,?\s+\d{{4}}\b)?"
    rf"|\d+\s*(?:年|月|日|時|分|秒)", re.IGNORECASE)
_THOUSANDS = re.compile(r"(?<=\d)[,\u066c](?=\d{3}(?!\d))")
_NUMBER = re.compile(rf"\d+(?:[.\u066b]\d+)?|[{_KANJI_NUMBER}]+")
MAX_NUMBERS = 1024  # a text with more distinct numbers keeps none (it is never skipped)

# A token: a run of letters of a script with spaces between words, a number, or one CJK
# character (Japanese and Chinese have no spaces: a character is the unit a word is changed by).
_TOKEN = re.compile(rf"\d+(?:[.,:/]\d+)*|[{_CJK}]|[^\W\d_{_CJK}]+")
_IN_WORD = re.compile(r"(?<=[^\W\d_])[.\-‐‑’'](?=[^\W\d_])")  # U.S., cease-fire, don't
_EDGE_BRACKETS = re.compile(r"^\W*[(\[【（「『〈《][^)\]】）」』〉》]{1,40}[)\]】）」』〉》]"
                            r"|[(\[【（「『〈《][^)\]】）」』〉》]{1,40}[)\]】）」』〉》]\W*$")
# What a wire credit or byline is made of, besides words in brackets at an end
CREDIT_WORDS = frozenset(
    "reuters ap afp upi dpa efe ansa xinhua kyodo jiji yonhap bloomberg bbc cnn pa aap "
    "press associated agency agencies wire news by staff reporter reporters correspondent "
    "writer writers desk updated update breaking exclusive live video watch photos photo "
    "共 同 時 事 速 報 記 者 電 通 信 配".split())
# Words that change a number's size: never spelling variants of each other
NUMBER_WORDS = frozenset(
    "hundred hundreds thousand thousands million millions billion billions trillion trillions "
    "dozen dozens percent".split())
AFFIX_CHARS = 24  # the most characters a credit at one end may add
_VARIANT_CHARS = 6  # a lower-case word this long may differ by one edit (centre/center, a typo)

_HEADER = struct.Struct("<BHH")  # version and flags, numbers, shingles
_PUBLISHED = struct.Struct("<q")
_WHOLE = struct.Struct("<H")
_VERSION = 1
_NUMBERS, _SHORT, _WHEN, _WHOLE_FLAG = 1, 2, 4, 8


def numbers(text: str) -> Optional[tuple[int, ...]]:
    """The distinct numbers of a (NFKC) text, dates and times left out: each a run of digits of
    any script, with its decimals ("5.25" is one number; "1,000" and "1000" alike; "٤٥" is 45),
    or a run of kanji numerals as written; as CRC-32s, sorted. None for a text of more than
    ``MAX_NUMBERS`` (a table: never skipped)."""
    text = _THOUSANDS.sub("", _DATES.sub(" ", text))
    found = {_value(match) for match in _NUMBER.findall(text)}
    if len(found) > MAX_NUMBERS:
        return None
    return tuple(sorted(zlib.crc32(number.encode("utf-8")) for number in found))


def _value(number: str) -> str:
    """A number's digits in ASCII, without leading zeros ("09" is 9); kanji as written."""
    if number[0] in _KANJI_NUMBER:
        return number
    whole, _, decimals = number.replace("\u066b", ".").partition(".")
    digits = "".join(str(unicodedata.digit(ch)) for ch in whole).lstrip("0") or "0"
    return digits + ("." + "".join(str(unicodedata.digit(ch)) for ch in decimals)
                     if decimals else "")


@dataclasses.dataclass(frozen=True)
class Facts:
    """A text's numbers (None: not kept, action ``mark``), for a short text the text itself
    (NFKC, case kept; None for a longer one), how many shingles of its own it was signed with
    (at most 65,535), its ``published_at`` (micros; None: undated) and, where its source's
    boilerplate was cut from its signature, the low bytes of its whole text's (``whole``)."""

    numbers: Optional[tuple[int, ...]] = None
    short: Optional[str] = None
    shingles: int = 0
    published_us: Optional[int] = None
    whole: Optional[bytes] = None

    def to_bytes(self) -> bytes:
        values = self.numbers or ()
        flags = ((self.numbers is not None) * _NUMBERS | (self.short is not None) * _SHORT
                 | (self.published_us is not None) * _WHEN | (self.whole is not None) * _WHOLE_FLAG)
        parts = [_HEADER.pack(_VERSION << 4 | flags, len(values), min(self.shingles, 0xFFFF)),
                 struct.pack(f"<{len(values)}I", *values)]
        if self.published_us is not None:
            parts.append(_PUBLISHED.pack(self.published_us))
        if self.whole is not None:
            parts += [_WHOLE.pack(len(self.whole)), self.whole]
        parts.append((self.short or "").encode("utf-8", "surrogatepass"))
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: Optional[bytes]) -> Optional["Facts"]:
        """The facts, or None for none or for bytes of another version or shape (written by a
        later release, or planted): a text without facts is never skipped, nor a short copy."""
        if not isinstance(data, bytes) or len(data) < _HEADER.size:
            return None
        head, count, shingles = _HEADER.unpack_from(data)
        flags, at = head & 0xF, _HEADER.size + 4 * count
        if head >> 4 != _VERSION or len(data) < at:
            return None
        values = struct.unpack_from(f"<{count}I", data, _HEADER.size)
        published = whole = None
        try:
            if flags & _WHEN:
                (published,) = _PUBLISHED.unpack_from(data, at)
                at += _PUBLISHED.size
            if flags & _WHOLE_FLAG:
                (size,) = _WHOLE.unpack_from(data, at)
                whole = bytes(data[at + _WHOLE.size:at + _WHOLE.size + size])
                at += _WHOLE.size + size
                if len(whole) != size:
                    return None
            short = bytes(data[at:]).decode("utf-8", "surrogatepass")
        except (struct.error, UnicodeDecodeError):
            return None
        if short and not flags & _SHORT:
            return None
        return cls(tuple(values) if flags & _NUMBERS else None,
                   short if flags & _SHORT else None, shingles, published, whole)


def numbers_kept(copy: Optional[Facts], original: Optional[Facts]) -> bool:
    """Whether every number of ``copy`` is one of ``original``'s (both known)."""
    if copy is None or original is None or copy.numbers is None or original.numbers is None:
        return False
    return set(copy.numbers) <= set(original.numbers)


def tokens(text: str) -> list[tuple[str, bool]]:
    """(the word case folded, whether it was written in lower case) of each token of ``text``,
    a word's inner dots, hyphens and apostrophes dropped (house styles differ there)."""
    return [(token.casefold(), token == token.casefold())
            for token in _TOKEN.findall(_IN_WORD.sub("", text))]


def _credits(text: str) -> set[str]:
    """The words in brackets at ``text``'s start or end (a credit: "(Reuters)", "【共同】")."""
    return {word for group in _EDGE_BRACKETS.findall(text) for word, _ in tokens(group)}


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


def _variant(a: tuple[str, bool], b: tuple[str, bool]) -> bool:
    """A spelling variant or typo: words of letters written in lower case (not a name: Gambia
    and Zambia are two countries), the longer at least ``_VARIANT_CHARS`` long, one edit apart,
    neither a word of a number's size (million, billion)."""
    (x, x_lower), (y, y_lower) = a, b
    return (x_lower and y_lower and max(len(x), len(y)) >= _VARIANT_CHARS
            and min(len(x), len(y)) >= _VARIANT_CHARS - 1 and x.isalpha() and y.isalpha()
            and x not in NUMBER_WORDS and y not in NUMBER_WORDS and _one_edit(x, y))


def _as_variants(words: list[tuple[str, bool]], other: list[tuple[str, bool]]
                 ) -> list[tuple[str, bool]]:
    known = set(other)
    same = {}
    for word in set(words) - known:
        variants = [them for them in known if _variant(word, them)]
        if len(variants) == 1:
            same[word] = variants[0]
    return [same.get(word, word) for word in words]


def trivial_difference(a: str, b: str) -> bool:
    """Whether two short texts (NFKC) say the same: their words equal, case folded, but for
    spelling variants (``_variant``), and for words only one of them has at its start or end that
    are a credit (``CREDIT_WORDS``, or in brackets at that end), at most ``AFFIX_CHARS``
    characters a side, no digit among them. A first or last word changed ("Trump wins" / "Haley
    wins"), a word added inside or at an end that is not a credit ("No deal", "Israel denies")
    is a change."""
    x, y = tokens(a), tokens(b)
    if not x or not y:
        return False
    # A word of one that the other lacks, a spelling variant of one word of the other, is taken
    # as that word (both ways: the same verdict whichever text comes first)
    y = _as_variants(y, x)
    x = _as_variants(x, y)
    credit = CREDIT_WORDS | _credits(a) | _credits(b)
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(
            None, [w for w, _ in x], [w for w, _ in y], autojunk=False).get_opcodes():
        if op == "equal":
            continue
        at_edge = (i1 == 0 and j1 == 0) or (i2 == len(x) and j2 == len(y))
        if not at_edge or op == "replace":  # a word changed, or added within the text
            return False
        added = [word for word, _ in x[i1:i2] + y[j1:j2]]
        if (any(word[0].isdigit() or word not in credit for word in added)
                or sum(map(len, added)) > AFFIX_CHARS):
            return False
    return True

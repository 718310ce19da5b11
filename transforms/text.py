"""Prepare text: NewsEvent -> PreparedDoc (normalized text + the head of its token ids), or a dead
letter.

Normalization: HTML tags dropped and entities decoded, mojibake repaired (ftfy), Unicode NFC (or
NFKC: ``text.unicode_form``), control characters removed, invisible format characters (bidi
controls, joiners, soft hyphens) dropped, whitespace collapsed, and last a space put after every
``<`` that would open a tag (``defuse_markup``): text that only became markup on the way
(``&lt;script&gt;`` decoded, ``＜img＞`` folded to ASCII, ``<\u00adscript>`` once the soft hyphen
is dropped) is never live markup in the prepared text and title. Title and body are joined by a
newline.

Truncation keeps the HEAD of long articles: the text is tokenized here with the model's own
tokenizer, truncated on the right to ``max_tokens`` (special tokens included), and the ids go to
vLLM as they are. (vLLM's ``truncate_prompt_tokens`` would keep the tail, the wrong end for news.)
``model.document_prefix`` goes before the text and counts in its tokens. In chunks mode
(``transforms.chunking``) the whole text is tokenized, and cut into chunks as well.

Two fast paths give exactly the output of doing every step on every text (tools/reference_prepare.py
and tests/test_text_equivalence.py, on the BBC articles and the adversarial corpus):
- ftfy runs only on text it could change (``ftfy_may_change``): every one of its fixers is a
  no-op on the characters present, the text is NFC, and no window around a non-ASCII character
  looks like mojibake. Most news is ASCII or nearly so, and ftfy was 70% of the CPU time.
- a long text is tokenized in steps: first a prefix that ends where a BERT-style tokenizer
  splits whatever follows (before a space, after a CJK ideograph or a punctuation mark); if that
  already overflows ``max_tokens``, its head is the text's head. Otherwise a longer prefix, and
  at last the whole text. No bound on characters per token is assumed: none holds in every script
  (the proof: ``HeadTokenizer``). The unknown-token count reads the same prefix.

Hostile text costs time linear in its length, on every interpreter (Python 3.11.7's ``html.parser``
and ``unicodedata.normalize`` are quadratic on some inputs; the worker image pins a patched 3.11,
but these guards do not rely on it):
- the HTML parser may re-read the rest of a field for constructs that never close (``<a``,
  ``<a b="``, ``</``, ``<!``, ``<?``...) at most ``_RESCAN_FACTOR`` times the field's length; past
  that, the field's markup is removed by ``strip_markup_linear``, in a single pass;
- a run of more than ``MAX_COMBINING_RUN`` combining marks (non-starters) is cut to its first
  ``MAX_COMBINING_RUN`` before any Unicode normalization, ftfy's included (the Stream-Safe Text
  Format's limit: no text in any language needs more);
- titles longer than ``max_title_chars`` are dead-lettered (``text_too_long``), and so is a text
  that normalization makes longer than ``max_text_chars`` (NFKC writes U+FDFA as 18 characters),
  before the steps after it;
- ftfy's mojibake repair may read at most ``_DECODE_FACTOR`` times the text; past that, the text
  is fixed without it;
- each document has a budget of CPU time (``prepare_budget_s``), checked between the steps
  (normalization, tokenization, chunking, the unknown-token count) and in the loops that can be
  long: past it, the document is dead-lettered ``prepare_failed``.
"""
from __future__ import annotations

import functools
import hashlib
import html.parser
import itertools
import re
import sys
import threading
import time
import unicodedata
from typing import Generator, Iterable, Iterator, NamedTuple, Optional

import apache_beam as beam
import ftfy
import ftfy.badness
import ftfy.fixes
from apache_beam import pvalue

try:  # Python >= 3.11; typeshed has no stub for the private re._parser
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_parse

from transforms.chunking import Chunker, bert_style, copy_tokenizer
from transforms.engines.model import model_folder
from transforms.settings import (
    DEFAULT_MAX_TITLE_CHARS,
    DEFAULT_PREPARE_BUDGET_S,
    ChunkingSettings,
    ModelSettings,
    UnicodeForm,
)
from transforms.types import DEAD_LETTER, DeadLetter, NewsEvent, PreparedDoc, Reason, Step

_TOKENIZE_BATCH = 128
class PrepareTimeout(Exception):
    """A document used more than its budget of CPU time (``Deadline``)."""


# The clock of the budget: CPU time of the calling thread, so that other threads of the worker (and
# waiting for the GIL) do not count against a document. A module global, for the tests.
_clock = time.thread_time


class Deadline:
    """A document's budget of CPU time, checked between the steps of its preparation and every so
    often in the loops that can be long. Python cannot interrupt a thread from outside (signals
    reach only the main thread, and Beam runs DoFns in worker threads), so this is a backstop: the
    steps themselves are linear in the text (see the module docstring)."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self._start = _clock()

    def elapsed(self) -> float:
        return _clock() - self._start

    def check(self, step: str) -> None:
        elapsed = self.elapsed()
        if elapsed > self.budget_s:
            raise PrepareTimeout(f"{elapsed:.1f} s of CPU by {step}")


def _check(deadline: Optional[Deadline], step: str) -> None:
    if deadline is not None:
        deadline.check(step)

_TAG = re.compile(r"<[A-Za-z!/?]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\ufeff]")
# Invisible format characters (Unicode category Cf: bidi controls, joiners, soft hyphens, tags...)
# are dropped without a space: "co\u00adoperate" is one word. The model's tokenizer drops them too,
# so a text of nothing else is empty, not a row of special tokens only.
def _char_class(codepoints: list[int]) -> str:
    """A regex character class of these code points, as ranges (far faster to match than one
    escaped character each)."""
    ranges, start = [], None
    for c, nxt in zip(codepoints, codepoints[1:] + [None], strict=True):
        start = c if start is None else start
        if nxt != c + 1:
            ranges.append(re.escape(chr(start)) + ("" if start == c else "-" + re.escape(chr(c))))
            start = None
    return "[" + "".join(ranges) + "]"


_FORMAT = re.compile(_char_class(
    [c for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf"]))

# Combining marks: runs of more than this many non-starters are cut to their first this many
# (UAX #15's Stream-Safe Text Format allows 30; no text in any language needs more). Canonical
# ordering in Python <= 3.11.15's unicodedata.normalize is quadratic in a run's length.
MAX_COMBINING_RUN = 30
# Non-starters: characters whose decomposition (NFKD) is all combining marks (canonical combining
# class > 0): the marks themselves, and a few of class 0 that decompose to marks (U+0F73, U+0F75,
# U+0F81, U+FF9E, U+FF9F). No character's decomposition starts with a mark and holds a starter.
def _is_non_starter(ch: str) -> bool:
    if unicodedata.combining(ch):
        return True
    return bool(unicodedata.decomposition(ch)
                and unicodedata.combining(unicodedata.normalize("NFKD", ch)[0]))


_NON_STARTER = _char_class([c for c in range(sys.maxunicode + 1) if _is_non_starter(chr(c))])
_LONG_NON_STARTER_RUN = re.compile("(%s{%d})%s+" % (_NON_STARTER, MAX_COMBINING_RUN, _NON_STARTER))
# Every non-starter is U+0300 or above: a text without a run of that many such characters has no
# run to cut, and this is far faster to look for (the class above reaches past the BMP, where the
# regex engine has no bitmap: about 0.1 us per character).
_HIGH_RUN = re.compile("[^\\x00-\\u02ff]{%d}" % (MAX_COMBINING_RUN + 1))


def collapse_combining_marks(text: str) -> str:
    """``text`` with each run of more than ``MAX_COMBINING_RUN`` non-starters cut to its first
    ``MAX_COMBINING_RUN`` ("Zalgo" text). Any other text is returned as it is."""
    if text.isascii() or not _HIGH_RUN.search(text):
        return text
    return _LONG_NON_STARTER_RUN.sub(r"\1", text)


# ---- ftfy, adapted: the one place that changes how ftfy runs (tests/test_text.py checks that
# ftfy 6.3 still goes through both) ----

class _UnicodedataForFtfy:
    """``unicodedata`` as ftfy sees it: its ``normalize`` first cuts long runs of combining marks.
    ftfy decodes mojibake before normalizing, and a run of marks can come out of the decoding
    (``"\u0301\u0316"`` as UTF-8 read as Latin-1 is ``"Ì\x81Ì\x96"``), after newsvec's own cut. ftfy
    (6.3) calls ``unicodedata.normalize`` in one place, ``fix_and_explain``."""

    @staticmethod
    def normalize(form, text):
        return unicodedata.normalize(form, collapse_combining_marks(text))

    def __getattr__(self, name):
        return getattr(unicodedata, name)


class _MojibakeTooDeep(Exception):
    """ftfy's encoding steps read more than their allowance (``_ftfy``)."""


class _FtfyWork(threading.local):
    """What ftfy's encoding steps may still read in this thread, in characters (None: no bound,
    outside ``_ftfy``), the document's deadline, the steps taken so far, and the lines fixed so
    far (``_fix_line_once``)."""
    allowance: Optional[int] = None
    deadline: Optional[Deadline] = None
    steps = 0
    fixed: Optional[dict] = None


_FTFY_WORK = _FtfyWork()
_ftfy_encoding_step = ftfy._fix_encoding_one_step_and_explain  # pylint: disable=protected-access
_ftfy_fix_and_explain = ftfy.fix_and_explain


def _fix_line_once(text, config=None, **kwargs):
    """ftfy's ``fix_and_explain``, which ``fix_text`` calls by name for each line (each fixed on
    its own): inside ``_ftfy``, a line already fixed in the same text is not fixed again (its
    result is the same). Each call costs tens of microseconds however short the line: a text of
    many short lines, repeated, cost 100 times a normal text's time per character."""
    fixed = _FTFY_WORK.fixed
    if fixed is None or kwargs or config is None:
        return _ftfy_fix_and_explain(text, config, **kwargs)
    key = (text, config)
    if key not in fixed:
        fixed[key] = _ftfy_fix_and_explain(text, config)
    return fixed[key]


def _bounded_encoding_step(text, config):
    """ftfy's one step of mojibake repair (``_fix_encoding_one_step_and_explain``, which
    ``fix_encoding`` looks up by name at every step), charged the length of the text it reads."""
    work = _FTFY_WORK
    if work.allowance is not None:
        work.allowance -= len(text)
        if work.allowance < 0:
            raise _MojibakeTooDeep
        work.steps += 1
        if not work.steps % 256:
            _check(work.deadline, "ftfy's mojibake repair")
    return _ftfy_encoding_step(text, config)


ftfy.unicodedata = _UnicodedataForFtfy()  # type: ignore[assignment]
ftfy._fix_encoding_one_step_and_explain = _bounded_encoding_step  # pylint: disable=protected-access
ftfy.fix_and_explain = _fix_line_once

# ftfy (6.3) as fix_text runs it: per line, fix_encoding (only if is_bad(line)), then these
# fixers, then NFC, until nothing changes. remove_terminal_escapes needs ESC.
_FTFY_FIXERS = (ftfy.fixes.fix_c1_controls, ftfy.fixes.fix_latin_ligatures,
                ftfy.fixes.fix_character_width, ftfy.fixes.uncurl_quotes,
                ftfy.fixes.fix_line_breaks, ftfy.fixes.fix_surrogates,
                ftfy.fixes.remove_control_chars)


@functools.lru_cache(maxsize=65536)
def _ftfy_fixes_char(ch: str) -> bool:
    return ch == "\x1b" or any(fixer(ch) != ch for fixer in _FTFY_FIXERS)


_ASCII_FTFY_FIXES = re.compile(_char_class([c for c in range(128) if _ftfy_fixes_char(chr(c))]))
_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")
# The longest mojibake pattern ftfy looks for: a window this wide around each non-ASCII
# character sees every match that contains it.
_BADNESS_WIDTH = sre_parse.parse(ftfy.badness.BADNESS_RE.pattern,
                                 ftfy.badness.BADNESS_RE.flags).getwidth()[1]


def ftfy_may_change(text: str, deadline: Optional[Deadline] = None) -> bool:
    """False only if ``ftfy.fix_text`` would return ``text`` as it is (so it can be skipped)."""
    if text.isascii():
        # No mojibake without non-ASCII characters; the ASCII fixers' characters are listed.
        return bool(_ASCII_FTFY_FIXES.search(text))
    if _ASCII_FTFY_FIXES.search(text) or not unicodedata.is_normalized("NFC", text):
        return True
    if any(ord(ch) > 127 and _ftfy_fixes_char(ch) for ch in set(text)):
        return True
    # Mojibake: each match of ftfy's badness pattern holds a non-ASCII character and is at most
    # _BADNESS_WIDTH long, so it lies within that many characters of it, on its line (fix_text
    # checks each line on its own, and one of the patterns anchors at a line's start). So the
    # pattern is looked for around each run of non-ASCII characters, as far as it can reach, and
    # no further than the run's line; the line's bounds are found once per line.
    width = _BADNESS_WIDTH
    line_start = line_end = 0
    for count, run in enumerate(_NON_ASCII_RUN.finditer(text), 1):
        start, end = run.span()
        if start >= line_end:
            line_start = text.rfind("\n", 0, start) + 1
            line_end = text.find("\n", start)
            line_end = len(text) if line_end < 0 else line_end + 1
        around = text[max(line_start, start - width + 1): min(line_end, end - 1 + width)]
        if ftfy.badness.BADNESS_RE.search(around):
            return True
        if not count % 1024:
            _check(deadline, "the mojibake check")
    return False


# ftfy's patterns reach at most a few characters past the non-ASCII character they start from (the
# widest: 7, and a lookahead of 6 after "\xc3 "); ASCII further away is left as it is. So a long
# stretch of ASCII that ftfy leaves alone can stand out of the text ftfy reads: this much of it is
# kept on each side, and a marker takes the place of the rest.
_CONTEXT = 32
_UNTOUCHED_ASCII = _char_class([c for c in range(128) if c != 10 and not _ftfy_fixes_char(chr(c))])
_LONG_UNTOUCHED_STRETCH = re.compile(_UNTOUCHED_ASCII + "{%d,}" % (2 * _CONTEXT + 1))
_MARKER = "~#newsvec#~"


# ftfy repairs mojibake one step at a time, each step reading the whole line again; a line built so
# that each step leaves a new pair of mojibake ("Ã" + "ƒ" * n + "©") takes n steps, quadratic. The
# steps may read this many times the text given to ftfy, plus _DECODE_SLACK characters (the BBC
# articles need at most 3x); past that, the text is fixed without mojibake repair.
_DECODE_FACTOR = 8
_DECODE_SLACK = 4096


def _ftfy(text: str, deadline: Optional[Deadline] = None) -> str:
    """``ftfy.fix_text(text, unescape_html=False, normalization="NFC")``, its mojibake repair
    bounded: if its encoding steps read more than ``_DECODE_FACTOR`` times the text, the text is
    fixed without it (``fix_encoding=False``: the other fixers and NFC still run). A line that
    comes again is fixed once (``_fix_line_once``)."""
    work = _FTFY_WORK
    work.fixed = {}
    try:
        work.allowance, work.deadline, work.steps = (_DECODE_FACTOR * len(text) + _DECODE_SLACK,
                                                     deadline, 0)
        try:
            return ftfy.fix_text(text, unescape_html=False, normalization="NFC")
        except _MojibakeTooDeep:
            pass
        finally:
            work.allowance = work.deadline = None
        _check(deadline, "ftfy's mojibake repair")
        return ftfy.fix_text(text, unescape_html=False, normalization="NFC", fix_encoding=False)
    finally:
        work.fixed = None


def fix_text(text: str, deadline: Optional[Deadline] = None) -> str:
    """``ftfy.fix_text(text, unescape_html=False, normalization="NFC")``, faster: skipped where it
    would change nothing, and given only the neighbourhoods of the non-ASCII characters (with the
    lines kept whole) where it would; its mojibake repair bounded (``_ftfy``)."""
    if not ftfy_may_change(text, deadline):
        return text
    _check(deadline, "the mojibake check")
    if _MARKER in text or len(text) >= ftfy.TextFixerConfig().max_decode_length:
        return _ftfy(text, deadline)
    pieces, middles, last = [], [], 0
    for stretch in _LONG_UNTOUCHED_STRETCH.finditer(text):
        start, end = stretch.start() + _CONTEXT, stretch.end() - _CONTEXT
        pieces.append(text[last:start])
        middles.append(text[start:end])
        last = end
    if not middles:
        return _ftfy(text, deadline)
    pieces.append(text[last:])
    fixed = _ftfy(_MARKER.join(pieces), deadline).split(_MARKER)
    if len(fixed) != len(pieces):  # the marker was changed: cannot happen, but then do it whole
        return _ftfy(text, deadline)
    pairs = zip(fixed[:-1], middles, strict=True)  # the last piece has no middle after it
    return "".join(piece + middle for piece, middle in pairs) + fixed[-1]

_BLOCK_TAGS = frozenset(
    "address article aside blockquote br dd div dl dt figcaption figure footer h1 h2 h3 h4 h5 h6 "
    "header hr li main nav ol p pre section table td th tr ul".split())
_SKIP_TAGS = frozenset({"script", "style", "noscript", "template"})


class _TextExtractor(html.parser.HTMLParser):
    """Text content of an HTML fragment; block tags become spaces, scripts and styles are
    dropped."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in _SKIP_TAGS:
            self._skip += 1
        elif tag in _BLOCK_TAGS:
            self.parts.append(" ")

    def handle_endtag(self, tag):
        if tag in _SKIP_TAGS:
            self._skip = max(0, self._skip - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append(" ")

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def strip_html(text: str) -> str:
    """The text of an HTML fragment, by ``html.parser`` alone (``strip_markup`` bounds its cost)."""
    parser = _TextExtractor()
    parser.feed(text)
    parser.close()
    return "".join(parser.parts)


# How much the HTML parser may re-read for constructs that never close: this many times the
# field's length, plus _RESCAN_SLACK characters.
_RESCAN_FACTOR = 4
_RESCAN_SLACK = 4096


class _MarkupTooBroken(Exception):
    """The HTML parser re-read more than its allowance (``_BoundedTextExtractor``)."""


class _BoundedTextExtractor(_TextExtractor):
    """``_TextExtractor`` with a bound on its work. ``html.parser`` (before Python 3.11.14) is
    linear in its input except in one place: a construct that never closes (a tag, end tag,
    comment, declaration or processing instruction with no end) makes its ``parse_*`` method
    read the rest of the input and return -1, and then, at ``close()``, the parser takes only
    the construct's first characters as text and tries again at the next ``<``. So every such
    construct is charged the length of the rest of the input, and past the allowance
    ``_MarkupTooBroken`` is raised (``strip_markup`` then strips the markup in one pass)."""

    def __init__(self, allowance: int, deadline: Optional[Deadline]):
        super().__init__()
        self._allowance = allowance
        self._deadline = deadline
        self._calls = 0
        self._charged = 0  # characters charged so far

    def _charge(self, i: int, end: int) -> int:
        if end < 0:
            self._charged += len(self.rawdata) - i
            if self._charged > self._allowance:
                raise _MarkupTooBroken
        self._calls += 1
        if not self._calls % 1024:
            _check(self._deadline, "the HTML parser")
        return end

    def parse_starttag(self, i):
        return self._charge(i, super().parse_starttag(i))

    def parse_endtag(self, i):
        return self._charge(i, super().parse_endtag(i))

    def parse_comment(self, i, report=True):
        return self._charge(i, super().parse_comment(i, report))

    def parse_pi(self, i):
        return self._charge(i, super().parse_pi(i))

    def parse_html_declaration(self, i):
        return self._charge(i, super().parse_html_declaration(i))


def strip_markup(text: str, deadline: Optional[Deadline] = None) -> str:
    """The text of an HTML fragment: ``strip_html``'s, as long as the HTML parser stays within
    its allowance (always, for HTML that is not built to stall it); otherwise
    ``strip_markup_linear``'s."""
    parser = _BoundedTextExtractor(_RESCAN_FACTOR * len(text) + _RESCAN_SLACK, deadline)
    try:
        parser.feed(text)
        parser.close()
    except _MarkupTooBroken:
        _check(deadline, "the HTML parser")
        return strip_markup_linear(text, deadline)
    return "".join(parser.parts)


# strip_markup_linear's constructs: what starts one (no further than its second character: a
# construct that never closes is passed over, and must not have been read to its end), the end of
# a comment, a tag up to its ">" (its name as html.parser reads it), an end tag with space after
# "</" (which html.parser takes as one only whole: "</ p >"), the name of a marked section ("<![")
# and its ends.
_OPENER = re.compile(r"<(?:(!--)|/?[A-Za-z]|/\s+[A-Za-z]|[!?/])")
_COMMENT_CLOSE = re.compile(r"--\s*>")
_MARKUP_TAG = re.compile(r"<(/\s*)?([A-Za-z][^\t\n\r\f />\x00]*)[^>]*>|<[^>]*>")
_SPACED_END_TAG = re.compile(r"</\s*([a-zA-Z][-.a-zA-Z0-9:_]*)\s*>")
_SECTION_NAME = re.compile(r"[a-zA-Z][-_.a-zA-Z0-9]*\s*")
_SECTION_CLOSES = {"]]>": re.compile(r"]\s*]\s*>"), "]>": re.compile(r"]\s*>")}
_SECTION_CLOSE = {**dict.fromkeys(("temp", "cdata", "ignore", "include", "rcdata"), "]]>"),
                  **dict.fromkeys(("if", "else", "endif"), "]>")}
_CDATA_END = {tag: re.compile(r"</\s*%s\s*>" % tag, re.I) for tag in ("script", "style")}


def strip_markup_linear(text: str, deadline: Optional[Deadline] = None) -> str:
    """The text of an HTML fragment in one pass over it, with ``_TextExtractor``'s rules (block
    tags become spaces; scripts, styles, ``noscript`` and ``template`` are dropped; entities are
    decoded). Like Python 3.11's ``html.parser``, a construct that never closes (a comment or a
    marked section with no end, a tag with no ">" after it) is taken as text as far as the next
    ">" (or "<"), and what follows is read as markup again; a marked section with an unknown name
    raises ``AssertionError``, as the parser does. Unlike it, a tag ends at its first ``>`` even
    inside a quoted attribute value (which ``strip_markup`` only meets in markup built to stall
    the parser)."""
    extractor = _TextExtractor()
    last_gt = text.rfind(">")

    def last_start(pattern: re.Pattern) -> int:
        starts = [m.start() for m in pattern.finditer(text)]
        return starts[-1] if starts else -1

    last_comment_close = last_start(_COMMENT_CLOSE)
    last_section_close = {kind: last_start(close) for kind, close in _SECTION_CLOSES.items()}
    pos = data_from = 0
    parts = extractor.parts

    def data(end: int) -> None:
        if end > data_from and not extractor._skip:
            parts.append(html.unescape(text[data_from:end]))

    for count in itertools.count(1):
        match = _OPENER.search(text, pos)
        if match is None:
            break
        start = match.start()
        closing = name = end = None
        if match.group(1):  # a comment
            if last_comment_close >= start + 4:
                end = _COMMENT_CLOSE.search(text, start + 4).end()  # type: ignore[union-attr]
        elif text.startswith("<![", start):  # a marked section (CDATA...): dropped
            section = _SECTION_NAME.match(text, start + 3)
            if start + 3 == len(text):
                pass  # the end of the text: it never closes
            elif section is None:
                raise AssertionError(f"expected name token at {text[start:start + 20]!r}")
            elif section.end() < len(text):
                kind = _SECTION_CLOSE.get(section.group().strip().lower())
                if kind is None:
                    raise AssertionError(f"unknown status keyword {section.group()!r} in marked "
                                         f"section")
                if last_section_close[kind] >= start + 3:
                    end = _SECTION_CLOSES[kind].search(text, start + 3).end()  # type: ignore
        elif start <= last_gt:  # a tag, or a declaration, processing instruction or bogus comment
            tag_match = _MARKUP_TAG.match(text, start)
            assert tag_match, "a '>' is left after it"
            end = tag_match.end()
            closing, name = tag_match.groups()
            if closing is not None and closing != "/":  # "</ p>": an end tag only if whole
                spaced = _SPACED_END_TAG.match(text, start)
                name = spaced.group(1) if spaced else None  # else a bogus comment, dropped
        if end is None:  # it never closes: text, as far as the next ">" or "<"
            gt = text.find(">", start + 1) if start < last_gt else -1
            pos = gt + 1 if gt >= 0 else start + 1
            continue
        data(start)
        pos = data_from = end
        if name is not None:
            tag = name.lower()
            if closing is not None:
                extractor.handle_endtag(tag)
            elif text.endswith("/>", 0, end):
                extractor.handle_startendtag(tag, [])
            else:
                extractor.handle_starttag(tag, [])
                if tag in _CDATA_END:  # raw text (dropped: a skipped tag) up to its end tag
                    close = _CDATA_END[tag].search(text, end)
                    pos = data_from = close.start() if close else len(text)
        if not count % 1024:
            _check(deadline, "the markup stripper")
    data(len(text))
    return "".join(parts)


class TextTooLong(Exception):
    """Normalization made a field longer than ``normalize_text``'s ``max_chars``: NFKC writes some
    characters as many (U+FDFA is 18 characters), ftfy a ligature as its letters."""

    def __init__(self, chars: int):
        super().__init__(chars)
        self.chars = chars


def normalize_text(text: Optional[str], form: UnicodeForm = "NFC",
                   deadline: Optional[Deadline] = None, max_chars: Optional[int] = None) -> str:
    """One field's text, cleaned for the model, in Unicode ``form``. Idempotent. Its cost is
    linear in the text's length (see the module docstring); ``deadline``: the document's budget
    (``PrepareTimeout`` past it); ``max_chars``: ``TextTooLong`` if Unicode normalization makes
    the text longer (checked before the steps after it)."""
    if not text:
        return ""
    if _TAG.search(text):
        text = strip_markup(text, deadline)
    elif "&" in text:
        text = html.unescape(text)
    text = collapse_combining_marks(text)
    _check(deadline, "the HTML step")
    text = fix_text(text, deadline)  # NFC
    _check(deadline, "ftfy")
    if form == "NFKC" and not text.isascii():
        text = unicodedata.normalize("NFKC", text)  # NFKC(NFC(x)) == NFKC(x)
    if max_chars is not None and len(text) > max_chars:
        raise TextTooLong(len(text))
    if _CONTROL.search(text):
        text = _CONTROL.sub(" ", text)
    if not text.isascii():  # format characters (Cf) are all outside ASCII
        without = _FORMAT.sub("", text)
        if len(without) != len(text):
            # What stood between two runs of marks, or between a letter and its mark ("e\u200d"
            # "\u0301"), is gone: the runs are cut again, and the text normalized again.
            text = collapse_combining_marks(without)
            if not unicodedata.is_normalized(form, text):
                text = unicodedata.normalize(form, text)
    # str.split's whitespace is re's \s (the test checks each). Last, as every step before can
    # make a tag open: entities, ftfy's and NFKC's folding of full-width and small forms, a format
    # character dropped from between "<" and a letter.
    return defuse_markup(" ".join(text.split()))


# "<" then what makes it open something in HTML (the tokenizer's tag open state: an ASCII letter, a
# start tag or end tag; "!", a comment or declaration; "/", an end tag; "?", a processing
# instruction or bogus comment). After any other character "<" is text to every HTML and XML parser.
_TAG_OPEN = re.compile(r"<(?=[^\s0-9<>=])")


def defuse_markup(text: str) -> str:
    """``text`` with a space after every ``<`` that could open a tag (``<script>`` becomes
    ``< script>``): any ``<`` followed by what is not a space, an ASCII digit, ``<``, ``>`` or
    ``=``, so that neither HTML (a tag opens at an ASCII letter, ``!``, ``/`` or ``?``) nor XML
    (also at ``_``, ``:``, letters and other digits beyond ASCII) reads one. What is left of
    markup once the tags are stripped and the entities decoded (``&lt;img onerror=...&gt;``)
    then reads as text wherever the prepared title and text go, an HTML page that forgets to
    escape them included. Not escaped (``&lt;``): the outputs are plain text (Parquet, BigQuery,
    DuckDB, PostgreSQL, a terminal), which every consumer escapes for its own output, and the
    model would embed ``&lt;``'s tokens; nor removed: ``&lt;div&gt;`` in a title is a word of
    its text. A BERT-style tokenizer splits ``<`` off as punctuation either way: the same
    tokens, the same vector."""
    return _TAG_OPEN.sub("< ", text) if "<" in text else text


def join_text(title: str, body: str) -> str:
    """The text that is embedded, of a normalized title and body: title, a newline, body."""
    return "\n".join(part for part in (title, body) if part)


def compose_text(event: NewsEvent, form: UnicodeForm = "NFC") -> str:
    """The text that is embedded: normalized title, a newline, normalized body."""
    return join_text(normalize_text(event.title, form), normalize_text(event.body, form))


class Head(NamedTuple):
    """``HeadTokenizer.head``'s result: the token ids of the head, whether anything was cut, the
    length of the prefix of the text that was tokenized (its first tokens are the text's, so
    ``UnknownTokens`` reads the head's words there), and that tokenization, with its offsets,
    where it was made with them (else None)."""
    ids: tuple[int, ...]
    truncated: bool
    end: int
    encoding: object


class HeadTokenizer:
    """The model's tokenizer, truncating on the right (keeping the head) to ``max_tokens``.

    The head of a text is the first ``room`` tokens of the whole text (``room``: ``max_tokens``
    less the special tokens), and it was cut if there are more (tools/reference_prepare.py
    tokenizes every text whole). Tokenizing only a prefix ``text[:c]`` gives exactly that when
      (1) the prefix's tokens are the first tokens of the text's, and
      (2) the prefix has more than ``room`` tokens (its encoding overflows): the text, having those
          and more, overflows too, and both heads are the prefix's first ``room`` tokens.
    (2) is checked on every prefix tokenized. (1) holds for a BERT-style tokenizer (BERT's
    normalizer or none, then BERT's pre-tokenizer: MiniLM, bge, e5...) at a cut ``c`` where its
    pre-tokenizer splits whatever lies around: before a space, or after a character it makes a
    word of one token on its own (``_single_token_chars``: punctuation marks, which it isolates,
    and CJK ideographs, which the normalizer puts spaces around; each checked on the tokenizer
    itself, as Rust and Python do not agree on all of Unicode), as long as no added token that it
    matches in a text (``_added_in_text``: the special tokens, [CLS], [MASK]..., are read as text)
    holds a space or that character, so that no added token spans the cut.
    Then the prefix's words are the text's first words: the normalizer works character by
    character (it removes control characters, pads ideographs, lowercases, and strips accents after
    NFD, whose reordering moves combining marks only among themselves, never past a space or one
    of those characters), and the model tokenizes each word on its own. What the words hold does
    not matter: a word of combining marks alone normalizes to nothing, and WordPiece makes a word
    of over 100 characters one [UNK] (a run of kana or Thai of any length is one token), which
    only makes (2) fail, and then the whole text is tokenized.

    The cut is chosen so that (2) nearly always holds: before the ``room + 1``-th space (nearly
    every word is a token or more), or, in a text with fewer spaces (Chinese, Japanese), after
    the ``room + 1``-th single-token character, where (2) holds by construction. A text whose
    words are long (WordPiece reads a word of up to 100 characters again for each of its tokens:
    up to about a hundred times the cost of English per character) is first cut shorter, and
    further on while that does not overflow (``_cuts``), so that the characters tokenized stay
    within a few times what the head needs. Any other text, and every text of any other tokenizer
    (SentencePiece's Metaspace, byte-level BPE: not proven here), is tokenized whole."""

    def __init__(self, model: ModelSettings):
        model.apply_engine_env()  # e.g. HF_HUB_OFFLINE, read when transformers is imported
        from transformers import AutoTokenizer  # heavy import, only where it is used

        hf = AutoTokenizer.from_pretrained(model_folder(model), revision=model.revision,
                                           trust_remote_code=model.trust_remote_code)
        self._tok = hf.backend_tokenizer  # the fast (Rust) tokenizer, without Python overhead
        # A special token written in a text ("[SEP]", "[MASK]", "</s>") is text: the model's input
        # holds special tokens only where the tokenizer's post-processor puts them.
        self._tok.encode_special_tokens = True
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=model.max_tokens, direction="right")
        self.max_tokens = model.max_tokens
        room = model.max_tokens - self._tok.num_special_tokens_to_add(False)
        # Cuts before the room + 1-th space, and after as many single-token characters (found
        # when first needed, once: about 0.3 s). None: every text is tokenized whole.
        self._head_words = room + 1 if _cuts_at_words(self._tok) else None
        self._specials = self._tok.num_special_tokens_to_add(False)
        self._singles: Optional[tuple[re.Pattern, re.Pattern]] = None
        self._ascii_tok = _without_bert_normalizer(self._tok)
        # An added token that is not special (a model's own additions to its vocabulary) in a text
        # is matched before the normalizer, in the text's own case: a text that holds one does not
        # take the lowercased path.
        self._added = re.compile("|".join(map(re.escape, _added_in_text(self._tok))) or "(?!)")

    def __call__(self, text: str) -> tuple[tuple[int, ...], bool]:
        """(token ids of the head, whether anything was cut)."""
        return self.head(text)[:2]

    def batch(self, texts: list[str]) -> list[tuple[tuple[int, ...], bool]]:
        """``__call__`` for many texts."""
        return [self.head(text)[:2] for text in texts]

    def head(self, text: str, deadline: Optional[Deadline] = None) -> "Head":
        """The head of ``text`` (``Head``). A long text is first tokenized as far as a cut only
        (``_cuts``); the rest of it, only if that did not overflow. Plain ASCII texts skip the
        tokenizer's normalizer (see ``_without_bert_normalizer``). ``deadline`` is checked between
        the tries."""
        if (self._ascii_tok is not None and text.isascii() and not _BERT_CLEANS.search(text)
                and not self._added.search(text)):
            return self._head(self._ascii_tok, text.lower(), deadline)
        return self._head(self._tok, text, deadline)

    def _head(self, tok, text: str, deadline: Optional[Deadline]) -> "Head":
        cuts = self._cuts(text)
        end = next(cuts, 0)
        while end:
            e = tok.encode_batch_fast([text[:end]])[0]
            if e.overflowing:
                return Head(tuple(e.ids), True, end, None)
            _check(deadline, "tokenization")
            try:
                end = cuts.send(len(e.ids) - self._specials)
            except StopIteration:
                end = 0
        if self._head_words and len(text) > self._head_words * _FIRST_CUT_CHARS_PER_TOKEN:
            # a long text with nowhere to cut its head: tokenized once, with the offsets that
            # UnknownTokens reads (a second tokenization, otherwise)
            e = tok.encode(text)
            return Head(tuple(e.ids), bool(e.overflowing), len(text), e)
        e = tok.encode_batch_fast([text])[0]
        return Head(tuple(e.ids), bool(e.overflowing), len(text), None)

    def _cuts(self, text: str) -> Generator[int, int, None]:
        """Where to cut ``text`` to tokenize its head, at the places the class docstring proves,
        first to last; each is sent back the count of tokens its prefix held (not enough to
        overflow). None: the whole text is tokenized.

        The first is the cut before the ``room + 1``-th space, or after as many single-token
        characters (``_head_end``), whose prefix nearly always overflows. A text whose words are
        long and costly to tokenize (WordPiece reads a word of up to 100 characters again for each
        of its tokens) or too few for that cut is first cut shorter: at the last place at most
        ``_FIRST_CUT_CHARS_PER_TOKEN`` characters per token of the head from its start; then, while
        that does not overflow, further on, as far again at least, or as far as the tokens counted
        so far say the head reaches, with a quarter more (so the characters tokenized stay within
        a few times the last prefix's)."""
        if not self._head_words:
            return
        last = self._head_end(text)
        if last is None:
            return
        end, first = 0, self._head_words * _FIRST_CUT_CHARS_PER_TOKEN
        target = first
        while True:
            if last and target >= last:
                if last > end:
                    yield last
                return
            cut = self._cut_before(text, end, target) or self._cut_after(text, target)
            if not cut:
                return
            tokens = yield cut
            end = cut
            target = max(2 * end, end * self._head_words * 5 // (4 * max(tokens, 1)))

    def _head_end(self, text: str) -> Optional[int]:
        """The cut before the ``room + 1``-th space, or after as many single-token characters (see
        the class docstring); 0: the text has too few of both; None: it is short, tokenized
        whole."""
        assert self._head_words
        words = text.split(" ", self._head_words)
        if len(words) > self._head_words:
            return len(text) - len(words[-1]) - 1  # before the _head_words-th space
        if len(text) < self._head_words or (text.isascii() and len(text) <= _WHOLE_ASCII_CHARS):
            return None  # English with few spaces: short, tokenized whole
        match = self._single_chars()[1].match(text)
        return match.end() if match else 0

    def _single_chars(self) -> tuple[re.Pattern, re.Pattern]:
        """One single-token character; the shortest prefix that holds ``room + 1`` of them (found
        when first needed, once: about 0.3 s)."""
        if self._singles is None:
            with _SINGLES_LOCK:
                if self._singles is None:
                    chars, count = _single_token_chars(self._tok), self._head_words or 0
                    self._singles = (re.compile("[%s]" % chars if chars else "(?!)"),
                                     re.compile("(?:[^%s]*+[%s]){%d}" % (chars, chars, count)
                                                if chars else "(?!)"))  # (?!): none
        return self._singles

    def _cut_before(self, text: str, low: int, high: int) -> int:
        """The last place to cut in ``(low, high]`` (before a space, after a single-token
        character), 0 if none."""
        high = min(high, len(text) - 1)
        space = text.rfind(" ", low + 1, high + 1)
        single = 0
        for single_match in self._single_chars()[0].finditer(text, low, high):
            single = single_match.end()
        return max(space, single, 0)

    def _cut_after(self, text: str, low: int) -> int:
        """The first place to cut after ``low``, 0 if none (or at the text's end)."""
        space = text.find(" ", low + 1)
        single_match = self._single_chars()[0].search(text, low)
        cuts = [c for c in (space, single_match.end() if single_match else -1)
                if low < c < len(text)]
        return min(cuts, default=0)


_SINGLES_LOCK = threading.Lock()  # HeadTokenizer._singles is built once, by one thread
# HeadTokenizer's first cut is at most this many characters per token of the head from the start
# (English takes about 5; the cut before the head's last space comes first there).
_FIRST_CUT_CHARS_PER_TOKEN = 8
# An ASCII text with too few spaces to cut at is tokenized whole up to this length; a longer one
# (code, lists of links, markup that stayed text) is cut after single-token characters (its
# punctuation), as a text in a script without spaces is.
_WHOLE_ASCII_CHARS = 8192

# What BERT's normalizer changes in ASCII text besides the case: control characters (removed) and
# whitespace other than a space (made a space).
_BERT_CLEANS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _without_bert_normalizer(tokenizer):
    """A copy of a tokenizer whose normalizer is BERT's, without it: on ASCII text with no control
    characters that normalizer only lowercases (its accent, CJK and clean-up steps touch other
    characters) and turns tab, CR and LF into spaces (the pre-tokenizer splits at all three).
    Lowercasing in Python first gives the same ids for a fraction of the cost (the normalizer
    keeps an alignment per character: about a quarter of the tokenizer's time), except in a text
    that holds an added token, matched in the text's own case before the normalizer. None for any
    other normalizer, or if an added token is matched after it."""
    import json


    spec = json.loads(tokenizer.to_str())
    normalizer = spec.get("normalizer") or {}
    if (normalizer.get("type") != "BertNormalizer" or not normalizer.get("lowercase")
            or any(t.get("normalized") for t in spec.get("added_tokens") or ())):
        return None
    spec["normalizer"] = None
    return copy_tokenizer(tokenizer, json.dumps(spec))


def _added_in_text(tokenizer) -> list[str]:
    """The added tokens that this tokenizer matches in a text: all of them, but the special ones
    ([CLS], [SEP], [MASK]...) where it reads those as text (``encode_special_tokens``)."""
    return [t.content for t in tokenizer.get_added_tokens_decoder().values()
            if not (t.special and tokenizer.encode_special_tokens)]


def _cuts_at_words(tokenizer) -> bool:
    """Whether HeadTokenizer may tokenize a prefix of a text cut before a space or after a
    single-token character (see its docstring): BERT's pre-tokenizer (words at whitespace, then
    punctuation) after BERT's per-character normalizer (or none), and no added token that holds
    a space."""
    return bert_style(tokenizer) and not any(
        any(c.isspace() for c in t) for t in _added_in_text(tokenizer))


# Where BERT's normalizer puts spaces around CJK ideographs (its ``handle_chinese_chars``; the
# supplementary planes' ranges left out).
_BERT_CJK = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF))


def _single_token_chars(tokenizer) -> str:
    """The characters that this BERT-style tokenizer makes a word of exactly one token on their
    own, wherever they stand, and that no added token holds, as the inside of a regex character
    class ("" if none), each checked on the tokenizer:
    - punctuation, all of Unicode's (and the ASCII symbols, which BERT counts as punctuation):
      given all of them between letters (``"a" + "a".join(...) + "a"``), it makes each a word of
      one token (its own, or the unknown token);
    - CJK ideographs, if its normalizer puts spaces around them: it turns each into one
      character that is not a space, between two spaces."""
    import json
    import string

    spec = json.loads(tokenizer.to_str())
    in_added = set("".join(_added_in_text(tokenizer)))

    def usable(ch: str) -> bool:  # in no added token, and a starter (see HeadTokenizer)
        return ch not in in_added and all(unicodedata.combining(c) == 0
                                          for c in unicodedata.normalize("NFD", ch))

    marks = [ch for ch in map(chr, range(sys.maxunicode + 1))
             if (ch in string.punctuation or unicodedata.category(ch).startswith("P"))
             and usable(ch)]
    whole = copy_tokenizer(tokenizer)
    whole.no_truncation()
    text = "a" + "a".join(marks) + "a"
    encoding = whole.encode(text, add_special_tokens=False)
    tokens_per_word: dict = {}
    for word in encoding.word_ids:
        tokens_per_word[word] = tokens_per_word.get(word, 0) + 1
    single = [ord(text[start]) for (start, end), word in zip(encoding.offsets, encoding.word_ids,
                                                             strict=True)
              if end == start + 1 and tokens_per_word[word] == 1 and text[start] != "a"]
    if (spec.get("normalizer") or {}).get("handle_chinese_chars"):
        for low, high in _BERT_CJK:
            block = "".join(ch for ch in map(chr, range(low, high + 1)) if ch not in in_added)
            padded = tokenizer.normalizer.normalize_str(block)
            if len(padded) == 3 * len(block):
                single += [ord(ch) for i, ch in enumerate(block)
                           if padded[3 * i] == padded[3 * i + 2] == " "
                           and not padded[3 * i + 1].isspace()]
    return _char_class(sorted(single))[1:-1] if single else ""


def unknown_token_id(tokenizer, spec: Optional[str] = None) -> Optional[int]:
    """The id the tokenizer's model gives what it cannot read (BERT's ``[UNK]``, a SentencePiece
    model's ``<unk>``), read from the model itself; None where it never gives one: byte-level BPE
    (GPT-2, Qwen...), or byte fallback (its unknown characters become bytes). ``spec``: the
    tokenizer's ``to_str()``, if at hand."""
    import json

    model = json.loads(spec or tokenizer.to_str())["model"]
    if model.get("byte_fallback"):
        return None
    if model.get("type") == "Unigram":
        return model.get("unk_id")
    token = model.get("unk_token")
    return tokenizer.token_to_id(token) if token else None


def _is_word(text: str) -> bool:
    """Whether a piece of text holds a letter (any script): an unknown token of symbols only (an
    emoji, a flag) is not a word the model failed to read."""
    return any(unicodedata.category(ch)[0] == "L" for ch in text)


class UnknownTokens:
    """Counts the words of a prepared text that the model's tokenizer cannot read: its unknown
    tokens that hold a letter, among its own tokens (no special tokens, no document prefix). An
    unknown token of symbols only (emoji) counts neither way. Texts with no unknown id among their
    token ids (nearly all, for a model that fits the feed) cost one scan of their ids; in head mode
    the others have the prefix that gave their head tokenized once more, with offsets, to see what
    each unknown token covers (in chunks mode, the text's tokens have their offsets already)."""

    def __init__(self, tokenizer, document_prefix: str = ""):

        spec = tokenizer.to_str()
        self.unknown_id = unknown_token_id(tokenizer, spec)
        self._tok = copy_tokenizer(tokenizer, spec)
        self._tok.no_truncation()
        self._tok.no_padding()
        self._specials = self._tok.num_special_tokens_to_add(False)
        self._prefix = document_prefix

    def of_head(self, text: str, head_ids: tuple[int, ...], end: Optional[int] = None,
                encoding=None) -> tuple[int, int]:
        """(unknown words, tokens counted) of the head that ``head_ids`` (``HeadTokenizer.head``'s,
        of the prefix and ``text``) holds; ``end``: the length of the prefix of the document
        prefix and ``text`` that ``HeadTokenizer.head`` tokenized (its first tokens are the
        whole text's, cut where no token spans the cut; None: all of it); ``encoding``: that
        tokenization, if it has offsets (its special tokens are passed over)."""
        if self.unknown_id is None or self.unknown_id not in head_ids:
            return 0, 0
        if encoding is not None:
            own = [(i, offsets) for i, offsets, special in zip(
                encoding.ids, encoding.offsets, encoding.special_tokens_mask, strict=True)
                   if not special]
            return self._count(self._prefix + text, [i for i, _ in own], [o for _, o in own],
                               None, len(self._prefix))
        encoding = self._tok.encode((self._prefix + text)[:end], add_special_tokens=False)
        return self._count(self._prefix + text, encoding.ids, encoding.offsets,
                           len(head_ids) - self._specials, len(self._prefix))

    def of_text(self, text: str, ids, offsets) -> tuple[int, int]:
        """(unknown words, tokens counted) of the whole text, from its tokens (``ids`` and their
        ``offsets``: ``Chunker.encode``'s, of the text alone, with no special tokens)."""
        if self.unknown_id is None or self.unknown_id not in ids:
            return 0, 0
        return self._count(text, ids, offsets, None, 0)

    def _count(self, text: str, ids, offsets, limit: Optional[int],
               skip_chars: int) -> tuple[int, int]:
        unknown = counted = 0
        for token_id, (start, end) in itertools.islice(zip(ids, offsets, strict=True), limit):
            if start < skip_chars:  # the document prefix's
                continue
            if token_id == self.unknown_id:
                if not _is_word(text[start:end]):
                    continue
                unknown += 1
            counted += 1
        return unknown, counted


class TextTools(NamedTuple):
    """What preparing text needs of a model's tokenizer (see ``text_tools``)."""
    head: "HeadTokenizer"
    chunker: Optional[Chunker]  # in chunks and late modes only
    unknown: UnknownTokens


_TOOLS_LOCK = threading.Lock()
_TOOLS: dict[tuple[str, str], TextTools] = {}


def text_tools(model: ModelSettings, chunking: ChunkingSettings = ChunkingSettings()) -> TextTools:
    """The head tokenizer, the chunker (in chunks mode) and the unknown-token counter for these
    settings, built once per process and shared by every thread and DoFn instance. Building them
    costs about 100 ms (the tokenizer's files, and copies of it), and runners call ``setup`` as they
    please: the local streaming runner unpickles a new DoFn and calls ``setup`` at every bundle's
    start, which a soak run found to be a quarter of its time. All are used read-only once built
    (the Rust tokenizer's encode methods take no lock and change nothing)."""
    key = (model.model_dump_json(), chunking.model_dump_json())
    with _TOOLS_LOCK:
        if key not in _TOOLS:
            tokenizer = HeadTokenizer(model)
            chunker = (Chunker(tokenizer._tok, chunking, model.max_tokens,
                               model.document_prefix) if chunking.mode != "head" else None)
            _TOOLS[key] = TextTools(tokenizer, chunker,
                                    UnknownTokens(tokenizer._tok, model.document_prefix))
        return _TOOLS[key]


class _PrepareTextFn(beam.DoFn):
    def __init__(self, model: ModelSettings, max_text_chars: int, dead_letter_payload_bytes: int,
                 chunking: ChunkingSettings = ChunkingSettings(), *,
                 unicode_form: UnicodeForm = "NFC", max_unknown_token_ratio: float = 0.2,
                 max_title_chars: int = DEFAULT_MAX_TITLE_CHARS,
                 prepare_budget_s: float = DEFAULT_PREPARE_BUDGET_S):
        self._model, self._chunking = model, chunking
        self._max_text_chars, self._dl_bytes = max_text_chars, dead_letter_payload_bytes
        self._form, self._max_unknown = unicode_form, max_unknown_token_ratio
        self._max_title_chars, self._budget_s = max_title_chars, prepare_budget_s
        self._tokenizer: Optional[HeadTokenizer] = None
        self._chunker: Optional[Chunker] = None
        self._unknown: Optional[UnknownTokens] = None

    def setup(self):
        self._tokenizer, self._chunker, self._unknown = text_tools(self._model, self._chunking)

    def _tokenize(self, text: str, deadline: Deadline) -> tuple:
        """(head token ids, whether the head was cut, chunks, (unknown words, tokens counted)),
        the deadline checked after each step."""
        assert self._tokenizer is not None and self._unknown is not None, "setup() makes them"
        if self._chunker is not None:
            encoding = self._chunker.encode(text)
            _check(deadline, "tokenization")
            ids, truncated, chunks = self._chunker.split_encoded(
                text, encoding, check=lambda: _check(deadline, "chunking"))
            _check(deadline, "chunking")
            unknown = self._unknown.of_text(text, encoding.ids, encoding.offsets)
        else:
            ids, truncated, end, encoding = self._tokenizer.head(
                self._model.document_prefix + text, deadline)
            _check(deadline, "tokenization")
            chunks = ()
            unknown = self._unknown.of_head(text, ids, end, encoding)
        _check(deadline, "the unknown-token count")
        return ids, truncated, chunks, unknown

    def _dead_letter(self, event: NewsEvent, reason: Reason, detail: str):
        return pvalue.TaggedOutput(DEAD_LETTER, DeadLetter.for_event(
            event, Step.PREPARE, reason, detail, self._dl_bytes))

    def _compose(self, event: NewsEvent, deadline: Optional[Deadline] = None):
        """(the prepared title, the composed text), or a dead letter; ``PrepareTimeout`` past the
        deadline (the document's own, if none is given)."""
        deadline = deadline or Deadline(self._budget_s)
        length = len(event.title or "") + len(event.body or "")
        if length > self._max_text_chars:
            return self._dead_letter(event, Reason.TEXT_TOO_LONG,
                                     f"title and body hold {length} characters, over the limit of "
                                     f"{self._max_text_chars}")
        if len(event.title or "") > self._max_title_chars:
            return self._dead_letter(event, Reason.TEXT_TOO_LONG,
                                     f"the title holds {len(event.title or '')} characters, over "
                                     f"text.max_title_chars {self._max_title_chars} (is the body "
                                     f"in the title field?)")
        try:
            title = normalize_text(event.title, self._form, deadline, self._max_text_chars)
            text = join_text(title, normalize_text(event.body, self._form, deadline,
                                                   self._max_text_chars))
        except PrepareTimeout:
            raise
        except TextTooLong as exc:
            return self._expanded(event, exc.chars)
        except Exception as exc:  # pylint: disable=broad-except  # hostile markup must not crash
            return self._dead_letter(
                event, Reason.PREPARE_FAILED,
                f"text normalization failed: {type(exc).__name__}: {exc}"[:500])
        if len(text) > self._max_text_chars:
            return self._expanded(event, len(text))
        if not text:
            return self._dead_letter(event, Reason.EMPTY_AFTER_NORMALIZATION,
                                     "no text is left once HTML, control characters and whitespace "
                                     "are removed")
        return title, text

    def _expanded(self, event: NewsEvent, chars: int):
        return self._dead_letter(
            event, Reason.TEXT_TOO_LONG,
            f"normalization (text.unicode_form {self._form}) makes the text {chars} characters "
            f"long, over the limit of {self._max_text_chars}: some characters are written as "
            f"several in {self._form} (U+FDFA is 18)")

    def _unreadable(self, event: NewsEvent, unknown: int, counted: int):
        """A dead letter if the model cannot read most of the text (``max_unknown_token_ratio``):
        its head's tokens, or in chunks mode the whole text's (every chunk is embedded)."""
        if not unknown or unknown <= self._max_unknown * counted:
            return None
        where = "the text's" if self._chunker is not None else "its head's"
        return self._dead_letter(
            event, Reason.UNREADABLE_FOR_MODEL,
            f"{unknown} of {where} {counted} tokens are unknown to the model's tokenizer (ratio "
            f"{unknown / counted:.3f} > text.max_unknown_token_ratio {self._max_unknown}; language "
            f"{event.language or 'not given'}): the model cannot read this text; embed this feed "
            f"with a model whose vocabulary covers its language")

    def _prepare(self, event: NewsEvent):
        """The event's PreparedDoc, or its dead letter. Its budget of CPU time covers every step:
        normalization, tokenization, chunking and the unknown-token count."""
        deadline = Deadline(self._budget_s)
        try:
            composed = self._compose(event, deadline)
            if not isinstance(composed, tuple):
                return composed
            title, text = composed
            try:
                ids, truncated, chunks, (unknown, counted) = self._tokenize(text, deadline)
            except PrepareTimeout:
                raise
            except Exception as exc:  # pylint: disable=broad-except  # blame this text only
                return self._dead_letter(
                    event, Reason.PREPARE_FAILED,
                    f"tokenization failed: {type(exc).__name__}: {exc}"[:500])
        except PrepareTimeout as exc:
            return self._dead_letter(
                event, Reason.PREPARE_FAILED,
                f"text preparation went over its budget of text.prepare_budget_s "
                f"{self._budget_s:g} s of CPU ({exc}): the text is built to be slow to prepare, "
                f"or the worker is starved of CPU")
        unreadable = self._unreadable(event, unknown, counted)
        if unreadable is not None:
            return unreadable
        return PreparedDoc(event=event, text=text,
                           text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
                           token_ids=ids, truncated=truncated, chunks=chunks,
                           title=title or None)

    def process(self, events: list[NewsEvent]) -> Iterator:
        for event in events:
            yield self._prepare(event)


class PrepareText(beam.PTransform):
    """NewsEvent -> PreparedDoc (main output) and DeadLetter (``dead_letter`` output). In chunks
    mode (``transforms.chunking``) each document also holds its chunks.

    Text in ``unicode_form`` (``text.unicode_form``). An article the model cannot read (more than
    ``max_unknown_token_ratio`` of its head's tokens unknown to the tokenizer: ``UnknownTokens``;
    in chunks mode, of the whole text's) is dead-lettered ``unreadable_for_model``, not embedded:
    every such article would get about the same vector. A title over ``max_title_chars``, or a text
    over ``max_text_chars`` before or after normalization, is dead-lettered ``text_too_long``; a
    document that uses more than ``prepare_budget_s`` of CPU in preparation, ``prepare_failed``
    (``Deadline``)."""

    def __init__(self, model: ModelSettings, *, chunking: ChunkingSettings = ChunkingSettings(),
                 max_text_chars: int = 200_000, dead_letter_payload_bytes: int = 4096,
                 unicode_form: UnicodeForm = "NFC", max_unknown_token_ratio: float = 0.2,
                 max_title_chars: int = DEFAULT_MAX_TITLE_CHARS,
                 prepare_budget_s: float = DEFAULT_PREPARE_BUDGET_S):
        super().__init__()
        self._fn = _PrepareTextFn(model, max_text_chars, dead_letter_payload_bytes, chunking,
                                  unicode_form=unicode_form,
                                  max_unknown_token_ratio=max_unknown_token_ratio,
                                  max_title_chars=max_title_chars,
                                  prepare_budget_s=prepare_budget_s)

    def prepare(self, events: Iterable[NewsEvent]) -> list:
        """Each event's PreparedDoc, or its dead letter (a ``TaggedOutput``), prepared as the step
        does, outside a pipeline (``newsvec check-model``)."""
        self._fn.setup()
        return [self._fn._prepare(event) for event in events]

    def expand(self, events):
        return (events
                # Batches: each document is prepared on its own (its CPU budget covers all of its
                # steps), but the step keeps the shape a running streaming job was built with.
                | "Batch" >> beam.BatchElements(min_batch_size=_TOKENIZE_BATCH,
                                                max_batch_size=_TOKENIZE_BATCH)
                | "Prepare" >> beam.ParDo(self._fn).with_outputs(DEAD_LETTER, main="docs"))

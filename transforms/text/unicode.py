"""Unicode repair of a field's text: runs of combining marks cut (``collapse_combining_marks``),
ftfy's mojibake repair made fast (skipped where it would change nothing: ``ftfy_may_change``;
given only the neighbourhoods of non-ASCII characters: ``fix_text``) and bounded (its steps read
at most ``_DECODE_FACTOR`` times the text), and the control and invisible format characters that
``transforms.text.normalize`` drops."""
from __future__ import annotations

import functools
import re
import sys
import threading
import unicodedata
from typing import Optional

import ftfy
import ftfy.badness
import ftfy.fixes

try:  # Python >= 3.11; typeshed has no stub for the private re._parser
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_parse

from transforms.text.deadline import Deadline, _check


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



_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\ufeff]")
# Invisible format characters (Unicode category Cf: bidi controls, joiners, soft hyphens, tags...)
# are dropped without a space: "co\u00adoperate" is one word. The model's tokenizer drops them too,
# so a text of nothing else is empty, not a row of special tokens only.
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


# ---- ftfy, adapted: the one place that changes how ftfy runs (tests/input/test_text.py checks that
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

"""Markup stripped from a field: the text of an HTML fragment (``strip_markup``: by
``html.parser``, its re-reads bounded, else ``strip_markup_linear`` in one pass), and ``<`` that
could open a tag defused (``defuse_markup``)."""
from __future__ import annotations

import html.parser
import itertools
import re
from typing import Optional

from transforms.text.deadline import Deadline, _check

_TAG = re.compile(r"<[A-Za-z!/?]")  # a field that holds this goes through the HTML parser

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
    return _LinearStripper(text).strip(deadline)


def _last_start(pattern: re.Pattern, text: str) -> int:
    starts = [m.start() for m in pattern.finditer(text)]
    return starts[-1] if starts else -1


class _LinearStripper:
    """``strip_markup_linear``'s pass over one text. Where the last ``>``, comment end and marked
    section ends stand is found first: a construct that starts after them never closes, and is
    passed over without searching the rest of the text for its end."""

    def __init__(self, text: str):
        self.text = text
        self.extractor = _TextExtractor()
        self.last_gt = text.rfind(">")
        self.last_comment_close = _last_start(_COMMENT_CLOSE, text)
        self.last_section_close = {kind: _last_start(close, text)
                                   for kind, close in _SECTION_CLOSES.items()}

    def strip(self, deadline: Optional[Deadline]) -> str:
        text = self.text
        pos = data_from = 0
        for count in itertools.count(1):
            match = _OPENER.search(text, pos)
            if match is None:
                break
            start = match.start()
            end, closing, name = self._construct(match)
            if end is None:  # it never closes: text, as far as the next ">" or "<"
                gt = text.find(">", start + 1) if start < self.last_gt else -1
                pos = gt + 1 if gt >= 0 else start + 1
                continue
            self._data(data_from, start)
            pos = data_from = self._tag(end, closing, name)
            if not count % 1024:
                _check(deadline, "the markup stripper")
        self._data(data_from, len(text))
        return "".join(self.extractor.parts)

    def _data(self, start: int, end: int) -> None:
        if end > start and not self.extractor._skip:
            self.extractor.parts.append(html.unescape(self.text[start:end]))

    def _construct(self, match: re.Match) -> tuple[Optional[int], Optional[str], Optional[str]]:
        """Where the construct that ``match`` opens ends (None: it never closes), and for a tag,
        what stands between ``<`` and its name ("/" and spaces: an end tag) and its name."""
        text, start = self.text, match.start()
        if match.group(1):  # a comment
            if self.last_comment_close >= start + 4:
                end = _COMMENT_CLOSE.search(text, start + 4).end()  # type: ignore[union-attr]
                return end, None, None
            return None, None, None
        if text.startswith("<![", start):  # a marked section (CDATA...): dropped
            return self._section_end(start), None, None
        if start <= self.last_gt:  # a tag, declaration, processing instruction or bogus comment
            return self._tag_end(start)
        return None, None, None

    def _section_end(self, start: int) -> Optional[int]:
        text = self.text
        section = _SECTION_NAME.match(text, start + 3)
        if start + 3 == len(text):
            return None  # the end of the text: it never closes
        if section is None:
            raise AssertionError(f"expected name token at {text[start:start + 20]!r}")
        if section.end() >= len(text):
            return None
        kind = _SECTION_CLOSE.get(section.group().strip().lower())
        if kind is None:
            raise AssertionError(f"unknown status keyword {section.group()!r} in marked "
                                 f"section")
        if self.last_section_close[kind] >= start + 3:
            return _SECTION_CLOSES[kind].search(text, start + 3).end()  # type: ignore
        return None

    def _tag_end(self, start: int) -> tuple[int, Optional[str], Optional[str]]:
        tag_match = _MARKUP_TAG.match(self.text, start)
        assert tag_match, "a '>' is left after it"
        closing: Optional[str] = tag_match.group(1)
        name: Optional[str] = tag_match.group(2)
        if closing is not None and closing != "/":  # "</ p>": an end tag only if whole
            spaced = _SPACED_END_TAG.match(self.text, start)
            name = spaced.group(1) if spaced else None  # else a bogus comment, dropped
        return tag_match.end(), closing, name

    def _tag(self, end: int, closing: Optional[str], name: Optional[str]) -> int:
        """The tag that ends at ``end`` given to the extractor; returns where the text after it
        starts (a script's or style's raw text is passed over, to its end tag)."""
        if name is None:
            return end
        tag = name.lower()
        if closing is not None:
            self.extractor.handle_endtag(tag)
        elif self.text.endswith("/>", 0, end):
            self.extractor.handle_startendtag(tag, [])
        else:
            self.extractor.handle_starttag(tag, [])
            if tag in _CDATA_END:  # raw text (dropped: a skipped tag) up to its end tag
                close = _CDATA_END[tag].search(self.text, end)
                return close.start() if close else len(self.text)
        return end


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

"""Text preparation: normalization, composition and head truncation with the model's tokenizer."""
import csv
import hashlib
import re
import unicodedata

import apache_beam as beam
import pytest
from apache_beam import pvalue
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.common import bbc_file
from transforms.text import PrepareText, compose_text, normalize_text
from transforms.types import NewsEvent, Reason


@pytest.mark.parametrize("raw, clean", [
    ("Â£5m deal", "£5m deal"),                         # mojibake, as in the BBC data
    ("itâ€™s a cafÃ©", "it's a café"),                 # mojibake, curly quote straightened
    ("<p>Hello &amp; <b>world</b></p><p>next</p>", "Hello & world next"),
    ("<div>kept</div><script>var dropped = 1;</script><style>p {}</style>", "kept"),
    ("AT&amp;T &lt;b&gt; &#8217; &nbsp;x", "AT&T < b> ' x"),  # decoded once, tag defused
    ("&amp;lt;", "&lt;"),                                   # never decoded twice
    ("AT&T < 5 > 3", "AT&T < 5 > 3"),                       # not HTML: left alone
    ("  many   spaces\t\ttabs\n\n\nlines  ", "many spaces tabs lines"),
    ("cafe\u0301", "caf\u00e9"),                           # NFC
    ("zero\u200bwidth\ufeff and bell\x07", "zero width and bell"),
    ("", ""),
    (None, ""),
])
def test_normalize_text(raw, clean):
    assert normalize_text(raw) == clean


def test_normalize_is_idempotent_on_real_bbc_text():
    with open(bbc_file("test.csv"), encoding="utf-8") as f:
        # The first 200 rows of the file: shorter than it on purpose.
        texts = [row["text"] for _, row in zip(range(200), csv.DictReader(f), strict=False)]
    damaged = [t for t in texts if "Â" in t or "â€" in t]
    assert damaged, "the BBC sample should hold real mojibake"
    for text in texts:
        once = normalize_text(text)
        assert normalize_text(once) == once
        assert "Â£" not in once and "â€" not in once


def test_compose_joins_title_and_body_and_skips_empty_parts():
    assert compose_text(NewsEvent(id="1", title=" T ", body="<p>B</p>")) == "T\nB"
    assert compose_text(NewsEvent(id="1", title=None, body="B")) == "B"
    assert compose_text(NewsEvent(id="1", title="T", body="   ")) == "T"


def test_head_tokenizer_keeps_the_head_and_flags_truncation(tokenizer):
    short_ids, short_cut = tokenizer("the bank held rates")
    assert not short_cut and len(short_ids) == 6  # [CLS] 4 words [SEP]
    words = " ".join(f"word{i}" for i in range(2000))
    ids, cut = tokenizer(words)
    assert cut and len(ids) == tokenizer.max_tokens
    head_ids, _ = tokenizer(" ".join(f"word{i}" for i in range(20)))
    assert ids[: len(head_ids) - 1] == head_ids[:-1], "the head of the text must be kept"
    assert ids[-1] == short_ids[-1], "the last token is still the end-of-text token"


def test_head_tokenizer_bounds_the_work_on_huge_text(tokenizer):
    ids, cut = tokenizer("news " * 1_000_000)  # 5 MB of real words: only the head is tokenized
    assert cut and len(ids) == tokenizer.max_tokens
    assert len(set(ids[1:-1])) == 1, "all kept tokens are the repeated word"


def _prepare(**kwargs):
    from tests.common import make_config

    return PrepareText(make_config().model, **kwargs)


def test_prepare_text_outputs_docs_and_dead_letters():
    events = [
        NewsEvent(id="ok", title="Rates", body="The bank held rates."),
        NewsEvent(id="html-only", body="<script>x()</script><p> </p>"),
        NewsEvent(id="long", body="z" * 1000),
        NewsEvent(id="bad-markup", body="<p>x</p><![foo]> text"),  # html.parser raises on this
    ]
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(events) | _prepare(max_text_chars=500)
        assert_that(out.docs | beam.Map(lambda d: (d.event.id, d.text, d.text_sha256,
                                                   d.token_count, d.truncated)),
                    equal_to([("ok", "Rates\nThe bank held rates.",
                               hashlib.sha256(b"Rates\nThe bank held rates.").hexdigest(), 8,
                               False)]), label="docs")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.event_id, d.step, d.reason)),
                    equal_to([("html-only", "prepare_text", Reason.EMPTY_AFTER_NORMALIZATION),
                              ("long", "prepare_text", Reason.TEXT_TOO_LONG),
                              ("bad-markup", "prepare_text", Reason.PREPARE_FAILED)]), label="dead")


def test_dead_letters_after_parsing_keep_the_message_id_of_streamed_events():
    from transforms.types import DeadLetter, Lineage

    event = NewsEvent(id="s-1", body="<![foo]>").model_copy(
        update={"lineage": Lineage(message_id="777", publish_time=None)})
    letter = DeadLetter.for_event(event, "prepare_text", Reason.PREPARE_FAILED, "bad markup", 10)
    assert (letter.event_id, letter.message_id, letter.payload) == ("s-1", "777", '{"id":"s-1')
    assert letter.payload_bytes > 10
    assert DeadLetter.for_event(
        NewsEvent(id="b", body="x"), "embed", "r", "d", 100).message_id is None


# ---- hostile text costs linear time (docs/input.md: limits) ----

N = 20_000  # characters per hostile field: the old code's cost at this size is still seconds
# The constructions that make Python's html.parser (before 3.11.14) re-read the rest of the field
# for every construct that never closes, and the markup declarations that repeat one.
HOSTILE_MARKUP = {
    "unclosed tags": "<a" * (N // 2),
    "unclosed attribute": '<a b="' * (N // 6),
    "end tags": "</" * (N // 2),
    "declarations": "<!" * (N // 2),
    "processing instructions": "<?" * (N // 2),
    "comments": "<!--" * (N // 4),
    "CDATA sections": "<![CDATA[" * (N // 9),
    "doctypes": "<!DOCTYPE" * (N // 9),
    "among real markup": "<p>Rates <b>held</b></p><a href='x" * (N // 34),
}


@pytest.fixture
def html_rereads(monkeypatch):
    """Characters that html.parser's parse_* methods are asked to read and give up on (returning
    -1: the construct does not close), summed over a run; each such call reads up to the end of
    the input. Counted on html.parser's own class, whichever subclass newsvec uses."""
    import html.parser

    counted = {"chars": 0}

    def counting(original):
        def parse(self, i, *args):
            end = original(self, i, *args)
            if end < 0:
                counted["chars"] += len(self.rawdata) - i
            return end
        return parse

    for name in ("parse_starttag", "parse_endtag", "parse_comment", "parse_pi",
                 "parse_html_declaration"):
        monkeypatch.setattr(html.parser.HTMLParser, name,
                            counting(getattr(html.parser.HTMLParser, name)))
    return counted


@pytest.mark.parametrize("name", HOSTILE_MARKUP)
def test_the_html_parser_never_rereads_a_field_more_than_a_few_times(name, html_rereads):
    text = HOSTILE_MARKUP[name]
    normalize_text(text)
    assert html_rereads["chars"] <= 6 * len(text), (
        f"{name}: the HTML parser re-read {html_rereads['chars']:,} characters of a "
        f"{len(text):,}-character field")


def test_markup_declarations_that_do_not_parse_still_fail_fast():
    """'<![' with no name makes html.parser raise at once (prepare_failed, as before)."""
    with pytest.raises(AssertionError):
        normalize_text("<![" * (N // 3))


@pytest.mark.parametrize("name", [n for n in HOSTILE_MARKUP if n != "among real markup"])
def test_markup_stripped_in_one_pass_reads_as_the_html_parser_reads_it(name):
    """Past its allowance the field is stripped by strip_markup_linear: on these fields (small
    enough for the HTML parser to finish), the same text as the HTML parser's. (Not on the last:
    its unclosed quotes hold '>', which only the HTML parser reads as part of a value.)"""
    from transforms.text.markup import strip_html, strip_markup_linear

    text = HOSTILE_MARKUP[name][:3000]
    assert strip_markup_linear(text) == strip_html(text)


HTML_PIECES = st.one_of(
    st.sampled_from([
        "<p>", "</p>", "<div class='a b'>", "</div>", "<br>", "<br/>", "<hr />", "<b>", "</b>",
        "<i>", "</i>", "<a href=\"https://x.example/?a=1&amp;b=2\">", "</a>", "<img src=x alt=''>",
        "<script>var a = '<p>' + b < c;</script>", "<style>p { color: red }</style>",
        "<noscript><p>no</p></noscript>", "<template><b>t</b></template>", "<!-- a comment -->",
        "<!--x-- >", "<!DOCTYPE html>", "<?xml version='1.0'?>", "<![CDATA[data]]>", "</ p>",
        "<H2>", "</H2>", "<li>", "</li>", "&amp;", "&lt;", "&gt;", "&#8217;", "&nbsp;", "&copy",
        "AT&T", " < ", "<3", "a > b", "\n", " ", "é", "中文"]),
    st.text(alphabet="abcdefghij XYZ.,'", min_size=1, max_size=20))


@settings(max_examples=400, deadline=None)
@given(st.lists(HTML_PIECES, min_size=1, max_size=40).map("".join))
def test_markup_stripped_in_one_pass_reads_as_the_html_parser_reads_html(value):
    """On HTML whose every construct closes (and with no '>' in a quoted value),
    strip_markup_linear gives the HTML parser's text."""
    from transforms.text.markup import strip_html, strip_markup_linear

    assert strip_markup_linear(value) == strip_html(value)


# Constructs that never close, or close only as a whole, among markup that does: html.parser takes
# such a construct as text as far as the next ">", then reads on.
UNCLOSED_PIECES = ["<", ">", "a", "b", "/", "!", "-", "--", "?", " ", "=", "&", "&amp;", "&#65;",
                   "p", "[", "]", "\n", "<!--", "-->", "--!>", "</", "</ ", "<![", "]]>", "CDATA",
                   "cdata", "if", "DOCTYPE", "<!", "<?", "<p>", "</p>", "P", "br", "script",
                   "style", "div"]


@pytest.mark.parametrize("value", [
    "x<!-- y <b>bold</b> z",          # a comment that never closes, a '>' after it
    "<!-- a <p> b",
    "<![CDATA[a>b]]>c",               # a marked section ends at ']]>', not at its first '>'
    "<![CDATA[a>b c",                 # ... and one that never closes
    "a <![if x]>y",
    "</ p >x </ p junk>y",            # '</' and a space: an end tag only if whole
    "s</\nP\n&#65;b&-->]",
])
def test_markup_stripped_in_one_pass_reads_what_never_closes_as_the_html_parser_does(value):
    from transforms.text.markup import strip_html, strip_markup_linear

    assert strip_markup_linear(value) == strip_html(value)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(UNCLOSED_PIECES), min_size=1, max_size=30).map("".join))
def test_markup_stripped_in_one_pass_reads_broken_markup_as_the_html_parser_reads_it(value):
    """Without quotes (a '>' in a quoted value is the one difference), the same text, or the same
    exception (a marked section with an unknown name)."""
    from transforms.text.markup import strip_html, strip_markup_linear

    def outcome(strip):
        try:
            return strip(value)
        except AssertionError:
            return AssertionError

    assert outcome(strip_markup_linear) == outcome(strip_html)


def _longest_mark_run(text: str) -> int:
    longest = run = 0
    for ch in text:
        run = run + 1 if unicodedata.combining(ch) else 0
        longest = max(longest, run)
    return longest


MARKS = "\u0301\u0316" * 5000  # alternating combining classes (230, 220): the quadratic case
HOSTILE_MARKS = {
    "marks": "a" + MARKS,
    "marks as Latin-1 mojibake": ("a" + MARKS).encode("utf-8").decode("latin-1"),
    "marks as entities": "a" + "&#769;&#790;" * 5000,
    "marks in markup": "<p>a" + MARKS + "</p>",
    "half-width sound marks": "\uff76" + "\uff9e\u0301" * 5000,  # U+FF9E: NFKC makes it a mark
}


@pytest.mark.parametrize("form", ["NFC", "NFKC"])
@pytest.mark.parametrize("name", HOSTILE_MARKS)
def test_unicode_normalization_never_sees_a_long_run_of_combining_marks(name, form, monkeypatch):
    """Every unicodedata.normalize call while preparing the field (newsvec's, and ftfy's after it
    decodes mojibake) gets runs of at most 30 marks (transforms.text.unicode.MAX_COMBINING_RUN: the
    Stream-Safe Text Format's limit): canonical ordering is quadratic in a run's length before
    Python 3.11.16."""
    real = unicodedata.normalize
    seen: list[int] = []

    def normalize(f, text):
        seen.append(_longest_mark_run(text))
        return real(f, text)

    monkeypatch.setattr(unicodedata, "normalize", normalize)
    out = normalize_text(HOSTILE_MARKS[name], form)
    assert seen and max(seen) <= 30, f"{name}: a normalization was given a run of {max(seen)} marks"
    if name == "marks as Latin-1 mojibake":
        assert max(seen) > 1, "ftfy's normalization of the decoded marks was seen"
    assert 1 < _longest_mark_run(out) <= 30
    assert len(out) <= 60


@pytest.mark.parametrize("form", ["NFC", "NFKC"])
def test_format_characters_removed_leave_no_long_run_of_marks_and_a_normalized_text(form):
    """Format characters (soft hyphens, joiners) are removed after the cut and the normalization:
    runs of 30 marks split by soft hyphens are cut again once they join, and a letter and its
    mark that come side by side are composed."""
    import re

    split_runs = "a" + ("\u0301\u0316" * 15 + "\u00ad") * 100
    out = normalize_text(split_runs, form)
    longest = max(len(m.group()) for m in re.finditer("[\u0300-\u036f]+", out))
    assert longest <= 30, f"a run of {longest} marks"
    assert unicodedata.is_normalized(form, out) and normalize_text(out, form) == out
    assert normalize_text("e\u200d\u0301 cafe\u00ad\u0301", form) == "\u00e9 caf\u00e9"


def test_a_short_run_of_marks_is_kept_whole():
    """Vietnamese and the like stack two or three marks; a run is cut only past
    MAX_COMBINING_RUN (30)."""
    from transforms.text.unicode import MAX_COMBINING_RUN, collapse_combining_marks

    assert MAX_COMBINING_RUN == 30
    kept = "a" + "\u0323\u0302" * (MAX_COMBINING_RUN // 2) + " Vi\u1ec7t"
    assert collapse_combining_marks(kept) == kept
    cut = "a" + "\u0301" * (MAX_COMBINING_RUN + 5) + "b" + "\u0316" * 3
    assert collapse_combining_marks(cut) == "a" + "\u0301" * MAX_COMBINING_RUN + "b" + "\u0316" * 3


# Mojibake that renews itself: each of ftfy's repair steps fixes one pair and leaves another, and
# reads the whole line again (quadratic).
MOJIBAKE_CHAINS = {
    "UTF-8 read as Windows-1252": "\u00c3" + "\u0192" * 3000 + "\u00a9",
    "C1 controls": "\u039e" + "\x9e" * 3000,
}


@pytest.fixture
def ftfy_step_reads(monkeypatch):
    """Characters ftfy's mojibake repair steps read, summed over a run: each step starts by asking
    whether its text is ASCII (``chardata.possible_encoding(text, "ascii")``, called nowhere else),
    counted on ftfy's own module."""
    import ftfy.chardata

    counted = {"chars": 0, "steps": 0}
    real = ftfy.chardata.possible_encoding

    def possible_encoding(text, encoding):
        if encoding == "ascii":
            counted["chars"] += len(text)
            counted["steps"] += 1
        return real(text, encoding)

    monkeypatch.setattr(ftfy.chardata, "possible_encoding", possible_encoding)
    return counted


@pytest.mark.parametrize("name", MOJIBAKE_CHAINS)
def test_ftfy_repairs_mojibake_reading_a_field_at_most_a_few_times(name, ftfy_step_reads):
    """Past 8 times the field (and 4,096 characters), the repair stops and the field is fixed
    without it: the other fixers and NFC still run, and the article is kept."""
    import ftfy

    text = MOJIBAKE_CHAINS[name]
    out = normalize_text(text)
    assert ftfy_step_reads["steps"] > 0, "ftfy's steps were counted"
    assert ftfy_step_reads["chars"] <= 8 * len(text) + 4096, (
        f"{name}: ftfy's repair steps read {ftfy_step_reads['chars']:,} characters of a "
        f"{len(text):,}-character field")
    assert out == " ".join(ftfy.fix_text(text, unescape_html=False, fix_encoding=False).split())


def test_ftfy_still_repairs_the_mojibake_of_real_text(ftfy_step_reads):
    """Layers of real mojibake (a curly quote encoded three times) are well within the bound."""
    import ftfy.bad_codecs  # noqa: F401 -- registers sloppy-windows-1252

    quote = "\u2019"
    for _ in range(3):
        quote = quote.encode("utf-8").decode("sloppy-windows-1252")
    line = "it" + quote + "s"
    assert normalize_text(line) == "it's"
    assert normalize_text("\n".join(["Â£5m for the café, itâ€™s"] * 50)) == " ".join(
        ["£5m for the café, it's"] * 50)


def _prepare_fn(**kwargs):
    from tests.common import make_config
    from transforms.text.prepare import _PrepareTextFn

    fn = _PrepareTextFn(make_config().model, 200_000, 4096, **kwargs)
    fn.setup()
    return fn


def _outcome(fn, event):
    (out,) = list(fn.process([event]))
    if isinstance(out, pvalue.TaggedOutput):
        return out.value.reason, out.value.detail
    return "row", out.text


def test_a_title_over_max_title_chars_is_dead_lettered_text_too_long():
    """2,000 characters by default; the detail names the setting."""
    default = _prepare_fn()
    assert _outcome(default, NewsEvent(id="t", title="title " * 333 + "ab", body="b"))[0] == "row"
    reason, detail = _outcome(default, NewsEvent(id="t", title="<a" * 1001, body="b"))
    assert reason == Reason.TEXT_TOO_LONG
    assert "title holds 2002 characters" in detail and "text.max_title_chars 2000" in detail
    fn = _prepare_fn(max_title_chars=50)
    assert _outcome(fn, NewsEvent(id="t", title="title " * 8 + "ab", body="b"))[0] == "row"
    assert _outcome(fn, NewsEvent(id="t", title="title " * 8 + "abc", body="b"))[0] == \
        Reason.TEXT_TOO_LONG


def test_a_text_that_normalization_makes_too_long_is_dead_lettered_text_too_long():
    """NFKC writes some characters as many (U+FDFA as 18): the prepared text is held to
    max_text_chars too, checked as soon as the normalization is done."""
    from tests.common import make_config
    from transforms.text.prepare import _PrepareTextFn

    def fn(form):
        prepare = _PrepareTextFn(make_config().model, 1000, 4096, unicode_form=form,
                                 max_unknown_token_ratio=1.0)
        prepare.setup()
        return prepare

    body = "\ufdfa" * 100
    reason, detail = _outcome(fn("NFKC"), NewsEvent(id="t", body=body))
    assert reason == Reason.TEXT_TOO_LONG
    assert "makes the text 1800 characters long, over the limit of 1000" in detail
    assert _outcome(fn("NFC"), NewsEvent(id="t", body=body)) == ("row", body)
    assert _outcome(fn("NFKC"), NewsEvent(id="t", title="\ufdfa" * 40, body="\ufdfa" * 20))[0] \
        == Reason.TEXT_TOO_LONG, "title and body together"
    assert _outcome(fn("NFKC"), NewsEvent(id="t", body="\ufdfa" * 55))[0] == "row"


class _FakeCpuClock:
    """A thread CPU clock that advances one second each time it is read."""

    def __init__(self):
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(self.reads)


def test_a_document_over_its_cpu_budget_is_dead_lettered_prepare_failed(monkeypatch):
    """The budget is checked between the steps and inside the loops that can be long (here, the
    HTML parser's): the document is dead-lettered with the budget and the step in the detail, and
    the next document has a budget of its own."""
    import transforms.text.deadline

    clock = _FakeCpuClock()
    monkeypatch.setattr(transforms.text.deadline, "_clock", clock, raising=False)
    fn = _prepare_fn()  # 10 s: ten reads of this clock
    long_html = "<p>word</p>" * 15_000  # 30,000 parser calls: the budget is read every 1,024
    reason, detail = _outcome(fn, NewsEvent(id="slow", title="Title", body=long_html))
    assert reason == Reason.PREPARE_FAILED
    assert "text.prepare_budget_s 10 s of CPU" in detail and "by the HTML parser" in detail
    assert clock.reads >= 10, "read inside the HTML parser, not only between the steps"
    assert _outcome(fn, NewsEvent(id="fast", title="Title", body="<p>word</p>")) == \
        ("row", "Title\nword")


@pytest.mark.parametrize("line", ["\x80", "\u2019", "Ã©"])
def test_ftfy_fixes_a_line_that_comes_again_once(line, monkeypatch):
    """ftfy fixes each line on its own, at a cost of tens of microseconds however short the
    line: 10,000 copies of a line are fixed once (counted as the calls of one of ftfy's fixers,
    made once per line and pass), with the same text as fixing each."""
    import ftfy

    calls = {"n": 0}
    real = ftfy.FIXERS["fix_line_breaks"]

    def fix_line_breaks(text):
        calls["n"] += 1
        return real(text)

    text = (line + "\n") * 10_000
    want = " ".join(ftfy.fix_text(line, unescape_html=False).split() * 10_000)
    monkeypatch.setitem(ftfy.FIXERS, "fix_line_breaks", fix_line_breaks)
    assert normalize_text(text) == want
    assert 0 < calls["n"] <= 10, f"{calls['n']:,} passes of ftfy's fixers over 10,000 lines"


def test_the_cpu_budget_is_checked_inside_ftfys_mojibake_repair(monkeypatch):
    """ftfy repairs each line on its own: a field of many short lines of mojibake keeps it busy
    for long in one call, in which the budget is read too."""
    import transforms.text.deadline

    clock = _FakeCpuClock()
    monkeypatch.setattr(transforms.text.deadline, "_clock", clock, raising=False)
    fn = _prepare_fn()
    body = "".join(f"Ã© {i}\n" for i in range(10_000))  # distinct lines: each fixed
    reason, detail = _outcome(fn, NewsEvent(id="slow", body=body))
    assert reason == Reason.PREPARE_FAILED
    assert "by ftfy's mojibake repair" in detail
    assert _outcome(fn, NewsEvent(id="fast", body="Ã©")) == ("row", "é")


def test_the_title_limit_and_the_budget_are_settings():
    from pipeline.graph import _prepare
    from tests.common import make_config
    from transforms.settings import TextSettings

    config = make_config(text=TextSettings(max_title_chars=5, prepare_budget_s=1e-9))
    events = [NewsEvent(id="long-title", title="123456", body="b"),
              NewsEvent(id="any", title="12345", body="b")]
    with TestPipeline(runner="FnApiRunner") as p:
        out = _prepare(p | beam.Create(events), config)
        assert_that(out.dead_letter | beam.Map(lambda d: (d.event_id, d.reason)),
                    equal_to([("long-title", Reason.TEXT_TOO_LONG),
                              ("any", Reason.PREPARE_FAILED)]))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.text(alphabet="abcXYZ019", min_size=1, max_size=300),
                          st.sampled_from(["<", "<a", '"', "/", "&", ".", "-", "[UNK]", " ",
                                           "\t", "\x07"])),
                min_size=1, max_size=60).map("".join).map(lambda t: t * (8192 // len(t) + 1)))
def test_long_ascii_texts_with_few_spaces_tokenize_as_the_whole_text(tokenizer, value):
    """Past 8,192 characters an ASCII text with fewer spaces than the head has words (markup
    left as text, code) is cut after its punctuation to tokenize its head: the same head as
    tokenizing all of it (tools/reference_prepare.py)."""
    from tools import reference_prepare as reference

    assert tokenizer.batch([value]) == reference.head_tokens(tokenizer._tok, [value],
                                                             tokenizer.max_tokens)


def test_markup_left_as_text_is_cut_to_its_head_before_tokenizing(tokenizer):
    """200,000 characters of '<a' (what a field of tags that never close comes out as) are cut
    after the head's punctuation, not tokenized whole: same head."""
    from tools import reference_prepare as reference

    value = "<a" * 100_000
    assert 0 < tokenizer._head_end(value) < 1000
    assert tokenizer.batch([value]) == reference.head_tokens(tokenizer._tok, [value],
                                                             tokenizer.max_tokens)


# ---- tokenization: the head costs what the head needs; every step under the budget ----

class _CountingTokenizer:
    """A tokenizer that counts the characters it is given to encode, and the calls (by length)."""

    def __init__(self, tok, counted: dict):
        self._tok, self._counted = tok, counted

    def _count(self, texts):
        for text in texts:
            self._counted["chars"] += len(text)
            self._counted["lengths"].append(len(text))

    def encode(self, text, *args, **kwargs):
        self._count([text])
        return self._tok.encode(text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self._count(texts)
        return self._tok.encode_batch(texts, *args, **kwargs)

    def encode_batch_fast(self, texts, *args, **kwargs):
        self._count(texts)
        return self._tok.encode_batch_fast(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


@pytest.fixture
def tokenized(monkeypatch):
    """Counts what every tokenizer of PrepareText (the head's, the chunker's, the unknown-token
    counter's) is given to encode; returns (counts, a function that prepares one body)."""
    from tests.common import make_config
    from transforms.settings import ChunkingSettings
    from transforms.text import text_tools

    counted: dict = {"chars": 0, "lengths": []}
    model = make_config().model
    for chunking in (ChunkingSettings(), ChunkingSettings(mode="chunks")):
        tools = text_tools(model, chunking)
        for owner, name in [(tools.head, "_tok"), (tools.head, "_ascii_tok"),
                            (tools.unknown, "_tok"), (tools.chunker, "_tok")]:
            if owner is not None and getattr(owner, name) is not None:
                monkeypatch.setattr(owner, name, _CountingTokenizer(getattr(owner, name), counted))

    def prepare(body: str, **kwargs):
        (out,) = list(_prepare_fn(**kwargs).process([NewsEvent(id="t", body=body)]))
        return out

    return counted, prepare


def _repeat(unit: str, chars: int) -> str:
    return (unit * (chars // len(unit) + 1))[:chars]


# Words of up to 100 characters (WordPiece reads such a word again for each of its tokens), between
# punctuation outside the blocks the head's cut looked in (Arabic comma, Armenian comma: the
# tokenizer's unknown token), or spaces; and the same words made by NFKC (U+3316 is six katakana).
LONG_WORDS = {
    "kana, Arabic comma": ("あ" * 100 + "\u060c", "NFC"),
    "kana, Armenian comma (unknown)": ("あ" * 100 + "\u055d", "NFC"),
    "NFKC katakana, Armenian comma": ("\u3316" * 16 + "\u055d", "NFKC"),
    "NFKC katakana, spaces": ("\u3316" * 16 + " ", "NFKC"),
}


@pytest.mark.parametrize("name", LONG_WORDS)
def test_the_head_of_a_long_text_of_long_words_is_tokenized_from_a_short_prefix(name, tokenized,
                                                                              tokenizer):
    """20,000 characters (NFKC makes the katakana six times as many): the head's tokens (and the
    unknown-token count, on the head's span only) come from tokenizing a prefix of a few thousand
    characters, and are the head of the whole text's tokens."""
    from tools import reference_prepare as reference

    counted, prepare = tokenized
    unit, form = LONG_WORDS[name]
    doc = prepare(_repeat(unit, 20_000), unicode_form=form)
    assert not isinstance(doc, pvalue.TaggedOutput), doc.value.detail
    assert counted["chars"] <= 10_000, (
        f"{name}: {counted['chars']:,} characters tokenized, in calls of {counted['lengths']}")
    assert (doc.token_ids, doc.truncated) == reference.head_tokens(
        tokenizer._tok, [doc.text], tokenizer.max_tokens)[0]


def test_a_long_text_with_nowhere_to_cut_its_head_is_tokenized_once(tokenized):
    """20,000 characters of katakana with no space or punctuation: the whole text is tokenized,
    once, with the offsets the unknown-token count reads (one word over 100 characters: one
    unknown token)."""
    counted, prepare = tokenized
    out = prepare(_repeat("\u30ad\u30ed\u30e1\u30fc\u30c8\u30eb", 20_000))
    assert out.value.reason == Reason.UNREADABLE_FOR_MODEL
    assert "1 of its head's 1 tokens are unknown" in out.value.detail
    assert counted["lengths"] == [20_000]


def test_chunks_mode_tokenizes_the_whole_text_once(tokenized):
    """The unknown-token count reads the chunker's tokens of the text, not a second
    tokenization; the chunks' own re-tokenizations are each at most a chunk's text."""
    from transforms.settings import ChunkingSettings

    counted, prepare = tokenized
    body = _repeat("あ" * 100 + "\u055d", 20_000)
    doc = prepare(body, chunking=ChunkingSettings(mode="chunks"))
    assert not isinstance(doc, pvalue.TaggedOutput), doc.value.detail
    assert len(doc.chunks) > 10
    assert counted["lengths"].count(len(doc.text)) == 1, counted["lengths"][:10]
    assert max(length for length in counted["lengths"] if length != len(doc.text)) <= 2_000


class _SettableClock:
    """A thread CPU clock that stands still until a test moves it."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("mode", ["head", "chunks"])
def test_the_cpu_budget_covers_tokenization(mode, monkeypatch):
    """A tokenization that uses the budget up (the clock moved past it while the text is
    tokenized) dead-letters the article prepare_failed, naming the step, before its chunks or its
    unknown tokens are looked at."""
    import transforms.text.deadline
    from tests.common import make_config
    from transforms.settings import ChunkingSettings
    from transforms.text import text_tools

    clock = _SettableClock()
    monkeypatch.setattr(transforms.text.deadline, "_clock", clock, raising=False)
    chunking = ChunkingSettings(mode=mode)
    tools = text_tools(make_config().model, chunking)
    owner = tools.chunker if mode == "chunks" else tools.head

    class SlowTokenizer(_CountingTokenizer):
        def _count(self, texts):
            clock.now += 11.0

    for name in ("_tok", "_ascii_tok"):
        if getattr(owner, name, None) is not None:
            monkeypatch.setattr(owner, name, SlowTokenizer(getattr(owner, name), {}))
    fn = _prepare_fn(chunking=chunking)
    reason, detail = _outcome(fn, NewsEvent(id="slow", title="Title", body="Rates held. " * 50))
    assert reason == Reason.PREPARE_FAILED
    assert "text.prepare_budget_s 10 s of CPU" in detail and "by tokenization" in detail


@pytest.mark.parametrize("mode", ["head", "chunks"])
def test_special_tokens_written_in_a_text_are_read_as_text(mode, tokenizer):
    """The model's input holds special tokens only where newsvec puts them ([CLS] first, [SEP]
    last, in the head and in every chunk); "[UNK]" in a text is not an unknown word."""
    from transforms.settings import ChunkingSettings

    specials = {t.content: i for i, t in tokenizer._tok.get_added_tokens_decoder().items()}
    assert set(specials) == {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    fn = _prepare_fn(chunking=ChunkingSettings(mode=mode, chunk_tokens=16, overlap_tokens=4))
    body = "Markets rose [SEP] [CLS] [MASK] [PAD] today. " + "In BERT, [UNK] replaces them. " * 9
    (doc,) = list(fn.process([NewsEvent(id="t", body=body)]))
    assert not isinstance(doc, pvalue.TaggedOutput), doc.value.detail
    inputs = [doc.token_ids] + [chunk.token_ids for chunk in doc.chunks]
    assert mode == "head" or len(doc.chunks) > 1
    for ids in inputs:
        assert ids[0] == specials["[CLS]"] and ids[-1] == specials["[SEP]"]
        assert not set(ids[1:-1]) & set(specials.values()), ids


LOW_DENSITY = ["\u3042" * 101, "\u0301", "\u0301\u0301", "a" * 120, "\U0001F600" * 3,
               "\u00e9" * 101]
HIGH_DENSITY = ["word", "\u4e2d", "x.y", "\u30ad\u30ed\u30e1\u30fc\u30c8\u30eb" * 3, "ab"]


@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(LOW_DENSITY + HIGH_DENSITY),
                          st.sampled_from([" ", "\u060c", "\u055d", "\u3002", ","])),
                min_size=1, max_size=40).map(lambda parts: "".join(a + b for a, b in parts)),
       st.integers(5_000, 30_000))
def test_texts_of_words_of_few_tokens_tokenize_as_the_whole_text(tokenizer, unit, chars):
    """Words that give few tokens (over 100 characters: one unknown token; combining marks alone:
    none) make the head's first cut too short: the prefix is tokenized further, more than once,
    and the head is still the whole text's."""
    from tools import reference_prepare as reference

    text = (unit * (chars // len(unit) + 1))[:chars]
    assert tokenizer.batch([text]) == reference.head_tokens(tokenizer._tok, [text],
                                                            tokenizer.max_tokens)


# --- no live markup in a prepared title or text -------------------------------------------------

# "<" then what opens a tag, comment, declaration or processing instruction in HTML's tokenizer
# (an ASCII letter, "!", "/", "?") or an element in XML (also "_", ":" and letters beyond ASCII).
LIVE_MARKUP = re.compile(r"<[A-Za-z!/?_:]|<[^\W0-9]")
HOSTILE_TITLES = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "&lt;script&gt;alert(1)&lt;/script&gt; plain title",
    "<p>Breaking</p> &lt;img src=x onerror=alert(document.cookie)&gt;",
    "&#60;svg onload=alert(1)&#62;",
    "&#x3C;iframe src=javascript:alert(1)&#x3E;",
    "a &lt;/title&gt;&lt;script&gt;alert(1)&lt;/script&gt;",
    "&lt;!-- x --&gt; &lt;!DOCTYPE html&gt; &lt;?php echo 1 ?&gt;",
    "\uff1cscript\uff1ealert(1)\uff1c/script\uff1e",  # full width: ftfy folds it to ASCII
    "\ufe64img src=x onerror=alert(1)\ufe65",            # small form: NFKC folds it
    "<\u00adscript>alert(1)</script>",                    # a soft hyphen, dropped after the HTML
    "&lt;\u200dimg src=x onerror=alert(1)&gt;",           # a joiner, the same
    "&lt;sc<b>ri</b>pt&gt;alert(1)",                       # a tag stripped from inside a tag
    "<<b>script>alert(1)<</b>/script>",
    "&lt;\x00script&gt;",
    # An XML element's name may start so (ElementTree parses each):
    "&lt;_x onload=1/&gt;",
    "&lt;:x/&gt; &lt;\u00e9l\u00e9ment/&gt; &lt;\u8a18\u4e8b/&gt;",
    "&lt;\u0660x/&gt;",  # an Arabic-Indic digit: a name's first character in XML 1.0 (5th ed.)
]


@pytest.mark.parametrize("form", ["NFC", "NFKC"])
@pytest.mark.parametrize("raw", HOSTILE_TITLES)
def test_no_live_markup_survives_normalization(raw, form):
    """Tags stripped and entities decoded, a title may still hold markup: decoded from entities,
    folded to ASCII from other forms, or joined once an invisible character between its "<" and
    its name is dropped. The prepared text goes to the outputs, the store and ``newsvec search``,
    and to whoever shows them: its every "<" that would open a tag has a space after it. Before:
    '&lt;script&gt;alert(1)&lt;/script&gt; plain title' was prepared as
    '<script>alert(1)</script> plain title', and so were the full-width, small-form and
    soft-hyphen variants."""
    once = normalize_text(raw, form)
    assert not LIVE_MARKUP.search(once), once
    assert normalize_text(once, form) == once


@pytest.mark.parametrize("raw, prepared", [
    ("&lt;script&gt;alert(1)&lt;/script&gt; plain title",
     "< script>alert(1)< /script> plain title"),
    ("Why &lt;div&gt; soup hurts", "Why < div> soup hurts"),  # the words are kept: they are text
    ("<p>Breaking</p> &lt;img src=x onerror=alert(1)&gt;",
     "Breaking < img src=x onerror=alert(1)>"),
    ("\uff1cb\uff1ebold", "< b>bold"),
    ("AT&T < 5 > 3, 2<3, x <= y, <<", "AT&T < 5 > 3, 2<3, x <= y, <<"),  # no tag: left alone
    ("&lt;_x onload=1/&gt;", "< _x onload=1/>"),  # XML would read an element there
    ("&amp;lt;script&amp;gt;", "&lt;script&gt;"),  # decoded once: no "<" at all
])
def test_markup_left_in_text_is_defused_not_removed(raw, prepared):
    assert normalize_text(raw) == prepared


def test_prepared_titles_and_texts_carry_no_live_markup(tokenizer):
    """Through PrepareText's DoFn: the title the outputs hold and the text that is embedded (its
    first line), the body's markup too. The space after "<" changes no token of a BERT-style
    tokenizer (it splits "<" off as punctuation): the same vector as before."""
    fn = _prepare_fn()
    for i, raw in enumerate(HOSTILE_TITLES):
        (doc,) = list(fn.process([NewsEvent(id=str(i), title=raw + " news",
                                            body=raw + " <p>body</p> &lt;a href=x&gt;more")]))
        assert not isinstance(doc, pvalue.TaggedOutput), doc
        assert doc.title and not LIVE_MARKUP.search(doc.title), doc.title
        assert not LIVE_MARKUP.search(doc.text), doc.text
        assert doc.text.split("\n")[0] == doc.title
    assert tokenizer.batch(["< script>alert(1)< /script> Why < div> soup"]) == \
        tokenizer.batch(["<script>alert(1)</script> Why <div> soup"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["<", "&lt;", "&#60;", "\uff1c", "\ufe64", "\u00ad", "\u200d",
                                 "\x00", "b", "img", "/", "!", "?", ">", "&gt;", " ", "<b>", "</b>",
                                 "&amp;", "script", "é", "\u0301", "_", ":", "\u8a18"]),
                min_size=1, max_size=24).map("".join))
def test_no_generated_text_normalizes_to_live_markup(value):
    for form in ("NFC", "NFKC"):
        assert not LIVE_MARKUP.search(normalize_text(value, form))

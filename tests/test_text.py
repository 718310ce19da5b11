"""Text preparation: normalization, composition and head truncation with the model's tokenizer."""
import csv
import hashlib

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from tests.conftest import BBC
from transforms.schema import NewsEvent, Reason
from transforms.text import PrepareText, compose_text, normalize_text


@pytest.mark.parametrize("raw, clean", [
    ("Â£5m deal", "£5m deal"),                         # mojibake, as in the BBC data
    ("itâ€™s a cafÃ©", "it's a café"),                 # mojibake, curly quote straightened
    ("<p>Hello &amp; <b>world</b></p><p>next</p>", "Hello & world next"),
    ("<div>kept</div><script>var dropped = 1;</script><style>p {}</style>", "kept"),
    ("AT&amp;T &lt;b&gt; &#8217; &nbsp;x", "AT&T <b> ' x"),  # entities, decoded once
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
    with open(BBC / "test.csv", encoding="utf-8") as f:
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
    from tests.conftest import make_config

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
    from transforms.schema import DeadLetter, Lineage

    event = NewsEvent(id="s-1", body="<![foo]>").model_copy(
        update={"lineage": Lineage(message_id="777", publish_time=None)})
    letter = DeadLetter.for_event(event, "prepare_text", Reason.PREPARE_FAILED, "bad markup", 10)
    assert (letter.event_id, letter.message_id, letter.payload) == ("s-1", "777", '{"id":"s-1')
    assert letter.payload_bytes > 10
    assert DeadLetter.for_event(
        NewsEvent(id="b", body="x"), "embed", "r", "d", 100).message_id is None

"""News in every language (issue 23): an article the model cannot read is dead-lettered, not
embedded silently, and counted by language in the batch summary and the streaming ledger; the
Unicode form is a setting that text_sha256, the dedup key and the embedding signature follow; the
outputs hold the prepared title, the one that was embedded.

The model is the packaged English MiniLM (WordPiece, English vocabulary), with its real tokenizer;
the embedding engine is FAKE where only the accounting and the columns are under test."""
from __future__ import annotations

import csv
import json

import pyarrow.parquet as pq
import pytest
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Timestamp

from pipeline import ledger
from pipeline.config import ConfigError, validate
from pipeline.run import run_batch
from tests.common import bbc_file, make_config
from tests.fakes import FakeEngine
from transforms.dedup import dedup_key_function
from transforms.incremental import embedding_key
from transforms.settings import (
    ChunkingSettings,
    StreamingSettings,
    TextSettings,
    embedding_signature,
)
from transforms.text import normalize_text
from transforms.text.prepare import _PrepareTextFn
from transforms.types import DeadLetter, NewsEvent, PreparedDoc

UNREADABLE = "unreadable_for_model"
# A Japanese news paragraph with kanji: WordPiece knows some kanji, no run of kana (about 40%
# [UNK]).
KANJI = ("東京証券取引所で13日、日経平均株価は大幅に反発し、前日比512円高の"
         "3万8千円台で取引を終えた。米国の利下げ観測が強まったことを受けて、"
         "半導体関連株を中心に買い注文が広がった。")
KANA = "かなカナ" * 150  # 600 characters of kana: [CLS] [UNK] [SEP]
THAI = ("กรุงเทพมหานคร ฝนตกหนักตลอดคืนทำให้ถนนหลายสายมีน้ำท่วมขัง "
        "การจราจรติดขัดอย่างหนักในช่วงเช้า")
ENGLISH = "The central bank held interest rates on Tuesday, citing slowing inflation."
RAW_TITLE = "Old town caf\u00c3\u00a9s host <b>winter</b> concert&nbsp;series"  # mojibake + HTML
PREPARED_TITLE = "Old town caf\u00e9s host winter concert series"

ARTICLES = [
    {"id": "ja-kanji", "title": "株価が反発", "body": KANJI * 3, "language": "ja"},
    {"id": "ja-kana", "body": KANA, "language": "ja"},
    {"id": "th", "body": THAI, "language": "th"},
    {"id": "kana-no-language", "body": KANA},
    {"id": "en", "title": RAW_TITLE, "body": ENGLISH, "language": "en"},
    {"id": "en-emoji", "title": "Stocks \U0001F4C8\U0001F680 soar", "body": ENGLISH,
     "language": "en"},
]
UNREADABLE_IDS = {"ja-kanji", "ja-kana", "th", "kana-no-language"}
BY_LANGUAGE = {"ja": {UNREADABLE: 2}, "th": {UNREADABLE: 1},
               "unknown": {"invalid_json": 1, UNREADABLE: 1}}


def prepare(events, **settings):
    """PrepareText's DoFn on these events: {id: PreparedDoc or DeadLetter}."""
    chunking = settings.pop("chunking", ChunkingSettings())
    fn = _PrepareTextFn(make_config().model, 200_000, 4096, chunking, **settings)
    fn.setup()
    out = {}
    for item in fn.process([NewsEvent(**e) for e in events]):
        value = getattr(item, "value", item)  # a dead letter comes as a TaggedOutput
        out[value.event_id if isinstance(value, DeadLetter) else value.id] = value
    return out


# ---- the check ----

def test_articles_the_model_cannot_read_are_dead_lettered_with_their_reason():
    out = prepare(ARTICLES)
    for doc_id in UNREADABLE_IDS:
        letter = out[doc_id]
        assert isinstance(letter, DeadLetter), f"{doc_id} was embedded: {letter}"
        assert (letter.step, letter.reason) == ("prepare_text", UNREADABLE)
        assert "text.max_unknown_token_ratio" in letter.detail and "tokens" in letter.detail
    assert out["ja-kanji"].language == "ja" and out["kana-no-language"].language is None
    assert "1 of its head's 1 tokens" in out["ja-kana"].detail  # [CLS] [UNK] [SEP]
    for doc_id in ("en", "en-emoji"):  # an emoji is an unknown token, but not an unread word
        assert isinstance(out[doc_id], PreparedDoc), out[doc_id]


def test_the_unknown_token_is_the_tokenizers_own(tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from transforms.text import UnknownTokens, unknown_token_id

    assert unknown_token_id(tokenizer._tok) == tokenizer._tok.token_to_id("[UNK]") == 100
    unigram = Tokenizer(models.Unigram([("<pad>", 0.0), ("<unk>", 0.0), ("a", -1.0)], 1, False))
    assert unknown_token_id(unigram) == 1
    byte_level = Tokenizer(models.BPE())  # GPT-2's kind: every byte is a token, none unknown
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert unknown_token_id(byte_level) is None
    never = UnknownTokens(byte_level)
    assert never.of_head(KANA, (0, 0, 0)) == (0, 0), "no unknown id: the check never fires"


def test_the_limit_is_a_setting():
    kanji = [ARTICLES[0]]
    assert isinstance(prepare(kanji, max_unknown_token_ratio=0.5)["ja-kanji"], PreparedDoc)
    assert isinstance(prepare(kanji, max_unknown_token_ratio=0.3)["ja-kanji"], DeadLetter)
    everything = prepare(ARTICLES, max_unknown_token_ratio=1)
    assert all(isinstance(v, PreparedDoc) for v in everything.values()), "1: never"
    with pytest.raises(ConfigError, match="max_unknown_token_ratio"):
        validate({**json.loads(make_config(input="x", output="y").model_dump_json()),
                  "text": {"max_unknown_token_ratio": 1.5}})


def test_no_bbc_article_is_unreadable():
    events = []
    for name in ("train.csv", "val.csv", "test.csv"):
        with open(bbc_file(name), encoding="utf-8") as f:
            events += [{"id": f"{name}-{i}", "body": row["text"]}
                       for i, row in enumerate(csv.DictReader(f))]
    assert len(events) == 2225
    # At a limit of 0, any unknown word in a head would dead-letter its article: none does.
    out = prepare(events, max_unknown_token_ratio=0)
    assert not [v for v in out.values() if isinstance(v, DeadLetter)]


def test_chunks_mode_judges_the_whole_text():
    """Every chunk is embedded, so in chunks mode the whole text is judged: an English head
    followed by mostly Japanese text is dead-lettered; in head mode only its head is embedded."""
    mixed = [{"id": "mixed", "title": "Markets in Tokyo", "body": ENGLISH * 30 + KANJI * 40}]
    assert isinstance(prepare(mixed)["mixed"], PreparedDoc)
    letter = prepare(mixed, chunking=ChunkingSettings(mode="chunks"))["mixed"]
    assert isinstance(letter, DeadLetter) and letter.reason == UNREADABLE
    assert "the text's" in letter.detail
    readable = [{"id": "en", "body": ENGLISH * 60}]
    assert isinstance(prepare(readable, chunking=ChunkingSettings(mode="chunks"))["en"],
                      PreparedDoc)


# ---- counted by language: batch summary and streaming ledger ----

@pytest.fixture(scope="module")
def batch_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("languages")
    path = root / "in.jsonl"
    path.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in ARTICLES)
                    + "{not json\n", encoding="utf-8")
    config = make_config(input=str(path), output=str(root / "out"))
    summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]),
                        engine_factory=FakeEngine)
    return root / "out", summary, config


def test_batch_summary_counts_dead_letters_by_language(batch_run):
    out, summary, _ = batch_run
    counts = summary["counts"]
    assert summary["invariant_holds"] and counts["in"] == 7 and counts["written"] == 2
    assert counts["dead_lettered_by_reason"] == {"invalid_json": 1, UNREADABLE: 4}
    assert counts["dead_lettered_by_language"] == BY_LANGUAGE
    letters = [json.loads(line) for f in (out / "dead_letter").glob("*.jsonl")
               for line in f.read_text(encoding="utf-8").splitlines()]
    assert sorted((d["event_id"], d["language"]) for d in letters if d["event_id"]) == [
        ("ja-kana", "ja"), ("ja-kanji", "ja"), ("kana-no-language", None), ("th", "th")]


def test_written_rows_and_search_hold_the_prepared_title(batch_run, monkeypatch):
    out, _, config = batch_run
    rows = pq.read_table(sorted((out / "vectors").glob("*.parquet"))).to_pylist()
    titles = {r["id"]: r["title"] for r in rows}
    assert titles == {"en": PREPARED_TITLE, "en-emoji": "Stocks \U0001F4C8\U0001F680 soar"}
    from pipeline import search

    # The query's vector: any; what is under test is the title shown.
    monkeypatch.setattr(search, "embed_query",
                        lambda cfg, query: FakeEngine(cfg.model).embed([[1]])[0])
    found = {r["id"]: r["title"] for r in search.search(config, "cafés", k=5, output=str(out))}
    assert found["en"] == PREPARED_TITLE


def test_streaming_ledger_counts_dead_letters_by_language(tmp_path):
    t0 = Timestamp.of(1_764_590_400)  # 2025-12-01T12:00:00Z
    payloads = [json.dumps(e, ensure_ascii=False).encode() for e in ARTICLES] + [b"{not json"]
    messages = [TimestampedValue(PubsubMessage(data, {}, message_id=f"m{i}",
                                               publish_time=t0 + i), t0 + i)
                for i, data in enumerate(payloads)]
    stream = (TestStream().advance_watermark_to(t0).add_elements(messages)
              .advance_watermark_to_infinity())
    from pipeline.graph import embed_and_write_streaming

    config = make_config(output=str(tmp_path),
                         # one shard: English and Japanese in one micro-batch
                         streaming=StreamingSettings(window_s=60, batch_shards=1))
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embed_and_write_streaming(p | stream, config, "20251201T120000Z-1a2b3c4d",
                              engine_factory=FakeEngine)
    p.run().wait_until_finish()
    report = ledger.check(str(tmp_path))
    assert report.ok, report.problems
    assert (report.totals["messages_in"], report.totals["rows_written"]) == (7, 2)
    assert report.totals["dead_lettered_by_language"] == BY_LANGUAGE
    titles = pq.read_table(sorted((tmp_path / "vectors").rglob("*.parquet")))["title"]
    assert PREPARED_TITLE in titles.to_pylist()

    # The balance stays exact: a record whose counts by language do not add up is found, and a
    # record written before they were kept counts its dead letters under "unknown".
    record_path = next(p for p in (tmp_path / "ledger").rglob("*.json")
                       if json.loads(p.read_text())["dead_lettered"])
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps({**record, "dead_lettered_by_language": {"xx": {"x": 1}}}))
    assert any("by language" in problem for problem in ledger.check(str(tmp_path)).problems)
    del record["dead_lettered_by_language"]
    record_path.write_text(json.dumps(record))
    old = ledger.check(str(tmp_path))
    assert old.ok, old.problems
    assert sum(old.totals["dead_lettered_by_language"]["unknown"].values()) >= record[
        "dead_lettered"]


# ---- the Unicode form ----

COMPAT = "Rice 10\u338f up \u2460 x\u00b2 \u3231"  # 10㎏ ① x² ㈱


def test_nfkc_folds_what_nfc_keeps():
    assert normalize_text(COMPAT) == COMPAT  # NFC: as written
    assert normalize_text(COMPAT, "NFKC") == "Rice 10kg up 1 x2 (株)"
    # ftfy folds these in either form (issue 23 named them as NFKC's)
    for form in ("NFC", "NFKC"):
        assert normalize_text("\uff21\uff22\uff23\uff11\uff12\uff13 \uff76\uff80\uff76\uff85",
                              form) == "ABC123 カタカナ"
    for text in (COMPAT, "\u00a8x \u00bd", RAW_TITLE, KANJI):
        once = normalize_text(text, "NFKC")
        assert normalize_text(once, "NFKC") == once


def test_text_sha256_and_dedup_key_follow_the_form():
    events = [{"id": "a", "body": COMPAT}, {"id": "b", "body": "Rice 10kg up 1 x2 (株)"},
              {"id": "c", "body": ENGLISH}]
    nfc, nfkc = prepare(events), prepare(events, unicode_form="NFKC")
    assert nfc["a"].text_sha256 != nfkc["a"].text_sha256
    assert nfc["c"].text_sha256 == nfkc["c"].text_sha256  # ASCII: the same text
    by_text = dedup_key_function("text_sha256")
    assert by_text(nfc["a"]) != by_text(nfc["b"]), "NFC: two texts"
    assert by_text(nfkc["a"]) == by_text(nfkc["b"]), "NFKC: the same text, a duplicate"


def test_the_embedding_signature_holds_the_form():
    config = make_config()
    model, chunking = config.model, config.chunking
    legacy = embedding_signature(model, chunking)
    assert embedding_signature(model, chunking, "NFC") == legacy, "keys made before stay valid"
    assert "NFKC" in embedding_signature(model, chunking, "NFKC")
    from pipeline.config import signature_of

    nfkc = make_config(text=TextSettings(unicode_form="NFKC"))
    assert signature_of(nfkc) != signature_of(config)
    key = embedding_key("e", "0" * 64, "m@1", signature_of(config))
    assert key != embedding_key("e", "0" * 64, "m@1", signature_of(nfkc)), "switching re-embeds"
    with pytest.raises(ConfigError, match="unicode_form"):
        validate({**json.loads(make_config(input="x", output="y").model_dump_json()),
                  "text": {"unicode_form": "NFD"}})

"""Chunks of text in scripts without spaces (issue 23): transforms/chunking.py with the English
MiniLM's BERT tokenizer and with a SentencePiece-style tokenizer (Unigram + Metaspace, as XLM-R,
multilingual-e5 and bge-m3 use) trained here on text this file writes, with byte fallback, so that
a character it never saw is several tokens. Nothing is downloaded.

- every chunk's ids are the tokens of its text, re-tokenized alone; no chunk starts or ends
  between two tokens of one character; chunks cover the text and overlap as asked;
- with ``sentence_end_slack_tokens``, chunks end at Chinese and Japanese sentence ends (。！？ and
  their fullwidth and halfwidth forms, before closing quotes and brackets);
- a run of characters the SentencePiece model does not know, one unit of byte tokens longer than a
  chunk, is cut inside (the one exception), without failing.
The head mode's fast path in every script: tests/input/test_text_equivalence.py."""
from __future__ import annotations

import json
import random

import pytest

from tools import japanese_text as japanese
from transforms.chunking import Chunker, special_tokens_around
from transforms.settings import ChunkingSettings

ZH_ACTORS = ["北京市政府", "国务院", "专家", "记者", "央行", "上海的企业", "研究人员", "消费者"]
ZH_TOPICS = ["新的交通计划", "明年的预算", "经济增长", "房地产市场", "人工智能", "出口数据",
             "就业形势", "能源价格"]
ZH_VERBS = ["周一宣布了", "表示将调整", "正在研究", "公布了", "讨论了", "批评了"]


def chinese_sentence(rng: random.Random) -> str:
    end = rng.choice(["。", "。", "。", "！", "？", "。”"])
    return (f"{rng.choice(ZH_ACTORS)}{rng.choice(ZH_VERBS)}{rng.choice(ZH_TOPICS)}，"
            f"{rng.choice(ZH_ACTORS)}认为{rng.choice(ZH_TOPICS)}{end}")


ENGLISH = ["The government announced a new transport plan on Monday.",
           "Markets were calm after the central bank held rates.",
           "Is the recovery real? Economists are divided.",
           "Officials said the review would take months."]


@pytest.fixture(scope="module")
def sentencepiece():
    """A Unigram + Metaspace tokenizer trained on Japanese, Chinese and English sentences written
    here, with NFKC as its normalizer and byte fallback: <s> text </s>."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    rng = random.Random(1)
    corpus = ([japanese.sentence(rng) for _ in range(1500)]
              + [chinese_sentence(rng) for _ in range(1000)] + ENGLISH * 50)
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(corpus, trainers.UnigramTrainer(
        vocab_size=1200, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    spec = json.loads(tok.to_str())
    spec["model"]["vocab"] += [[f"<0x{b:02X}>", -30.0] for b in range(256)]
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    assert any(len(piece) >= 3 for piece, _ in spec["model"]["vocab"][4:])  # pieces, not chars
    return tok


@pytest.fixture(params=["bert", "sentencepiece"])
def any_tokenizer(request):
    """The English MiniLM's tokenizer (BERT's), and the SentencePiece-style one; untruncated."""
    from tokenizers import Tokenizer

    if request.param == "sentencepiece":
        return request.getfixturevalue("sentencepiece")
    tok = Tokenizer.from_str(request.getfixturevalue("tokenizer")._tok.to_str())
    tok.no_truncation()
    return tok


# Characters the trained tokenizer never saw: several byte tokens each.
RARE = ["鬱", "鰻", "麒麟", "🎉", "𠮷"]


def cjk_texts() -> list[str]:
    """Japanese articles (tools/japanese_text.py), Chinese paragraphs, and both with rare
    characters, English and numbers in them: no spaces but between paragraphs."""
    rng = random.Random(2)
    texts = [title + "\n" + body for title, body in japanese.articles(6, seed=2)]
    texts += ["".join(chinese_sentence(rng) for _ in range(40)) for _ in range(3)]
    mixed = []
    for text in texts[:3] + texts[-2:]:
        chars = list(text)
        for _ in range(30):
            chars.insert(rng.randrange(len(chars)), rng.choice(RARE + ["AI", "2026年", "G7"]))
        mixed.append("".join(chars))
    return texts + mixed


def inside_a_character(offsets, i: int) -> bool:
    """Whether tokens i-1 and i of a text share a character."""
    return 0 < i < len(offsets) and offsets[i][0] < offsets[i - 1][1]


def ids_without_specials(tok, span):
    lead, trail = special_tokens_around(tok)
    assert span.token_ids[:len(lead)] == lead and span.token_ids[len(span.token_ids)
                                                                 - len(trail):] == trail
    return list(span.token_ids[len(lead):len(span.token_ids) - len(trail)])


@pytest.mark.parametrize("chunk_tokens,overlap", [(48, 8), (128, 32)])
def test_chunks_of_text_without_spaces_are_their_texts_tokens(any_tokenizer, chunk_tokens,
                                                              overlap):
    tok = any_tokenizer
    chunker = Chunker(tok, ChunkingSettings(mode="chunks", chunk_tokens=chunk_tokens,
                                            overlap_tokens=overlap), 256)
    texts = cjk_texts()
    multi_token_chars = retokenized = 0
    for text, (_, _, spans) in zip(texts, chunker.split(texts), strict=True):
        encoding = tok.encode(text, add_special_tokens=False)
        offsets, n = encoding.offsets, len(encoding.ids)
        multi_token_chars += sum(inside_a_character(offsets, i) for i in range(n))
        retokenized += sum(ids_without_specials(tok, span)
                           != encoding.ids[span.token_start:span.token_end] for span in spans)
        assert len(spans) > 3
        assert spans[0].token_start == 0 and spans[-1].token_end == n
        for span in spans:
            assert len(span.token_ids) <= chunk_tokens
            chunk_text = text[span.char_start:span.char_end]
            assert ids_without_specials(tok, span) == tok.encode(
                chunk_text, add_special_tokens=False).ids, (
                f"chunk {span.token_start}-{span.token_end} {chunk_text[:20]!r}... tokenizes "
                "to other ids")
            assert not inside_a_character(offsets, span.token_start), chunk_text[:10]
            assert not inside_a_character(offsets, span.token_end), chunk_text[-10:]
        for before, after in zip(spans, spans[1:], strict=False):  # consecutive pairs
            assert before.token_end - after.token_start >= overlap, "overlap_tokens"
            assert after.token_start > before.token_start
    if type(tok.pre_tokenizer).__name__ == "Metaspace":
        # the texts hold what the test is about: characters of several tokens (bytes, and the
        # "▁" before the first), which BERT's WordPiece does not make, and chunks whose text
        # tokenizes otherwise than the whole text did there
        assert multi_token_chars > 20 and retokenized > 10


SENTENCE_ENDS = ["。", "！", "？", "．", "｡", "。」", "！』", "？）", "。】", "。”"]


def cjk_sentences(rng: random.Random, n: int) -> list[str]:
    """Japanese and Chinese sentences, each ending with one of SENTENCE_ENDS."""
    out = []
    for _ in range(n):
        body = japanese.sentence(rng) if rng.random() < 0.5 else chinese_sentence(rng)
        out.append(body.rstrip("。！？」”") + rng.choice(SENTENCE_ENDS))
    return out


@pytest.mark.parametrize("chunk_tokens", [96, 160])
def test_chunks_end_at_cjk_sentence_ends_within_the_slack(any_tokenizer, chunk_tokens):
    tok = any_tokenizer
    rng = random.Random(3)
    sentences = [cjk_sentences(rng, 60) for _ in range(4)]
    slack = 64
    # the premise: every sentence is shorter than the slack, so one ends within it
    assert max(len(tok.encode(s, add_special_tokens=False).ids)
               for text in sentences for s in text) < slack
    texts = ["".join(text) for text in sentences]
    chunker = Chunker(tok, ChunkingSettings(mode="chunks", chunk_tokens=chunk_tokens,
                                            overlap_tokens=16, sentence_end_slack_tokens=slack),
                      256)
    ends = set("。！？．｡")
    for text, (_, _, spans) in zip(texts, chunker.split(texts), strict=True):
        assert len(spans) > 3
        for span in spans[:-1]:
            chunk_text = text[span.char_start:span.char_end]
            assert chunk_text.rstrip("」』）】”")[-1] in ends, chunk_text[-15:]


def test_a_unit_of_more_tokens_than_a_chunk_is_cut_inside(sentencepiece):
    """Byte fallback spells a run of unknown characters as one unit of byte tokens: 🎉 is 4."""
    text = "東京都は月曜日、新しい交通計画を発表した。" + "🎉" * 30 + "政府は予算案を閣議決定した。"
    encoding = sentencepiece.encode(text, add_special_tokens=False)
    unit = [i for i, (s, e) in enumerate(encoding.offsets) if text[s:e].startswith("🎉🎉")]
    assert len(unit) >= 120  # one unit: every byte token spans the whole run
    chunker = Chunker(sentencepiece, ChunkingSettings(mode="chunks", chunk_tokens=48,
                                                      overlap_tokens=8), 256)
    ((_, _, spans),) = chunker.split([text])
    assert spans[0].token_start == 0 and spans[-1].token_end == len(encoding.ids)
    assert all(len(span.token_ids) <= 48 for span in spans)
    inside = [span for span in spans if unit[0] < span.token_end <= unit[-1]]
    assert inside and all(ids_without_specials(sentencepiece, span)
                          == encoding.ids[span.token_start:span.token_end] for span in inside)

"""Chunks: a long article embedded as windows of its tokens (``chunking.mode: chunks``; ``late``
pools the same windows from one pass over the article's head, ``late_span``), and the
document vector made from them.

A model with a 256-token head sees a fraction of most news articles. In chunks mode PrepareText
cuts the whole prepared text into windows of at most ``chunk_tokens`` tokens (the model's special
tokens and ``model.document_prefix`` included), overlapping by at least ``overlap_tokens``, with the
model's own tokenizer, so the engine never truncates a chunk. A window starts and ends at a word
boundary of the tokenizer, or, in scripts written without spaces (Chinese, Japanese, Thai...),
between two characters, never inside one; its ids are the tokens of its text, re-tokenized alone
(``Chunker`` says when those are not the article's own, and the one exception to both). With
``sentence_end_slack_tokens`` it ends at a sentence end (. ! ? 。！？ and others, closing quotes and
brackets after them) when one lies that close before the cut.

Each chunk becomes a row of ``chunks/`` (``transforms.types.chunk_schema``), and the article keeps
one row in ``vectors/``: the vector of its head (``doc_vector: head``, as in head mode) or the
token-weighted mean of its chunk vectors, L2-normalized (``doc_vector: mean``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from transforms.settings import ChunkingSettings
from transforms.vector_math import normalized

# Sentence ends: ASCII's; the ideographic full stop (and its halfwidth form) and the fullwidth
# ! ? . of Chinese and Japanese (ftfy makes the fullwidth forms ASCII in a prepared text; a
# chunker may be given any); Arabic's question mark and Urdu's full stop; the Devanagari dandas;
# the Armenian, Ethiopic, Myanmar and Khmer full stops. Not commas (、，), colons, semicolons,
# ellipses or the middle dot, which go on a sentence.
_SENTENCE_ENDS = frozenset(".!?。｡！？．؟۔।॥։።။។")
# What may close a sentence after its end: quotes and brackets, ASCII, CJK and fullwidth.
_CLOSERS = frozenset("\"'”’)]」』）】〕〉》〗〙〛〞〟］｝＂＇")
_CLOSERS_TEXT = "".join(_CLOSERS)
# Scripts written without spaces between words (Thai, Lao, Tibetan, Myanmar, Khmer; CJK
# punctuation, kana, ideographs, fullwidth forms): a chunk may start or end between two tokens
# inside a word of the tokenizer when either side is one of these (see ``Chunker``).
_UNSPACED = re.compile("[\u0e00-\u0fff\u1000-\u109f\u1780-\u17ff\u19e0-\u19ff\u3000-\u30ff"
                       "\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
                       "\U00020000-\U0003ffff]")


@dataclasses.dataclass(frozen=True)
class ChunkSpan:
    """One chunk of a prepared text. ``token_ids`` is what the engine embeds (special tokens and the
    document prefix included); the other fields locate it: tokens ``[token_start, token_end)`` of
    the text's own tokens (no special tokens, no prefix), characters ``[char_start, char_end)`` of
    the prepared text."""

    token_ids: tuple[int, ...]
    token_start: int
    token_end: int
    char_start: int
    char_end: int


def copy_tokenizer(tokenizer, spec: Optional[str] = None):
    """A copy of a ``tokenizers.Tokenizer`` (of ``spec``, its ``to_str()`` changed, if given) that
    reads special tokens written in a text as the original does (``encode_special_tokens``, which
    ``to_str`` leaves out)."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(spec or tokenizer.to_str())
    copy.encode_special_tokens = tokenizer.encode_special_tokens
    return copy


def special_tokens_around(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special token ids a tokenizer puts before and after one sequence ([CLS] / [SEP] for
    BERT, <s> / </s> for XLM-R), read from its own post-processor."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return tuple(full[:i]), tuple(full[i + len(plain):])
    raise ValueError("cannot find where this tokenizer puts a sequence among its special tokens")


def bert_style(tokenizer) -> bool:
    """BERT's pre-tokenizer (words at whitespace, then each punctuation mark) after BERT's
    per-character normalizer, or none (MiniLM, bge, e5...): what lies on either side of a point
    where it splits does not change the words and tokens on the other."""
    normalizer = type(tokenizer.normalizer).__name__ if tokenizer.normalizer else None
    return (type(tokenizer.pre_tokenizer).__name__ == "BertPreTokenizer"
            and normalizer in (None, "BertNormalizer"))


class Chunker:
    """Cuts prepared texts into ``ChunkSpan``s with the model's tokenizer (``tokenizers.Tokenizer``,
    which it copies without truncation or padding).

    Where a chunk may start and end (a "break", between two of the text's tokens): at a word
    boundary of the tokenizer (its pre-tokenizer's words), or, in a script written without spaces
    (``_UNSPACED``: CJK, kana, Thai...), between any two tokens beside one of its characters;
    never between two tokens of one character (a byte-fallback character, or SentencePiece's
    "▁" before the first character). A chunk ends at the last break that fits (at a sentence end,
    if one lies within ``sentence_end_slack_tokens``); only a word longer than a chunk with no
    break in it is cut inside, at a character boundary if it has one.

    A chunk's ``token_ids`` are always the tokens of its text (``text[char_start:char_end]``,
    re-tokenized alone): for a BERT-style tokenizer (``bert_style``) and a chunk that starts and
    ends at word boundaries, they are the text's own tokens ``[token_start, token_end)``, by
    construction; otherwise (any other tokenizer, such as SentencePiece's Unigram with Metaspace
    that XLM-R, multilingual-e5 and bge-m3 use, whose words run from space to space; a chunk cut
    inside a word) the chunk's text is tokenized again, and its tokens may differ from the
    article's at the edges (a leading "▁", characters segmented otherwise near a cut); if they are
    more than a chunk holds, the chunk ends at the next best place. ``token_start`` and
    ``token_end`` then still locate the chunk among the article's tokens. One exception: where no
    place to end a chunk gives a text whose tokens fit (its first characters are one unit of about
    as many tokens as a chunk holds, or more: byte fallback spells a run of characters that a
    SentencePiece model does not know as one unit, byte by byte), the chunk takes the article's
    tokens ``[token_start, token_end)`` as they are, cut inside that unit, and the next chunk
    starts inside it."""

    def __init__(self, tokenizer, settings: ChunkingSettings, max_tokens: int,
                 document_prefix: str = ""):
        self._tok = copy_tokenizer(tokenizer)
        self._tok.no_truncation()
        self._tok.no_padding()
        self._lead, self._trail = special_tokens_around(self._tok)
        self._prefix = (tuple(self._tok.encode(document_prefix, add_special_tokens=False).ids)
                        if document_prefix else ())
        chunk_tokens = settings.chunk_tokens or max_tokens
        if chunk_tokens > max_tokens:
            raise ValueError(f"chunking.chunk_tokens ({chunk_tokens}) must be at most "
                             f"model.max_tokens ({max_tokens}): the engine would truncate chunks")
        self.capacity = chunk_tokens - len(self._lead) - len(self._trail) - len(self._prefix)
        if self.capacity <= settings.overlap_tokens:
            raise ValueError(
                f"chunking: a chunk of {chunk_tokens} tokens holds {self.capacity} tokens of text "
                f"(after special tokens and the document prefix), not more than overlap_tokens "
                f"({settings.overlap_tokens}): chunks would not advance")
        self._overlap, self._slack = settings.overlap_tokens, settings.sentence_end_slack_tokens
        self._head_room = max_tokens - len(self._lead) - len(self._trail) - len(self._prefix)
        self._words_exact = bert_style(self._tok)

    def late_span(self, head_length: int, span: ChunkSpan) -> Optional[tuple[int, int]]:
        """Where a chunk's tokens lie in its article's head-mode input of ``head_length`` tokens
        (``[start, end)``, after the special tokens and the prefix), or None if the head does not
        hold the whole chunk (``chunking.mode: late`` embeds that chunk alone)."""
        offset = len(self._lead) + len(self._prefix)
        held = head_length - offset - len(self._trail)  # the text's tokens in the head
        if span.token_end > held:
            return None
        return offset + span.token_start, offset + span.token_end

    def split(self, texts: Sequence[str]) -> list[
            tuple[tuple[int, ...], bool, tuple[ChunkSpan, ...]]]:
        """Per text: its head-mode input (its first tokens up to ``max_tokens``, with the prefix and
        the special tokens), whether that head was cut, and its chunks."""
        return [self.split_encoded(text, self.encode(text)) for text in texts]

    def encode(self, text: str):
        """The tokens of the whole text, with their offsets and words (no special tokens)."""
        return self._tok.encode(text, add_special_tokens=False)

    def split_encoded(self, text: str, encoding, check: Optional[Callable[[], None]] = None
                      ) -> tuple[tuple[int, ...], bool, tuple[ChunkSpan, ...]]:
        """``split`` of one text, from its ``encode``; ``check`` is called every so many chunks
        (a deadline)."""
        ids = encoding.ids
        head = self._lead + self._prefix + tuple(ids[:self._head_room]) + self._trail
        return (head, len(ids) > self._head_room,
                self._spans(text, ids, encoding.offsets, encoding.word_ids, check))

    def _spans(self, text: str, ids, offsets, word_ids,
               check: Optional[Callable[[], None]] = None) -> tuple[ChunkSpan, ...]:
        n = len(ids)
        breaks = _Breaks(text, offsets, word_ids, n)
        spans, start = [], 0
        while True:
            end, token_ids = self._chunk(text, ids, offsets, start, breaks)
            spans.append(ChunkSpan(
                token_ids=self._lead + self._prefix + token_ids + self._trail,
                token_start=start, token_end=end,
                char_start=offsets[start][0], char_end=offsets[end - 1][1]))
            if end >= n:
                return tuple(spans)
            if check is not None and not len(spans) % 16:
                check()
            following = max(end - self._overlap, start + 1)
            while following > start + 1 and not breaks.at_break(following):
                following -= 1
            start = following if breaks.at_break(following) else end

    def _chunk(self, text: str, ids, offsets, start: int,
               breaks: _Breaks) -> tuple[int, tuple[int, ...]]:
        """(where the chunk from ``start`` ends, its tokens): at the best place to end it whose
        text's tokens fit (``_token_ids``)."""
        tried: set[int] = set()
        for end in breaks.ends(start, self.capacity, self._slack):
            if end in tried:
                continue
            tried.add(end)
            token_ids = self._token_ids(text, ids, offsets, start, end, breaks.at_word_boundary)
            if token_ids is not None:  # else its text has more tokens than a chunk holds
                return end, token_ids
        # a unit of more tokens than a chunk holds, from start on: cut it inside
        end = min(start + self.capacity, len(ids))
        return end, tuple(ids[start:end])

    def _token_ids(self, text: str, ids, offsets, start: int, end: int,
                   at_word_boundary: Callable[[int], bool]) -> Optional[tuple[int, ...]]:
        """The tokens of the chunk ``[start, end)``'s text tokenized alone (see the class
        docstring), or None if they are more than a chunk holds. For a BERT-style tokenizer, whose
        words are tokenized each on its own, only a word the chunk cuts is tokenized again (the
        part of it in the chunk): the words in between keep the text's tokens."""
        char_start, char_end = offsets[start][0], offsets[end - 1][1]
        if char_start == 0 and char_end == len(text):
            return tuple(ids[start:end])  # the same text
        if self._words_exact:
            first_whole = start  # the first token of the chunk's first whole word
            while first_whole < end and not at_word_boundary(first_whole):
                first_whole += 1
            last_whole = end  # where its last word the chunk cuts starts
            while last_whole > first_whole and not at_word_boundary(last_whole):
                last_whole -= 1
            if first_whole == start and last_whole == end:
                return tuple(ids[start:end])  # the same words
            if last_whole >= first_whole and (first_whole > start or last_whole < end):
                own = (self._encode(text[char_start:offsets[first_whole - 1][1]])
                       if first_whole > start else ())
                own += tuple(ids[first_whole:last_whole])
                if last_whole < end:
                    own += self._encode(text[offsets[last_whole][0]:char_end])
                return own if len(own) <= self.capacity else None
        own = self._encode(text[char_start:char_end])
        return own if len(own) <= self.capacity else None

    def _encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(text, add_special_tokens=False).ids)


class _Breaks:
    """Where a chunk of one text may start and end, between its tokens ``i - 1`` and ``i`` (see
    ``Chunker``): at a break, and best at a break after a sentence's end."""

    def __init__(self, text: str, offsets, word_ids, n: int):
        self._text, self._offsets, self._word_ids, self._n = text, offsets, word_ids, n
        # For token j: the last token at or before it that is not a closing quote or bracket (or
        # token 0), filled in as ends_sentence walks back, so that each token is walked over once
        # in the whole text (a text of nothing but quotes was read back to its start at every
        # place a chunk could end: quadratic).
        self._before_closers: dict[int, int] = {}

    def at_word_boundary(self, i: int) -> bool:
        word_ids = self._word_ids
        return i <= 0 or i >= self._n or word_ids[i] is None or word_ids[i] != word_ids[i - 1]

    def at_char_boundary(self, i: int) -> bool:  # tokens i-1 and i share no character
        offsets = self._offsets
        return i <= 0 or i >= self._n or offsets[i][0] >= offsets[i - 1][1]

    def at_break(self, i: int) -> bool:
        text, offsets = self._text, self._offsets
        return self.at_char_boundary(i) and (self.at_word_boundary(i) or bool(
            _UNSPACED.match(text, offsets[i][0])
            or _UNSPACED.match(text, max(0, offsets[i - 1][1] - 1))))

    def _piece(self, j: int) -> str:  # token j's text, without the space SentencePiece keeps in it
        return self._text[self._offsets[j][0]:self._offsets[j][1]].strip()

    def ends_sentence(self, i: int) -> bool:  # the text's token i-1 closes a sentence
        before_closers = self._before_closers
        j, walked = i - 1, []
        while j > 0 and j not in before_closers and self._piece(j) in _CLOSERS:
            walked.append(j)
            j -= 1
        j = before_closers.get(j, j)
        before_closers.update(dict.fromkeys(walked, j))
        return self._piece(j).rstrip(_CLOSERS_TEXT)[-1:] in _SENTENCE_ENDS

    def ends(self, start: int, capacity: int, slack: int) -> Iterator[int]:
        """Where the chunk from ``start`` may end, best first."""
        n = self._n
        end = min(start + capacity, n)
        if end == n:
            yield n  # the rest fits
        low = max(start, end - slack)
        yield from (e for e in range(end, low, -1) if self.at_break(e) and self.ends_sentence(e))
        yield from (e for e in range(end, start, -1) if self.at_break(e))
        # a word longer than a chunk, with no break: cut inside, between characters
        yield from (e for e in range(end, start, -1) if self.at_char_boundary(e))


def chunk_id(doc_id: str, text_sha256: str, model: str, chunk_recipe: str, index: int) -> str:
    """Deterministic: the same document, text, model and chunking settings give the same id in every
    run and retry."""
    key = "\0".join((doc_id, text_sha256, model, chunk_recipe, str(index)))
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


def late_vector(tokens: np.ndarray, start: int, end: int, normalize: bool) -> np.ndarray:
    """A chunk's late-chunking vector: the mean of its tokens' vectors ``[start, end)`` from the
    pass over the whole head (L2-normalized if the model's vectors are). The mean whatever the
    model's own pooling: a chunk has no CLS or last token of its own that saw only it, and the
    mean over a span is the pooling late chunking was defined with."""
    return normalized(tokens[start:end].astype(np.float64).mean(axis=0), normalize)


def mean_vector(vectors: Sequence[np.ndarray], weights: Sequence[int]) -> np.ndarray:
    """The weighted mean of chunk vectors, L2-normalized."""
    mean = np.average(np.stack(vectors).astype(np.float64), axis=0, weights=np.asarray(weights))
    norm = np.linalg.norm(mean)
    return (mean / norm if norm else mean).astype(np.float32)

"""The head of a text in the model's tokens (``HeadTokenizer``): the model's tokenizer, truncating
on the right to ``max_tokens``, that tokenizes only a prefix of a long text where the cut rules of
a BERT-style tokenizer prove the prefix's tokens are the text's first ones."""
from __future__ import annotations

import re
import sys
import threading
import unicodedata
from typing import Generator, NamedTuple, Optional

from transforms.chunking import bert_style, copy_tokenizer
from transforms.engines.model import model_folder
from transforms.settings import ModelSettings
from transforms.text.deadline import Deadline, _check
from transforms.text.unicode import _char_class


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


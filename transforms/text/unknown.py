"""The words of a prepared text that the model's tokenizer cannot read (``UnknownTokens``): what
``text.max_unknown_token_ratio`` is checked against."""
from __future__ import annotations

import itertools
import unicodedata
from typing import Optional

from transforms.chunking import copy_tokenizer


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


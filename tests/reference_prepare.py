"""The reference text preparation: newsvec's PrepareText as of 2026-12-02, frozen here, before its
fast paths (transforms/text.py). Every field goes through the HTML step, the whole of ftfy, then the
control/format/whitespace clean-up; every text is tokenized whole (up to the old character bound)
with right truncation. tests/test_text_equivalence.py checks that the fast paths give exactly this
output: the same prepared text (so the same text_sha256), token ids and truncation flag.

It reuses what the fast paths did not change (the HTML extractor, the tag and control-character
expressions) from transforms/text.py; the format-character and whitespace expressions are the old
ones, built here as they were.
"""
from __future__ import annotations

import html
import re
import sys
import unicodedata
from typing import Optional

import ftfy

from transforms import text as fast

CHARS_PER_TOKEN_BOUND = 32
_FORMAT = re.compile("[" + "".join(
    re.escape(chr(c)) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf")
    + "]")
_SPACE = re.compile(r"\s+")


def normalize_text(text: Optional[str]) -> str:
    if not text:
        return ""
    if fast._TAG.search(text):
        text = fast.strip_html(text)
    elif "&" in text:
        text = html.unescape(text)
    text = ftfy.fix_text(text, unescape_html=False, normalization="NFC")
    text = _FORMAT.sub("", fast._CONTROL.sub(" ", text))
    return _SPACE.sub(" ", text).strip()


def compose_text(title: Optional[str], body: Optional[str]) -> str:
    return "\n".join(part for part in (normalize_text(title), normalize_text(body)) if part)


def head_tokens(tokenizer, texts: list[str], max_tokens: int) -> list[tuple[tuple[int, ...], bool]]:
    """``tokenizer``: the model's fast tokenizer (``backend_tokenizer``), truncation on the right to
    ``max_tokens``, as HeadTokenizer sets it up."""
    max_chars = max_tokens * CHARS_PER_TOKEN_BOUND
    encodings = tokenizer.encode_batch([t[:max_chars] for t in texts])
    return [(tuple(e.ids), len(t) > max_chars or bool(e.overflowing))
            for e, t in zip(encodings, texts, strict=True)]

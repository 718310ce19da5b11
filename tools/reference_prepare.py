"""The reference text preparation: newsvec's PrepareText as of 2026-12-02, frozen here, before its
fast paths (transforms/text/). Every field goes through the HTML step, the whole of ftfy, then the
control/format/whitespace clean-up (since 2026-12-06, a text that had format characters is NFC
again once they are removed, and last of all a space goes after every "<" that would open a tag:
no live markup in a prepared text or title); every text is tokenized whole with right truncation
(the version of 2026-12-02 first cut texts at 32 characters per token, a bound that does not hold
in scripts without spaces: issue 23; the reference is the definition, so it cuts nothing).
tests/input/test_text_equivalence.py checks that the fast paths give exactly this output: the same
prepared text (so the same text_sha256), token ids and truncation flag.

It reuses what the fast paths did not change (the HTML extractor, the tag and control-character
expressions) from transforms/text/; the format-character and whitespace expressions are the old
ones, built here as they were.
"""
from __future__ import annotations

import html
import re
import sys
import unicodedata
from typing import Optional

import ftfy

from transforms.text.markup import _TAG, strip_html
from transforms.text.unicode import _CONTROL

_FORMAT = re.compile("[" + "".join(
    re.escape(chr(c)) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf")
    + "]")
_SPACE = re.compile(r"\s+")
_TAG_OPEN = re.compile(r"<([^\s0-9<>=])")  # "<" that could open an HTML or XML tag, comment...


def normalize_text(text: Optional[str]) -> str:
    if not text:
        return ""
    if _TAG.search(text):
        text = strip_html(text)
    elif "&" in text:
        text = html.unescape(text)
    text = ftfy.fix_text(text, unescape_html=False, normalization="NFC")
    text = _CONTROL.sub(" ", text)
    without = _FORMAT.sub("", text)
    if without != text:  # a letter and its mark side by side again: NFC again (since 2026-12-06)
        text = unicodedata.normalize("NFC", without)
    text = _SPACE.sub(" ", text).strip()
    return _TAG_OPEN.sub(r"< \1", text)  # since 2026-12-06: defused, read as text


def compose_text(title: Optional[str], body: Optional[str]) -> str:
    return "\n".join(part for part in (normalize_text(title), normalize_text(body)) if part)


def head_tokens(tokenizer, texts: list[str], max_tokens: int) -> list[tuple[tuple[int, ...], bool]]:
    """``tokenizer``: the model's fast tokenizer (``backend_tokenizer``), truncation on the right to
    ``max_tokens``, as HeadTokenizer sets it up: the whole text, truncated."""
    assert tokenizer.truncation and tokenizer.truncation["max_length"] == max_tokens
    return [(tuple(e.ids), bool(e.overflowing)) for e in tokenizer.encode_batch(texts)]

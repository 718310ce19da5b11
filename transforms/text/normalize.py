"""One field's text cleaned for the model (``normalize_text``: markup stripped, Unicode repaired
and normalized, control and format characters dropped, whitespace collapsed, markup defused), and
the text that is embedded (``join_text``, ``compose_text``)."""
from __future__ import annotations

import html
import unicodedata
from typing import Optional

from transforms.settings import UnicodeForm
from transforms.text.deadline import Deadline, _check
from transforms.text.markup import _TAG, defuse_markup, strip_markup
from transforms.text.unicode import _CONTROL, _FORMAT, collapse_combining_marks, fix_text
from transforms.types import NewsEvent


class TextTooLong(Exception):
    """Normalization made a field longer than ``normalize_text``'s ``max_chars``: NFKC writes some
    characters as many (U+FDFA is 18 characters), ftfy a ligature as its letters."""

    def __init__(self, chars: int):
        super().__init__(chars)
        self.chars = chars


def normalize_text(text: Optional[str], form: UnicodeForm = "NFC",
                   deadline: Optional[Deadline] = None, max_chars: Optional[int] = None) -> str:
    """One field's text, cleaned for the model, in Unicode ``form``. Idempotent. Its cost is
    linear in the text's length (see ``transforms.text``'s docstring); ``deadline``: the
    document's budget (``PrepareTimeout`` past it); ``max_chars``: ``TextTooLong`` if Unicode
    normalization makes the text longer (checked before the steps after it)."""
    if not text:
        return ""
    if _TAG.search(text):
        text = strip_markup(text, deadline)
    elif "&" in text:
        text = html.unescape(text)
    text = collapse_combining_marks(text)
    _check(deadline, "the HTML step")
    text = fix_text(text, deadline)  # NFC
    _check(deadline, "ftfy")
    if form == "NFKC" and not text.isascii():
        text = unicodedata.normalize("NFKC", text)  # NFKC(NFC(x)) == NFKC(x)
    if max_chars is not None and len(text) > max_chars:
        raise TextTooLong(len(text))
    if _CONTROL.search(text):
        text = _CONTROL.sub(" ", text)
    if not text.isascii():  # format characters (Cf) are all outside ASCII
        without = _FORMAT.sub("", text)
        if len(without) != len(text):
            # What stood between two runs of marks, or between a letter and its mark ("e\u200d"
            # "\u0301"), is gone: the runs are cut again, and the text normalized again.
            text = collapse_combining_marks(without)
            if not unicodedata.is_normalized(form, text):
                text = unicodedata.normalize(form, text)
    # str.split's whitespace is re's \s (the test checks each). Last, as every step before can
    # make a tag open: entities, ftfy's and NFKC's folding of full-width and small forms, a format
    # character dropped from between "<" and a letter.
    return defuse_markup(" ".join(text.split()))


def join_text(title: str, body: str) -> str:
    """The text that is embedded, of a normalized title and body: title, a newline, body."""
    return "\n".join(part for part in (title, body) if part)


def compose_text(event: NewsEvent, form: UnicodeForm = "NFC") -> str:
    """The text that is embedded: normalized title, a newline, normalized body."""
    return join_text(normalize_text(event.title, form), normalize_text(event.body, form))


"""Prepare text: NewsEvent -> PreparedDoc (normalized text + the head of its token ids), or a dead
letter.

Normalization: HTML tags dropped and entities decoded, mojibake repaired (ftfy), Unicode NFC (or
NFKC: ``text.unicode_form``), control characters removed, invisible format characters (bidi
controls, joiners, soft hyphens) dropped, whitespace collapsed, and last a space put after every
``<`` that would open a tag (``defuse_markup``): text that only became markup on the way
(``&lt;script&gt;`` decoded, ``＜img＞`` folded to ASCII, ``<\u00adscript>`` once the soft hyphen
is dropped) is never live markup in the prepared text and title. Title and body are joined by a
newline.

Truncation keeps the HEAD of long articles: the text is tokenized here with the model's own
tokenizer, truncated on the right to ``max_tokens`` (special tokens included), and the ids go to
vLLM as they are. (vLLM's ``truncate_prompt_tokens`` would keep the tail, the wrong end for news.)
``model.document_prefix`` goes before the text and counts in its tokens. In chunks mode
(``transforms.chunking``) the whole text is tokenized, and cut into chunks as well.

Two fast paths give exactly the output of doing every step on every text (tools/reference_prepare.py
and tests/input/test_text_equivalence.py, on the BBC articles and the adversarial corpus):
- ftfy runs only on text it could change (``ftfy_may_change``): every one of its fixers is a
  no-op on the characters present, the text is NFC, and no window around a non-ASCII character
  looks like mojibake. Most news is ASCII or nearly so, and ftfy was 70% of the CPU time.
- a long text is tokenized in steps: first a prefix that ends where a BERT-style tokenizer
  splits whatever follows (before a space, after a CJK ideograph or a punctuation mark); if that
  already overflows ``max_tokens``, its head is the text's head. Otherwise a longer prefix, and
  at last the whole text. No bound on characters per token is assumed: none holds in every script
  (the proof: ``HeadTokenizer``). The unknown-token count reads the same prefix.

Hostile text costs time linear in its length, on every interpreter (Python 3.11.7's ``html.parser``
and ``unicodedata.normalize`` are quadratic on some inputs; the worker image pins a patched 3.11,
but these guards do not rely on it):
- the HTML parser may re-read the rest of a field for constructs that never close (``<a``,
  ``<a b="``, ``</``, ``<!``, ``<?``...) at most ``_RESCAN_FACTOR`` times the field's length; past
  that, the field's markup is removed by ``strip_markup_linear``, in a single pass;
- a run of more than ``MAX_COMBINING_RUN`` combining marks (non-starters) is cut to its first
  ``MAX_COMBINING_RUN`` before any Unicode normalization, ftfy's included (the Stream-Safe Text
  Format's limit: no text in any language needs more);
- titles longer than ``max_title_chars`` are dead-lettered (``text_too_long``), and so is a text
  that normalization makes longer than ``max_text_chars`` (NFKC writes U+FDFA as 18 characters),
  before the steps after it;
- ftfy's mojibake repair may read at most ``_DECODE_FACTOR`` times the text; past that, the text
  is fixed without it;
- each document has a budget of CPU time (``prepare_budget_s``), checked between the steps
  (normalization, tokenization, chunking, the unknown-token count) and in the loops that can be
  long: past it, the document is dead-lettered ``prepare_failed``.

One file per part:
- ``deadline``: a document's budget of CPU time (``Deadline``, ``PrepareTimeout``);
- ``unicode``: combining marks cut, ftfy's repair fast and bounded, control and format characters;
- ``markup``: the two markup strippers (``strip_markup``, ``strip_markup_linear``) and
  ``defuse_markup``;
- ``normalize``: one field's text (``normalize_text``) and the text embedded (``compose_text``);
- ``head``: ``HeadTokenizer``, the head of a text in tokens, with BERT's cut rules;
- ``unknown``: ``UnknownTokens``, the words the model cannot read;
- ``prepare``: the ``PrepareText`` step and the tokenizer tools it shares (``text_tools``).
"""
from transforms.text.deadline import Deadline, PrepareTimeout
from transforms.text.head import Head, HeadTokenizer
from transforms.text.normalize import TextTooLong, compose_text, join_text, normalize_text
from transforms.text.prepare import PrepareText, TextTools, text_tools
from transforms.text.unknown import UnknownTokens, unknown_token_id

__all__ = [
    "Deadline", "Head", "HeadTokenizer", "PrepareText", "PrepareTimeout", "TextTools",
    "TextTooLong", "UnknownTokens", "compose_text", "join_text", "normalize_text", "text_tools",
    "unknown_token_id",
]

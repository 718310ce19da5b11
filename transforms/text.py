"""Prepare text: NewsEvent -> PreparedDoc (normalized text + the head of its token ids), or a dead letter.

Normalization: HTML tags dropped and entities decoded, mojibake repaired (ftfy), Unicode NFC, control
characters removed, invisible format characters (bidi controls, joiners, soft hyphens) dropped,
whitespace collapsed. Title and body are joined by a newline.

Truncation keeps the HEAD of long articles: the text is tokenized here with the model's own tokenizer,
truncated on the right to ``max_tokens`` (special tokens included), and the ids go to vLLM as they
are. (vLLM's ``truncate_prompt_tokens`` would keep the tail, the wrong end for news.)
"""
from __future__ import annotations

import hashlib
import html.parser
import re
import sys
import unicodedata
from typing import Iterator, Optional

import apache_beam as beam
import ftfy
from apache_beam import pvalue

from transforms.model import ModelSettings, resolve_model_path
from transforms.schema import DeadLetter, NewsEvent, PreparedDoc, Reason, Step

DEAD_LETTER = "dead_letter"

# Text past this many characters per allowed token is cut before tokenizing: real text has far more
# tokens than max_tokens by then, so that part would be truncated anyway (and ``truncated`` is set).
_CHARS_PER_TOKEN_BOUND = 32
_TOKENIZE_BATCH = 128
_TAG = re.compile(r"<[A-Za-z!/?]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b\ufeff]")
# Invisible format characters (Unicode category Cf: bidi controls, joiners, soft hyphens, tags...)
# are dropped without a space: "co\u00adoperate" is one word. The model's tokenizer drops them too,
# so a text of nothing else is empty, not a row of special tokens only.
_FORMAT = re.compile("[" + "".join(
    re.escape(chr(c)) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cf")
    + "]")
_SPACE = re.compile(r"\s+")
_BLOCK_TAGS = frozenset(
    "address article aside blockquote br dd div dl dt figcaption figure footer h1 h2 h3 h4 h5 h6 "
    "header hr li main nav ol p pre section table td th tr ul".split())
_SKIP_TAGS = frozenset({"script", "style", "noscript", "template"})


class _TextExtractor(html.parser.HTMLParser):
    """Text content of an HTML fragment; block tags become spaces, scripts and styles are dropped."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in _SKIP_TAGS:
            self._skip += 1
        elif tag in _BLOCK_TAGS:
            self.parts.append(" ")

    def handle_endtag(self, tag):
        if tag in _SKIP_TAGS:
            self._skip = max(0, self._skip - 1)
        elif tag in _BLOCK_TAGS:
            self.parts.append(" ")

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def strip_html(text: str) -> str:
    parser = _TextExtractor()
    parser.feed(text)
    parser.close()
    return "".join(parser.parts)


def normalize_text(text: Optional[str]) -> str:
    """One field's text, cleaned for the model. Idempotent."""
    if not text:
        return ""
    if _TAG.search(text):
        text = strip_html(text)
    elif "&" in text:
        text = html.unescape(text)
    text = ftfy.fix_text(text, unescape_html=False, normalization="NFC")
    text = _FORMAT.sub("", _CONTROL.sub(" ", text))
    return _SPACE.sub(" ", text).strip()


def compose_text(event: NewsEvent) -> str:
    """The text that is embedded: normalized title, a newline, normalized body."""
    return "\n".join(part for part in (normalize_text(event.title), normalize_text(event.body)) if part)


class HeadTokenizer:
    """The model's tokenizer, truncating on the right (keeping the head) to ``max_tokens``."""

    def __init__(self, model: ModelSettings):
        model.apply_engine_env()  # e.g. HF_HUB_OFFLINE, read when transformers is imported
        from transformers import AutoTokenizer  # heavy import, only where it is used

        hf = AutoTokenizer.from_pretrained(resolve_model_path(model.path), revision=model.revision,
                                           trust_remote_code=model.trust_remote_code)
        self._tok = hf.backend_tokenizer  # the fast (Rust) tokenizer, without Python overhead
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=model.max_tokens, direction="right")
        self.max_tokens = model.max_tokens
        self._max_chars = model.max_tokens * _CHARS_PER_TOKEN_BOUND

    def __call__(self, text: str) -> tuple[tuple[int, ...], bool]:
        """(token ids of the head, whether anything was cut)."""
        return self.batch([text])[0]

    def batch(self, texts: list[str]) -> list[tuple[tuple[int, ...], bool]]:
        """``__call__`` for many texts at once: the Rust tokenizer spreads a batch over the cores."""
        cut = [len(t) > self._max_chars for t in texts]
        encodings = self._tok.encode_batch([t[: self._max_chars] for t in texts])
        return [(tuple(e.ids), c or bool(e.overflowing)) for e, c in zip(encodings, cut)]


class _PrepareTextFn(beam.DoFn):
    def __init__(self, model: ModelSettings, max_text_chars: int, dead_letter_payload_bytes: int):
        self._model = model
        self._max_text_chars, self._dl_bytes = max_text_chars, dead_letter_payload_bytes
        self._tokenizer: Optional[HeadTokenizer] = None

    def setup(self):
        self._tokenizer = HeadTokenizer(self._model)

    def _dead_letter(self, event: NewsEvent, reason: str, detail: str):
        return pvalue.TaggedOutput(DEAD_LETTER, DeadLetter.for_event(
            event, Step.PREPARE, reason, detail, self._dl_bytes))

    def _compose(self, event: NewsEvent):
        """The composed text, or a dead letter."""
        length = len(event.title or "") + len(event.body or "")
        if length > self._max_text_chars:
            return self._dead_letter(event, Reason.TEXT_TOO_LONG,
                                     f"title and body hold {length} characters, over the limit of "
                                     f"{self._max_text_chars}")
        try:
            text = compose_text(event)
        except Exception as exc:  # pylint: disable=broad-except  # hostile markup must not crash
            return self._dead_letter(event, Reason.PREPARE_FAILED,
                                     f"text normalization failed: {type(exc).__name__}: {exc}"[:500])
        if not text:
            return self._dead_letter(event, Reason.EMPTY_AFTER_NORMALIZATION,
                                     "no text is left once HTML, control characters and whitespace "
                                     "are removed")
        return text

    def _tokenize(self, texts: list[str]) -> list:
        try:
            return self._tokenizer.batch(texts)
        except Exception:  # pylint: disable=broad-except  # find the text to blame, keep the rest
            results = []
            for text in texts:
                try:
                    results.append(self._tokenizer(text))
                except Exception as exc:  # pylint: disable=broad-except
                    results.append(exc)
            return results

    def process(self, events: list[NewsEvent]) -> Iterator:
        composed = [(event, self._compose(event)) for event in events]
        yield from (text for _, text in composed if not isinstance(text, str))
        ready = [(event, text) for event, text in composed if isinstance(text, str)]
        for (event, text), tokens in zip(ready, self._tokenize([text for _, text in ready])):
            if isinstance(tokens, Exception):
                yield self._dead_letter(event, Reason.PREPARE_FAILED,
                                        f"tokenization failed: {type(tokens).__name__}: {tokens}"[:500])
                continue
            ids, truncated = tokens
            yield PreparedDoc(event=event, text=text,
                              text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
                              token_ids=ids, truncated=truncated)


class PrepareText(beam.PTransform):
    """NewsEvent -> PreparedDoc (main output) and DeadLetter (``dead_letter`` output)."""

    def __init__(self, model: ModelSettings, *, max_text_chars: int = 200_000,
                 dead_letter_payload_bytes: int = 4096):
        super().__init__()
        self._fn = _PrepareTextFn(model, max_text_chars, dead_letter_payload_bytes)

    def expand(self, events):
        return (events
                # Batches only so that the tokenizer works on many texts at once.
                | "Batch" >> beam.BatchElements(min_batch_size=_TOKENIZE_BATCH,
                                                max_batch_size=_TOKENIZE_BATCH)
                | "Prepare" >> beam.ParDo(self._fn).with_outputs(DEAD_LETTER, main="docs"))

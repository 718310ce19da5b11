"""The PrepareText step: NewsEvent -> PreparedDoc (the normalized text and the head of its token
ids, or its chunks), or a dead letter; and the tokenizer tools it shares per process
(``text_tools``)."""
from __future__ import annotations

import hashlib
import threading
from typing import Iterable, Iterator, NamedTuple, Optional

import apache_beam as beam
from apache_beam import pvalue

from transforms.chunking import Chunker
from transforms.settings import (
    DEFAULT_MAX_TITLE_CHARS,
    DEFAULT_PREPARE_BUDGET_S,
    ChunkingSettings,
    ModelSettings,
    UnicodeForm,
)
from transforms.text.deadline import Deadline, PrepareTimeout, _check
from transforms.text.head import HeadTokenizer
from transforms.text.normalize import TextTooLong, join_text, normalize_text
from transforms.text.unknown import UnknownTokens
from transforms.types import DEAD_LETTER, DeadLetter, NewsEvent, PreparedDoc, Reason, Step

_TOKENIZE_BATCH = 128


class TextTools(NamedTuple):
    """What preparing text needs of a model's tokenizer (see ``text_tools``)."""
    head: "HeadTokenizer"
    chunker: Optional[Chunker]  # in chunks and late modes only
    unknown: UnknownTokens


_TOOLS_LOCK = threading.Lock()
_TOOLS: dict[tuple[str, str], TextTools] = {}


def text_tools(model: ModelSettings, chunking: ChunkingSettings = ChunkingSettings()) -> TextTools:
    """The head tokenizer, the chunker (in chunks mode) and the unknown-token counter for these
    settings, built once per process and shared by every thread and DoFn instance. Building them
    costs about 100 ms (the tokenizer's files, and copies of it), and runners call ``setup`` as they
    please: the local streaming runner unpickles a new DoFn and calls ``setup`` at every bundle's
    start, which a soak run found to be a quarter of its time. All are used read-only once built
    (the Rust tokenizer's encode methods take no lock and change nothing)."""
    key = (model.model_dump_json(), chunking.model_dump_json())
    with _TOOLS_LOCK:
        if key not in _TOOLS:
            tokenizer = HeadTokenizer(model)
            chunker = (Chunker(tokenizer._tok, chunking, model.max_tokens,
                               model.document_prefix) if chunking.mode != "head" else None)
            _TOOLS[key] = TextTools(tokenizer, chunker,
                                    UnknownTokens(tokenizer._tok, model.document_prefix))
        return _TOOLS[key]


class _PrepareTextFn(beam.DoFn):
    def __init__(self, model: ModelSettings, max_text_chars: int, dead_letter_payload_bytes: int,
                 chunking: ChunkingSettings = ChunkingSettings(), *,
                 unicode_form: UnicodeForm = "NFC", max_unknown_token_ratio: float = 0.2,
                 max_title_chars: int = DEFAULT_MAX_TITLE_CHARS,
                 prepare_budget_s: float = DEFAULT_PREPARE_BUDGET_S):
        self._model, self._chunking = model, chunking
        self._max_text_chars, self._dl_bytes = max_text_chars, dead_letter_payload_bytes
        self._form, self._max_unknown = unicode_form, max_unknown_token_ratio
        self._max_title_chars, self._budget_s = max_title_chars, prepare_budget_s
        self._tokenizer: Optional[HeadTokenizer] = None
        self._chunker: Optional[Chunker] = None
        self._unknown: Optional[UnknownTokens] = None

    def setup(self):
        self._tokenizer, self._chunker, self._unknown = text_tools(self._model, self._chunking)

    def _tokenize(self, text: str, deadline: Deadline) -> tuple:
        """(head token ids, whether the head was cut, chunks, (unknown words, tokens counted)),
        the deadline checked after each step."""
        assert self._tokenizer is not None and self._unknown is not None, "setup() makes them"
        if self._chunker is not None:
            encoding = self._chunker.encode(text)
            _check(deadline, "tokenization")
            ids, truncated, chunks = self._chunker.split_encoded(
                text, encoding, check=lambda: _check(deadline, "chunking"))
            _check(deadline, "chunking")
            unknown = self._unknown.of_text(text, encoding.ids, encoding.offsets)
        else:
            ids, truncated, end, encoding = self._tokenizer.head(
                self._model.document_prefix + text, deadline)
            _check(deadline, "tokenization")
            chunks = ()
            unknown = self._unknown.of_head(text, ids, end, encoding)
        _check(deadline, "the unknown-token count")
        return ids, truncated, chunks, unknown

    def _dead_letter(self, event: NewsEvent, reason: Reason, detail: str):
        return pvalue.TaggedOutput(DEAD_LETTER, DeadLetter.for_event(
            event, Step.PREPARE, reason, detail, self._dl_bytes))

    def _compose(self, event: NewsEvent, deadline: Optional[Deadline] = None):
        """(the prepared title, the composed text), or a dead letter; ``PrepareTimeout`` past the
        deadline (the document's own, if none is given)."""
        deadline = deadline or Deadline(self._budget_s)
        length = len(event.title or "") + len(event.body or "")
        if length > self._max_text_chars:
            return self._dead_letter(event, Reason.TEXT_TOO_LONG,
                                     f"title and body hold {length} characters, over the limit of "
                                     f"{self._max_text_chars}")
        if len(event.title or "") > self._max_title_chars:
            return self._dead_letter(event, Reason.TEXT_TOO_LONG,
                                     f"the title holds {len(event.title or '')} characters, over "
                                     f"text.max_title_chars {self._max_title_chars} (is the body "
                                     f"in the title field?)")
        try:
            title = normalize_text(event.title, self._form, deadline, self._max_text_chars)
            text = join_text(title, normalize_text(event.body, self._form, deadline,
                                                   self._max_text_chars))
        except PrepareTimeout:
            raise
        except TextTooLong as exc:
            return self._expanded(event, exc.chars)
        except Exception as exc:  # pylint: disable=broad-except  # hostile markup must not crash
            return self._dead_letter(
                event, Reason.PREPARE_FAILED,
                f"text normalization failed: {type(exc).__name__}: {exc}"[:500])
        if len(text) > self._max_text_chars:
            return self._expanded(event, len(text))
        if not text:
            return self._dead_letter(event, Reason.EMPTY_AFTER_NORMALIZATION,
                                     "no text is left once HTML, control characters and whitespace "
                                     "are removed")
        return title, text

    def _expanded(self, event: NewsEvent, chars: int):
        return self._dead_letter(
            event, Reason.TEXT_TOO_LONG,
            f"normalization (text.unicode_form {self._form}) makes the text {chars} characters "
            f"long, over the limit of {self._max_text_chars}: some characters are written as "
            f"several in {self._form} (U+FDFA is 18)")

    def _unreadable(self, event: NewsEvent, unknown: int, counted: int):
        """A dead letter if the model cannot read most of the text (``max_unknown_token_ratio``):
        its head's tokens, or in chunks mode the whole text's (every chunk is embedded)."""
        if not unknown or unknown <= self._max_unknown * counted:
            return None
        where = "the text's" if self._chunker is not None else "its head's"
        return self._dead_letter(
            event, Reason.UNREADABLE_FOR_MODEL,
            f"{unknown} of {where} {counted} tokens are unknown to the model's tokenizer (ratio "
            f"{unknown / counted:.3f} > text.max_unknown_token_ratio {self._max_unknown}; language "
            f"{event.language or 'not given'}): the model cannot read this text; embed this feed "
            f"with a model whose vocabulary covers its language")

    def _prepare(self, event: NewsEvent):
        """The event's PreparedDoc, or its dead letter. Its budget of CPU time covers every step:
        normalization, tokenization, chunking and the unknown-token count."""
        deadline = Deadline(self._budget_s)
        try:
            composed = self._compose(event, deadline)
            if not isinstance(composed, tuple):
                return composed
            title, text = composed
            try:
                ids, truncated, chunks, (unknown, counted) = self._tokenize(text, deadline)
            except PrepareTimeout:
                raise
            except Exception as exc:  # pylint: disable=broad-except  # blame this text only
                return self._dead_letter(
                    event, Reason.PREPARE_FAILED,
                    f"tokenization failed: {type(exc).__name__}: {exc}"[:500])
        except PrepareTimeout as exc:
            return self._dead_letter(
                event, Reason.PREPARE_FAILED,
                f"text preparation went over its budget of text.prepare_budget_s "
                f"{self._budget_s:g} s of CPU ({exc}): the text is built to be slow to prepare, "
                f"or the worker is starved of CPU")
        unreadable = self._unreadable(event, unknown, counted)
        if unreadable is not None:
            return unreadable
        return PreparedDoc(event=event, text=text,
                           text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
                           token_ids=ids, truncated=truncated, chunks=chunks,
                           title=title or None)

    def process(self, events: list[NewsEvent]) -> Iterator:
        for event in events:
            yield self._prepare(event)


class PrepareText(beam.PTransform):
    """NewsEvent -> PreparedDoc (main output) and DeadLetter (``dead_letter`` output). In chunks
    mode (``transforms.chunking``) each document also holds its chunks.

    Text in ``unicode_form`` (``text.unicode_form``). An article the model cannot read (more than
    ``max_unknown_token_ratio`` of its head's tokens unknown to the tokenizer: ``UnknownTokens``;
    in chunks mode, of the whole text's) is dead-lettered ``unreadable_for_model``, not embedded:
    every such article would get about the same vector. A title over ``max_title_chars``, or a text
    over ``max_text_chars`` before or after normalization, is dead-lettered ``text_too_long``; a
    document that uses more than ``prepare_budget_s`` of CPU in preparation, ``prepare_failed``
    (``Deadline``)."""

    def __init__(self, model: ModelSettings, *, chunking: ChunkingSettings = ChunkingSettings(),
                 max_text_chars: int = 200_000, dead_letter_payload_bytes: int = 4096,
                 unicode_form: UnicodeForm = "NFC", max_unknown_token_ratio: float = 0.2,
                 max_title_chars: int = DEFAULT_MAX_TITLE_CHARS,
                 prepare_budget_s: float = DEFAULT_PREPARE_BUDGET_S):
        super().__init__()
        self._fn = _PrepareTextFn(model, max_text_chars, dead_letter_payload_bytes, chunking,
                                  unicode_form=unicode_form,
                                  max_unknown_token_ratio=max_unknown_token_ratio,
                                  max_title_chars=max_title_chars,
                                  prepare_budget_s=prepare_budget_s)

    def prepare(self, events: Iterable[NewsEvent]) -> list:
        """Each event's PreparedDoc, or its dead letter (a ``TaggedOutput``), prepared as the step
        does, outside a pipeline (``newsvec check-model``)."""
        self._fn.setup()
        return [self._fn._prepare(event) for event in events]

    def expand(self, events):
        return (events
                # Batches: each document is prepared on its own (its CPU budget covers all of its
                # steps), but the step keeps the shape a running streaming job was built with.
                | "Batch" >> beam.BatchElements(min_batch_size=_TOKENIZE_BATCH,
                                                max_batch_size=_TOKENIZE_BATCH)
                | "Prepare" >> beam.ParDo(self._fn).with_outputs(DEAD_LETTER, main="docs"))

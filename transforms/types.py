"""The one home of newsvec's data types (their Parquet schemas: ``transforms.output.parquet``):
every stage imports these, none redefines them.

- ``NewsEvent``: a validated input event (the input contract, as a pydantic model).
- ``PreparedDoc``: an event with its normalized text and model token ids (and its chunks).
- ``EmbeddedDoc``: a vector row: the output columns of an embedded document, and nothing else
  (and, in chunks mode, its ``ChunkRow``s).
- ``ChunkRow``: a row of ``chunks/``: one chunk of an article and its vector.
- ``DeadLetter``: an input that could not become a vector row, with the step and the reason.
- ``OversizedPayload``: the head of an input line too large to read whole.
- ``MicroBatch``: streaming: one firing of one window and shard, embedded and written together.
- ``LedgerRecord``: streaming: what a micro-batch took in and wrote, a JSON file beside its data.
- ``Counts``: where the articles of a run or a micro-batch went, and whether that balances.
- ``Step``, ``Reason``: where and why an input was dead-lettered.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import enum
import json
import re
from typing import Annotated, Any, Iterable, Mapping, Optional, overload

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
)

MAX_ID_CHARS = 256


_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


def _require_rfc3339(value):
    """pydantic alone also takes '2026-11-30 09:15Z' or epoch seconds in a string: not RFC 3339."""
    if isinstance(value, str):
        if not _RFC3339.fullmatch(value):
            raise ValueError("must be an RFC 3339 date-time such as 2026-11-30T09:15:00Z")
        return dt.datetime.fromisoformat(value.upper())
    return value


def _representable_in_utc(value: Optional[dt.datetime]) -> Optional[dt.datetime]:
    """A time every reader can hold: its UTC instant within 0001-01-01T00:00:00Z ..
    9999-12-31T23:59:59.999999Z (Python's datetime, BigQuery's TIMESTAMP). RFC 3339 also allows
    ``0001-01-01T00:00:00+00:01`` (year 0 in UTC), which Parquet stores but no reader converts back
    (``OverflowError``) and PostgreSQL's loader cannot take."""
    if value is not None:
        try:
            value.astimezone(dt.timezone.utc)
        except OverflowError:
            raise ValueError("its UTC instant is outside 0001-01-01T00:00:00Z .. "
                             "9999-12-31T23:59:59.999999Z, which readers cannot hold") from None
    return value


Rfc3339Time = Annotated[Optional[AwareDatetime], BeforeValidator(_require_rfc3339),
                        AfterValidator(_representable_in_utc)]
"""An optional RFC 3339 date-time with an offset, whose UTC instant every reader can hold."""


CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""Unicode's control characters (category Cc: C0, DEL, C1)."""


def control_character(value: str) -> Optional[str]:
    """``U+XXXX at character N`` of the first control character in ``value``, or None. NUL cannot
    be stored in a PostgreSQL text or jsonb value at all, and none of them belongs in an
    identifier."""
    found = CONTROL_CHARACTER.search(value)
    return f"U+{ord(found.group()):04X} at character {found.start()}" if found else None


def _no_control_characters(value: Optional[str]) -> Optional[str]:
    where = None if value is None else control_character(value)
    if where:
        raise ValueError(f"control character {where}: not allowed in an identifying field")
    return value


Identifier = Annotated[str, AfterValidator(_no_control_characters)]
"""A string that names or places an article (``id``, ``url``, ``source``, ``language``): any
characters but control characters."""


@dataclasses.dataclass(frozen=True)
class Lineage:
    """Where a streamed event came from: its Pub/Sub message. None for events read from files."""

    message_id: Optional[str]
    publish_time: Optional[dt.datetime]
    attributes: tuple[tuple[str, str], ...] = ()


class NewsEvent(BaseModel):
    """A news event as it arrives (JSON, UTF-8). Unknown fields are ignored.

    Strict: a number where a string belongs is an error, not coerced; ``published_at`` must be
    RFC 3339 with an offset, its UTC instant within what readers can hold; ``id``, ``url``,
    ``source`` and ``language`` hold no control characters (``title`` and ``body`` may: text
    preparation removes them).
    """

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    id: Annotated[Identifier, StringConstraints(min_length=1, max_length=MAX_ID_CHARS,
                                                pattern=r"\S")]
    title: Optional[str] = None
    body: Optional[str] = None
    url: Optional[Identifier] = None
    source: Optional[Identifier] = None
    language: Optional[Identifier] = None
    published_at: Rfc3339Time = None
    # When the article was last changed (a correction): RFC 3339 like published_at. It orders the
    # versions of an article (VERSION_ORDER): a correction that sends a later one wins.
    updated_at: Rfc3339Time = None
    # Set by the parse step from the Pub/Sub message, never from the payload
    # (see _no_lineage_input).
    lineage: Optional[Any] = Field(default=None, exclude=True)

    @field_validator("lineage", mode="before")
    @classmethod
    def _no_lineage_input(cls, value):
        return None  # a payload's own "lineage" field is ignored like any unknown field


@dataclasses.dataclass(frozen=True)
class PreparedDoc:
    """An event ready for the model: normalized text and the head of its token ids; in chunks mode
    also its chunks (``transforms.chunking.ChunkSpan``), which cover the whole text. ``title`` is
    the prepared title (the text's first line, when there is one), which the outputs hold."""

    event: NewsEvent
    text: str
    text_sha256: str
    token_ids: tuple[int, ...]
    truncated: bool
    chunks: tuple = ()
    title: Optional[str] = None
    # Its story, where it was marked before the embedding (streaming; batch with action skip);
    # EmbeddedDoc.of carries it to the row
    story_id: Optional[str] = None
    near_duplicate_of: Optional[str] = None
    similarity: Optional[float] = None
    minhash: Optional[bytes] = None  # its text's signature (transforms.stories), for keys/
    story_facts: Optional[bytes] = None  # what a copy must keep of it (transforms.stories.facts)

    @property
    def token_count(self) -> int:
        return len(self.token_ids)

    @property
    def id(self) -> str:
        return self.event.id

    @property
    def published_at(self) -> Optional[dt.datetime]:
        return self.event.published_at


@dataclasses.dataclass(frozen=True)
class EmbeddedDoc:
    """One row of ``vectors/`` (``vector_schema``): an embedded document's output columns only.
    Nothing after the embedding needs the body, the prepared text or the token ids, so they are
    left behind: the dedup shuffle and the sink's batches carry rows, not documents."""

    id: str
    url: Optional[str]
    source: Optional[str]
    title: Optional[str]
    published_at: Optional[dt.datetime]
    language: Optional[str]
    model: str
    embedding: Any  # numpy float32 array of shape (dim,)
    text_sha256: str
    token_count: int
    truncated: bool
    embedded_at: dt.datetime
    lineage: Optional[Lineage] = None  # the Pub/Sub message, streaming
    doc_vector: str = "head"  # what ``embedding`` is: "head" or "mean" (of the chunk vectors)
    chunk_count: int = 0  # chunks written to chunks/ (0 in head mode)
    chunks: tuple = ()  # ChunkRow, written to chunks/ (not a column of vectors/)
    updated_at: Optional[dt.datetime] = None  # the event's (VERSION_ORDER)
    # Its story (transforms.stories.StoryMark); all None with near_duplicates off
    story_id: Optional[str] = None
    near_duplicate_of: Optional[str] = None
    similarity: Optional[float] = None
    minhash: Optional[bytes] = None  # its text's signature: a column of keys/, not of vectors/
    story_facts: Optional[bytes] = None  # its text's facts (transforms.stories.facts): keys/

    @classmethod
    def of(cls, doc: PreparedDoc, embedding, model: str, embedded_at: dt.datetime, *,
           doc_vector: str = "head", chunks: tuple = ()) -> "EmbeddedDoc":
        """The row of a document. A mean vector stands for all the text's tokens, none cut."""
        e = doc.event
        mean = doc_vector == "mean"
        return cls(id=e.id, url=e.url, source=e.source, title=doc.title,
                   published_at=e.published_at,
                   language=e.language, model=model, embedding=embedding,
                   text_sha256=doc.text_sha256,
                   token_count=doc.chunks[-1].token_end if mean else doc.token_count,
                   truncated=False if mean else doc.truncated, embedded_at=embedded_at,
                   lineage=e.lineage, doc_vector=doc_vector, chunk_count=len(chunks),
                   chunks=chunks,
                   # An event held in streaming state by a release before updated_at has none.
                   updated_at=getattr(e, "updated_at", None),
                   # A document held in streaming state by a release before stories has none.
                   minhash=getattr(doc, "minhash", None),
                   story_facts=getattr(doc, "story_facts", None), **story_of(doc))


STORY_FIELDS = ("story_id", "near_duplicate_of", "similarity")
"""The story of a document, a row and a chunk row (``transforms.stories.StoryMark``)."""


def story_of(item) -> dict[str, Any]:
    """The story fields of a document or row, by name (None where it has none)."""
    return {name: getattr(item, name, None) for name in STORY_FIELDS}


@dataclasses.dataclass(frozen=True)
class ChunkRow:
    """One row of ``chunks/`` (``chunk_schema``): a chunk of an article and its vector."""

    id: str  # the article's id
    chunk_id: str  # deterministic: transforms.chunking.chunk_id
    chunk_index: int
    chunk_count: int
    token_start: int  # [start, end) of the text's own tokens (no special tokens, no prefix)
    token_end: int
    char_start: int  # [start, end) of the prepared text's characters
    char_end: int
    chunk_sha256: str  # sha256 of the chunk's text (the prepared text's characters above)
    text_sha256: str  # the article's
    model: str
    embedding: Any  # numpy float32 array of shape (dim,)
    embedded_at: dt.datetime
    chunk_text: Optional[str] = None  # with sink.store_chunk_text
    # Its article's story (EmbeddedDoc's)
    story_id: Optional[str] = None
    near_duplicate_of: Optional[str] = None
    similarity: Optional[float] = None


DEAD_LETTER = "dead_letter"  # the tag of every step's dead-letter output (parse, prepare, embed)


UNKNOWN_LANGUAGE = "unknown"  # a dead letter's language in the counts when its event gave none


class Step(enum.StrEnum):
    """Names of the steps that can dead-letter an input."""

    PARSE = "parse"
    PREPARE = "prepare_text"
    EMBED = "embed"


class Reason(enum.StrEnum):
    """Dead-letter reasons: stable codes, one per thing a person would fix differently."""

    PAYLOAD_TOO_LARGE = "payload_too_large"
    INVALID_UTF8 = "invalid_utf8"
    INVALID_JSON = "invalid_json"
    NOT_AN_OBJECT = "not_a_json_object"
    MISSING_ID = "missing_id"
    INVALID_ID = "invalid_id"
    INVALID_FIELD = "invalid_field"
    NO_TEXT = "no_text"
    PUBLISHED_IN_FUTURE = "published_at_in_future"
    UPDATED_IN_FUTURE = "updated_at_in_future"
    TEXT_TOO_LONG = "text_too_long"
    EMPTY_AFTER_NORMALIZATION = "empty_after_normalization"
    UNREADABLE_FOR_MODEL = "unreadable_for_model"
    PREPARE_FAILED = "prepare_failed"
    EMBEDDING_FAILED = "embedding_failed"


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """An input that did not become a vector row. Written as one JSON line in ``dead_letter/``."""

    step: Step
    reason: Reason
    detail: str
    payload: str  # the raw payload, truncated to a bound, undecodable bytes backslash-escaped
    payload_bytes: int  # the size of the whole raw payload
    event_id: Optional[str] = None
    message_id: Optional[str] = None  # the Pub/Sub message id, when streaming
    language: Optional[str] = None  # the event's, once parsed
    failed_at: str = dataclasses.field(
        default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds"))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @classmethod
    def for_event(cls, event: NewsEvent, step: Step, reason: Reason, detail: str,
                  payload_limit: int) -> "DeadLetter":
        """A dead letter raised after parsing: the event re-serialized as its payload, and its
        lineage's message id when streamed."""
        raw = event.model_dump_json(exclude_none=True).encode("utf-8")
        return cls(step=step, reason=reason, detail=detail,
                   payload=truncate_payload(raw, payload_limit), payload_bytes=len(raw),
                   event_id=event.id,
                   message_id=event.lineage.message_id if event.lineage else None,
                   language=event.language)


@dataclasses.dataclass(frozen=True)
class OversizedPayload:
    """A payload too large to hold whole: its head and its full size. The file reader emits it in
    place of an over-long line, so no line is buffered whole; Parse dead-letters it
    (``payload_too_large``)."""

    head: bytes
    size: int


@overload
def utc_time(text: str) -> dt.datetime: ...


@overload
def utc_time(text: None) -> None: ...


@overload
def utc_time(text: Optional[str]) -> Optional[dt.datetime]: ...


def utc_time(text: Optional[str]) -> Optional[dt.datetime]:
    """An RFC 3339 time (a ledger record's window, a command's ``--from``) as a UTC datetime."""
    if text is None:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(dt.timezone.utc)


def truncate_payload(raw: bytes, limit: int) -> str:
    """The head of a raw payload, as text a person can read in a dead letter."""
    return raw[:limit].decode("utf-8", errors="backslashreplace")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Streaming: everything one firing of the grouping brought for one event-time window and shard.

    Each message that reached the grouping is in it exactly once: as a document to embed (``docs``),
    as a dead letter, or counted as a duplicate. The window and pane are carried as data, so the
    steps after the grouping run in the global window and nothing there can drop it as late. It is
    embedded as one unit and written as one set of files (vectors, chunks, keys, dead letters,
    ledger record), named by window, pane, shard and a digest of its messages: a retried bundle,
    or the job that replaced its writer, rewrites the same names.
    """

    window_start_us: int  # the event-time window, in microseconds since the epoch (UTC)
    window_end_us: int
    pane: int  # the firing's index for this window and shard: 0, 1, ... (later ones are late panes)
    shard: int
    shards: int
    docs: tuple = ()  # PreparedDoc to embed; after Embed, empty
    rows: tuple = ()  # EmbeddedDoc, filled by Embed
    dead_letters: tuple = ()  # DeadLetter: from parse and prepare, then embed
    messages_in: int = 0
    duplicates: int = 0
    late_reassigned: int = 0
    near_duplicates: int = 0  # copies not embedded (near_duplicates.action skip)

    @property
    def batch_id(self) -> "BatchId":
        """(window_start_us, pane, shard): one per firing of the grouping, for every step after it
        that keys or tracks a micro-batch."""
        return self.window_start_us, self.pane, self.shard


BatchId = tuple[int, int, int]  # MicroBatch.batch_id


@dataclasses.dataclass(frozen=True)
class Counts:
    """Where the articles of a run or a micro-batch went: the ledger's one type. The batch commit,
    the streaming ledger record and ``newsvec ledger`` all count with it, and it alone says what
    balancing means: every article in is written, dead-lettered, a dropped duplicate, unchanged or
    a skipped near duplicate (``near_duplicates.action: skip``).

    ``truncated`` (rows whose text was cut to the model's length) and ``chunks_written`` (rows of
    ``chunks/``) describe written rows; they are not destinations and are not in the balance.
    The dead letters are also counted by reason, and by the event's ``language`` and reason
    (``UNKNOWN_LANGUAGE`` where it gave none or was never parsed): a feed in a language the model
    cannot read shows there as ``unreadable_for_model`` dead letters.
    """

    articles_in: int = 0
    written: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    unchanged: int = 0  # incremental runs: already embedded with the same text and settings
    near_duplicates: int = 0  # near_duplicates.action skip: copies of a story, not embedded
    truncated: int = 0
    chunks_written: int = 0
    dead_lettered_by_reason: Mapping[str, int] = dataclasses.field(default_factory=dict)
    dead_lettered_by_language: Mapping[str, Mapping[str, int]] = dataclasses.field(
        default_factory=dict)

    @property
    def accounted(self) -> int:
        return (self.written + self.dead_lettered + self.duplicates + self.unchanged
                + self.near_duplicates)

    def balances(self) -> bool:
        return self.articles_in == self.accounted

    def reasons_add_up(self) -> bool:
        """The dead letters by reason sum to the dead letters."""
        return sum(self.dead_lettered_by_reason.values()) == self.dead_lettered

    def languages_add_up(self) -> bool:
        """The dead letters by language and reason sum to the dead letters by reason."""
        reasons: collections.Counter[str] = collections.Counter()
        for by_reason in self.dead_lettered_by_language.values():
            reasons.update(by_reason)
        return reasons == collections.Counter(self.dead_lettered_by_reason)

    def __add__(self, other: "Counts") -> "Counts":
        reasons = collections.Counter(self.dead_lettered_by_reason)
        reasons.update(other.dead_lettered_by_reason)
        languages: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        for counts in (self, other):
            for language, by_reason in counts.dead_lettered_by_language.items():
                languages[language].update(by_reason)
        breakdowns = {"dead_lettered_by_reason", "dead_lettered_by_language"}
        return Counts(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                         for f in dataclasses.fields(self) if f.name not in breakdowns},
                      dead_lettered_by_reason=dict(sorted(reasons.items())),
                      dead_lettered_by_language={
                          language: dict(sorted(by_reason.items()))
                          for language, by_reason in sorted(languages.items())})

    @classmethod
    def total(cls, counts: Iterable["Counts"]) -> "Counts":
        return sum(counts, cls())

    @staticmethod
    def by_reason(reasons: Iterable[str]) -> dict[str, int]:
        """Dead letters by reason, sorted by reason (the form every output writes)."""
        return dict(sorted(collections.Counter(reasons).items()))

    @staticmethod
    def by_language(letters: Iterable[tuple[Optional[str], str]]) -> dict[str, dict[str, int]]:
        """Dead letters, given as (language, reason), by language and then by reason, sorted; a
        null or empty language is ``UNKNOWN_LANGUAGE``."""
        languages: dict[str, list[str]] = collections.defaultdict(list)
        for language, reason in letters:
            languages[language or UNKNOWN_LANGUAGE].append(reason)
        return {language: Counts.by_reason(reasons)
                for language, reasons in sorted(languages.items())}

    @staticmethod
    def languages_unrecorded(by_reason: Mapping[str, int]) -> dict[str, dict[str, int]]:
        """The by-language counts of a summary or ledger record written before they were kept:
        every dead letter under ``UNKNOWN_LANGUAGE``."""
        return {UNKNOWN_LANGUAGE: dict(by_reason)} if any(by_reason.values()) else {}

    @classmethod
    def from_summary(cls, counts: Mapping[str, Any]) -> "Counts":
        """The counts of a ``_summary.json`` (``to_summary``); keys it lacks count 0."""
        names = {f.name for f in dataclasses.fields(cls)} - {"articles_in"}
        found = cls(articles_in=counts.get("in", 0),
                    **{name: value for name, value in counts.items() if name in names})
        if "dead_lettered_by_language" in counts:
            return found
        return dataclasses.replace(found, dead_lettered_by_language=cls.languages_unrecorded(
            found.dead_lettered_by_reason))

    def to_summary(self) -> dict:
        """The ``counts`` of a batch run's ``_summary.json`` and manifest (docs/output.md)."""
        return {"in": self.articles_in, "written": self.written,
                "dead_lettered": self.dead_lettered,
                "dead_lettered_by_reason": dict(self.dead_lettered_by_reason),
                "dead_lettered_by_language": {language: dict(by_reason) for language, by_reason
                                              in self.dead_lettered_by_language.items()},
                "chunks_written": self.chunks_written, "duplicates": self.duplicates,
                "unchanged": self.unchanged, "near_duplicates": self.near_duplicates,
                "truncated": self.truncated,
                "accounted": self.accounted}


@dataclasses.dataclass(frozen=True)
class LedgerRecord:
    """Streaming: the ledger of one micro-batch, ``ledger/dt=../hour=../<name>.json``. Written after
    its data files, so a record names files that exist. It balances on its own (``Counts``):
    ``messages_in = rows_written + dead_lettered + duplicates + near_duplicates``."""

    run_id: str
    window_start: str  # RFC 3339, UTC
    window_end: str
    pane: int
    shard: int
    shards: int
    messages_in: int
    rows_written: int
    dead_lettered: int
    dead_lettered_by_reason: dict
    duplicates: int
    late_reassigned: int
    vectors_file: Optional[str]  # relative to the output prefix; None when no row was written
    dead_letter_file: Optional[str]
    written_at: str
    chunks_written: int = 0  # rows of chunks/ (chunks mode)
    chunks_file: Optional[str] = None
    keys_written: int = 0  # rows of keys/ (the key index)
    keys_file: Optional[str] = None
    digest: Optional[str] = None  # of the micro-batch's messages: in its files' names
    # {language: {reason: n}} (Counts.by_language); None in records written before it was kept
    dead_lettered_by_language: Optional[dict] = None
    # The store (transforms.stores): rows loaded, under this load key; 0 and None with it off
    store_rows: int = 0
    store_load_key: Optional[str] = None
    # The rows the store refused (transforms.stores, StoreLoad.rejected): one
    # {"id", "text_sha256", "reason", "detail"} each; store_rows + these = rows_written
    store_rejected: list = dataclasses.field(default_factory=list)
    # The articles an earlier attempt at this micro-batch stored and this one does not hold: their
    # rows were withdrawn, the versions they had replaced brought back (StoreLoad.withdrawn)
    store_withdrawn: list = dataclasses.field(default_factory=list)
    # Copies of a story not embedded (near_duplicates.action skip); 0 in records before it
    near_duplicates: int = 0

    @property
    def counts(self) -> Counts:
        languages = (Counts.languages_unrecorded(self.dead_lettered_by_reason)
                     if self.dead_lettered_by_language is None else self.dead_lettered_by_language)
        return Counts(articles_in=self.messages_in, written=self.rows_written,
                      dead_lettered=self.dead_lettered, duplicates=self.duplicates,
                      near_duplicates=self.near_duplicates,
                      chunks_written=self.chunks_written,
                      dead_lettered_by_reason=self.dead_lettered_by_reason,
                      dead_lettered_by_language=languages)

    def balances(self) -> bool:
        return self.counts.balances()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LedgerRecord":
        """A record's fields; fields this release does not know (a newer release wrote the
        record: a job rolled back, or an older ``newsvec ledger``) are left out, not an error."""
        known = {field.name for field in dataclasses.fields(cls)}
        record = cls(**{k: v for k, v in json.loads(text).items() if k in known})
        record.check()
        return record

    def check(self) -> None:
        """``ValueError`` naming the first field whose value no writer of a record gives (a
        count that is not a non-negative integer, a window that is not an RFC 3339 time, a
        file that is not a string...): such a record is not one, and every reader names it so
        rather than failing on it later (``newsvec ledger``, ``/status``)."""
        for name in _RECORD_COUNTS:
            _require_count(name, getattr(self, name))
        for name in ("run_id", "window_start", "window_end", "written_at"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} is {getattr(self, name)!r}, not a string")
        for name in _RECORD_NAMES:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} is {getattr(self, name)!r}, not a string or null")
        for name in ("window_start", "window_end"):
            try:
                utc_time(getattr(self, name))
            except ValueError:
                raise ValueError(f"{name} is {getattr(self, name)[:40]!r}, not an RFC 3339 "
                                 "time") from None
        _require_by_reason("dead_lettered_by_reason", self.dead_lettered_by_reason)
        if self.dead_lettered_by_language is not None:
            if not isinstance(self.dead_lettered_by_language, dict):
                raise ValueError("dead_lettered_by_language is not an object")
            for language, by_reason in self.dead_lettered_by_language.items():
                _require_by_reason(f"dead_lettered_by_language[{language!r}]", by_reason)
        if not isinstance(self.store_rejected, list) or not all(
                isinstance(item, dict) for item in self.store_rejected):
            raise ValueError("store_rejected is not a list of objects")
        if not isinstance(self.store_withdrawn, list):
            raise ValueError("store_withdrawn is not a list")


_RECORD_COUNTS = ("pane", "shard", "shards", "messages_in", "rows_written", "dead_lettered",
                  "duplicates", "late_reassigned", "chunks_written", "keys_written", "store_rows",
                  "near_duplicates")
_RECORD_NAMES = ("vectors_file", "dead_letter_file", "chunks_file", "keys_file", "digest",
                 "store_load_key")


def _require_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} is {value!r}, not a count")


def _require_by_reason(name: str, by_reason: Any) -> None:
    if not isinstance(by_reason, dict):
        raise ValueError(f"{name} is not an object")
    for reason, count in by_reason.items():
        _require_count(f"{name}[{reason!r}]", count)

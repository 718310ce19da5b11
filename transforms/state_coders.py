"""Coders of streaming state: an explicit, versioned encoding per kind of state, never a pickle of
newsvec's classes.

A streaming job's state outlives the code that wrote it: ``--update`` hands the running job's
state to the new release's workers. Pickled objects of newsvec's classes are read back through
the new release's classes, so a field renamed, or added without a default (to a pydantic model,
even with one), leaves an object without that field, and the work items that hold it fail for
good. These coders write plain values (JSON, little-endian numbers), name fields by their names,
and begin with a version; a release reads every version written before it.

Every value starts with two bytes: its kind (an ASCII letter) and the version of its layout (1 to
127; a pickle starts with 0x80, so state pickled by a release before these coders is told apart
and refused with a message).

- ``MicroBatchCoder`` (``M``): a ``MicroBatch`` (``EmbedStreaming``' micro-batches in flight,
  ``DropDuplicatesStreaming``'s regroup header). Version 1, after the two bytes, four sections,
  each but the last behind its size in bytes (uint32): ``n | JSON | t | token ids | x | texts |
  vector values``. The JSON and the texts are UTF-8 (a lone surrogate as its three bytes); the
  token ids are the width of an id (one byte: 2, or 4 if an id is over 65,535), then the ids
  (uint16 or uint32); the vector values (float32) run to the end; numbers are little-endian.
  The JSON object holds the micro-batch's fields by name; ``docs``, ``dead_letters`` and ``rows``
  are lists of objects holding their classes' fields by name, except the large values: each
  ``token_ids`` (a document's, a chunk's) is ``[offset, length]`` in the token ids; each long
  text (a document's ``text``, its event's ``body``, a chunk row's ``chunk_text``) ``null`` or
  ``[offset, length]`` in the texts' bytes; each ``embedding`` (a row's, a chunk row's)
  ``[offset, length]`` in the vector values. A document's ``event`` is the ``NewsEvent`` as
  pydantic writes it in JSON mode (every field but ``lineage``, and ``body`` as above), and its
  ``lineage`` is beside it: ``null``, or ``message_id``, ``publish_time`` and ``attributes``
  (``[key, value]`` pairs). Date-times are ISO 8601 with their offset; enums are their values.
- ``PendingIdCoder`` (``I``): ``(batch id, timestamp in micros)`` of a micro-batch in flight.
  Version 1: four int64: window start (micros), pane, shard, timestamp (micros).
- ``HeldStoriesCoder`` (``H``): the articles one LSH band key of ``MarkStoriesStreaming`` holds.
  Version 1: ``uint32 n | n bytes of JSON: [id, story id, rank, expiry, signature length] each |
  the signatures``.
- ``SeenKeysCoder`` (``S``): ``{dedup key: expiry in micros}`` (the local runner's dedup state per
  shard). Version 1: ``uint32 n | n bytes of JSON: the keys, a list | the expiries, int64``.

Reading: a field the state lacks takes its class's default, so a field added with a default needs
no new version. A ``NewsEvent`` is rebuilt from its fields' types only, its validators not run
again: a check a later release adds to parsing never makes state written before it unreadable;
its fields the class no longer has are ignored. Any other difference between the state and
today's classes (a field with no default that the state lacks, a dataclass field the state holds
that the class lost) raises ``StateSchemaError`` when reading, and the fixture test
(tests/streaming/test_state_coders.py) finds it before a release. Such a change is a new version:
raise the coder's ``VERSION``, keep reading the old one, and give ``UPGRADES`` a function that
turns the old version's plain form (its JSON object) into the new one's (docs/dataflow.md,
Drain, cancel, update). Never rename a coder class: Beam names each coder in the job's graph
after its class, and Dataflow's update check compares those names.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import functools
import json
import struct
import typing
from typing import Any, Callable, ClassVar, Optional

import numpy as np
from apache_beam.coders import Coder
from pydantic import TypeAdapter

from transforms import types as schema
from transforms.chunking import ChunkSpan

_PICKLE_PROTOCOL_2_TO_5 = 0x80
_VALUE = np.dtype("<f4")
_U32 = struct.Struct("<I")
_PENDING_ID = struct.Struct("<qqqq")
_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
# A lone surrogate in a string (which parsing refuses, but nothing else does) is written as its
# three bytes, as pickle does: json.loads reads bytes with "surrogatepass" too. A string that
# cannot be written would fail the work item on every retry.
_LONE_SURROGATES = "surrogatepass"


_SEE = "docs/dataflow.md: What an update carries over, and when a new job is needed"


class StateSchemaError(ValueError):
    """State that this release cannot read: another kind, a newer version, pickled state, or a
    version whose plain form does not fit today's classes (a missing upgrade)."""


class _VersionedCoder(Coder):
    """Two bytes (kind, version), then the version's layout. Subclasses set ``KIND``, ``VERSION``
    (the version written), ``_write`` (value -> bytes of ``VERSION``) and ``_read`` (version,
    bytes -> value). The instance holds nothing: the coder pickled into the job's graph is the
    same in every release."""

    KIND: ClassVar[bytes]
    VERSION: ClassVar[int]

    def encode(self, value) -> bytes:
        return self.KIND + bytes((self.VERSION,)) + self._write(value)

    def decode(self, encoded: bytes):
        data = memoryview(encoded)
        if len(data) >= 1 and data[0] == _PICKLE_PROTOCOL_2_TO_5:
            raise StateSchemaError(
                f"{type(self).__name__}: this state was pickled by a release before versioned "
                f"state, which this one cannot read: drain a job of that release and start a new "
                f"one ({_SEE})")
        if len(data) < 2 or data[:1] != self.KIND:
            raise StateSchemaError(f"{type(self).__name__}: not state of kind {self.KIND!r}")
        version = data[1]
        if not 1 <= version <= self.VERSION:
            raise StateSchemaError(
                f"{type(self).__name__}: state version {version} was written by a newer release "
                f"than this one (which reads up to {self.VERSION}): update to that release again "
                f"({_SEE})")
        return self._read(version, data[2:])

    def _write(self, value) -> bytes:
        raise NotImplementedError

    def _read(self, version: int, data: memoryview):
        raise NotImplementedError

    def is_deterministic(self) -> bool:
        return False

    def to_type_hint(self):
        return Any

    def __eq__(self, other):
        return type(self) is type(other)

    def __hash__(self):
        return hash(type(self))


# ---- plain values -------------------------------------------------------------------------------

def _datetime_out(value: Optional[dt.datetime]) -> Optional[str]:
    return None if value is None else value.isoformat()


def _datetime_in(value: Optional[str]) -> Optional[dt.datetime]:
    return None if value is None else dt.datetime.fromisoformat(value)


def _enum_in(kind: type[enum.StrEnum]) -> Callable[[str], Any]:
    """An enum member, or the plain string if this release does not know it (a value added by a
    newer one: a ``StrEnum`` compares and writes as its string)."""
    members = {member.value: member for member in kind}
    return lambda value: members.get(value, value)


def _lineage_out(lineage: Optional[schema.Lineage]) -> Optional[dict]:
    return None if lineage is None else _plain(lineage, {
        "attributes": lambda pairs: [list(pair) for pair in pairs]})


def _lineage_in(plain: Optional[dict]) -> Optional[schema.Lineage]:
    return None if plain is None else _build(schema.Lineage, plain, {
        "attributes": lambda pairs: tuple((key, value) for key, value in pairs)})


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, ...], frozenset[str]]:
    """(the field names, those declared a date-time or an optional one) of a dataclass: its
    date-times are written as ISO 8601 without a converter of their own, so a date-time field
    added to a class needs no change here."""
    fields = dataclasses.fields(cls)
    try:
        hints = typing.get_type_hints(cls)
        datetimes = {f.name for f in fields
                     if dt.datetime in (hints[f.name], *typing.get_args(hints[f.name]))}
    except NameError:  # an annotation that names a type imported only for type checkers
        datetimes = {f.name for f in fields if "datetime" in str(f.type)}
    return tuple(f.name for f in fields), frozenset(datetimes)


def _build(cls, plain: dict, convert: dict[str, Callable]):
    """``cls`` (a dataclass) from its plain form: each field by name, converted where ``convert``
    says (date-times without being told); a field the plain form lacks takes its default."""
    datetimes = _fields(cls)[1]
    values = {name: convert[name](value) if name in convert
              else _datetime_in(value) if name in datetimes else value
              for name, value in plain.items()}
    try:
        return cls(**values)
    except TypeError as exc:  # a field the class lost, or one with no default the state lacks
        raise StateSchemaError(f"{cls.__name__} from state: {exc}: an upgrade of this state "
                               f"version is missing ({_SEE})") from None


def _plain(obj, convert: dict[str, Callable]) -> dict:
    """A dataclass's fields by name, converted where ``convert`` says (date-times without being
    told)."""
    names, datetimes = _fields(obj.__class__)
    plain = {}
    for name in names:
        value = getattr(obj, name)
        plain[name] = (convert[name](value) if name in convert
                       else _datetime_out(value) if name in datetimes else value)
    return plain


@functools.cache
def _event_fields(event_class) -> tuple[frozenset[str], frozenset[str], dict[str, Callable]]:
    """(the field names; those with no default; field -> its value from JSON, for the fields JSON
    does not hold as Python does) of a NewsEvent class. Types only: the validators and constraints
    of the fields are not run again, so a check a later release adds to parsing never makes state
    written before it unreadable."""
    plain_json = (str, int, bool, float, Optional[str], Optional[int], Optional[bool],
                  Optional[float])
    fields = event_class.model_fields
    convert = {name: TypeAdapter(field.annotation).validate_python
               for name, field in fields.items()
               if not field.exclude and field.annotation not in plain_json}
    return (frozenset(fields), frozenset(n for n, f in fields.items() if f.is_required()),
            convert)


def _event_in(plain: dict, lineage) -> schema.NewsEvent:
    event_class = schema.NewsEvent
    names, required, convert = _event_fields(event_class)
    missing = required - plain.keys()
    if missing:
        raise StateSchemaError(f"NewsEvent from state lacks {sorted(missing)}, which have no "
                               f"default: an upgrade of this state version is missing ({_SEE})")
    values = {name: value for name, value in plain.items() if name in names}
    for name, to_python in convert.items():
        if name in values:
            values[name] = to_python(values[name])
    return event_class.model_construct(**values, lineage=lineage)


# ---- MicroBatch ---------------------------------------------------------------------------------

class _Arrays:
    """The large values of a micro-batch: each ``token_ids``, long text and ``embedding`` in the
    JSON is its ``[offset, length]`` in the token ids, text bytes or vector values that follow
    the JSON."""

    def __init__(self):
        self.tokens: list[tuple[int, ...]] = []
        self.texts: list[bytes] = []
        self.vectors: list[np.ndarray] = []
        self.token_count = self.text_size = self.value_count = 0

    def token_ids(self, ids: tuple[int, ...]) -> list[int]:
        self.tokens.append(ids)
        self.token_count += len(ids)
        return [self.token_count - len(ids), len(ids)]

    def text(self, text: Optional[str]) -> Optional[list[int]]:
        if text is None:
            return None
        data = text.encode("utf-8", _LONE_SURROGATES)
        self.texts.append(data)
        self.text_size += len(data)
        return [self.text_size - len(data), len(data)]

    def vector(self, values) -> list[int]:
        array = np.asarray(values, dtype=_VALUE)
        if array.ndim != 1:
            raise ValueError(f"an embedding must be one vector, got shape {array.shape}")
        self.vectors.append(array)
        self.value_count += len(array)
        return [self.value_count - len(array), len(array)]

    def token_bytes(self) -> bytes:
        """A byte (the width of a token id: 2, or 4 if one is over 65,535), then the ids."""
        widest = max((max(ids) for ids in self.tokens if ids), default=0)
        code = "H" if widest <= 0xFFFF else "I"
        return bytes((struct.calcsize(code),)) + b"".join(
            struct.pack(f"<{len(ids)}{code}", *ids) for ids in self.tokens)

    def vector_bytes(self) -> bytes:
        return np.concatenate(self.vectors).tobytes() if self.vectors else b""


class _Slices:
    """The large values read back, by ``[offset, length]``."""

    def __init__(self, tokens: memoryview, width: int, texts: memoryview, vectors: np.ndarray):
        self._tokens, self._texts, self._vectors = tokens, texts, vectors
        self._code = {2: "H", 4: "I"}[width]
        self._width, self._token_count = width, len(tokens) // width

    def token_ids(self, at: list[int]) -> tuple[int, ...]:
        offset, length = _checked(at, self._token_count, "token ids")
        return struct.unpack_from(f"<{length}{self._code}", self._tokens, offset * self._width)

    def text(self, at: Optional[list[int]]) -> Optional[str]:
        if at is None:
            return None
        offset, length = _checked(at, len(self._texts), "text bytes")
        return str(self._texts[offset:offset + length], "utf-8", _LONE_SURROGATES)

    def vector(self, at: list[int]) -> np.ndarray:
        offset, length = _checked(at, len(self._vectors), "vector values")
        return self._vectors[offset:offset + length]


def _checked(at: list[int], size: int, what: str) -> tuple[int, int]:
    offset, length = at
    if offset < 0 or length < 0 or offset + length > size:
        raise StateSchemaError(f"MicroBatch state names {what} [{offset}, +{length}) of {size}")
    return offset, length


def _event_out(event: schema.NewsEvent, arrays: _Arrays) -> dict:
    plain = event.model_dump(mode="json")
    if "body" in plain:
        plain["body"] = arrays.text(plain["body"])
    return plain


def _hex_out(value: Optional[bytes]) -> Optional[str]:
    return None if value is None else value.hex()


def _hex_in(value: Optional[str]) -> Optional[bytes]:
    return None if value is None else bytes.fromhex(value)


def _doc_out(doc: schema.PreparedDoc, arrays: _Arrays) -> dict:
    return _plain(doc, {
        "event": lambda event: _event_out(event, arrays),
        "text": arrays.text,
        "token_ids": arrays.token_ids,
        "chunks": lambda chunks: [_plain(c, {"token_ids": arrays.token_ids}) for c in chunks],
        "minhash": _hex_out,
        "story_facts": _hex_out,
    }) | {"lineage": _lineage_out(doc.event.lineage)}


def _doc_in(plain: dict, cursor: _Slices) -> schema.PreparedDoc:
    plain = dict(plain)
    lineage = _lineage_in(plain.pop("lineage", None))
    return _build(schema.PreparedDoc, plain, {
        "event": lambda event: _event_in(
            {**event, "body": cursor.text(event["body"])} if "body" in event else event,
            lineage),
        "text": cursor.text,
        "token_ids": cursor.token_ids,
        "chunks": lambda chunks: tuple(
            _build(ChunkSpan, c, {"token_ids": cursor.token_ids}) for c in chunks),
        "minhash": _hex_in,
        "story_facts": _hex_in,
    })


def _chunk_row_out(row: schema.ChunkRow, arrays: _Arrays) -> dict:
    return _plain(row, {"embedding": arrays.vector, "chunk_text": arrays.text})


def _chunk_row_in(plain: dict, cursor: _Slices) -> schema.ChunkRow:
    return _build(schema.ChunkRow, plain, {"embedding": cursor.vector,
                                           "chunk_text": cursor.text})


def _row_out(row: schema.EmbeddedDoc, arrays: _Arrays) -> dict:
    return _plain(row, {
        "embedding": arrays.vector, "lineage": _lineage_out,
        "chunks": lambda chunks: [_chunk_row_out(c, arrays) for c in chunks],
        "minhash": _hex_out,
        "story_facts": _hex_out,
    })


def _row_in(plain: dict, cursor: _Slices) -> schema.EmbeddedDoc:
    return _build(schema.EmbeddedDoc, plain, {
        "embedding": cursor.vector, "lineage": _lineage_in,
        "chunks": lambda chunks: tuple(_chunk_row_in(c, cursor) for c in chunks),
        "minhash": _hex_in,
        "story_facts": _hex_in,
    })


_STEP, _REASON = _enum_in(schema.Step), _enum_in(schema.Reason)


def _dead_letter_out(letter: schema.DeadLetter) -> dict:
    return _plain(letter, {"step": str, "reason": str})


def _dead_letter_in(plain: dict) -> schema.DeadLetter:
    return _build(schema.DeadLetter, plain, {"step": _STEP, "reason": _REASON})


def _micro_batch_in(plain: dict, cursor: _Slices) -> schema.MicroBatch:
    return _build(schema.MicroBatch, plain, {
        "docs": lambda docs: tuple(_doc_in(d, cursor) for d in docs),
        "rows": lambda rows: tuple(_row_in(r, cursor) for r in rows),
        "dead_letters": lambda letters: tuple(map(_dead_letter_in, letters)),
    })


class MicroBatchCoder(_VersionedCoder):
    """A ``MicroBatch`` with its documents, rows and dead letters (layout: the module's doc)."""

    KIND = b"M"
    VERSION = 1
    # version -> the function that turns that version's plain form (its JSON object; the large
    # values it names by [offset, length] stay where they are) into the next version's
    UPGRADES: ClassVar[dict[int, Callable[[dict], dict]]] = {}

    def _write(self, batch: schema.MicroBatch) -> bytes:
        arrays = _Arrays()
        plain = _plain(batch, {
            "docs": lambda docs: [_doc_out(d, arrays) for d in docs],
            "rows": lambda rows: [_row_out(r, arrays) for r in rows],
            "dead_letters": lambda letters: list(map(_dead_letter_out, letters)),
        })
        header = _JSON.encode(plain).encode("utf-8", _LONE_SURROGATES)
        tokens = arrays.token_bytes()
        return b"".join((_U32.pack(len(header)), header, _U32.pack(len(tokens)), tokens,
                         _U32.pack(arrays.text_size), *arrays.texts, arrays.vector_bytes()))

    def _read(self, version: int, data: memoryview) -> schema.MicroBatch:
        (n,) = _U32.unpack_from(data)
        at = _U32.size + n
        plain = json.loads(bytes(data[_U32.size:at]))
        (token_bytes,) = _U32.unpack_from(data, at)
        at += _U32.size
        width, tokens = data[at], data[at + 1:at + token_bytes]
        at += token_bytes
        (text_bytes,) = _U32.unpack_from(data, at)
        at += _U32.size
        texts = data[at:at + text_bytes]
        vectors = np.frombuffer(data[at + text_bytes:], dtype=_VALUE).copy()
        for old in range(version, self.VERSION):
            plain = self.UPGRADES[old](plain)
        return _micro_batch_in(plain, _Slices(tokens, width, texts, vectors))


# ---- the small ones -----------------------------------------------------------------------------

class PendingIdCoder(_VersionedCoder):
    """``((window_start_us, pane, shard), timestamp_us)`` of a micro-batch in flight."""

    KIND = b"I"
    VERSION = 1

    def _write(self, value) -> bytes:
        (window_start_us, pane, shard), timestamp_us = value
        return _PENDING_ID.pack(window_start_us, pane, shard, timestamp_us)

    def _read(self, version: int, data: memoryview):
        window_start_us, pane, shard, timestamp_us = _PENDING_ID.unpack(data)
        return (window_start_us, pane, shard), timestamp_us


class SeenKeysCoder(_VersionedCoder):
    """``{dedup key: expiry in micros}``: the keys as a JSON list, the expiries as int64."""

    KIND = b"S"
    VERSION = 1

    def _write(self, seen: dict[str, int]) -> bytes:
        keys = _JSON.encode(list(seen)).encode("utf-8", _LONE_SURROGATES)
        expiries = np.fromiter(seen.values(), dtype="<i8", count=len(seen))
        return b"".join((_U32.pack(len(keys)), keys, expiries.tobytes()))

    def _read(self, version: int, data: memoryview) -> dict[str, int]:
        (n,), start = _U32.unpack_from(data), _U32.size
        keys = json.loads(bytes(data[start:start + n]))
        expiries = np.frombuffer(data[start + n:], dtype="<i8").tolist()
        if len(keys) != len(expiries):
            raise StateSchemaError("seen-keys state: not one expiry per key")
        return dict(zip(keys, expiries, strict=True))


STATE_CODERS = (MicroBatchCoder, PendingIdCoder, SeenKeysCoder)
"""Every coder of streaming state (tests/streaming/test_state_coders.py holds the bytes
each has written)."""


class HeldStoriesCoder(_VersionedCoder):
    """``[(id, story id, rank, expiry in micros, band signature, version, facts)]``: the articles
    a band key of ``MarkStoriesStreaming`` holds (or the local runner's one state); a rank is
    ``[micros, micros]`` (``story_rank`` without the id) or None (before every article); version
    (a short form of its text's hash) and facts (``transforms.stories.facts.Facts`` as bytes)
    may be None. Version 1 (the first five, the last two None): ``uint32 n | n bytes of JSON: a
    list of [id, story id, rank, expiry, signature length] | the signatures, one after
    another``, still written where no entry has a version or facts. Version 2: the JSON entries
    are ``[id, story id, rank, expiry, signature length, version, facts length]``, each
    signature followed by its facts. A value of another shape is refused
    (``StateSchemaError``), never read half."""

    KIND = b"H"
    VERSION = 2

    def encode(self, value) -> bytes:
        if all(entry[5:] in ((), (None,), (None, None)) for entry in value):
            return self.KIND + b"\x01" + self._write_1(value)
        return super().encode(value)

    def _write_1(self, held: list) -> bytes:
        head = _JSON.encode([[id_, story, rank, expiry, len(signature)]
                             for id_, story, rank, expiry, signature, *_ in held])
        head_bytes = head.encode("utf-8", _LONE_SURROGATES)
        return b"".join([_U32.pack(len(head_bytes)), head_bytes,
                         *(entry[4] for entry in held)])

    def _write(self, held: list) -> bytes:
        entries = [(*entry, None, None)[:7] for entry in held]
        head = _JSON.encode([[id_, story, rank, expiry, len(signature), version,
                              None if facts is None else len(facts)]
                             for id_, story, rank, expiry, signature, version, facts in entries])
        head_bytes = head.encode("utf-8", _LONE_SURROGATES)
        body = [part for *_, signature, _, facts in entries for part in (signature, facts or b"")]
        return b"".join([_U32.pack(len(head_bytes)), head_bytes, *body])

    def _read(self, version: int, data: memoryview) -> list:
        (n,), at = _U32.unpack_from(data), _U32.size
        held = []
        at += n
        for entry in json.loads(bytes(data[_U32.size:_U32.size + n])):
            if not _held_entry(entry, version):
                raise StateSchemaError(f"held-stories state: an entry of another shape: {entry!r}")
            id_, story, rank, expiry, size, *more = entry
            signature = bytes(data[at:at + size])
            at += size
            facts = None
            if version >= 2 and more[1] is not None:
                facts = bytes(data[at:at + more[1]])
                at += more[1]
            held.append((id_, story, rank, expiry, signature,
                          more[0] if version >= 2 else None, facts))
        if at != len(data):
            raise StateSchemaError("held-stories state: the signatures do not fill the value")
        return held


def _held_entry(entry, version: int = 1) -> bool:
    """[id, story id, rank ([int, int] or None), expiry (int), signature length (int >= 0)], and
    in version 2 [..., version (str or None), facts length (int >= 0 or None)]."""
    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not (isinstance(entry, list) and len(entry) == (5 if version == 1 else 7)):
        return False
    id_, story, rank, expiry, size, *more = entry
    return (isinstance(id_, str) and isinstance(story, str)
            and (rank is None or (isinstance(rank, list) and len(rank) == 2
                                  and all(map(integer, rank))))
            and integer(expiry) and integer(size) and size >= 0
            and (version == 1 or ((more[0] is None or isinstance(more[0], str))
                                  and (more[1] is None or (integer(more[1]) and more[1] >= 0)))))

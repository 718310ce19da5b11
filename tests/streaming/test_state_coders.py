"""Streaming state survives a release (transforms/state_coders.py).

State in flight (EmbedStreaming' micro-batches, DropDuplicatesStreaming's regroup header and
per-shard keys) is read back by whatever release runs next (``--update``). These tests hold the
bytes each state version wrote (``tests/data/state-v<N>.json``): every later release must still
read them to the same values. They also show what pickled state did when a class changed: the
release after it read an object without the new field, and its work items failed for good.

``python -m tests.streaming.test_state_coders`` writes the current version's fixture if it is
missing (it never rewrites one: a version's bytes are frozen once released).
"""
from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import importlib
import inspect
import json
import pickle
import pkgutil
from pathlib import Path
from typing import Optional

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.coders import (
    BooleanCoder,
    BytesCoder,
    FloatCoder,
    NullableCoder,
    StrUtf8Coder,
    TupleCoder,
    VarIntCoder,
)
from apache_beam.transforms.userstate import StateSpec
from pydantic import field_validator

import pipeline
import transforms
from transforms import types as schema
from transforms.chunking import ChunkSpan
from transforms.dedup import _KeepFirstPerShard, _Regroup
from transforms.embed import _EmbedInFlightFn
from transforms.types import (
    ChunkRow,
    DeadLetter,
    EmbeddedDoc,
    Lineage,
    MicroBatch,
    NewsEvent,
    PreparedDoc,
    Reason,
    Step,
)

FIXTURES = Path(__file__).parents[1] / "data"
_UTC = dt.timezone.utc
_IST = dt.timezone(dt.timedelta(hours=5, minutes=30))


# ---- the values each version's fixture holds ----------------------------------------------------

def _event(i: int, lineage: Optional[Lineage]) -> NewsEvent:
    event = NewsEvent.model_validate({
        "id": f"evt-{i}", "title": f"Title {i} – «déjà vu» 東京", "body": f"Body {i}.\n\"Quoted\"",
        "url": f"https://news.example.com/{i}", "source": "example-news", "language": "fr",
        "published_at": "2026-11-30T09:15:00.250+05:30"})
    return event if lineage is None else event.model_copy(update={"lineage": lineage})


def _micro_batch_v1() -> MicroBatch:
    """The micro-batch of the version 1 fixture: every field the classes had then set to something
    other than its default, so that a field the coder dropped would show. Frozen: a field added
    since reads as its default from these bytes (``_micro_batch_now`` sets it)."""
    lineage = Lineage(message_id="17000000001",
                      publish_time=dt.datetime(2026, 12, 1, 10, 0, 1, 123000, tzinfo=_UTC),
                      attributes=(("feed", "wire"), ("lang", "fr")))
    doc = PreparedDoc(event=_event(1, lineage), text="Title 1\nBody 1.", text_sha256="a" * 64,
                      token_ids=(101, 2023, 30521, 102), truncated=True,
                      chunks=(ChunkSpan(token_ids=(101, 2023, 102), token_start=0, token_end=1,
                                        char_start=0, char_end=7),
                              ChunkSpan(token_ids=(101, 30521, 102), token_start=1, token_end=2,
                                        char_start=8, char_end=15)),
                      title="Title 1")
    chunk = ChunkRow(id="evt-2", chunk_id="c" * 32, chunk_index=1, chunk_count=2, token_start=3,
                     token_end=9, char_start=10, char_end=40, chunk_sha256="d" * 64,
                     text_sha256="b" * 64, model="minilm@abc",
                     embedding=np.array([0.5, -0.25, 0.0, 1.0], np.float32),
                     embedded_at=dt.datetime(2026, 12, 1, 10, 1, tzinfo=_UTC),
                     chunk_text="the chunk's text")
    row = EmbeddedDoc(id="evt-2", url="https://news.example.com/2", source="wire", title="Two",
                      published_at=dt.datetime(2026, 11, 30, 9, 15, tzinfo=_IST), language="de",
                      model="minilm@abc", embedding=np.array([0.1, 0.2, 0.3, 0.4], np.float32),
                      text_sha256="b" * 64, token_count=9, truncated=True,
                      embedded_at=dt.datetime(2026, 12, 1, 10, 1, tzinfo=_UTC), lineage=lineage,
                      doc_vector="mean", chunk_count=1, chunks=(chunk,))
    letter = DeadLetter(step=Step.EMBED, reason=Reason.EMBEDDING_FAILED, detail="engine said no",
                        payload='{"id": "evt-3"}', payload_bytes=15, event_id="evt-3",
                        message_id="17000000003", language="en",
                        failed_at="2026-12-01T10:00:02.000+00:00")
    return MicroBatch(window_start_us=1_796_000_000_000_000, window_end_us=1_796_000_060_000_000,
                      pane=2, shard=3, shards=8, docs=(doc,), rows=(row,), dead_letters=(letter,),
                      messages_in=4, duplicates=1, late_reassigned=1)


def _micro_batch_0_2() -> MicroBatch:
    """``_micro_batch_v1`` with the fields 0.2 added: ``updated_at`` of the event and of the row
    (frozen: the in-flight fixture of 0.2 holds it)."""
    batch = _micro_batch_v1()
    updated = dt.datetime(2026, 12, 1, 8, 30, 0, 500000, tzinfo=_IST)
    doc = batch.docs[0]
    doc = dataclasses.replace(doc, event=doc.event.model_copy(update={"updated_at": updated}))
    row = dataclasses.replace(batch.rows[0], updated_at=updated)
    return dataclasses.replace(batch, docs=(doc,), rows=(row,))


def _micro_batch_now() -> MicroBatch:
    """``_micro_batch_v1`` with every field added to its classes since set to something other
    than its default (``test_the_sample_sets_every_field`` checks): what today's coders must
    carry: ``updated_at`` of the event and of the row; the story of the document, the row and
    the chunk row, and the signature and its facts of the document and the row; the skipped
    copies."""
    batch = _micro_batch_v1()
    updated = dt.datetime(2026, 12, 1, 8, 30, 0, 500000, tzinfo=_IST)
    story = {"story_id": "evt-0", "near_duplicate_of": "evt-00", "similarity": 0.75}
    doc = batch.docs[0]
    doc = dataclasses.replace(doc, event=doc.event.model_copy(update={"updated_at": updated}),
                              minhash=b"\x01\x00\xff\x7f", story_facts=b"\x05\x01\x00", **story)
    row = batch.rows[0]
    chunks = tuple(dataclasses.replace(chunk, **story) for chunk in row.chunks)
    row = dataclasses.replace(row, updated_at=updated, chunks=chunks, minhash=b"\x00\x80",
                              story_facts=b"\x04\x00", **story)
    return dataclasses.replace(batch, docs=(doc,), rows=(row,), near_duplicates=2)


def _wide_tokens_v1() -> MicroBatch:
    """Token ids over 65,535 (XLM-R's vocabulary), no lineage, a dead letter of parse."""
    doc = PreparedDoc(event=_event(5, None), text="Body 5.", text_sha256="e" * 64,
                      token_ids=(0, 250001, 65536, 2), truncated=False)
    letter = DeadLetter(step=Step.PARSE, reason=Reason.INVALID_JSON, detail="not valid JSON",
                        payload="{oops", payload_bytes=5, failed_at="2026-12-01T10:00:03.000+00:00")
    return MicroBatch(window_start_us=0, window_end_us=60_000_000, pane=0, shard=0, shards=1,
                      docs=(doc,), dead_letters=(letter,), messages_in=2)


def _values_v1() -> dict:
    """name -> (coder, value) of the version 1 fixture."""
    from transforms.state_coders import MicroBatchCoder, PendingIdCoder, SeenKeysCoder

    return {
        "micro_batch": (MicroBatchCoder(), _micro_batch_v1()),
        "micro_batch_wide_tokens": (MicroBatchCoder(), _wide_tokens_v1()),
        "micro_batch_empty": (MicroBatchCoder(), MicroBatch(
            window_start_us=60_000_000, window_end_us=120_000_000, pane=1, shard=1, shards=2)),
        "pending_id": (PendingIdCoder(), ((1_796_000_000_000_000, 2, 3), 1_796_000_059_999_999)),
        "seen_keys": (SeenKeysCoder(), {"evt-1": 1_796_003_600_000_000, "ключ-2": 1}),
    }


VALUES = {1: _values_v1}  # each state version -> the values its fixture holds


def _fixture(version: int) -> Path:
    return FIXTURES / f"state-v{version}.json"


def write_fixture() -> Path:
    from transforms.state_coders import STATE_CODERS

    version = max(coder.VERSION for coder in STATE_CODERS)
    path = _fixture(version)
    if path.exists():
        raise SystemExit(f"{path} exists: a released version's bytes are never rewritten")
    values = {name: base64.b64encode(coder.encode(value)).decode("ascii")
              for name, (coder, value) in VALUES[version]().items()}
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"state_version": version, "values": values}, indent=1) + "\n")
    return path


# ---- comparing values ---------------------------------------------------------------------------

def assert_same(got, want, where: str = "value") -> None:
    """Equal, field by field, and of the same types (a tuple is not a list, a vector is float32,
    a date-time keeps its offset)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            assert_same(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")
    elif isinstance(want, NewsEvent):
        assert got == want, where
        assert_same(got.lineage, want.lineage, f"{where}.lineage")
        assert_same(got.published_at, want.published_at, f"{where}.published_at")
    elif isinstance(want, np.ndarray):
        assert got.dtype == np.float32 and np.array_equal(got, want), where
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, dt.datetime):
        assert got.isoformat() == want.isoformat(), where
    else:
        assert got == want, where


# ---- what a release reads -----------------------------------------------------------------------

def _state_specs():
    """(DoFn, state spec) of every stateful step in newsvec."""
    for package in (transforms, pipeline):  # sub-packages too (transforms.stories.streaming)
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if module.name.endswith(".__main__"):  # runs the command
                continue
            for _, cls in inspect.getmembers(importlib.import_module(module.name),
                                             inspect.isclass):
                if issubclass(cls, beam.DoFn) and cls.__module__ == module.name:
                    for _, value in inspect.getmembers(cls):  # inherited specs too (regroup_fn)
                        if isinstance(value, StateSpec):
                            yield cls, value


def test_no_state_is_pickled():
    """Every state spec's coder is a versioned state coder or Beam's own coder of primitives
    (whose encoding Beam specifies; raw bytes are each step's own versioned layout), never a
    pickle."""
    def plain(coder) -> bool:
        if isinstance(coder, TupleCoder):
            return all(map(plain, coder.coders()))
        if isinstance(coder, NullableCoder):
            return plain(coder._value_coder)
        return (isinstance(coder, (VarIntCoder, StrUtf8Coder, BooleanCoder, FloatCoder, BytesCoder))
                or type(coder).__module__ == "transforms.state_coders")

    specs = list(_state_specs())
    assert {cls.__name__ for cls, _ in specs} >= {
        "_EmbedInFlightFn", "_Regroup", "_KeepFirstPerShard", "_KeepFirstPerKey", "_CutRegroup",
        "_Resolve", "_MatchPerBand", "_StoryPerArticle", "_MarkLocally", "_LearnPerSource"}
    pickled = [f"{cls.__name__}.{spec.name}: {type(spec.coder).__name__}" for cls, spec in specs
               if not plain(spec.coder)]
    assert not pickled


@pytest.mark.parametrize("version", sorted(VALUES))
def test_every_state_version_written_is_read_to_its_values(version):
    """The fixture of each version, written by that version's coders, decodes with today's to the
    values it was written from; and today's version has a fixture."""
    from transforms.state_coders import STATE_CODERS

    stored = json.loads(_fixture(version).read_text())
    assert stored["state_version"] == version
    values = VALUES[version]()
    assert stored["values"].keys() == values.keys()
    for name, (coder, want) in values.items():
        data = base64.b64decode(stored["values"][name])
        assert data[1] == version, name
        assert_same(coder.decode(data), want, name)
    assert max(coder.VERSION for coder in STATE_CODERS) in VALUES


def test_state_round_trips_through_the_state_specs():
    """Each stateful step's coder gives back what it was given (today's version)."""
    batch = _micro_batch_now()
    for spec in (_EmbedInFlightFn.PENDING, _Regroup.HEADER):
        assert_same(spec.coder.decode(spec.coder.encode(batch)), batch)
    pending = ((1, 2, 3), 4)
    assert _EmbedInFlightFn.PENDING_IDS.coder.decode(
        _EmbedInFlightFn.PENDING_IDS.coder.encode(pending)) == pending
    seen = {"a": 1, "b": 2, "lone \udc80 surrogate": 3}
    assert _KeepFirstPerShard.SEEN.coder.decode(_KeepFirstPerShard.SEEN.coder.encode(seen)) == seen
    # Parsing refuses lone surrogates, but a dead letter's detail is any exception's text: a
    # string the state cannot write would fail the work item on every retry.
    odd = dataclasses.replace(batch, dead_letters=(dataclasses.replace(
        batch.dead_letters[0], detail="\ud800 from an exception"),))
    coder = _EmbedInFlightFn.PENDING.coder
    assert_same(coder.decode(coder.encode(odd)), odd)


def test_the_sample_sets_every_field():
    """The round trip's micro-batch sets every field of every class in it to something other than
    its default, so a field the state coders do not carry, or give back as another type, fails
    it. A field added to one of these classes fails here first: set it in ``_micro_batch_now``
    (a released fixture's values stay as they were; for a field without a default, see
    transforms/state_coders.py)."""
    batch = _micro_batch_now()
    samples = [batch, batch.docs[0], batch.docs[0].chunks[0], batch.rows[0],
               batch.rows[0].chunks[0], batch.rows[0].lineage, batch.dead_letters[0]]
    for sample in samples:
        for f in dataclasses.fields(sample):
            value, where = getattr(sample, f.name), f"{type(sample).__name__}.{f.name}"
            assert value is not None, where
            if f.default is not dataclasses.MISSING:
                assert value != f.default, where
    event = batch.docs[0].event
    for name, field in NewsEvent.model_fields.items():
        assert getattr(event, name) not in (None, field.default), f"NewsEvent.{name}"


def test_a_date_time_field_added_with_a_default_needs_no_coder_change(monkeypatch):
    """A field added to a document type is carried by its name; a date-time one (as
    ``updated_at`` was) by its declared type, with its offset; state written before it reads
    as its default."""
    from transforms.state_coders import MicroBatchCoder

    coder = MicroBatchCoder()
    before = coder.encode(_micro_batch_now())

    @dataclasses.dataclass(frozen=True)
    class EmbeddedDoc(schema.EmbeddedDoc):
        revised_at: Optional[dt.datetime] = None

    _as_next_release(monkeypatch, EmbeddedDoc)
    batch = _micro_batch_now()
    updated = dt.datetime(2026, 12, 2, 8, 0, tzinfo=_IST)
    row = EmbeddedDoc(**{f.name: getattr(batch.rows[0], f.name)
                         for f in dataclasses.fields(schema.EmbeddedDoc)
                         if f.name != "revised_at"}, revised_at=updated)
    with_field = dataclasses.replace(batch, rows=(row,))
    assert_same(coder.decode(coder.encode(with_field)), with_field)
    assert coder.decode(before).rows[0].revised_at is None


# ---- what pickled state did when a class changed ------------------------------------------------

def _as_next_release(monkeypatch, new_class) -> None:
    """Make ``new_class`` the class of its name in transforms.types, as a new release's worker
    has it (pickle looks classes up there by name)."""
    new_class.__module__ = "transforms.types"
    new_class.__qualname__ = new_class.__name__
    monkeypatch.setattr(schema, new_class.__name__, new_class)


def test_an_event_field_added_with_a_default_leaves_state_readable(monkeypatch):
    """The next release adds an optional field to NewsEvent (as ``updated_at`` would be) and a
    check that what the state holds would fail at parsing today: the micro-batches in flight and
    the regroup headers are read with the field at its default, and are whole (the steps after
    rebuild them with ``dataclasses.replace``). Pickled state read them as events without the
    field: ``AttributeError`` when read, for every retry of the work item."""
    batch = _micro_batch_v1()
    stored = {spec.name: (spec.coder, spec.coder.encode(batch))
              for spec in (_EmbedInFlightFn.PENDING, _Regroup.HEADER)}

    class NewsEvent(schema.NewsEvent):
        revision: Optional[int] = None

        @field_validator("id")
        @classmethod
        def _no_dashes(cls, value):  # the state's ids ("evt-1") would fail parsing now
            if "-" in value:
                raise ValueError("no dashes")
            return value

    _as_next_release(monkeypatch, NewsEvent)
    for name, (coder, data) in stored.items():
        read = coder.decode(data)
        event = read.docs[0].event
        assert type(event) is NewsEvent, name
        assert event.revision is None, name
        assert event.model_dump(exclude={"revision"}) == batch.docs[0].event.model_dump(), name
        assert_same(event.lineage, batch.docs[0].event.lineage, name)
        dataclasses.replace(read, docs=tuple(dataclasses.replace(d) for d in read.docs))


def test_a_field_without_a_default_is_never_read_half_built(monkeypatch):
    """The next release adds a field without a default to PreparedDoc. Reading state written
    before it fails at once, naming the field (and the fixture test fails before such a release
    ships), never as an object without the field: pickled state read one, and the step failed
    later, for every retry. The release raises the state version with an upgrade of the old one,
    and then reads it."""
    coder = _EmbedInFlightFn.PENDING.coder
    data = coder.encode(_micro_batch_v1())

    @dataclasses.dataclass(frozen=True)
    class PreparedDoc(schema.PreparedDoc):
        script: str = dataclasses.field(kw_only=True)  # no default

    _as_next_release(monkeypatch, PreparedDoc)
    with pytest.raises(ValueError, match="script"):
        coder.decode(data)

    from transforms.state_coders import MicroBatchCoder

    def upgrade_1(plain: dict) -> dict:
        return {**plain, "docs": [{**doc, "script": "Latn"} for doc in plain["docs"]]}

    monkeypatch.setattr(MicroBatchCoder, "VERSION", 2)
    monkeypatch.setattr(MicroBatchCoder, "UPGRADES", {1: upgrade_1})
    read = coder.decode(data)
    assert read.docs[0].script == "Latn"
    assert read.docs[0].token_ids == _micro_batch_v1().docs[0].token_ids
    assert coder.encode(read)[1] == 2 and coder.decode(coder.encode(read)).docs[0].script == "Latn"


def test_state_of_a_newer_release_or_pickled_is_refused_with_the_way_out():
    """A release reads no state version newer than its own (an update back to an older release),
    nor state pickled by a release before versioned state: each is a message that says what to
    do, not a half-read value."""
    from transforms.state_coders import MicroBatchCoder, SeenKeysCoder, StateSchemaError

    coder = MicroBatchCoder()
    newer = bytearray(coder.encode(_wide_tokens_v1()))
    newer[1] = MicroBatchCoder.VERSION + 1
    with pytest.raises(StateSchemaError, match="newer release"):
        coder.decode(bytes(newer))
    with pytest.raises(StateSchemaError, match="pickled"):
        coder.decode(pickle.dumps(_wide_tokens_v1(), pickle.HIGHEST_PROTOCOL))
    with pytest.raises(StateSchemaError, match="kind"):
        coder.decode(SeenKeysCoder().encode({"a": 1}))


if __name__ == "__main__":
    print(f"wrote {write_fixture()}")


# ---- elements in flight between steps ----------------------------------------------------------

IN_FLIGHT = FIXTURES / "in-flight-0.2.json"


def _in_flight_values() -> dict:
    """name -> value of elements a 0.2 streaming job holds between its steps (shuffled, or in
    timers' and GroupByKey's buffers): Beam encodes them with the coder it infers for their
    PCollection (``FastPrimitivesCoder``), which pickles a dataclass by its module and name."""
    batch = _micro_batch_0_2()
    return {"micro_batch": batch, "keyed_micro_batch": (3, batch),
            "prepared_doc": batch.docs[0], "dead_letter": batch.dead_letters[0],
            "embedded_doc": batch.rows[0]}


def write_in_flight_fixture() -> Path:
    """Run once by the version that wrote it (0.2); never rewritten."""
    if IN_FLIGHT.exists():
        raise SystemExit(f"{IN_FLIGHT} exists: a released version's bytes are never rewritten")
    coder = beam.coders.registry.get_coder(MicroBatch)
    values = {name: base64.b64encode(coder.encode(value)).decode("ascii")
              for name, value in _in_flight_values().items()}
    IN_FLIGHT.write_text(json.dumps({"written_by": "0.2", "values": values}, indent=1) + "\n")
    return IN_FLIGHT


def test_elements_in_flight_written_by_0_2_are_read_after_the_types_moved():
    """An ``--update`` from 0.2 hands the new job the elements in flight, pickled by 0.2 under its
    types' module (``transforms.schema``): today's code reads them to the same values (the types
    moved to ``transforms.types``; ``transforms/schema.py`` stays as their old name)."""
    stored = json.loads(IN_FLIGHT.read_text())
    coder = beam.coders.registry.get_coder(MicroBatch)
    values = _in_flight_values()
    assert stored["values"].keys() == values.keys()
    for name, want in values.items():
        assert_same(coder.decode(base64.b64decode(stored["values"][name])), want, name)

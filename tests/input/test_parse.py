"""Parse: the input contract, and hostile payloads that must become dead letters with a reason."""
import datetime as dt
import json

import apache_beam as beam
import pytest
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from transforms.parse import ParseError, ParseEvents, parse_event
from transforms.types import Reason

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)
LIMITS = dict(max_payload_bytes=1 << 20, max_future_skew=dt.timedelta(days=1), now=NOW)
GOOD = {"id": "a-1", "title": "Rates held", "body": "The bank held rates.",
        "url": "https://news.example.com/a-1", "source": "wire", "language": "en",
        "published_at": "2026-11-30T09:15:00Z"}


def payload(**changes) -> bytes:
    event = {**GOOD, **changes}
    return json.dumps({k: v for k, v in event.items() if v is not ...}).encode()


def reason_of(raw: bytes) -> str:
    with pytest.raises(ParseError) as info:
        parse_event(raw, **LIMITS)
    assert info.value.detail, "a dead letter needs a reason a person can act on"
    return info.value.reason


def test_valid_event_parses_all_fields():
    event = parse_event(payload(), **LIMITS)
    assert event.id == "a-1" and event.title == "Rates held" and event.language == "en"
    assert event.published_at == dt.datetime(2026, 11, 30, 9, 15, tzinfo=dt.timezone.utc)


def test_unknown_fields_are_ignored_and_optional_fields_may_be_missing():
    event = parse_event(b'{"id": "x", "body": "text", "tags": ["a"], "extra": {"deep": 1}}',
                        **LIMITS)
    assert event.id == "x" and event.title is None and event.published_at is None


def test_title_alone_or_body_alone_is_enough():
    assert parse_event(payload(body=...), **LIMITS).body is None
    assert parse_event(payload(title=...), **LIMITS).title is None


def test_rfc3339_offsets_are_kept_as_aware_datetimes():
    event = parse_event(payload(published_at="2026-11-30T10:15:00+01:00"), **LIMITS)
    assert event.published_at == dt.datetime(2026, 11, 30, 9, 15, tzinfo=dt.timezone.utc)
    event = parse_event(payload(published_at="2026-11-30t09:15:00.250z"), **LIMITS)
    assert event.published_at == dt.datetime(2026, 11, 30, 9, 15, 0, 250000, tzinfo=dt.timezone.utc)


@pytest.mark.parametrize("raw, reason", [
    (b'{"id": "a", "body": "cut in the mid', Reason.INVALID_JSON),
    (b"", Reason.INVALID_JSON),
    (b"not json at all", Reason.INVALID_JSON),
    (b'{"id": "a", "body": "x"} trailing', Reason.INVALID_JSON),
    (b"[1, 2, 3]", Reason.NOT_AN_OBJECT),
    (b'"just a string"', Reason.NOT_AN_OBJECT),
    (b"null", Reason.NOT_AN_OBJECT),
    (b'{"title": "t", "body": "b"}', Reason.MISSING_ID),
    (b'{"id": 12345, "body": "b"}', Reason.INVALID_ID),
    (b'{"id": "", "body": "b"}', Reason.INVALID_ID),
    (json.dumps({"id": "x" * 257, "body": "b"}).encode(), Reason.INVALID_ID),
    (b'{"id": null, "body": "b"}', Reason.INVALID_ID),
    (b'{"id": "   ", "body": "b"}', Reason.INVALID_ID),
    (b'{"id": "a", "body": 42}', Reason.INVALID_FIELD),
    (b'{"id": "a", "title": ["list"], "body": "b"}', Reason.INVALID_FIELD),
    (b'{"id": "a", "body": {"nested": "object"}}', Reason.INVALID_FIELD),
    (b'{"id": "a", "body": "b", "published_at": "yesterday"}', Reason.INVALID_FIELD),
    (b'{"id": "a", "body": "b", "published_at": "2026-11-30T09:15:00"}', Reason.INVALID_FIELD),
    (b'{"id": "a", "body": "b", "published_at": 1764000000}', Reason.INVALID_FIELD),
    (b'{"id": "a", "body": "b", "published_at": "1764000000"}', Reason.INVALID_FIELD),
    (b'{"id": "a", "body": "b", "published_at": "2026-11-30 09:15:00Z"}', Reason.INVALID_FIELD),
    (b'{"id": "a", "body": "b", "published_at": "2026-11-30T09:15Z"}', Reason.INVALID_FIELD),
    (b'{"id": "a", "body": "b", "published_at": "2026-02-30T09:15:00Z"}', Reason.INVALID_FIELD),
    (b'{"id": "a", "title": "", "body": ""}', Reason.NO_TEXT),
    (b'{"id": "a", "title": "  \\n\\t ", "body": null}', Reason.NO_TEXT),
    (b'{"id": "a"}', Reason.NO_TEXT),
    (b'\xff\xfe{"id": "a", "body": "b"}', Reason.INVALID_UTF8),
    (b'{"id": "a", "body": "caf\xe9"}', Reason.INVALID_UTF8),
    (b"[" * 100_000 + b"]" * 100_000, Reason.INVALID_JSON),
])
def test_hostile_payloads_get_specific_reasons(raw, reason):
    assert reason_of(raw) == reason


def test_oversized_payload_is_rejected_before_decoding():
    body = "x" * (20 * 1024 * 1024)
    assert reason_of(payload(body=body)) == Reason.PAYLOAD_TOO_LARGE


def test_future_dates_beyond_the_allowed_skew_are_dead_lettered():
    assert reason_of(payload(published_at="2031-01-01T00:00:00Z")) == Reason.PUBLISHED_IN_FUTURE
    # Within the skew (clocks differ): accepted.
    assert parse_event(payload(published_at="2026-12-01T18:00:00Z"), **LIMITS).id == "a-1"


def test_nul_bytes_and_path_like_fields_are_just_data():
    event = parse_event(payload(id="../../etc/passwd", source="../../x", body="a\u0000b"), **LIMITS)
    assert event.id == "../../etc/passwd" and event.body == "a\x00b"


def test_parse_transform_routes_every_payload_exactly_once():
    raws = [payload(id="ok-1"), b"{broken", payload(id="ok-2"), b"[]", b"\xff"]
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(raws) | ParseEvents(max_payload_bytes=1 << 20)
        assert_that(out.events | beam.Map(lambda e: e.id), equal_to(["ok-1", "ok-2"]), label="ok")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.step, d.reason)),
                    equal_to([("parse", Reason.INVALID_JSON), ("parse", Reason.NOT_AN_OBJECT),
                              ("parse", Reason.INVALID_UTF8)]), label="dead")
        assert_that(out.dead_letter | beam.Map(lambda d: d.payload_bytes > 0 and bool(d.payload)),
                    equal_to([True] * 3), label="payload kept")


def test_dead_letter_payload_is_truncated_to_its_bound():
    big = b'{"id": "a", "body": "' + b"y" * 10_000
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create([big]) | ParseEvents(dead_letter_payload_bytes=100)
        assert_that(out.dead_letter | beam.Map(lambda d: (len(d.payload), d.payload_bytes)),
                    equal_to([(100, len(big))]))


def test_pubsub_messages_keep_their_lineage_and_payloads_cannot_forge_it():
    from apache_beam.io.gcp.pubsub import PubsubMessage
    from apache_beam.utils.timestamp import Timestamp

    published = Timestamp.from_utc_datetime(NOW)
    good = PubsubMessage(payload(id="m-1", lineage={"message_id": "forged"}), {"origin": "wire"},
                         message_id="101", publish_time=published)
    bad = PubsubMessage(b"{broken", {}, message_id="102", publish_time=published)
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create([good, bad]) | ParseEvents()
        assert_that(out.events | beam.Map(lambda e: (e.id, e.lineage.message_id,
                                                     e.lineage.publish_time,
                                                     e.lineage.attributes)),
                    equal_to([("m-1", "101", NOW, (("origin", "wire"),))]), label="lineage")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.message_id, d.reason)),
                    equal_to([("102", Reason.INVALID_JSON)]), label="dead")


def test_parse_dead_letters_keep_the_language_where_the_event_gave_one():
    """Counted by language (issue 23): a Japanese feed's parse failures are the feed's, not
    'unknown'. A language that is itself the fault, or an unreadable payload, gives none."""
    raws = [payload(id="ja-empty", title="", body="  ", language="ja"),
            payload(id="ja-future", published_at="2031-01-01T00:00:00Z", language="ja"),
            payload(id="ja-bad-title", title=5, language="ja"),
            payload(id=..., language="th"),
            payload(id="bad-language", language=5),
            b'{"id": "ja-cut", "language": "ja", "bo']
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(raws) | ParseEvents(max_payload_bytes=1 << 20)
        assert_that(out.dead_letter | beam.Map(lambda d: (d.reason, d.language)), equal_to([
            (Reason.NO_TEXT, "ja"), (Reason.PUBLISHED_IN_FUTURE, "ja"),
            (Reason.INVALID_FIELD, "ja"), (Reason.MISSING_ID, "th"),
            (Reason.INVALID_FIELD, None), (Reason.INVALID_JSON, None)]))


# ---- values no store or reader can hold: dead-lettered at parse, never a stalled load ----

@pytest.mark.parametrize("field, value, reason", [
    ("id", "evt\u0000nul", Reason.INVALID_ID),
    ("id", "line1\nline2", Reason.INVALID_ID),
    ("url", "https://x.example/\u0000", Reason.INVALID_FIELD),
    ("source", "wire\u0000", Reason.INVALID_FIELD),
    ("language", "en\u0000", Reason.INVALID_FIELD),
    ("source", "wire\u0085", Reason.INVALID_FIELD),  # C1: NEXT LINE
    ("url", "https://x.example/\u007f", Reason.INVALID_FIELD),  # DEL
])
def test_control_characters_in_identifying_fields_are_dead_lettered(field, value, reason):
    """PostgreSQL text cannot hold NUL: such an id passed parse and embedding, then failed the
    store load for ever (a streaming job retries it without end). The detail names the field."""
    with pytest.raises(ParseError) as info:
        parse_event(payload(**{field: value}), **LIMITS)
    assert info.value.reason == reason
    assert info.value.detail.startswith(f"{field}: ") and "control character U+" in \
        info.value.detail, info.value.detail


def test_title_and_body_may_hold_control_characters_text_preparation_removes_them():
    event = parse_event(payload(title="a\u0000b", body="c\u001bd"), **LIMITS)
    assert (event.title, event.body) == ("a\x00b", "c\x1bd")


@pytest.mark.parametrize("value", ["0001-01-01T00:00:00+00:01", "0001-01-01T00:59:59+01:00",
                                   "9999-12-31T23:59:59-00:01"])
def test_times_whose_utc_instant_no_reader_can_hold_are_dead_lettered(value):
    """Valid RFC 3339, but its UTC instant is year 0 or 10000: Parquet stores it, and every
    conversion back (pyarrow's to_pylist, the store's loader, astimezone) raised OverflowError."""
    with pytest.raises(ParseError) as info:
        parse_event(payload(published_at=value), **dict(LIMITS, max_future_skew=dt.timedelta(
            days=10_000 * 366)))
    assert info.value.reason == Reason.INVALID_FIELD
    assert info.value.detail.startswith("published_at: ") and "UTC instant" in info.value.detail


@pytest.mark.parametrize("value", ["0001-01-01T00:00:00Z", "0001-01-01T01:00:00+01:00",
                                   "0001-01-01T00:00:00-01:00"])
def test_the_earliest_time_readers_hold_is_accepted(value):
    event = parse_event(payload(published_at=value), **LIMITS)
    assert event.published_at.astimezone(dt.timezone.utc).year == 1


def test_pubsub_attributes_with_control_characters_are_dead_lettered():
    from apache_beam.io.gcp.pubsub import PubsubMessage
    from apache_beam.utils.timestamp import Timestamp

    published = Timestamp.from_utc_datetime(NOW)
    messages = [PubsubMessage(payload(id=f"m-{i}"), attributes, message_id=str(i),
                              publish_time=published)
                for i, attributes in enumerate([{"origin": "wire"}, {"origin": "a\u0000b"},
                                                {"ori\u0000gin": "wire"}, {"x": "tab\there"}])]
    with TestPipeline(runner="FnApiRunner") as p:
        out = p | beam.Create(messages) | ParseEvents()
        assert_that(out.events | beam.Map(lambda e: e.id), equal_to(["m-0"]), label="ok")
        assert_that(out.dead_letter | beam.Map(lambda d: (d.message_id, d.event_id, d.reason,
                                                          d.detail)), equal_to([
            ("1", "m-1", Reason.INVALID_FIELD,
             "pubsub attribute 'origin': control character U+0000 at character 1 of its value"),
            ("2", "m-2", Reason.INVALID_FIELD,
             "pubsub attribute 'ori\\x00gin': control character U+0000 at character 3 of its key"),
            ("3", "m-3", Reason.INVALID_FIELD,
             "pubsub attribute 'x': control character U+0009 at character 3 of its value"),
        ]), label="dead")


def test_updated_at_is_held_to_the_same_range_and_the_same_limit_ahead_of_now():
    """``updated_at`` orders an article's versions: a far-future one would keep its version
    current for ever, whatever correction came after it."""
    assert parse_event(payload(updated_at="2026-12-01T18:00:00Z"), **LIMITS).updated_at == \
        dt.datetime(2026, 12, 1, 18, tzinfo=dt.timezone.utc)
    assert reason_of(payload(updated_at="2031-01-01T00:00:00Z")) == Reason.UPDATED_IN_FUTURE
    assert reason_of(payload(updated_at="0001-01-01T00:00:00+00:01")) == Reason.INVALID_FIELD
    assert reason_of(payload(updated_at="2026-11-30 09:15Z")) == Reason.INVALID_FIELD

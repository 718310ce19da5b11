"""Parse: raw bytes (a JSON Lines line, or the head of one too large to read: ``OversizedPayload``)
or a Pub/Sub message -> NewsEvent, or a dead letter.

A Pub/Sub message's data is parsed as the same bytes; its id, publish time and attributes are kept
on the event as ``Lineage`` (and on its dead letter, the message id). An attribute whose key or
value holds a control character dead-letters its message (``invalid_field``), as such a character
in ``id``, ``url``, ``source`` or ``language`` does.

Every payload leaves this step exactly once: on the main output as a ``NewsEvent``, or on the
``dead_letter`` output with a reason from ``schema.Reason``.
"""
from __future__ import annotations

import datetime as dt
from typing import Any, Iterator, Mapping, Optional, Union

import apache_beam as beam
import pydantic
import pydantic_core
from apache_beam import pvalue

from transforms.metrics import EVENTS_IN
from transforms.types import (
    DEAD_LETTER,
    DeadLetter,
    Lineage,
    NewsEvent,
    OversizedPayload,
    Reason,
    Step,
    control_character,
    truncate_payload,
)


class ParseError(ValueError):
    def __init__(self, reason: Reason, detail: str, event_id: Optional[str] = None,
                 language: Optional[str] = None):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.event_id = reason, detail, event_id
        self.language = language  # the event's, where it could be read: counted by language


def _describe(err: Mapping[str, Any]) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
    return f"{loc}: {err.get('msg', 'invalid')}"


def _readable_language(document: Any, errors: list) -> Optional[str]:
    """The ``language`` of a JSON object that failed validation, unless that field is at fault."""
    if not isinstance(document, dict) or any(e.get("loc", ())[:1] == ("language",)
                                             for e in errors):
        return None
    language = document.get("language")
    return language if isinstance(language, str) else None


def _from_validation_error(exc: pydantic.ValidationError, document: Any) -> ParseError:
    errors = exc.errors(include_url=False, include_input=False)
    language = _readable_language(document, errors)
    first = errors[0]
    kind, loc = first.get("type", ""), first.get("loc", ())
    detail = "; ".join(_describe(e) for e in errors[:5])
    if kind == "json_invalid":
        return ParseError(Reason.INVALID_JSON, f"not valid JSON ({first.get('msg')})")
    if kind in ("model_type", "model_attributes_type") and not loc:
        return ParseError(Reason.NOT_AN_OBJECT, "the payload must be a JSON object")
    if loc and loc[0] == "id":
        reason = Reason.MISSING_ID if kind == "missing" else Reason.INVALID_ID
        return ParseError(reason, detail, language=language)
    return ParseError(Reason.INVALID_FIELD, detail, language=language)


def parse_event(
    payload: bytes,
    *,
    max_payload_bytes: int,
    max_future_skew: dt.timedelta,
    now: Optional[dt.datetime] = None,
) -> NewsEvent:
    """Validate one payload against the input contract. Raises ParseError with a reason code."""
    if isinstance(payload, OversizedPayload):
        raise ParseError(Reason.PAYLOAD_TOO_LARGE,
                         f"{payload.size} bytes is over the limit of {max_payload_bytes} bytes "
                         f"(not read whole)")
    if not isinstance(payload, (bytes, bytearray)):
        raise ParseError(Reason.INVALID_FIELD,
                         f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > max_payload_bytes:
        raise ParseError(Reason.PAYLOAD_TOO_LARGE,
                         f"{len(payload)} bytes is over the limit of {max_payload_bytes} bytes")
    try:
        text = bytes(payload).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ParseError(Reason.INVALID_UTF8,
                         f"not UTF-8 at byte {exc.start}: {exc.reason}") from None
    try:
        # pydantic's JSON parser takes NaN and Infinity, which are not JSON (RFC 8259).
        document = pydantic_core.from_json(text, allow_inf_nan=False, cache_strings=False)
    except ValueError as exc:
        raise ParseError(Reason.INVALID_JSON, f"not valid JSON ({exc})") from None
    try:
        event = NewsEvent.model_validate_json(text)
    except pydantic.ValidationError as exc:
        raise _from_validation_error(exc, document) from None
    if not (event.title or "").strip() and not (event.body or "").strip():
        raise ParseError(Reason.NO_TEXT, "title and body are both missing or empty", event.id,
                         event.language)
    now = now or dt.datetime.now(dt.timezone.utc)
    for field, reason in (("published_at", Reason.PUBLISHED_IN_FUTURE),
                          ("updated_at", Reason.UPDATED_IN_FUTURE)):
        at = getattr(event, field)
        if at is not None and at - now > max_future_skew:
            # A far-future updated_at would keep its version current for ever (VERSION_ORDER).
            raise ParseError(
                reason, f"{field} {at.isoformat()} is more than {max_future_skew} after now "
                f"({now.isoformat(timespec='seconds')})", event.id, event.language)
    return event


def check_attributes(lineage: Optional[Lineage], event: NewsEvent) -> None:
    """ParseError (``invalid_field``) naming the first Pub/Sub attribute whose key or value holds a
    control character: attributes are stored beside the vector (a Parquet map, a jsonb column),
    and PostgreSQL's jsonb cannot hold NUL at all."""
    for key, value in lineage.attributes if lineage else ():
        for what, text in (("key", key), ("value", value)):
            where = control_character(text)
            if where:
                raise ParseError(Reason.INVALID_FIELD, f"pubsub attribute {key!r}: control "
                                 f"character {where} of its {what}", event.id, event.language)


def split_message(element) -> tuple[bytes, Optional[Lineage]]:
    """(payload, lineage) of raw bytes or an ``OversizedPayload`` (no lineage), or of a Pub/Sub
    message (``PubsubMessage``)."""
    if (isinstance(element, (bytes, bytearray, OversizedPayload))
            or not hasattr(element, "attributes")):
        return element, None
    publish_time = getattr(element, "publish_time", None)
    if publish_time is not None and not isinstance(publish_time, dt.datetime):
        publish_time = publish_time.to_utc_datetime(has_tz=True)  # a Beam Timestamp
    lineage = Lineage(message_id=element.message_id, publish_time=publish_time,
                      attributes=tuple(sorted((element.attributes or {}).items())))
    return element.data if element.data is not None else b"", lineage


class _ParseFn(beam.DoFn):
    def __init__(self, max_payload_bytes: int, max_future_skew_s: float,
                 dead_letter_payload_bytes: int):
        self._max_payload_bytes = max_payload_bytes
        self._max_future_skew = dt.timedelta(seconds=max_future_skew_s)
        self._dl_bytes = dead_letter_payload_bytes

    def process(self, element) -> Iterator[Union[NewsEvent, pvalue.TaggedOutput]]:
        EVENTS_IN.inc()
        payload, lineage = split_message(element)
        try:
            event = parse_event(payload, max_payload_bytes=self._max_payload_bytes,
                                max_future_skew=self._max_future_skew)
            check_attributes(lineage, event)
            yield event if lineage is None else event.model_copy(update={"lineage": lineage})
        except ParseError as exc:
            if isinstance(payload, OversizedPayload):
                raw, size = payload.head, payload.size
            else:
                raw = (bytes(payload) if isinstance(payload, (bytes, bytearray))
                       else repr(payload).encode())
                size = len(raw)
            yield pvalue.TaggedOutput(DEAD_LETTER, DeadLetter(
                step=Step.PARSE, reason=exc.reason, detail=exc.detail,
                payload=truncate_payload(raw, self._dl_bytes), payload_bytes=size,
                event_id=exc.event_id, message_id=lineage.message_id if lineage else None,
                language=exc.language))


class ParseEvents(beam.PTransform):
    """bytes or PubsubMessage -> NewsEvent (main output) and DeadLetter (``dead_letter`` output)."""

    def __init__(self, *, max_payload_bytes: int = 1 << 20, max_future_skew_s: float = 86400,
                 dead_letter_payload_bytes: int = 4096):
        super().__init__()
        self._fn = _ParseFn(max_payload_bytes, max_future_skew_s, dead_letter_payload_bytes)

    def expand(self, payloads):
        return payloads | beam.ParDo(self._fn).with_outputs(DEAD_LETTER, main="events")

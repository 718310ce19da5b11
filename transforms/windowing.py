"""Event time and windows for streaming: NewsEvent (timestamped by Pub/Sub publish time) ->
NewsEvent in fixed event-time windows.

Event time is ``published_at``, falling back to the publish time (the timestamp ReadFromPubSub gives
each message). Late data is never dropped:
- an event whose ``published_at`` lies more than ``allowed_lateness_s`` before its publish time (an
  old article published now, a backfill) would land in a window already closed and be dropped by
  Beam, so it is windowed by its publish time instead, and counted (``late_reassigned``);
- an event within the allowed lateness whose window has already fired produces a late pane: its
  window fires again with the late events alone (discarding mode), and they are written as a file of
  their own.

The grouping that fires these windows (``GroupMicroBatches``) is the only step that checks lateness:
after it, the window travels as data in the global window, so no later step can drop what it
accepted. It keeps a window open for late panes ``GROUPING_GRACE_S`` longer than the allowed
lateness: an event's time is at most ``allowed_lateness_s`` before its publish time, but the
watermark may run ahead of that publish time while the message is on its way to the grouping.
"""
from __future__ import annotations

import datetime as dt

import apache_beam as beam
from apache_beam.transforms import trigger, window
from apache_beam.utils.timestamp import Duration, Timestamp

from transforms.metrics import LATE_REASSIGNED
from transforms.types import NewsEvent

_UNIX_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
GROUPING_GRACE_S = 3600


def _timestamp(instant: dt.datetime) -> Timestamp:
    # Aware datetimes subtract without a conversion to UTC, which overflows for valid RFC 3339
    # instants such as 0001-01-01T00:00:00+01:00 (year 0 in UTC).
    return Timestamp(micros=(instant - _UNIX_EPOCH) // dt.timedelta(microseconds=1))


def windowed_by_publish_time(event: NewsEvent, publish_time: Timestamp,
                             allowed_lateness_s: float) -> bool:
    """Whether ``published_at`` lies more than the allowed lateness before the publish time."""
    return (event.published_at is not None
            and (publish_time - _timestamp(event.published_at)
                 > Duration(seconds=allowed_lateness_s)))


def event_time(event: NewsEvent, publish_time: Timestamp, allowed_lateness_s: float) -> Timestamp:
    """``published_at`` when it is within the allowed lateness of the publish time, else the
    latter."""
    if event.published_at is None:
        return publish_time
    if windowed_by_publish_time(event, publish_time, allowed_lateness_s):
        LATE_REASSIGNED.inc()
        return publish_time
    return _timestamp(event.published_at)


class _AssignEventTimeFn(beam.DoFn):
    def __init__(self, allowed_lateness_s: float):
        self._lateness = allowed_lateness_s

    def process(self, event: NewsEvent, publish_time=beam.DoFn.TimestampParam):
        yield window.TimestampedValue(event, event_time(event, publish_time, self._lateness))


class AssignEventTime(beam.PTransform):
    """NewsEvent timestamped by publish time -> the same, timestamped by event time."""

    def __init__(self, allowed_lateness_s: float = 600):
        super().__init__()
        self._lateness = allowed_lateness_s

    def expand(self, events):
        return events | beam.ParDo(_AssignEventTimeFn(self._lateness))


class FixedEventTimeWindows(beam.PTransform):
    """Fixed windows (default 60 s) whose groupings fire every ``max_wait_s`` of processing time
    while the window is open (so a batch waits at most that long when traffic is light), when the
    watermark passes the window's end, then once per late element within ``allowed_lateness_s``
    (plus ``GROUPING_GRACE_S``). Panes discard what they fired, so each element goes downstream
    once."""

    def __init__(self, window_s: float = 60, allowed_lateness_s: float = 600,
                 max_wait_s: int | None = None):
        super().__init__()
        if window_s <= 0 or allowed_lateness_s < 0 or (max_wait_s is not None and max_wait_s <= 0):
            raise ValueError("window_s and max_wait_s must be > 0 and allowed_lateness_s >= 0")
        if max_wait_s is not None and max_wait_s != int(max_wait_s):
            raise ValueError("max_wait_s must be whole seconds (Beam's trigger keeps no fraction)")
        self._window_s, self._lateness = window_s, allowed_lateness_s
        # One trigger object for every application of this transform: Beam's AfterProcessingTime
        # has no __eq__, so two equal triggers built apart compare unequal, and Flatten warns "All
        # input pcollections must have the same window" about windowings that are the same.
        early = trigger.AfterProcessingTime(int(max_wait_s)) if max_wait_s else None
        self._trigger = trigger.AfterWatermark(early=early, late=trigger.AfterCount(1))

    def expand(self, pcoll):
        return pcoll | beam.WindowInto(
            window.FixedWindows(self._window_s),
            trigger=self._trigger,
            accumulation_mode=trigger.AccumulationMode.DISCARDING,
            allowed_lateness=Duration(seconds=self._lateness + GROUPING_GRACE_S))


class WindowByEventTime(beam.PTransform):
    """AssignEventTime, then FixedEventTimeWindows (``windows``: apply the same to what must be
    flattened with these events, such as their dead letters)."""

    def __init__(self, window_s: float = 60, allowed_lateness_s: float = 600,
                 max_wait_s: int | None = None):
        super().__init__()
        self._assign = AssignEventTime(allowed_lateness_s)
        self.windows = FixedEventTimeWindows(window_s, allowed_lateness_s, max_wait_s)

    def expand(self, events):
        return events | "AssignEventTime" >> self._assign | "FixedWindows" >> self.windows

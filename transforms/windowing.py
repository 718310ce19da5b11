"""Event time and windows for streaming: NewsEvent (timestamped by Pub/Sub publish time) -> NewsEvent
in fixed event-time windows.

Event time is ``published_at``, falling back to the publish time (the timestamp ReadFromPubSub gives
each message). Late data is never dropped:
- an event whose ``published_at`` lies more than ``allowed_lateness_s`` before its publish time (an
  old article published now, a backfill) would land in a window already closed and be dropped by
  Beam, so it is windowed by its publish time instead, and counted (``late_reassigned``);
- an event within the allowed lateness whose window has already fired produces a late pane: its
  window fires again with the late events alone (discarding mode), and they are written as a file of
  their own.
"""
from __future__ import annotations

import apache_beam as beam
from apache_beam.transforms import trigger, window
from apache_beam.utils.timestamp import Duration, Timestamp

from transforms.metrics import LATE_REASSIGNED
from transforms.schema import NewsEvent


def event_time(event: NewsEvent, publish_time: Timestamp, allowed_lateness_s: float) -> Timestamp:
    """``published_at`` when it is within the allowed lateness of the publish time, else the latter."""
    if event.published_at is None:
        return publish_time
    published = Timestamp.from_utc_datetime(event.published_at)
    if publish_time - published > Duration(seconds=allowed_lateness_s):
        LATE_REASSIGNED.inc()
        return publish_time
    return published


class _AssignEventTimeFn(beam.DoFn):
    def __init__(self, allowed_lateness_s: float):
        self._lateness = allowed_lateness_s

    def process(self, event: NewsEvent, publish_time=beam.DoFn.TimestampParam):
        yield window.TimestampedValue(event, event_time(event, publish_time, self._lateness))


class WindowByEventTime(beam.PTransform):
    """Fixed event-time windows (default 60 s) that fire when the watermark passes their end, then
    once per late event within ``allowed_lateness_s``."""

    def __init__(self, window_s: float = 60, allowed_lateness_s: float = 600):
        super().__init__()
        if window_s <= 0 or allowed_lateness_s < 0:
            raise ValueError("window_s must be > 0 and allowed_lateness_s >= 0")
        self._window_s, self._lateness = window_s, allowed_lateness_s

    def expand(self, events):
        return (events
                | "AssignEventTime" >> beam.ParDo(_AssignEventTimeFn(self._lateness))
                | "FixedWindows" >> beam.WindowInto(
                    window.FixedWindows(self._window_s),
                    trigger=trigger.AfterWatermark(late=trigger.AfterCount(1)),
                    accumulation_mode=trigger.AccumulationMode.DISCARDING,
                    allowed_lateness=Duration(seconds=self._lateness)))

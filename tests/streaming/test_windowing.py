"""Event time and windows (TestStream on the streaming local runner): published_at drives the
window, old articles fall back to publish time, and late data within the allowed lateness is a late
pane, never dropped."""
import datetime as dt

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import PaneInfoTiming

from transforms.types import NewsEvent
from transforms.windowing import WindowByEventTime, event_time

T0 = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc)
BASE = Timestamp.from_utc_datetime(T0)


def at(seconds: float) -> Timestamp:
    return BASE + seconds


def ev(event_id: str, published_s=None) -> NewsEvent:
    published = None if published_s is None else T0 + dt.timedelta(seconds=published_s)
    return NewsEvent(id=event_id, body="x", published_at=published)


def test_event_time_prefers_published_at_within_the_lateness():
    assert event_time(ev("a", published_s=5), at(70), allowed_lateness_s=600) == at(5)
    assert event_time(ev("a"), at(70), allowed_lateness_s=600) == at(70)
    assert event_time(ev("a", published_s=-10_000), at(70), allowed_lateness_s=600) == at(70)
    paris = dt.timezone(dt.timedelta(hours=1))
    offset = NewsEvent(id="a", body="x",
                       published_at=(T0 + dt.timedelta(seconds=5)).astimezone(paris))
    assert event_time(offset, at(70), allowed_lateness_s=600) == at(5)


class _WindowAndPane(beam.DoFn):
    def process(self, kv, win=beam.DoFn.WindowParam, pane=beam.DoFn.PaneInfoParam):
        yield (int((win.start - BASE).micros // 1_000_000), pane.timing, sorted(kv[1]))


def _late_stream():
    return (TestStream()
              .advance_watermark_to(at(0))
              .add_elements([TimestampedValue(ev("a"), at(10)),               # publish time 10
                             TimestampedValue(ev("b", published_s=5), at(70))])  # published at 5
              .advance_watermark_to(at(130))                   # [0, 60) and [60, 120) close
              .add_elements([TimestampedValue(ev("late", published_s=100), at(140)),  # late, kept
                             # reassigned:
                             TimestampedValue(ev("old", published_s=-10_000), at(150))])
              .advance_watermark_to_infinity())


def _panes(allowed_lateness_s: float, expected):
    with TestPipeline(runner="BundleBasedDirectRunner",
                      options=PipelineOptions(streaming=True)) as p:
        panes = (p | _late_stream()
                 | WindowByEventTime(window_s=60, allowed_lateness_s=allowed_lateness_s)
                 | beam.Map(lambda e: ("k", e.id))
                 | beam.GroupByKey()
                 | beam.ParDo(_WindowAndPane()))
        assert_that(panes, equal_to(expected))


def test_late_data_within_the_lateness_is_a_late_pane():
    _panes(600, [(0, PaneInfoTiming.ON_TIME, ["a", "b"]),
                 (60, PaneInfoTiming.LATE, ["late"]),     # its window had fired: fires again
                 (120, PaneInfoTiming.ON_TIME, ["old"])])  # too old: windowed by publish time


def test_with_no_lateness_late_data_is_windowed_by_publish_time_not_dropped():
    _panes(0, [(0, PaneInfoTiming.ON_TIME, ["a"]),         # b: published 65 s before publish
               (60, PaneInfoTiming.ON_TIME, ["b"]),
               (120, PaneInfoTiming.ON_TIME, ["late", "old"])])


def test_max_wait_fires_a_batch_before_the_window_closes():
    stream = (TestStream()
              .advance_watermark_to(at(0))
              .add_elements([TimestampedValue(ev("a"), at(10)), TimestampedValue(ev("b"), at(11))])
              .advance_processing_time(6)            # past max_wait: the waiting batch fires
              .add_elements([TimestampedValue(ev("c"), at(20))])
              .advance_watermark_to_infinity())
    with TestPipeline(runner="BundleBasedDirectRunner",
                      options=PipelineOptions(streaming=True)) as p:
        panes = (p | stream
                 | WindowByEventTime(window_s=60, allowed_lateness_s=600, max_wait_s=5)
                 | beam.Map(lambda e: ("k", e.id))
                 | beam.GroupByKey()
                 | beam.ParDo(_WindowAndPane()))
        assert_that(panes, equal_to([(0, PaneInfoTiming.EARLY, ["a", "b"]),
                                     (0, PaneInfoTiming.ON_TIME, ["c"])]))

"""Late data is never dropped silently: the whole streaming graph (embed_and_write_streaming, a FAKE
engine that takes its time, so that processing lags between steps) on a TestStream of Pub/Sub
messages at the edges of the allowed lateness; every message ends in the ledger, as a row in the
window docs/streaming.md's rule gives it.

Edges (window_s 60, allowed_lateness_s 600, and the grouping's GROUPING_GRACE_S beyond it):
- published_at exactly allowed_lateness_s before the publish time: its own event-time window;
  a microsecond older: its publish time's window (counted late_reassigned);
- a message whose window the watermark passed long ago, up to the end of the grace: a late pane;
- a burst of late messages while the watermark jumps to the end of time and the engine is slow.
Runner: BundleBasedDirectRunner, streaming.
"""
from __future__ import annotations

import collections
import datetime as dt
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Timestamp

from pipeline import graph, ledger
from pipeline.graph import embed_and_write_streaming
from tests.common import make_config
from tests.fakes import FakeEngine
from transforms.settings import StreamingSettings
from transforms.windowing import GROUPING_GRACE_S

WINDOW_S, LATENESS_S = 60, 600
T0 = Timestamp.from_utc_datetime(dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.timezone.utc))
RUN_ID = "20261201T120000Z-1a7e1a7e"


class SlowEngine(FakeEngine):
    """FAKE, and slow: 0.2 s per call, so the watermark moves on while documents are embedded."""

    def embed(self, prompts):
        time.sleep(0.2)
        return super().embed(prompts)


def rfc3339(t: Timestamp) -> str:
    return t.to_utc_datetime(has_tz=True).isoformat().replace("+00:00", "Z")


def message(event_id: str, publish: Timestamp, published_at: Timestamp | None = None):
    body = {"id": event_id, "body": f"Story {event_id}."}
    if published_at is not None:
        body["published_at"] = rfc3339(published_at)
    return TimestampedValue(PubsubMessage(json.dumps(body).encode(), {}, message_id=f"m-{event_id}",
                                          publish_time=publish), publish)


def window_of(t: Timestamp) -> str:
    start = Timestamp(micros=t.micros - t.micros % (WINDOW_S * 1_000_000))
    return rfc3339(start)


def run(stream: TestStream, out: Path) -> dict[str, str]:
    """Runs the graph; returns {event id: window start} of every row written."""
    config = make_config(output=str(out), streaming=StreamingSettings(
        window_s=WINDOW_S, allowed_lateness_s=LATENESS_S, max_wait_s=5, batch_shards=2))
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embed_and_write_streaming(p | stream, config, RUN_ID, engine_factory=SlowEngine)
    p.run().wait_until_finish()
    rows = {}
    for path in (out / "vectors").rglob("*.parquet"):
        start = path.name.split("-")[1]  # part-<window start>-<pane>-...
        for event_id in pq.read_table(path)["id"].to_pylist():
            assert event_id not in rows, f"{event_id} written twice"
            rows[event_id] = dt.datetime.strptime(start, "%Y%m%dT%H%M%SZ").replace(
                tzinfo=dt.timezone.utc).isoformat().replace("+00:00", "Z")
    return rows


@pytest.mark.parametrize("dedup_state", ["per_shard", "per_key"])
def test_every_message_at_the_edges_of_the_lateness_is_written_in_its_window(tmp_path, monkeypatch,
                                                                              dedup_state):
    # per_shard is this runner's dedup layout (transforms.dedup.state_layout_for); per_key, that of
    # Dataflow, runs here too so that the whole graph, late panes included, is checked with it.
    monkeypatch.setattr(graph, "state_layout_for", lambda runner: dedup_state)
    publish = T0 + 900
    edge = publish - LATENESS_S          # exactly the allowed lateness before its publish time
    past_edge = Timestamp(micros=edge.micros - 1)
    grace_end = T0 + WINDOW_S + LATENESS_S + GROUPING_GRACE_S  # window [T0, T0+60) expires here
    late = [message(f"burst-{i}", T0 + 1 + i) for i in range(12)]
    stream = (TestStream().advance_watermark_to(T0)
              .add_elements([message("on-time", T0 + 10)])
              .advance_watermark_to(publish - 1)
              .add_elements([message("at-edge", publish, published_at=edge),
                             message("past-edge", publish, published_at=past_edge)])
              .advance_processing_time(2)
              # The watermark is far past [T0, T0+60): late, but within the grouping's lateness.
              .advance_watermark_to(grace_end - 1)
              .add_elements([message("grace-edge", T0 + 30)])
              .advance_processing_time(2)
              .add_elements(late)
              .advance_watermark_to_infinity())
    rows = run(stream, tmp_path)
    expected = {"on-time": window_of(T0 + 10), "at-edge": window_of(edge),
                "past-edge": window_of(publish), "grace-edge": window_of(T0),
                **{m.value.message_id[2:]: window_of(T0) for m in late}}
    assert rows == expected
    report = ledger.check(str(tmp_path))
    assert report.ok, report.problems
    assert report.totals["messages_in"] == report.totals["rows_written"] == len(expected)
    assert report.totals["late_reassigned"] == 1, "past-edge went to its publish time's window"
    panes = collections.Counter(r.pane > 0 for r in _records(tmp_path))
    assert panes[True] >= 2, "the late messages came as late panes of their window"


def _records(out: Path):
    from transforms.types import LedgerRecord

    return [LedgerRecord.from_json(p.read_text()) for p in (out / "ledger").rglob("*.json")]

"""Streaming dedup on a TestStream: redeliveries within the horizon are dropped and counted, and a
key is forgotten once the watermark passes its horizon (the state is bounded).

Runner: BundleBasedDirectRunner, the local runner that executes TestStream with user state and
event-time timers. DirectRunner would pick it too for a TestStream, but only after a check for
Prism (a download, which fails offline); naming it skips that.
"""
import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.testing.util import assert_that, equal_to
from apache_beam.transforms.window import FixedWindows, TimestampedValue

from transforms.dedup import DropDuplicatesStreaming
from transforms.metrics import NAMESPACE
from transforms.schema import NewsEvent, PreparedDoc


def doc(id_: str, sha: str) -> PreparedDoc:
    return PreparedDoc(event=NewsEvent(id=id_, body="x"), text="x", text_sha256=sha,
                       token_ids=(101, 1, 102), truncated=False)


def stream(*steps) -> TestStream:
    """steps: a list of (doc, t_seconds) adds one bundle, processed in list order; a number
    advances the watermark to it. Ends with the watermark at infinity."""
    ts = TestStream()
    for step in steps:
        if isinstance(step, list):
            ts.add_elements([TimestampedValue(doc_, t) for doc_, t in step])
        else:
            ts.advance_watermark_to(step)
    return ts.advance_watermark_to_infinity()


def run_dedup(test_stream: TestStream, expected, windowed_s=None, **dedup_args):
    """Runs the stream (in fixed windows of windowed_s, if given) through DropDuplicatesStreaming,
    asserts the (id, text_sha256, timestamp) of the output, and returns the finished pipeline
    result (for its metrics)."""
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    docs = p | test_stream
    if windowed_s:
        docs = docs | beam.WindowInto(FixedWindows(windowed_s))
    out = (docs
           | DropDuplicatesStreaming(**dedup_args)
           | beam.Map(lambda d, t=beam.DoFn.TimestampParam: (d.event.id, d.text_sha256, float(t))))
    assert_that(out, equal_to(expected))
    result = p.run()
    result.wait_until_finish()
    return result


def duplicates_counted(result) -> int:
    """The duplicates counter as the job reports it. Beam 2.77's BundleBasedDirectRunner keeps
    only a step's FIRST bundle's metrics per executor thread (statesampler caches the scoped state,
    and with it the first bundle's MetricsContainer, by step name), so tests that read it feed
    the dedup step one bundle."""
    counters = result.metrics().query(
        MetricsFilter().with_namespace(NAMESPACE).with_name("duplicates"))["counters"]
    return sum(c.committed for c in counters)


def test_redeliveries_within_the_horizon_are_dropped_and_counted():
    result = run_dedup(
        stream([(doc("a", "copy0"), 0), (doc("b", "b"), 5), (doc("a", "copy1"), 10),
                (doc("a", "copy2"), 20)]),
        expected=[("a", "copy0", 0.0), ("b", "b", 5.0)])  # the first copy, its timestamp kept
    assert duplicates_counted(result) == 2


@pytest.mark.parametrize("horizon_s, expected", [
    (60, [("a", "first", 0.0), ("a", "again", 210.0)]),  # 0 + 60 < watermark 200: forgotten
    (300, [("a", "first", 0.0)]),                        # 0 + 300 > 210: still a duplicate
])
def test_a_key_is_forgotten_once_the_watermark_passes_its_horizon(horizon_s, expected):
    # This is the bounded-state test: nothing but the expiry timer clears "seen", so the second
    # "a" passes at horizon 60 only because the timer fired at t=60 and dropped the key's state;
    # the horizon-300 case is the same stream with the timer not yet due.
    run_dedup(stream([(doc("a", "first"), 0)], 200, [(doc("a", "again"), 210)]),
              expected=expected, horizon_s=horizon_s)


def test_windowed_input_is_deduplicated_across_windows():
    # The transform moves docs to the global window: per-window state would forget "a" at t=5.
    run_dedup(stream([(doc("a", "copy0"), 0)], [(doc("a", "copy1"), 10)]),
              expected=[("a", "copy0", 0.0)], windowed_s=5)


def test_text_hash_key_drops_the_same_text_under_another_id():
    result = run_dedup(
        stream([(doc("a", "same"), 0), (doc("b", "same"), 1), (doc("c", "other"), 2)]),
        expected=[("a", "same", 0.0), ("c", "other", 2.0)], key="text_sha256")
    assert duplicates_counted(result) == 1


def test_unknown_key_or_empty_horizon_fails_at_construction():
    with pytest.raises(ValueError, match="dedup key"):
        DropDuplicatesStreaming(key="url")
    with pytest.raises(ValueError, match="horizon_s"):
        DropDuplicatesStreaming(horizon_s=0)

"""Costs that must not grow with a streaming job's uptime, on the local streaming runner
(BundleBasedDirectRunner), which unpickles a fresh DoFn and calls its ``setup`` at every bundle's
start, and keeps a key's trigger state for every window it ever had. Figures:
``python -m benchmarks.uptime``."""
import datetime as dt
import json

import apache_beam as beam
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms.window import FixedWindows, TimestampedValue
from apache_beam.utils.timestamp import Timestamp

from pipeline.config import StreamingSettings
from pipeline.graph import embed_and_write_streaming
from tests.conftest import make_config
from tests.fakes import FakeEngine
from transforms import text
from transforms.schema import NewsEvent
from transforms.text import PrepareText

T0 = Timestamp.from_utc_datetime(dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc))


def test_the_tokenizer_is_built_once_per_process_whatever_the_runner_does(fp32_config,
                                                                        monkeypatch):
    built = []
    original = text.HeadTokenizer.__init__

    def counting_init(self, model):
        built.append(model)
        original(self, model)

    monkeypatch.setattr(text.HeadTokenizer, "__init__", counting_init)
    monkeypatch.setattr(text, "_TOOLS", {}, raising=False)  # as in a fresh process
    stream = TestStream()
    for i in range(6):  # six bundles, each a setup() on this runner
        stream = stream.add_elements([TimestampedValue(NewsEvent(id=f"a{i}", body="Story."), i)])
        stream = stream.advance_watermark_to(i + 1)
    p = beam.Pipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    docs = (p | stream.advance_watermark_to_infinity() | beam.WindowInto(FixedWindows(10))
            | PrepareText(fp32_config.model)).docs
    docs | beam.Map(lambda d: d.id)
    p.run().wait_until_finish()
    assert len(built) == 1, f"the tokenizer was built {len(built)} times for 6 bundles"


def _message(n: int, publish: Timestamp):
    data = json.dumps({"id": f"a-{n}", "body": f"Story number {n}."}).encode()
    return TimestampedValue(PubsubMessage(data, {}, message_id=f"m-{n}", publish_time=publish),
                            publish)


def test_each_grouping_key_holds_the_state_of_one_window(tmp_path):
    """The local runner copies a key's whole trigger state at each of its bundles and never drops
    a window's (Beam Python's trigger driver has no garbage collection after the allowed
    lateness): a key per shard alone held every window of the job, and each micro-batch cost more
    than the one before. The grouping key holds the window too. (Reads the runner's state
    through its private evaluation context: what is asserted is what the cost comes from.)"""
    windows = 12
    config = make_config(output=str(tmp_path / "out"), streaming=StreamingSettings(
        window_s=60, allowed_lateness_s=0, max_wait_s=5, batch_shards=1))
    stream = TestStream().advance_watermark_to(T0)
    for w in range(windows):
        start = T0 + 60 * w
        stream = stream.add_elements([_message(w * 2 + i, start + 10 + i) for i in range(2)])
        stream = stream.advance_watermark_to(start + 61)
    p = beam.Pipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embed_and_write_streaming(p | stream.advance_watermark_to_infinity(), config, "uptime",
                              engine_factory=FakeEngine)
    result = p.run()
    result.wait_until_finish()
    states = result._evaluation_context._transform_keyed_states  # pylint: disable=protected-access
    grouping = [keyed for transform, keyed in states.items()
                if transform.full_label.startswith("GroupMicroBatches/")
                and transform.full_label.endswith("GroupByWindow")]
    assert len(grouping) == 1 and grouping[0], "the micro-batch grouping's state was not found"
    windows_per_key = [len(state.state) for state in grouping[0].values()]
    assert max(windows_per_key) <= 1, windows_per_key
    assert len(grouping[0]) == windows  # one key per shard and window

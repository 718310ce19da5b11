"""Costs that must not grow with a streaming job's uptime, on the local streaming runner
(BundleBasedDirectRunner), which unpickles a fresh DoFn and calls its ``setup`` at every bundle's
start, and keeps a key's trigger state for every window it ever had. Figures:
``python -m benchmarks.uptime``."""
import datetime as dt
import json
import sys

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms.window import FixedWindows, TimestampedValue
from apache_beam.utils.timestamp import Timestamp

from pipeline.graph import embed_and_write_streaming
from tests.common import make_config
from tests.fakes import FakeEngine
from transforms import text
from transforms.engines import base as engines
from transforms.engines.base import FreedMemory
from transforms.engines.registry import load_engine
from transforms.settings import StreamingSettings
from transforms.text import PrepareText
from transforms.types import NewsEvent

T0 = Timestamp.from_utc_datetime(dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc))


def test_the_tokenizer_is_built_once_per_process_whatever_the_runner_does(fp32_config,
                                                                        monkeypatch):
    built = []
    original = text.HeadTokenizer.__init__

    def counting_init(self, model):
        built.append(model)
        original(self, model)

    monkeypatch.setattr(text.HeadTokenizer, "__init__", counting_init)
    monkeypatch.setattr(text.prepare, "_TOOLS", {}, raising=False)  # as in a fresh process
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


def test_freed_memory_is_given_back_at_most_once_per_interval():
    """The engine gives freed memory back after a call once ``every_s`` has passed since it last
    did, not after every call (the trim's page faults would slow every call)."""
    now, trims = [100.0], []
    freed = FreedMemory(every_s=10, trim=lambda: trims.append(now[0]), clock=lambda: now[0])
    for t in (100.0, 105.0, 109.9, 110.0, 111.0, 119.0, 125.0):
        now[0] = t
        freed.after_call()
    assert trims == [110.0, 125.0]


def test_the_real_engine_gives_freed_memory_back_after_its_calls(fp32_config, tokenizer,
                                                                 monkeypatch):
    trims = []
    monkeypatch.setattr(engines, "FREED_MEMORY",
                        FreedMemory(every_s=0, trim=lambda: trims.append(1)))
    engine = load_engine(fp32_config.model)
    engine.embed([tokenizer("One story.")[0], tokenizer("Another, longer story.")[0]])
    assert trims, "a call of the real engine did not give its freed memory back"


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_trim_gives_the_heap_s_free_pages_back_to_the_system():
    """What the engine's calls leave behind, in small: freed blocks in the middle of the heap
    (a block still in use above them) stay resident until they are trimmed."""
    blocks = [np.ones(64 * 1024 // 8) for _ in range(4000)]  # 256 MiB of heap blocks
    kept = blocks[-1]
    del blocks
    held = _rss_mib()
    FreedMemory(every_s=0).after_call()
    assert _rss_mib() < held - 128, f"RSS {held:.0f} MiB before the trim, {_rss_mib():.0f} after"
    assert kept.sum() == len(kept)


def _record_in_a_spawned_process() -> None:
    from tools import engine_calls

    engine_calls.record([[101, 7, 102], [101, 102]])


def test_the_streaming_benchmark_sees_the_calls_of_an_engine_in_another_process(tmp_path,
                                                                                monkeypatch):
    """With ``model.share_across_processes`` the engine runs in a spawned process: what it records
    must reach the benchmark's process (module lists did not, and the benchmark crashed)."""
    import multiprocessing

    from tools import engine_calls

    calls = tmp_path / "calls.txt"
    calls.touch()
    monkeypatch.setenv(engine_calls.CALLS_ENV, str(calls))  # the spawned process inherits it
    process = multiprocessing.get_context("spawn").Process(target=_record_in_a_spawned_process)
    process.start()
    process.join(120)
    assert process.exitcode == 0
    assert engine_calls.calls(calls) == ([2], [5])

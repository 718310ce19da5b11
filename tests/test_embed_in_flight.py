"""Streaming keeps an engine call in flight (transforms.embed._EmbedInFlightFn): the step hands a
micro-batch to the engine and the runner goes on, so the next micro-batch reaches the engine while
the first is still being embedded. A step that waited for each call in its bundle (RunInference, as
before) would never send the second while the first is computing. The engine is a FAKE that
blocks its first call until a second micro-batch is in flight; figures with a MODELED engine:
``python -m benchmarks.duty``."""
import threading
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from tests.conftest import make_config
from tests.fakes import FakeEngine
from transforms import embed
from transforms.embed import EmbedMicroBatches
from transforms.schema import MicroBatch, NewsEvent, PreparedDoc

_SEEN_TWO_IN_FLIGHT = threading.Event()
_EMBEDDED: list = []  # what came out (the runner runs in this process)


def _record(batch: MicroBatch) -> None:
    _EMBEDDED.append((batch.shard, [row.id for row in batch.rows]))


class WaitsForASecondCall(FakeEngine):
    """FAKE engine: its first call returns only once two micro-batches are in flight (or fails
    after 20 s)."""

    def embed(self, prompts):
        if not self.calls:
            deadline = time.monotonic() + 20
            while len(getattr(embed, "_IN_FLIGHT", ())) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError("the second micro-batch never reached the engine while "
                                       "the first was being embedded")
                time.sleep(0.01)
            _SEEN_TWO_IN_FLIGHT.set()
        return super().embed(prompts)


def _batch(shard: int) -> MicroBatch:
    doc = PreparedDoc(event=NewsEvent(id=f"d{shard}", body="Story."), text="Story.",
                      text_sha256=f"{shard:064x}", token_ids=(101, 7 + shard, 102),
                      truncated=False)
    return MicroBatch(window_start_us=0, window_end_us=60_000_000, pane=0, shard=shard, shards=2,
                      docs=(doc,), messages_in=1)


def test_the_next_micro_batch_reaches_the_engine_while_one_is_embedded():
    config = make_config()
    p = beam.Pipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embedded = (p | beam.Create([_batch(0), _batch(1)])
                | EmbedMicroBatches(config.model, engine_factory=WaitsForASecondCall))
    embedded | beam.Map(_record)
    p.run().wait_until_finish()
    assert _SEEN_TWO_IN_FLIGHT.is_set()
    assert sorted(_EMBEDDED) == [(0, ["d0"]), (1, ["d1"])]

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

from tests.common import make_config
from tests.fakes import FakeEngine
from transforms import embed
from transforms.embed import EmbedStreaming
from transforms.types import MicroBatch, NewsEvent, PreparedDoc

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
                | EmbedStreaming(config.model, engine_factory=WaitsForASecondCall))
    embedded | beam.Map(_record)
    p.run().wait_until_finish()
    assert _SEEN_TWO_IN_FLIGHT.is_set()
    assert sorted(_EMBEDDED) == [(0, ["d0"]), (1, ["d1"])]


class _Bag:
    def __init__(self):
        self.items: list = []

    def add(self, item):
        self.items.append(item)

    def read(self):
        return list(self.items)

    def clear(self):
        self.items = []


class _Timer:
    def __init__(self):
        self.at = None

    def set(self, timestamp):
        self.at = timestamp

    def clear(self):
        self.at = None


def test_a_timer_in_another_process_starts_no_call_and_the_done_timer_embeds_once(monkeypatch):
    """Dataflow runs a key's work items in any SDK process of the worker: the POLL of a process
    that has no call for a micro-batch must not start one (each would embed it again), and the
    DONE timer embeds it there, once. Two processes are two ``_IN_FLIGHT`` tables here."""
    config = make_config()
    step = EmbedStreaming(config.model, engine_factory=FakeEngine)
    fn = step._fn  # pylint: disable=protected-access
    fn.setup()
    pending, ids, poll, done = _Bag(), _Bag(), _Timer(), _Timer()
    first_process: dict = {}
    monkeypatch.setattr(embed, "_IN_FLIGHT", first_process)
    fn.process((0, _batch(0)), pending, ids, poll, done)
    assert len(first_process) == 1 and poll.at is not None and done.at is not None
    first_process[next(iter(first_process))].future.result(timeout=20)

    other_process: dict = {}
    monkeypatch.setattr(embed, "_IN_FLIGHT", other_process)
    poll.clear()
    assert list(fn.emit_done(pending, ids, poll, done)) == []
    assert other_process == {}, "a POLL started a call of its own"
    assert poll.at is not None, "the POLL stopped looking"
    assert len(pending.read()) == 1

    out = list(fn.emit_all(pending, ids, poll))
    assert [[row.id for row in b.value.rows] for b in out] == [["d0"]]
    assert pending.read() == [] and ids.read() == [] and poll.at is None
    assert other_process == {}, "the DONE timer left its call behind"

    monkeypatch.setattr(embed, "_IN_FLIGHT", first_process)
    pending.add(_batch(1))  # the first process collects its own finished call at its next POLL
    ids.add(((0, 0, 1), 59_999_999))
    fn.process((1, _batch(1)), _Bag(), _Bag(), _Timer(), _Timer())
    call = first_process[(fn._step, (0, 0, 1))]  # pylint: disable=protected-access
    call.future.result(timeout=20)
    out = list(fn.emit_done(pending, ids, poll, done))
    assert [[row.id for row in b.value.rows] for b in out] == [["d1"]]
    assert (fn._step, (0, 0, 1)) not in first_process  # pylint: disable=protected-access

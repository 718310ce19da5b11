"""One poison message of each kind never stops a streaming job with the store on.

Before, each of these passed parse and embedding and then failed the store load with a
``DataError`` for ever: a NUL in ``id``, ``url``, ``source``, ``language`` or a Pub/Sub attribute
(PostgreSQL text and jsonb cannot hold NUL), a ``published_at`` whose UTC instant is year 0 (no
reader converts it back), a non-finite vector (pgvector refuses NaN). Streaming retried the
micro-batch without end (locally: the bundle failed 4 times and the pipeline with it), so the
window never closed. Now each is a dead letter that names the field, before the store; the job
completes, and ``newsvec ledger --store`` balances.

TestStream through the whole streaming graph (``embed_and_write_streaming``) on
BundleBasedDirectRunner, the session's PostgreSQL, and a FAKE engine (the point here is what the
graph does with a poison message, not the model) that returns a NaN vector for one marker word.
"""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Timestamp

from pipeline import ledger
from pipeline.graph import embed_and_write_streaming
from tests.adversarial import NOW, ev
from tests.common import make_config
from tests.fakes import FakeEngine
from transforms.settings import StreamingSettings

RUN_ID = "20261201T000000Z-00c0ffee"
T0 = Timestamp.from_utc_datetime(NOW.replace(second=0))
MARKER = "zebra"  # the NaN engine's marker word: one token of the model's vocabulary
GOOD = {"title": "Markets", "body": "Shares rose on Tuesday.", "url": "https://x.example/a",
        "source": "wire", "language": "en", "published_at": "2026-11-30T09:15:00Z"}

# name: (payload fields, attributes, expected reason, what the detail starts with or holds)
POISONS = {
    "id": ({"id": "p-id\u0000"}, {}, "invalid_id", "id: "),
    "url": ({"url": "https://x.example/\u0000"}, {}, "invalid_field", "url: "),
    "source": ({"source": "wire\u0000"}, {}, "invalid_field", "source: "),
    "language": ({"language": "en\u0000"}, {}, "invalid_field", "language: "),
    "attribute value": ({}, {"origin": "wi\u0000re"}, "invalid_field",
                        "pubsub attribute 'origin'"),
    "attribute key": ({}, {"ori\u0000gin": "wire"}, "invalid_field", "pubsub attribute 'ori"),
    "year 0": ({"published_at": "0001-01-01T00:00:00+00:01"}, {}, "invalid_field",
               "published_at: "),
    "non-finite vector": ({"body": f"A {MARKER} in the text."}, {}, "embedding_failed", ""),
}
GOOD_IDS = [f"good-{i}" for i in range(6)]


class NonFiniteFakeEngine(FakeEngine):
    """FAKE: FakeEngine's vectors, but NaN for a prompt holding the marker token (as a broken
    kernel or a bad fine-tune can give for some inputs)."""

    marker_id: int = -1

    def embed(self, prompts):
        out = super().embed(prompts)
        return [np.full_like(v, np.nan) if self.marker_id in p else v
                for p, v in zip(prompts, out, strict=True)]


def messages() -> list[TimestampedValue]:
    out = []
    for i, (name, (fields, attributes, _, _)) in enumerate(POISONS.items()):
        payload = ev(**{**GOOD, "id": f"p-{i}", **fields})
        out.append((f"poison-{name}", payload, attributes))
    out += [(f"m-{doc_id}", ev(**{**GOOD, "id": doc_id, "body": f"Story {doc_id} of the day."}),
             {"origin": "wire"}) for doc_id in GOOD_IDS]
    return [TimestampedValue(PubsubMessage(payload, attributes, message_id=message_id,
                                           publish_time=T0 + 5 + i), T0 + 5 + i)
            for i, (message_id, payload, attributes) in enumerate(out)]


@pytest.fixture
def poisoned_run(tmp_path, store_settings, tokenizer):
    ids, _ = tokenizer(MARKER)
    assert len(ids) == 3, "the marker is one token"
    NonFiniteFakeEngine.marker_id = ids[1]
    out = tmp_path / "out"
    config = make_config(output=str(out), store=store_settings, streaming=StreamingSettings(
        window_s=60, allowed_lateness_s=600, max_wait_s=5, batch_shards=2))
    stream = (TestStream().advance_watermark_to(T0 - 60).add_elements(messages())
              .advance_watermark_to_infinity())
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embed_and_write_streaming(p | stream, config, RUN_ID, engine_factory=NonFiniteFakeEngine)
    p.run().wait_until_finish()  # before: failed after 4 attempts of the micro-batch's bundle
    return out


def test_one_poison_message_of_each_kind_never_stops_a_streaming_job_with_the_store_on(
        poisoned_run, store_settings):
    out = poisoned_run
    letters = {d["message_id"]: d for path in sorted(out.glob("dead_letter/**/*.jsonl"))
               for d in map(json.loads, path.read_bytes().splitlines())}
    for name, (_, _, reason, detail) in POISONS.items():
        letter = letters.get(f"poison-{name}")
        assert letter is not None, f"{name}: no dead letter"
        assert letter["reason"] == reason, (name, letter)
        assert detail in letter["detail"] and (
            not detail.endswith(": ") or letter["detail"].startswith(detail)), (name, letter)
    rows = pq.read_table(sorted(out.glob("vectors/**/*.parquet")))
    assert sorted(rows["id"].to_pylist()) == GOOD_IDS
    assert np.isfinite(np.stack(rows["embedding"].to_numpy(zero_copy_only=False))).all()
    report = ledger.check(str(out), store=store_settings)
    assert report.ok, report.problems
    totals = report.totals
    assert (totals["messages_in"], totals["rows_written"], totals["dead_lettered"]) == (
        len(POISONS) + len(GOOD_IDS), len(GOOD_IDS), len(POISONS))
    assert totals["store_articles"] == len(GOOD_IDS)

"""The streaming pipeline end to end: Google's Pub/Sub emulator -> newsvec (BundleBasedDirectRunner,
real vLLM at float32) -> per-window Parquet on gcp-storage-emulator. Every published message must be
accounted for: rows + dead letters + duplicates = published + redelivered, in the files and in the
ledger that ``python -m pipeline.ledger`` checks.

Messages of 2 MB, 5 MB and 9.9 MB (Pub/Sub takes up to 10 MB) are published among the others: each
becomes a ``payload_too_large`` dead letter, and holds up no other message.

Redelivery is real: the acks of some messages' first delivery are dropped on their way to the
emulator (as when a worker's ack is lost or late), so the emulator delivers them again once the
subscription's 10 s ack deadline expires."""
import io
import json
import re
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import ledger
from tests.common import SAMPLE_EVENTS, make_config
from tests.emulators import gcs_emulator, pubsub_emulator
from tools.emulators import local_streaming_job
from tools.publish import publish_file
from transforms.output.parquet import vector_schema
from transforms.text import compose_text
from transforms.types import NewsEvent

PROJECT, BUCKET = "newsvec-test", "newsvec-stream"
TOPIC, SUBSCRIPTION = f"projects/{PROJECT}/topics/news", f"projects/{PROJECT}/subscriptions/news"
SAFE_NAME = re.compile(r"^part-[A-Za-z0-9._-]+\.(parquet|jsonl|json)$")
PARTITION = re.compile(r"^(vectors|dead_letter|ledger)/dt=\d{4}-\d{2}-\d{2}/hour=\d{2}/[^/]+$")


@pytest.fixture(scope="module")
def emulators(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    logs = tmp_path_factory.mktemp("emulator-logs")
    with pubsub_emulator(PROJECT, logs) as pubsub_host, gcs_emulator(BUCKET, logs) as gcs:
        mp.setenv("PUBSUB_EMULATOR_HOST", pubsub_host)
        mp.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
        mp.setenv("NO_GCE_CHECK", "true")
        import google.auth
        from google.auth.credentials import AnonymousCredentials

        mp.setattr(google.auth, "default", lambda *a, **k: (AnonymousCredentials(), PROJECT))
        from google.cloud import pubsub_v1

        pubsub_v1.PublisherClient().create_topic(name=TOPIC)
        pubsub_v1.SubscriberClient().create_subscription(
            name=SUBSCRIPTION, topic=TOPIC, ack_deadline_seconds=ACK_DEADLINE_S)
        yield mp
    mp.undo()


ACK_DEADLINE_S = 10  # the emulator's minimum


class LoseFirstAcks:
    """Wraps the runner's SubscriberClient (in this process): the ack of the first delivery of each
    message whose event id is in ``ids`` never reaches the emulator, which redelivers it after the
    ack deadline. Records every delivery's (message id, event id)."""

    def __init__(self, ids: set[str]):
        self.ids, self.deliveries, self._lost_ack_ids = ids, [], set()
        self._lock = threading.Lock()

    def install(self, mp):
        from google.cloud import pubsub_v1

        pull, acknowledge = pubsub_v1.SubscriberClient.pull, pubsub_v1.SubscriberClient.acknowledge
        wrapper = self

        def lossy_pull(client, *args, **kwargs):
            response = pull(client, *args, **kwargs)
            with wrapper._lock:
                for received in response.received_messages:
                    event_id = _event_id(received.message.data)
                    first = all(m != received.message.message_id for m, _ in wrapper.deliveries)
                    wrapper.deliveries.append((received.message.message_id, event_id))
                    if first and event_id in wrapper.ids:
                        wrapper._lost_ack_ids.add(received.ack_id)
            return response

        def lossy_acknowledge(client, *args, ack_ids=(), **kwargs):
            kept = [a for a in ack_ids if a not in wrapper._lost_ack_ids]
            return acknowledge(client, *args, ack_ids=kept, **kwargs) if kept else None

        mp.setattr(pubsub_v1.SubscriberClient, "pull", lossy_pull)
        mp.setattr(pubsub_v1.SubscriberClient, "acknowledge", lossy_acknowledge)

    def redelivered(self) -> list[str]:
        """Event ids of the messages delivered more than once."""
        with self._lock:
            seen, again = set(), []
            for message_id, event_id in self.deliveries:
                if message_id in seen:
                    again.append(event_id)
                seen.add(message_id)
            return again


def _event_id(data: bytes):
    try:
        return json.loads(data).get("id")
    except (ValueError, AttributeError):
        return None


def _outputs(prefix: str):
    from google.cloud import storage

    client = storage.Client.create_anonymous_client()
    blobs = [b for b in client.list_blobs(BUCKET, prefix=prefix + "/")]
    rows = [pq.read_table(io.BytesIO(b.download_as_bytes())) for b in blobs
            if b.name.endswith(".parquet") and "/vectors/" in b.name]
    letters = [json.loads(line) for b in blobs if b.name.endswith(".jsonl")
               for line in b.download_as_text().splitlines()]
    return blobs, rows, letters


def test_every_published_message_is_accounted_for(emulators, tmp_path):
    lines = SAMPLE_EVENTS.read_bytes().splitlines()
    extra = tmp_path / "extra.jsonl"
    oversized = json.dumps({"id": "huge-1", "body": "x" * 200_000}).encode()
    big = [json.dumps({"id": f"big-{n}", "body": "y" * n}).encode()
           for n in (2_000_000, 5_000_000, 9_900_000)]
    # A redelivered/republished article (same id as line 1), a message over the size limit, then
    # messages past gRPC's default 4 MiB, each followed by an article that must not be held up.
    after = [json.dumps({"id": f"after-big-{i}", "title": f"Published after big message {i}",
                         "body": "The market rallied on news of the deal."}).encode()
             for i in range(3)]
    extra.write_bytes(b"\n".join([lines[0], oversized, big[0], after[0], big[1], after[1], big[2],
                                  after[2]]) + b"\n")
    published_dups = 2  # line 46 of the sample repeats line 1; extra line 1 repeats it again
    lose_acks = LoseFirstAcks({json.loads(lines[i])["id"] for i in (2, 3, 4)})
    lose_acks.install(emulators)
    config = make_config(output=f"gs://{BUCKET}/stream")
    config = config.model_copy(update={
        "parse": config.parse.model_copy(update={"max_payload_bytes": 100_000}),
        "streaming": config.streaming.model_copy(update={
            "subscription": SUBSCRIPTION, "window_s": 10, "max_wait_s": 2, "batch_shards": 1})})
    with local_streaming_job(config, TOPIC):
        sent = publish_file(TOPIC, SAMPLE_EVENTS, rate=50)["published"]
        sent += publish_file(TOPIC, extra, rate=50)["published"]
        assert sent == len(lines) + 8
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            blobs, rows, letters = _outputs("stream")
            if (sum(t.num_rows for t in rows) + len(letters) + published_dups >= sent
                    and len(lose_acks.redelivered()) >= len(lose_acks.ids)):
                break
            time.sleep(2)
        # A redelivered copy that escaped dedup would show up as a second row once its window
        # fires (at most max_wait_s after it arrives): give it time to.
        time.sleep(config.streaming.max_wait_s + 3)

    blobs, rows, letters = _outputs("stream")
    table = pa.concat_tables(rows)
    redelivered = lose_acks.redelivered()
    assert sorted(redelivered) == sorted(lose_acks.ids), "the lost acks made the emulator redeliver"
    # Each redelivery is one more message in and one more duplicate dropped: they cancel out.
    assert table.num_rows + len(letters) + published_dups == sent
    ids = table["id"].to_pylist()
    assert len(ids) == len(set(ids)) == 43, "each valid article exactly once"
    assert {f"after-big-{i}" for i in range(3)} <= set(ids), "no article held up by a big one"
    assert lose_acks.ids <= set(ids), "a redelivered article is written, once"
    reasons = sorted(d["reason"] for d in letters)
    assert reasons.count("payload_too_large") == 4 and len(reasons) == 17
    assert reasons.count("unreadable_for_model") == 6, "the sample's Japanese, English model"
    assert {d["payload_bytes"] for d in letters if d["event_id"] is None
            and d["reason"] == "payload_too_large"} >= {len(b) for b in big}
    # The ledger the job wrote balances, window by window, and names every file.
    report = ledger.check(f"gs://{BUCKET}/stream")
    assert report.ok, report.problems
    assert report.totals["messages_in"] == sent + len(redelivered)
    assert (report.totals["rows_written"], report.totals["dead_lettered"],
            report.totals["duplicates"]) == (43, 17, published_dups + len(redelivered))
    assert all(d["message_id"] for d in letters), "dead letters keep the message id"
    assert table.schema.equals(vector_schema(384))
    assert all(table["pubsub_message_id"].to_pylist())
    for blob in blobs:
        relative = blob.name[len("stream/"):]
        if relative.startswith(("vectors/", "dead_letter/", "ledger/")):
            assert PARTITION.match(relative), relative
            assert SAFE_NAME.match(relative.rsplit("/", 1)[1]), relative

    from sentence_transformers import SentenceTransformer

    from transforms.engines.model import resolve_model_path

    events = {}
    for line in lines + after:
        try:
            raw = json.loads(line)
            events.setdefault(raw["id"], raw)
        except (ValueError, KeyError, TypeError):
            continue
    texts = [compose_text(NewsEvent(id=i, title=events[i].get("title"), body=events[i].get("body")))
             for i in ids]
    model = SentenceTransformer(resolve_model_path(config.model.path), device="cpu")
    expected = model.encode(texts, normalize_embeddings=True)
    got = table["embedding"].combine_chunks().flatten().to_numpy().reshape(-1, 384)
    assert (got * expected).sum(axis=1).min() >= 0.9999

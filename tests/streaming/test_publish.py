"""The publisher (pipeline/publish.py): pacing against a fake client, and the real client against
Google's Pub/Sub emulator started by the test on loopback."""
import collections
import concurrent.futures
import datetime as dt
import json
import subprocess
import threading
import time
import weakref

import pytest

from tests.emulators import pubsub_emulator
from tools.publish import SENT_AT, main, publish_file

PROJECT = "newsvec-test"
VALID = [json.dumps({"id": f"ev-{i}", "title": f"title {i}", "body": "body"}).encode()
         for i in range(5)]
TRUNCATED = b'{"id": "ev-cut", "title": "cut he'
NOT_UTF8 = b"\xff\xfe"
EXPECTED = VALID + [TRUNCATED, NOT_UTF8]  # what must arrive: every line but the blank one


def write_jsonl(path, lines):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def parse_sent_at(value: str) -> dt.datetime:
    assert value.endswith("Z") and len(value) == len("2026-12-01T07:44:22.123Z"), value
    return dt.datetime.fromisoformat(value)


class FakePublisher:
    """Records what was published and when; every publish has already succeeded (or failed with
    ``error``)."""

    def __init__(self, error: Exception = None):
        self.calls = []  # (time.monotonic(), topic, data, attributes)
        self.error = error

    def publish(self, topic, data, **attributes):
        self.calls.append((time.monotonic(), topic, data, attributes))
        future = concurrent.futures.Future()
        if self.error:
            future.set_exception(self.error)
        else:
            future.set_result(str(len(self.calls)))
        return future

    def stop(self):
        pass


def test_pacing_holds_the_target_rate(tmp_path):
    path = write_jsonl(tmp_path / "events.jsonl", [b'{"id": "%d"}' % i for i in range(50)])
    fake = FakePublisher()
    summary = publish_file("projects/p/topics/t", path, rate=100, publisher=fake)
    assert len(fake.calls) == 50 and summary["published"] == 50 and summary["failed"] == 0
    assert 0.4 <= summary["seconds"] <= 1.5, summary
    assert 0.4 <= fake.calls[-1][0] - fake.calls[0][0] <= 1.5


def test_limit_repeat_and_attributes_without_a_client(tmp_path):
    path = write_jsonl(tmp_path / "events.jsonl", [b"a", b"", b"b", b"c"])
    fake = FakePublisher()
    summary = publish_file("projects/p/topics/t", path, rate=0, limit=7, repeat=3,
                           attributes={"run": "unit"}, publisher=fake)
    assert [c[2] for c in fake.calls] == [b"a", b"b", b"c", b"a", b"b", b"c", b"a"]
    assert summary["published"] == 7
    for _, _, _, attributes in fake.calls:
        assert attributes["run"] == "unit"
        parse_sent_at(attributes[SENT_AT])


def test_failed_publishes_are_counted_and_main_exits_non_zero(tmp_path, monkeypatch, capsys):
    from google.cloud import pubsub_v1

    path = write_jsonl(tmp_path / "events.jsonl", VALID)
    monkeypatch.setattr(pubsub_v1, "PublisherClient",
                        lambda: FakePublisher(error=RuntimeError("publish refused")))
    assert main(["--topic", "projects/p/topics/t", "--file", str(path), "--rate", "0"]) == 1
    summary = json.loads(capsys.readouterr().out)
    assert summary["published"] == 0 and summary["failed"] == 5


class SlowFakePublisher:
    """A FAKE client whose publishes complete at the next call (the last one 0.2 s after it is
    made, on another thread), every third one failing. Through weak references it records how many
    completed futures the caller still holds at each call."""

    def __init__(self, total: int):
        self.total, self.issued, self.completed_alive = total, [], []

    def publish(self, topic, data, **attributes):
        if self.issued:
            self._complete(self.issued[-1]())
        # the future completed just now is still the caller's loop variable: count the others
        self.completed_alive.append(sum(ref() is not None for ref in self.issued[:-1]))
        future = concurrent.futures.Future()
        self.issued.append(weakref.ref(future))
        if len(self.issued) == self.total:
            threading.Timer(0.2, self._complete, [future]).start()
        return future

    def _complete(self, future):
        if len(self.issued) % 3 == 0:
            future.set_exception(RuntimeError("publish failed late"))
        else:
            future.set_result("id")

    def stop(self):
        pass


def test_completed_publishes_are_released_and_late_failures_counted(tmp_path):
    """A soak publishes for hours: holding every future to the end grew the harness's memory by
    about 10 KiB a message (20,000 BBC articles through the emulator: RSS 356 -> 557 MiB)."""
    path = write_jsonl(tmp_path / "events.jsonl", [b'{"id": "%d"}' % i for i in range(300)])
    fake = SlowFakePublisher(total=300)
    summary = publish_file("projects/p/topics/t", path, rate=0, publisher=fake)
    assert len(fake.completed_alive) == 300 and max(fake.completed_alive) == 0, \
        "completed publish futures were kept"
    assert summary == {**summary, "published": 200, "failed": 100}


@pytest.fixture(scope="module")
def pubsub(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    with pubsub_emulator(PROJECT, tmp_path_factory.mktemp("pubsub-log")) as host:
        mp.setenv("PUBSUB_EMULATOR_HOST", host)
        yield host
    mp.undo()
    port = host.rsplit(":", 1)[1]
    ours = {f"--port={port}", f"--host-port={host}"}  # the java emulator's, gcloud's
    left = [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True,
                                            text=True, check=True).stdout.splitlines()
            if ours & set(line.split())]
    assert not left, f"emulator processes left behind: {left}"


def create_topic_and_subscription(name: str) -> tuple[str, str]:
    from google.cloud import pubsub_v1

    topic = f"projects/{PROJECT}/topics/{name}"
    subscription = f"projects/{PROJECT}/subscriptions/{name}-sub"
    publisher = pubsub_v1.PublisherClient()
    publisher.create_topic(name=topic)
    with pubsub_v1.SubscriberClient() as subscriber:
        subscriber.create_subscription(name=subscription, topic=topic)
    return topic, subscription


def pull_all(subscription: str, expected: int, deadline_s: float = 30) -> list:
    """Pull synchronously (and ack) until ``expected`` messages arrived or the deadline passed."""
    from google.cloud import pubsub_v1

    messages = []
    deadline = time.monotonic() + deadline_s
    with pubsub_v1.SubscriberClient() as subscriber:
        while len(messages) < expected and time.monotonic() < deadline:
            response = subscriber.pull(
                request={"subscription": subscription, "max_messages": 100}, timeout=5)
            if response.received_messages:
                subscriber.acknowledge(request={"subscription": subscription, "ack_ids": [
                    m.ack_id for m in response.received_messages]})
            messages += [m.message for m in response.received_messages]
    return messages


def test_lines_arrive_as_sent_bytes_with_attributes(pubsub, tmp_path):
    topic, subscription = create_topic_and_subscription("raw-lines")
    lines = VALID[:3] + [TRUNCATED, b"", NOT_UTF8] + VALID[3:]
    path = write_jsonl(tmp_path / "events.jsonl", lines)
    before = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)

    summary = publish_file(topic, path, rate=200, attributes={"run": "emulator-test"})
    assert summary["published"] == 7 and summary["failed"] == 0, summary

    messages = pull_all(subscription, expected=7)
    assert collections.Counter(m.data for m in messages) == collections.Counter(EXPECTED)
    for message in messages:
        assert message.attributes["run"] == "emulator-test"
        sent_at = parse_sent_at(message.attributes[SENT_AT])
        assert before <= sent_at <= dt.datetime.now(dt.timezone.utc)


def test_main_creates_the_topic_and_prints_a_summary(pubsub, tmp_path, capsys):
    path = write_jsonl(tmp_path / "events.jsonl", EXPECTED + [b""])
    topic = f"projects/{PROJECT}/topics/from-main"
    argv = ["--topic", topic, "--file", str(path), "--rate", "0", "--create-topic",
            "--attribute", "run=cli"]
    assert main(argv) == 0
    assert main(argv) == 0, "an existing topic is fine with --create-topic"
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2, printed
    for line in printed:
        summary = json.loads(line)
        assert summary["published"] == 7 and summary["failed"] == 0
        assert set(summary) == {"published", "failed", "seconds", "rate"}

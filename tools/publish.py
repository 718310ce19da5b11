"""Publish a JSON Lines file to Pub/Sub at a steady rate: for streaming demos, tests, benchmarks.

``python -m tools.publish --topic projects/P/topics/T --file events.jsonl [--rate 50] [--limit N]
[--repeat K] [--create-topic] [--attribute key=value ...]``

Lines go out as raw bytes, never decoded or validated: malformed lines are exactly what the pipeline
must dead-letter, so they are sent as they are. Only blank lines are skipped. Each message carries
``newsvec_sent_at`` (when it was handed to the client) so end-to-end latency can be measured. With
PUBSUB_EMULATOR_HOST set, google-cloud-pubsub talks to the emulator by itself.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

SENT_AT = "newsvec_sent_at"


def _lines(path: Path, repeat: int) -> Iterator[bytes]:
    """Each non-blank line without its line ending (as ReadFromText splits), ``repeat`` times."""
    for _ in range(repeat):
        with open(path, "rb") as f:
            for line in f:
                line = line.rstrip(b"\r\n")
                if line:
                    yield line


def _now_rfc3339() -> str:
    now = dt.datetime.now(dt.timezone.utc)
    return now.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _Outcome:
    """Counts publishes as their futures complete, holding only those still pending: a soak that
    publishes for hours keeps no future (about 10 KiB each with the real client) once it is done."""

    def __init__(self):
        self.attempted = 0
        self.failed = 0
        self._pending: set = set()
        self._lock = threading.Condition()

    def refused(self) -> None:
        with self._lock:
            self.attempted += 1
            self.failed += 1

    def track(self, future) -> None:
        with self._lock:
            self.attempted += 1
            self._pending.add(future)
        future.add_done_callback(self._done)  # runs at once if the future is already done

    def _done(self, future) -> None:
        failed = future.exception() is not None  # every kind of publish failure counts the same
        with self._lock:
            self._pending.discard(future)
            self.failed += failed
            self._lock.notify_all()

    def wait(self) -> None:
        """Until every publish has completed and been counted."""
        with self._lock:
            self._lock.wait_for(lambda: not self._pending)


def publish_file(topic: str, path, rate: float, limit: Optional[int] = None, repeat: int = 1,
                 attributes: Optional[dict] = None, publisher=None) -> dict:
    """Publish the file's lines to ``topic`` at ``rate`` messages/s (0: as fast as possible), wait
    for every publish, and return ``{"published", "failed", "seconds", "rate"}``.

    Send times are scheduled from one start (message i at start + i/rate), so a late message is
    followed by catch-up rather than the rate drifting down by each message's own overhead."""
    own_client = publisher is None
    if own_client:
        from google.cloud import pubsub_v1

        publisher = pubsub_v1.PublisherClient()
    attributes = dict(attributes or {})
    outcome = _Outcome()
    start = time.monotonic()
    try:
        for i, data in enumerate(_lines(Path(path), repeat)):
            if limit is not None and i >= limit:
                break
            if rate > 0:
                delay = start + i / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            sent_at = {SENT_AT: _now_rfc3339()}  # when handed to the client, after the pacing wait
            try:
                future = publisher.publish(topic, data, **{**attributes, **sent_at})
            except Exception:  # noqa: BLE001 - refused at once (too large...): a failure too
                outcome.refused()
            else:
                outcome.track(future)
        outcome.wait()
        seconds = time.monotonic() - start
    finally:
        if own_client:
            publisher.stop()
    attempted, failed = outcome.attempted, outcome.failed
    published = attempted - failed
    return {"published": published, "failed": failed, "seconds": round(seconds, 3),
            "rate": round(published / seconds, 1) if seconds > 0 else 0.0}


def create_topic(publisher, topic: str) -> None:
    """Create ``topic`` unless it exists."""
    from google.api_core.exceptions import AlreadyExists

    try:
        publisher.create_topic(name=topic)
    except AlreadyExists:
        pass


def _attribute(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    if key == SENT_AT:
        raise argparse.ArgumentTypeError(f"{SENT_AT} is set by the publisher")
    return key, value


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.publish",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--topic", required=True, help="projects/P/topics/T")
    parser.add_argument("--file", required=True, type=Path, help="JSON Lines, sent as raw bytes")
    parser.add_argument("--rate", type=float, default=50.0, help="messages per second; 0: unpaced")
    parser.add_argument("--limit", type=int, default=None, help="stop after N messages")
    parser.add_argument("--repeat", type=int, default=1, help="send the file K times")
    parser.add_argument("--create-topic", action="store_true", help="create the topic if missing")
    parser.add_argument("--attribute", type=_attribute, action="append", default=[],
                        metavar="KEY=VALUE", help="extra message attribute (repeatable)")
    args = parser.parse_args(argv)
    if args.rate < 0 or args.repeat < 1 or (args.limit is not None and args.limit < 0):
        parser.error("--rate must be >= 0, --repeat >= 1 and --limit >= 0")
    from google.cloud import pubsub_v1

    publisher = pubsub_v1.PublisherClient()
    if args.create_topic:
        create_topic(publisher, args.topic)
    try:
        summary = publish_file(args.topic, args.file, args.rate, args.limit, args.repeat,
                               dict(args.attribute), publisher)
    finally:
        publisher.stop()
    print(json.dumps(summary))
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

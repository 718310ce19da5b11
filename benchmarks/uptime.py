"""Does the streaming graph slow down or grow with uptime? Figures, not timed asserts.
``python -m benchmarks.uptime [--windows 300] [--per-window 20]``.

The whole streaming graph (``embed_and_write_streaming``) on the local streaming runner
(BundleBasedDirectRunner), fed by a TestStream instead of Pub/Sub so that hours of event time pass
in minutes: ``--windows`` event-time windows of ``streaming.window_s`` (60 s in
configs/local-streaming.yaml), each with ``--per-window`` BBC articles (every 50th message
truncated JSON, every 100th a republished copy of an earlier article), the watermark advanced past
each window as it is fed. The engine is FREE (no model, no sleep: ``benchmarks.feed.ModeledEngine``
with no rate), so what is measured is newsvec's CPU side and the runner's. Each ledger record's
arrival time and the process's RSS are logged.

Prints, per tenth of the run: micro-batches written, wall seconds per window, and RSS. A cost that
grows with uptime shows as seconds per window rising from the second tenth to the last (the first
holds the start-up). The dedup horizon is ``--dedup-horizon-s`` (default 120 s of event time), so
that the dedup state is pruned during the run, as the soak does. Writes
``bench-results/uptime-<time>.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import SMOKE_HELP
from benchmarks.batch import bbc_texts
from benchmarks.soak import rss_mb
from pipeline.config import REPO_ROOT, load
from tools.bench_results import write_results


class _LogRecord:
    """Appends (time, RSS MB, messages in) per ledger record to a file (the runner pickles its
    DoFns, so a list in this module would not see them)."""

    def __init__(self, path: str):
        self._path = path

    def __call__(self, record) -> None:
        with open(self._path, "a") as f:
            f.write(f"{time.time()} {rss_mb()} "
                    f"{record.messages_in}\n")


def _stream(windows: int, per_window: int, window_s: int, texts: list[str]):
    from apache_beam.io.gcp.pubsub import PubsubMessage
    from apache_beam.testing.test_stream import TestStream
    from apache_beam.transforms.window import TimestampedValue
    from apache_beam.utils.timestamp import Timestamp

    t0 = Timestamp.from_utc_datetime(dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc))
    stream = TestStream().advance_watermark_to(t0)
    n = 0
    for w in range(windows):
        start = t0 + w * window_s
        batch = []
        for i in range(per_window):
            n += 1
            publish = start + (i + 0.5) * window_s / per_window
            if n % 50 == 0:
                data = b'{"id": "truncated'
            elif n % 100 == 1 and n > 100:
                data = json.dumps({"id": f"a-{n - 90}", "body": texts[(n - 90) % len(texts)]}
                                  ).encode()
            else:
                data = json.dumps({"id": f"a-{n}", "body": texts[n % len(texts)]}).encode()
            batch.append(TimestampedValue(PubsubMessage(data, {}, message_id=f"m-{n}",
                                                        publish_time=publish), publish))
        stream = stream.add_elements(batch).advance_watermark_to(start + window_s + 1)
    return stream.advance_watermark_to_infinity(), n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.uptime",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local-streaming.yaml"))
    parser.add_argument("--windows", type=int, default=300)
    parser.add_argument("--per-window", type=int, default=20)
    parser.add_argument("--dedup-horizon-s", type=float, default=120)
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.windows, args.per_window = 6, 4

    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    from benchmarks.feed import ModeledEngineFactory
    from pipeline.graph import embed_and_write_streaming

    work = Path(tempfile.mkdtemp(prefix="newsvec-uptime-"))
    config = load(args.config)
    config = config.model_copy(update={
        "output": str(work / "out"),
        # the FREE engine in this process (configs/local-streaming.yaml spawns the real one)
        "model": config.model.model_copy(update={"share_across_processes": False}),
        "streaming": config.streaming.model_copy(update={
            "dedup_horizon_s": args.dedup_horizon_s, "subscription": None})})
    stream, messages = _stream(args.windows, args.per_window, config.streaming.window_s,
                               bbc_texts(None))
    pipeline = beam.Pipeline(runner="BundleBasedDirectRunner",
                             options=PipelineOptions([], streaming=True))
    records = embed_and_write_streaming(pipeline | stream, config, "uptime",
                                        engine_factory=ModeledEngineFactory(
                                            None, 0.0, str(work / "engine.log")))
    log_path = work / "records.log"
    records | "Log" >> beam.Map(_LogRecord(str(log_path)))
    started = time.time()
    pipeline.run().wait_until_finish()
    wall = time.time() - started
    log = [tuple(map(float, line.split())) for line in log_path.read_text().splitlines()]

    tenths = []
    per_tenth = max(1, len(log) // 10)
    windows_per_record = args.windows / max(1, len(log))
    previous = started
    for i in range(0, len(log) - per_tenth + 1, per_tenth):
        part = log[i:i + per_tenth]
        seconds = part[-1][0] - previous
        previous = part[-1][0]
        tenths.append({"records": len(part),
                       "s_per_window": seconds / (len(part) * windows_per_record),
                       "rss_mb": round(statistics.median(r[1] for r in part))})
    print(f"{messages} messages in {args.windows} windows of {config.streaming.window_s} s, "
          f"{len(log)} micro-batches, {wall:.0f} s wall (FREE engine, BundleBasedDirectRunner)")
    print("tenth  micro-batches  s/window  RSS MB")
    for i, t in enumerate(tenths):
        print(f"{i + 1:>5}  {t['records']:>13}  {t['s_per_window']:>8.3f}  {t['rss_mb']:>6}")
    if len(tenths) >= 3:
        print(f"last tenth / second tenth, s per window: "
              f"{tenths[-1]['s_per_window'] / tenths[1]['s_per_window']:.2f}")
    write_results({"windows": args.windows, "per_window": args.per_window, "messages": messages,
                   "wall_s": wall, "tenths": tenths}, args.results, "uptime")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the publisher hold memory per message? Figures, not timed asserts.
``python -m benchmarks.publisher [--messages 60000]``.

The soak (``benchmarks.soak``) publishes in the runner's process for as long as it runs, so memory
the publisher holds per message reads as the runner growing with uptime. This publishes
``--messages`` BBC articles through Google's Pub/Sub emulator with ``tools.publish.publish_file``,
unpaced, and prints this process's resident memory (the emulator, a child, not counted) before, at
its peak while publishing (sampled every 0.2 s) and after, with the growth per message.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import SMOKE_HELP
from benchmarks.batch import bbc_texts
from pipeline.config import REPO_ROOT
from tools.bench_results import record


def rss_mb() -> float:
    """This process's resident memory, MiB (not its children: the emulator is one)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


PROJECT, TOPIC = "newsvec-bench", "projects/newsvec-bench/topics/publisher-memory"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.publisher",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=60000)
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.messages = 300
    from tools.emulators import pubsub_emulator
    from tools.publish import create_topic, publish_file

    work = Path(tempfile.mkdtemp(prefix="newsvec-publisher-"))
    texts = bbc_texts(None)
    events = work / "events.jsonl"
    with open(events, "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"a{i}", "title": text[:60], "body": text}) + "\n")
    with pubsub_emulator(PROJECT, work) as host:
        os.environ["PUBSUB_EMULATOR_HOST"] = host
        from google.cloud import pubsub_v1

        publisher = pubsub_v1.PublisherClient()
        create_topic(publisher, TOPIC)
        publish_file(TOPIC, events, rate=0, limit=200, publisher=publisher)  # warm the client
        gc.collect()
        before, peak, stop = rss_mb(), [0.0], threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], rss_mb())
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True).start()
        summary = publish_file(TOPIC, events, rate=0, limit=args.messages,
                               repeat=args.messages // len(texts) + 1, publisher=publisher)
        stop.set()
        gc.collect()
        after = rss_mb()
        publisher.stop()
    growth = (peak[0] - before) * 1024 / max(1, summary["published"])
    figures = {"messages": args.messages, "publish": summary,
               "rss_before_mib": round(before), "rss_peak_mib": round(peak[0]),
               "rss_after_mib": round(after), "peak_growth_kib_per_message": round(growth, 2)}
    print(json.dumps(figures))
    print(f"results: {record('publisher', figures, argv, args.results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

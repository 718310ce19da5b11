"""The whole streaming demo in one command: ``make run-streaming``
(``python -m tools.streaming_demo``).

1. starts Google's Pub/Sub emulator on loopback and creates the config's topic and subscription;
2. starts the streaming job (``configs/local-streaming.yaml``, the local runner) and publishes the
   repo's sample (``pipeline/sample_data/news-events.jsonl``: articles, malformed lines, a
   duplicate) to the topic;
3. waits until the ledger accounts for every message published (``pipeline.ledger``), prints the
   accounting, and stops the job cleanly (cancel: the local runner has no drain);
4. stops the emulator, and leaves the output in ``out/local-streaming`` (emptied first: the demo's
   accounting is of this run alone).
A missing emulator fails at once, with how to install it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from pipeline import ledger
from pipeline.config import REPO_ROOT, load_for_command
from tools.emulators import EmulatorMissing, emulated_streaming_job
from tools.publish import publish_file

SAMPLE = REPO_ROOT / "pipeline" / "sample_data" / "news-events.jsonl"


def run_demo(config_path: str, events: Path, output: str | None, rate: float, timeout_s: float,
             log=print) -> dict:
    """Runs the demo; returns the ledger's totals with what was published."""
    config = load_for_command(config_path, output=output)
    out = Path(config.output)
    if out.exists():
        shutil.rmtree(out)
    with tempfile.TemporaryDirectory(prefix="newsvec-demo-") as work:
        log(f"starting the Pub/Sub emulator and the streaming job ({config_path})...")
        with emulated_streaming_job(config, Path(work)) as topic:
            published = publish_file(topic, events, rate=rate)
            log(f"published {published['published']} messages to {topic}; waiting for the "
                "ledger to account for each (the model loads on the first micro-batch)...")
            deadline = time.monotonic() + timeout_s
            report = ledger.check(str(out))
            while report.totals.get("messages_in", 0) < published["published"]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"after {timeout_s:.0f} s the ledger accounts for "
                                       f"{report.totals.get('messages_in', 0)} of "
                                       f"{published['published']} messages")
                time.sleep(2)
                report = ledger.check(str(out))
            log("every message is accounted for; stopping the job and the emulator")
    return {"published": published["published"], **report.totals, "problems": report.problems,
            "output": str(out)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.streaming_demo",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local-streaming.yaml"))
    parser.add_argument("--file", default=str(SAMPLE), help="JSON Lines to publish")
    parser.add_argument("--output", default=None, help="override the config's output")
    parser.add_argument("--rate", type=float, default=20, help="messages/s (0: all at once)")
    parser.add_argument("--timeout-s", type=float, default=600)
    args = parser.parse_args(argv)
    try:
        totals = run_demo(args.config, Path(args.file), args.output, args.rate, args.timeout_s)
    except EmulatorMissing as exc:
        print(f"newsvec demo: {exc}. The demo needs Google's Pub/Sub emulator: install the Google "
              "Cloud CLI (https://cloud.google.com/sdk/docs/install), then "
              "`gcloud components install pubsub-emulator beta`.", file=sys.stderr)
        return 2
    print(json.dumps(totals, indent=2))
    balanced = totals["balanced"] and totals["messages_in"] == totals["published"]
    print(f"\n{totals['published']} published = {totals['rows_written']} rows + "
          f"{totals['dead_lettered']} dead letters + {totals['duplicates']} duplicates: "
          f"{'balanced' if balanced else 'NOT balanced'}. Output: {totals['output']}/ "
          "(vectors/, dead_letter/, ledger/, keys/). Search it: newsvec search --config "
          "configs/local-streaming.yaml \"your query\"")
    return 0 if balanced else 1


if __name__ == "__main__":
    sys.exit(main())

"""Does the streaming path keep the engine busy? Figures, not timed asserts.
``python -m benchmarks.duty [--docs 2000] [--runs 3]``.

Through Google's Pub/Sub emulator (started here on loopback), on the BBC articles, the streaming
job on the local runner (BundleBasedDirectRunner, one thread) with a MODELED engine (not a model,
no GPU: ``benchmarks.feed.ModeledEngine``, which holds no GIL while it "computes", sleeping
``--per-call-ms`` plus its tokens at a set rate):
  1. the CPU side's rate: ``--docs`` articles published at once, with a FREE engine (no sleep),
     articles/s from the first publish to the last row on disk (after a warm-up);
  2. a balanced load: the engine modeled to embed at exactly that rate (tokens/s = the CPU side's
     articles/s times the articles' mean tokens), and ``--docs`` other articles published at once:
     articles/s, and the engine's duty cycle: its busy time over its span (first call to last),
     and over the whole run (first publish to last row, which adds the time before the first
     micro-batch fires and the last one's writing).
When the CPU side and the engine each take all of one core's time per article, a path that waits
for each engine call runs at half the engine's rate (duty cycle 0.5); one that keeps a call in
flight while it prepares and writes, at up to all of it (1.0). Medians of ``--runs``. Writes
``bench-results/duty-<time>.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import SMOKE_HELP
from benchmarks.batch import bbc_texts
from benchmarks.feed import ModeledEngineFactory
from benchmarks.streaming import _events, _wait_for
from pipeline.config import REPO_ROOT, load
from tools.bench_results import write_results
from tools.emulators import emulated_streaming_job

SUBSCRIPTION = "projects/newsvec-duty/subscriptions/news"


def _run(config, work: Path, texts: list[str], prefix: str, tokens_per_s, per_call_s) -> dict:
    """One streaming job; ``texts`` published at once after a warm-up. The engine's figures."""
    from tools.publish import publish_file

    log = work / f"engine-{prefix}.log"
    out = work / f"out-{prefix}"
    job_config = config.model_copy(update={"output": str(out)})
    with emulated_streaming_job(job_config, work, ModeledEngineFactory(
            tokens_per_s, per_call_s, str(log))) as topic:
        warm = work / f"warm-{prefix}.jsonl"
        _events(texts[:32], warm, f"warm{prefix}")
        publish_file(topic, warm, rate=0)
        _wait_for(out, f"warm{prefix}-", len(texts[:32]), timeout=300)
        log.write_text("")  # the warm-up's calls are not measured
        events = work / f"{prefix}.jsonl"
        _events(texts, events, prefix)
        started = time.time()
        publish_file(topic, events, rate=0)
        rows = _wait_for(out, f"{prefix}-", len(texts), timeout=1800)
    ended = max(mtime for _, mtime, _ in rows)
    calls = [tuple(map(float, line.split())) for line in log.read_text().splitlines()]
    busy = sum(end - start for start, end, _ in calls)
    first, last = min(c[0] for c in calls), max(c[1] for c in calls)
    return {"docs_per_s": len(texts) / (ended - started), "seconds": ended - started,
            "duty_cycle": busy / (last - first), "duty_cycle_whole": busy / (ended - started),
            "engine_calls": len(calls)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.duty",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local-streaming.yaml"))
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--per-call-ms", type=float, default=2.0)
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.docs, args.runs = 16, 1

    from transforms.text import HeadTokenizer, normalize_text

    texts = bbc_texts(64 if args.smoke else None)
    work = Path(tempfile.mkdtemp(prefix="newsvec-duty-"))
    base = load(args.config)
    # The MODELED engine in the runner's process, as this benchmark has always measured it: it
    # sleeps for its compute time, holding no GIL (configs/local-streaming.yaml puts the real
    # engine in a process of its own).
    config = base.model_copy(update={
        "model": base.model.model_copy(update={"share_across_processes": False}),
        "streaming": base.streaming.model_copy(update={"subscription": SUBSCRIPTION})})
    tokenizer = HeadTokenizer(config.model)
    mean_tokens = statistics.mean(len(tokenizer(normalize_text(t))[0]) for t in texts)
    per_call_s = args.per_call_ms / 1000
    results: dict = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "cpus": os.cpu_count(), "docs": args.docs, "mean_tokens": mean_tokens,
                     "per_call_ms": args.per_call_ms, "free": [], "balanced": []}
    print(f"MODELED engine: each call sleeps {args.per_call_ms:g} ms plus its tokens at the rate "
          f"below, holding no GIL; articles of {mean_tokens:.0f} tokens on average", flush=True)
    for run in range(args.runs):
        batch = [texts[(run * 2 * args.docs + i) % len(texts)] for i in range(2 * args.docs)]
        free = _run(config, work, batch[:args.docs], f"free{run}", None, 0.0)
        tokens_per_s = free["docs_per_s"] * mean_tokens
        balanced = _run(config, work, batch[args.docs:], f"bal{run}", tokens_per_s, per_call_s)
        balanced["engine_tokens_per_s"] = tokens_per_s
        results["free"].append(free)
        results["balanced"].append(balanced)
        print(f"run {run + 1}: CPU side {free['docs_per_s']:.1f} articles/s (FREE engine); "
              f"engine modeled at that rate: {balanced['docs_per_s']:.1f} articles/s, duty cycle "
              f"{balanced['duty_cycle']:.2f} ({balanced['duty_cycle_whole']:.2f} over the whole "
              f"run)", flush=True)
    duty = statistics.median(r["duty_cycle"] for r in results["balanced"])
    ratio = statistics.median(b["docs_per_s"] / f["docs_per_s"]
                              for f, b in zip(results["free"], results["balanced"], strict=True))
    print(f"median of {args.runs}: duty cycle {duty:.2f} at a balanced load; articles/s with the "
          f"engine over articles/s without it {ratio:.2f} (0.5: no overlap, 1.0: full)")
    results.update(duty_cycle=duty, rate_ratio=ratio)
    write_results(results, args.results, "duty")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

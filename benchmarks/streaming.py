"""Streaming benchmark: figures, not timed asserts. ``python -m benchmarks.streaming``.

Through Google's Pub/Sub emulator (started here on loopback), on the BBC articles, in one run:
  1. saturation: every article published at once; sustained docs/s from the first publish to the
     last row on disk, against the batch pipeline's docs/s on the same articles afterwards (same
     process; model load excluded from both), run ``--batch-runs`` times each way with the engine in
     a process of its own and in the runner's, the ratio over the faster median;
  2. latency: articles published at half the saturation rate, then at light traffic (one every
     2 s); publish-to-Parquet latency per row (the file's rename time minus the message's publish
     time), p50 and p95;
  3. batch fill at saturation: tokens per engine call over the token budget;
  4. the job's ledger (``python -m pipeline.ledger``) over the whole run: every message accounted.
Writes ``bench-results/streaming-<time>.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from benchmarks import SMOKE_HELP, plots
from benchmarks.batch import bbc_texts, write_events
from pipeline import ledger
from pipeline.config import REPO_ROOT, load
from tools.bench_results import write_results
from tools.emulators import emulated_streaming_job as streaming_job
from tools.engine_calls import CALLS_ENV, calls, record
from transforms.engines.registry import load_engine

SUBSCRIPTION = "projects/newsvec-bench/subscriptions/news"


class RecordingEngine:
    """The process's real vLLM engine; also records each call's documents and tokens (Beam
    metrics are unreliable on the local streaming runner) to the file $NEWSVEC_BENCH_ENGINE_CALLS
    names, in whichever process the engine runs."""

    def __init__(self, settings):
        self._handle = load_engine(settings)
        self.label = self._handle.label()

    def embed(self, prompts):
        record(prompts)
        return self._handle.embed(prompts)

    def healthy(self) -> bool:
        return True  # the handle inside checks the real engine

    def close(self) -> None:
        pass  # the process's engine stays loaded


class FakeFreeEngine(RecordingEngine):
    """FAKE: vectors that cost nothing (one fixed unit vector), for ``--runner-only``: what the
    streaming graph and the local runner alone can carry."""

    def __init__(self, settings):
        import numpy as np

        self.label = "fake@0"
        self._vector = np.eye(1, settings.output_dim, dtype=np.float32)[0]

    def embed(self, prompts):
        record(prompts)
        return [self._vector] * len(prompts)


def _rows(out: Path) -> list[tuple[str, float, dt.datetime]]:
    """(id, file time, publish time) of every row written so far."""
    rows = []
    for f in (out / "vectors").rglob("*.parquet"):
        table = pq.read_table(f, columns=["id", "pubsub_publish_time"])
        mtime = f.stat().st_mtime
        rows += [(i, mtime, p) for i, p in zip(table["id"].to_pylist(),
                                              table["pubsub_publish_time"].to_pylist(),
                                              strict=True)]
    return rows


def _wait_for(out: Path, prefix: str, n: int, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [r for r in _rows(out) if r[0].startswith(prefix)]
        if len(rows) >= n:
            return rows
        time.sleep(0.5)
    raise TimeoutError(f"only {len(rows)} of {n} rows with prefix {prefix} after {timeout} s")


def _events(texts: list[str], path: Path, prefix: str) -> None:
    write_events(texts, path)
    lines = path.read_text().splitlines()
    path.write_text("".join(line.replace('"bbc-', f'"{prefix}-', 1) + "\n" for line in lines))


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def warm_up(topic: str, texts: list[str], work: Path, out: Path) -> float:
    """Seconds until 64 articles published at once are on disk: start-up and model load."""
    from tools.publish import publish_file

    warm = work / "warm.jsonl"
    _events(texts[:64], warm, "warm")
    started = time.perf_counter()
    publish_file(topic, warm, rate=0)
    _wait_for(out, "warm-", len(texts[:64]), timeout=300)
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.streaming",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local-streaming.yaml"))
    parser.add_argument("--limit", type=int, default=None, help="use the first N articles only")
    parser.add_argument("--latency-s", type=float, default=60, help="length of the latency phase")
    parser.add_argument("--light-rate", type=float, default=0.5,
                        help="messages per second of the light-traffic latency phase")
    parser.add_argument("--batch-runs", type=int, default=2,
                        help="batch pipeline runs each way (engine in its own process, in the "
                             "runner's); the ratio is over the faster median")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--runner-only", action="store_true",
                        help="diagnostic: saturation only, with a FAKE model that costs nothing, "
                             "to measure what the graph and the local runner alone carry")
    parser.add_argument("--smoke", action="store_true",
                        help=SMOKE_HELP + "; the batch runs with a FAKE engine (in a process of "
                        "its own, vLLM would load again)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.limit, args.latency_s, args.light_rate, args.batch_runs = 16, 4, 1, 1

    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch
    from tools.publish import publish_file

    texts = bbc_texts(args.limit)
    work = Path(tempfile.mkdtemp(prefix="newsvec-stream-bench-"))
    base = load(args.config)
    config = base.model_copy(update={
        "output": str(work / "out"),
        "streaming": base.streaming.model_copy(update={"subscription": SUBSCRIPTION})})
    results: dict = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "docs": len(texts), "cpus": os.cpu_count(),
                     "streaming": config.streaming.model_dump(), "model": config.model.model_dump()}

    engine = FakeFreeEngine if args.runner_only else RecordingEngine
    calls_file = work / "engine-calls.txt"
    calls_file.touch()
    os.environ[CALLS_ENV] = str(calls_file)  # before the job spawns the engine's process
    with streaming_job(config, work, engine) as topic:
        results["startup_and_warmup_s"] = warm_up(topic, texts, work, work / "out")
        print(f"warm-up (start-up, model load, 64 articles): "
              f"{results['startup_and_warmup_s']:.1f} s", flush=True)

        calls_file.write_text("")  # the warm-up's calls are not the saturation's
        sat = work / "saturation.jsonl"
        _events(texts, sat, "sat")
        started = time.perf_counter()
        publish_file(topic, sat, rate=0)
        _wait_for(work / "out", "sat-", len(texts), timeout=1800)
        sat_s = time.perf_counter() - started
        saturation = len(texts) / sat_s
        batch_docs, batch_tokens = calls(calls_file)
        if not batch_docs:
            raise RuntimeError(f"no engine call was recorded in {calls_file}: is the engine "
                               f"{engine.__name__}, and does its process see ${CALLS_ENV}?")
        fill = [b / config.model.token_budget for b in batch_tokens]
        print(f"streaming at saturation: {saturation:.1f} docs/s; mean batch fill "
              f"{statistics.mean(fill):.3f} over {len(fill)} batches, "
              f"{statistics.mean(batch_docs):.1f} documents a batch", flush=True)
        if args.runner_only:
            print(f"runner only (FAKE model): {saturation:.1f} docs/s", flush=True)
            return 0

        rate = saturation / 2
        n = max(1, int(rate * args.latency_s))
        lat = work / "latency.jsonl"
        _events((texts * (n // len(texts) + 1))[:n], lat, "lat")
        publish_file(topic, lat, rate=rate)
        rows = _wait_for(work / "out", "lat-", n, timeout=600)
        latencies = [mtime - publish.timestamp() for _, mtime, publish in rows]
        p50, p95 = percentile(latencies, 0.5), percentile(latencies, 0.95)
        print(f"latency at {rate:.1f} docs/s (half saturation): p50 {p50:.1f} s, "
              f"p95 {p95:.1f} s (window {config.streaming.window_s:.0f} s)", flush=True)

        n_light = max(1, int(args.light_rate * args.latency_s))
        light = work / "light.jsonl"
        _events(texts[:n_light], light, "light")
        publish_file(topic, light, rate=args.light_rate)
        light_rows = _wait_for(work / "out", "light-", n_light, timeout=600)
        light_latencies = [mtime - publish.timestamp() for _, mtime, publish in light_rows]
        light_p50, light_p95 = percentile(light_latencies, 0.5), percentile(light_latencies, 0.95)
        print(f"latency at light traffic ({args.light_rate:g} docs/s): p50 {light_p50:.1f} s, "
              f"p95 {light_p95:.1f} s (max_wait_s {config.streaming.max_wait_s})", flush=True)
        time.sleep(2 * config.streaming.max_wait_s)  # the last panes' ledger records
    report = ledger.check(str(work / "out"))
    print(f"ledger: {report.totals['messages_in']} messages in, "
          f"{report.totals['rows_written']} rows, {report.totals['duplicates']} duplicates, "
          f"{report.totals['dead_lettered']} dead letters "
          f"over {report.totals['windows']} windows: "
          f"{'balanced' if report.ok else 'PROBLEMS: ' + '; '.join(report.problems[:5])}",
          flush=True)

    # The batch pipeline, same articles, same process, twice each way, alternating: with the engine
    # in a process of its own (as this streaming config has it) and in the runner's process (as
    # configs/local.yaml has it). The ratio is taken against the faster median.
    events = work / "batch.jsonl"
    write_events(texts, events)
    batch_rates: dict[str, list[float]] = {"engine_own_process": [], "engine_in_runner": []}
    for i in range(args.batch_runs):
        for way, share in (("engine_own_process", True), ("engine_in_runner", False)):
            model = config.model.model_copy(update={"share_across_processes": share})
            summary = run_batch(config.model_copy(update={
                "input": str(events), "output": str(work / f"batch-out-{way}-{i}"),
                "model": model}), PipelineOptions(["--runner=FnApiRunner"]),
                engine_factory=FakeFreeEngine if args.smoke else None)
            t = summary["timings"]
            batch_rates[way].append(len(texts) / (t["run_s"] - t["model_load_s"]))
            print(f"batch pipeline, {way}: {batch_rates[way][-1]:.1f} docs/s", flush=True)
    batch_medians = {way: statistics.median(r) for way, r in batch_rates.items()}
    batch_rate = max(batch_medians.values())

    results.update({
        "saturation": {"docs_per_s": saturation, "seconds": sat_s,
                       "mean_batch_fill": statistics.mean(fill), "batches": len(fill),
                       "mean_batch_docs": statistics.mean(batch_docs)},
        "batch_pipeline_docs_per_s": batch_rate,
        "batch_pipeline_runs_docs_per_s": batch_rates,
        "batch_pipeline_median_docs_per_s": batch_medians,
        "ratio_streaming_over_batch": saturation / batch_rate,
        "latency": {"rate_docs_per_s": rate, "messages": n, "p50_s": p50, "p95_s": p95,
                    "target_p95_s": config.streaming.window_s + 10, "latencies_s": latencies},
        "latency_light": {"rate_docs_per_s": args.light_rate, "messages": n_light,
                          "p50_s": light_p50, "p95_s": light_p95,
                          "max_wait_s": config.streaming.max_wait_s,
                          "latencies_s": light_latencies},
        "ledger": report.totals, "ledger_problems": report.problems[:20],
        "targets": {"ratio_streaming_over_batch": 0.9},
    })
    out_file = write_results(results, args.results, "streaming")
    print(f"plot: {plots.streaming(results, out_file)}")
    print("\nbatch medians: " + ", ".join(f"{w} {r:.1f} docs/s" for w, r in batch_medians.items()))
    print(f"streaming / batch (the faster): {saturation / batch_rate:.3f} (target >= 0.9)")
    print(f"latency p50 {p50:.1f} s, p95 {p95:.1f} s (target p95 <= "
          f"{config.streaming.window_s + 10:.0f} s)")
    print(f"latency at light traffic: p50 {light_p50:.1f} s, p95 {light_p95:.1f} s")
    print(f"mean batch fill at saturation: {statistics.mean(fill):.3f}")
    print(f"results: {out_file}")
    return 0


if __name__ == "__main__":
    import sys

    # Run from the module's importable name: a class defined in __main__ is pickled by value.
    from benchmarks import streaming

    sys.exit(streaming.main())

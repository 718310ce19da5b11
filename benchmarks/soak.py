"""Soak run of the streaming pipeline: figures, not timed asserts. ``python -m benchmarks.soak``.

Through Google's Pub/Sub emulator (started here on loopback), on the BBC articles:
  1. saturation (unless ``--rate`` is given): ``--saturation-docs`` articles published at once,
     docs/s from the first publish to the last row on disk;
  2. the soak: articles published at ``--load`` (default 0.8) of that rate for ``--minutes``
     (default 10), with a malformed message every 50th and a republished copy of an earlier
     article every 100th; the dedup horizon is cut to ``--dedup-horizon-s`` (default 120 s) so
     that the dedup state is pruned during the run, not only after an hour;
  3. every 10 s: rows on disk and the resident memory of this process's tree (the local runner and
     the pipeline live in this process; the engine in it too, or in a child process of its own
     with ``model.share_across_processes``, as in configs/local-streaming.yaml; the emulator's
     JVM is in the tree too), and apart: this process, and the shared engine's process;
  4. at the end: throughput, publish-to-Parquet latency percentiles, memory per minute and its
     trend (least-squares slope after the first ``--settle-min`` minutes), and the accounting:
     each published message is a row, a dead letter with a reason, or a dropped duplicate.
Writes ``bench-results/soak-<time>.json``.
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq

from benchmarks import SMOKE_HELP, plots, tree_rss
from benchmarks.batch import bbc_texts
from benchmarks.streaming import _events, _rows, _wait_for, percentile, streaming_job, warm_up
from pipeline import ledger
from pipeline.config import REPO_ROOT, load
from tools.bench_results import write_results

SUBSCRIPTION = "projects/newsvec-soak/subscriptions/news"
MALFORMED_EVERY, DUPLICATE_EVERY, DUPLICATE_LAG = 50, 100, 10
SMOKE_MESSAGES = 60  # one malformed (the 50th) and one duplicate (the 26th)


def rss_mb() -> float:
    """The resident memory of this process and its children (the shared engine's process), MiB."""
    return tree_rss() / 2**20


def engine_rss_mb() -> float:
    """The resident memory of this process's children that Python's multiprocessing spawned (the
    shared engine's process, ``model.share_across_processes``), MiB: not the emulator's JVM."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if any("multiprocessing" in part for part in child.cmdline()):
                total += child.memory_info().rss
        except psutil.Error:  # a child that ended meanwhile
            pass
    return total / 2**20


SOURCES = 37  # coprime with the BBC set's 2,225 texts: a text's reprints come from other sources


def soak_events(texts: list[str], n: int, path: Path) -> dict:
    """``n`` messages: unique articles (texts cycled, ids soak-NNNNNN), every MALFORMED_EVERY-th a
    truncated JSON line, every DUPLICATE_EVERY-th a byte-identical copy of the article published
    DUPLICATE_LAG messages before. Returns what each kind should become."""
    lines, good_ids = [], []
    expected = {"row": 0, "dead_letter": 0, "duplicate": 0}
    for i in range(n):
        if i % MALFORMED_EVERY == MALFORMED_EVERY - 1:
            lines.append('{"id": "soak-broken-%06d", "body": "cut off' % i)
            expected["dead_letter"] += 1
        elif i % DUPLICATE_EVERY == DUPLICATE_EVERY // 4 and len(lines) > DUPLICATE_LAG:
            source = next(line for line in reversed(lines[:-DUPLICATE_LAG])
                          if line.endswith("}"))
            lines.append(source)
            expected["duplicate"] += 1
        else:
            article_id = f"soak-{i:06d}"
            # The texts come round again every len(texts) messages, each time from another of
            # SOURCES sources: a wire story its customers reprint (a copy, marked), never one
            # source's boilerplate (a text one source prints under 3 ids would be).
            lines.append(json.dumps({"id": article_id, "body": texts[i % len(texts)],
                                     "source": f"source-{i % SOURCES:02d}", "language": "en"}))
            good_ids.append(article_id)
            expected["row"] += 1
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return {"messages": n, "good_ids": good_ids, **expected}


def read_outputs(out: Path) -> tuple[list[tuple[str, float, dt.datetime]], list[dict]]:
    """(id, file time, publish time) of every row, and every dead letter, written so far."""
    letters = [json.loads(line) for f in (out / "dead_letter").rglob("*.jsonl")
               for line in f.read_text(encoding="utf-8").splitlines() if line]
    return _rows(out), letters


class WrittenSoFar:
    """Counts the articles of ``ids`` written so far, reading each new vectors file once. (Reading
    every file every 10 s, as this benchmark did before, cost the measured process more each time:
    thousands of small files an hour, read in the process that runs the job.)"""

    def __init__(self, out: Path, ids: set):
        self._out, self._ids, self._seen = out, ids, {}

    def __call__(self) -> int:
        for f in (self._out / "vectors").rglob("*.parquet"):
            if f not in self._seen:
                ids = pq.read_table(f, columns=["id"]).column(0).to_pylist()
                self._seen[f] = sum(1 for i in ids if i in self._ids)
        return sum(self._seen.values())


def slope_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    xs, ys = [s for s, _ in samples], [m for _, m in samples]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def written_rate_by_span(progress: list[tuple[float, int]], until_s: float,
                         span_s: float = 300) -> list[tuple[float, float]]:
    """(span start in minutes, articles written per second in that span) for each whole span of
    ``span_s`` before ``until_s`` (the last publish), from the (seconds, rows on disk) samples."""
    def rows_at(t: float) -> float:  # linear between the 10 s samples
        before = max(((s, n) for s, n in progress if s <= t), default=(0.0, 0))
        after = min(((s, n) for s, n in progress if s >= t), default=before)
        if after[0] == before[0]:
            return before[1]
        return before[1] + (after[1] - before[1]) * (t - before[0]) / (after[0] - before[0])
    spans, start = [], 0.0
    while start + span_s <= until_s:
        spans.append((start / 60, (rows_at(start + span_s) - rows_at(start)) / span_s))
        start += span_s
    return spans


def table_figures(results: dict, argv: list[str], minutes: str) -> dict:
    """The figures docs/benchmarks.md shows, keyed by the table's wording."""
    from tools.bench_results import machine

    m = machine()
    cpu = (m["cpu"] or "CPU not noted").replace("(R)", "").replace(" Processor", "")
    where = f"{' '.join(cpu.split()[:3]) if 'EPYC' in cpu else cpu}, {m['cores']} vCPU"
    when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    command = "python -m benchmarks.soak" + (" " + " ".join(argv) if argv else "")

    def row(value: str, target=None, met=None) -> dict:
        return {"value": value, "target": target, "met": met, "machine": where,
                "measured": when, "command": command}

    rate, lat = results["written_rate"], results["latency_s"]
    acc, mem = results["accounting"], results["memory_mib"]
    worst = rate["worst_later_vs_first_10"]
    rows = {}
    if worst is not None:
        rows[f"{minutes} minutes at 0.8 of saturation ({results['soak']['rate_msgs_per_s']:.1f} "
             f"msg/s), stories on: worst 5-minute written rate over the first 10 minutes'"] = row(
            f"{worst:.3f}", "≥ 0.9", "yes" if worst >= 0.9 else "no")
    rows["publish-to-Parquet latency, p50 / p95 / p99, stories on"] = row(
        f"{lat['p50']:.1f} s / {lat['p95']:.1f} s / {lat['p99']:.1f} s")
    rows["messages accounted for (rows + dead letters + duplicates), ledger, stories on"] = row(
        f"{acc['rows'] + acc['dead_letters'] + acc['duplicates_dropped']:,} of "
        f"{acc['published']:,}, {'balanced' if not acc['ledger_problems'] else 'NOT balanced'}",
        "all", "yes" if acc["every_message_accounted_for"] else "no")
    runner = mem["runner_process"]["slope_after_settle_mib_per_min"]
    if runner is not None:
        rows["runner's process (local runner, stories held in memory): resident memory "
             "trend"] = row(f"{runner:+.2f} MiB/min")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local-streaming.yaml"))
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--load", type=float, default=0.8, help="fraction of saturation")
    parser.add_argument("--rate", type=float, default=None,
                        help="docs/s to publish at; default: --load times the measured saturation")
    parser.add_argument("--saturation-docs", type=int, default=600)
    parser.add_argument("--dedup-horizon-s", type=float, default=120)
    parser.add_argument("--settle-min", type=float, default=2,
                        help="minutes left out of the memory trend (engine warm-up, caches)")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true",
                        help=SMOKE_HELP + "; 60 messages (a malformed one and a duplicate among "
                        "them), sampled every 1 s")
    args = parser.parse_args(argv)
    sample_s = 10  # rows on disk and memory, every sample_s seconds
    if args.smoke:
        args.saturation_docs, args.minutes, args.settle_min, sample_s = 16, 0.1, 0, 1

    from tools.publish import publish_file

    texts = bbc_texts(32 if args.smoke else None)
    work = Path(tempfile.mkdtemp(prefix="newsvec-soak-"))
    out = work / "out"
    base = load(args.config)
    config = base.model_copy(update={"output": str(out), "streaming": base.streaming.model_copy(
        update={"subscription": SUBSCRIPTION, "dedup_horizon_s": args.dedup_horizon_s})})
    results: dict = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "cpus": os.cpu_count(), "streaming": config.streaming.model_dump(),
                     "model": config.model.model_dump()}
    memory: list[tuple[float, float]] = []  # (seconds since the soak began, MiB)
    runner: list[tuple[float, float]] = []  # the same, this process alone (runner and publisher)
    engine: list[tuple[float, float]] = []  # the same, the shared engine's process
    progress: list[tuple[float, int]] = []  # (seconds since the soak began, rows on disk)

    with streaming_job(config, work) as topic:
        warm_up(topic, texts, work, out)
        results["rss_after_warmup_mb"] = rss_mb()
        rate = args.rate
        if rate is None:
            sat = work / "saturation.jsonl"
            _events(texts[:args.saturation_docs], sat, "sat")
            started = time.perf_counter()
            publish_file(topic, sat, rate=0)
            _wait_for(out, "sat-", args.saturation_docs, timeout=1800)
            saturation = args.saturation_docs / (time.perf_counter() - started)
            results["saturation_docs_per_s"] = saturation
            rate = args.load * saturation
            print(f"saturation: {saturation:.1f} docs/s; soak at {rate:.1f} msg/s", flush=True)

        n = SMOKE_MESSAGES if args.smoke else int(rate * args.minutes * 60)
        if args.smoke:  # its messages spread over its --minutes, as a soak's are (not 0.8 of
            rate = max(rate, n / (args.minutes * 60))  # a 16-article saturation: 15-20 s)
        plan = soak_events(texts, n, work / "soak.jsonl")
        print(f"soak: {n} messages over {args.minutes:g} min ({plan['row']} articles, "
              f"{plan['dead_letter']} malformed, {plan['duplicate']} duplicates)", flush=True)
        begun = time.perf_counter()
        published: dict = {}
        publisher_thread = threading.Thread(target=lambda: published.update(
            publish_file(topic, work / "soak.jsonl", rate=rate)), daemon=True)
        publisher_thread.start()
        good = set(plan["good_ids"])
        written = WrittenSoFar(out, good)
        while True:
            time.sleep(sample_s)
            now = time.perf_counter() - begun
            done = written()
            memory.append((now, rss_mb()))
            runner.append((now, psutil.Process().memory_info().rss / 2**20))
            engine.append((now, engine_rss_mb()))
            progress.append((now, done))
            print(f"  {now / 60:5.1f} min: {done} of {len(good)} articles written, "
                  f"RSS {memory[-1][1]:.0f} MiB (runner's process {runner[-1][1]:.0f}, "
                  f"engine's {engine[-1][1]:.0f})", flush=True)
            if not publisher_thread.is_alive() and done >= len(good):
                break
            if now > args.minutes * 60 + 600:
                print("  gave up waiting 10 min after the last publish", flush=True)
                break
        publisher_thread.join()
        drained_s = time.perf_counter() - begun
        time.sleep(2 * config.streaming.max_wait_s)  # the last dead letters' pane
        rows, letters = read_outputs(out)

    soak_rows = [r for r in rows if r[0].startswith("soak-")]
    soak_letters = [d for d in letters if (d.get("event_id") or "").startswith("soak-")
                    or d.get("payload", "").startswith('{"id": "soak-broken')]
    ids = collections.Counter(r[0] for r in soak_rows)
    missing = good - set(ids)
    repeated = {i: c for i, c in ids.items() if c > 1}
    duplicates = n - len(soak_rows) - len(soak_letters)
    report = ledger.check(str(out))  # the job's own ledger, over every window of the run
    accounted = not missing and not repeated and len(soak_letters) == plan["dead_letter"] \
        and duplicates == plan["duplicate"] and report.ok
    latencies = [mtime - publish.timestamp() for _, mtime, publish in soak_rows]
    steady = [(s, m) for s, m in memory if s >= args.settle_min * 60]
    runner_steady = [(s, m) for s, m in runner if s >= args.settle_min * 60]
    engine_steady = [(s, m) for s, m in engine if s >= args.settle_min * 60 and m > 0]
    per_minute = collections.defaultdict(float)
    for s, m in memory:
        per_minute[int(s // 60)] = max(per_minute[int(s // 60)], m)
    spans = written_rate_by_span(progress, args.minutes * 60)
    first_10 = (statistics.mean(r for m, r in spans if m < 10)
                if any(m < 10 for m, _ in spans) else None)
    later = [r for m, r in spans if m >= 10]
    worst = min(later) / first_10 if first_10 and later else None
    results.update({
        "written_rate": {"per_5_min": spans, "first_10_min": first_10,
                         "worst_later_vs_first_10": worst},
        "soak": {"rate_msgs_per_s": rate, "minutes": args.minutes, "messages": n,
                 "published": published, "drained_s": drained_s,
                 "throughput_docs_per_s": len(soak_rows) / drained_s},
        "latency_s": {"p50": percentile(latencies, 0.5), "p95": percentile(latencies, 0.95),
                      "p99": percentile(latencies, 0.99), "max": max(latencies),
                      "values": latencies},
        "memory_mib": {"peak": max(m for _, m in memory),
                       "per_minute_peak": dict(sorted(per_minute.items())),
                       "slope_after_settle_mib_per_min": slope_per_min(steady) if steady else None,
                       "samples": memory,
                       "runner_process": {
                           "slope_after_settle_mib_per_min":
                               slope_per_min(runner_steady) if runner_steady else None,
                           "samples": runner},
                       "engine_process": {
                           "slope_after_settle_mib_per_min":
                               slope_per_min(engine_steady) if engine_steady else None,
                           "samples": engine}},
        "accounting": {"published": n, "rows": len(soak_rows), "dead_letters": len(soak_letters),
                       "duplicates_dropped": duplicates, "expected": {
                           k: plan[k] for k in ("row", "dead_letter", "duplicate")},
                       "missing_ids": sorted(missing)[:20], "ids_written_twice": len(repeated),
                       "dead_letter_reasons": dict(collections.Counter(
                           d["reason"] for d in soak_letters)),
                       "ledger": report.totals, "ledger_problems": report.problems[:20],
                       "every_message_accounted_for": accounted},
        "progress": progress,
    })
    results.update(table_figures(results, sys.argv[1:] if argv is None else argv,
                                 f"{args.minutes:g}"))
    out_file = write_results(results, args.results, "soak")
    print(f"plot: {plots.soak(results, out_file)}")
    lat, mem = results["latency_s"], results["memory_mib"]
    print(f"\nthroughput {results['soak']['throughput_docs_per_s']:.1f} docs/s at "
          f"{rate:.1f} msg/s offered, drained in {drained_s / 60:.1f} min")
    print(f"latency p50 {lat['p50']:.1f} s, p95 {lat['p95']:.1f} s, p99 {lat['p99']:.1f} s, "
          f"max {lat['max']:.1f} s")
    if first_10:
        print(f"written rate per 5 minutes (docs/s): {[round(r, 1) for _, r in spans]}; first 10 "
              f"minutes {first_10:.2f}", end="")
        print(f"; worst later span {worst:.3f} of it" if worst is not None else "")
    slope = mem["slope_after_settle_mib_per_min"]
    trend = f"{slope:+.2f} MiB/min" if slope is not None else "none (too short a run)"
    print(f"memory: peak {mem['peak']:.0f} MiB; per-minute peaks "
          f"{[round(v) for v in mem['per_minute_peak'].values()]}; trend after "
          f"{args.settle_min:g} min: {trend}")
    runner_slope = mem["runner_process"]["slope_after_settle_mib_per_min"]
    if runner_slope is not None:
        print(f"  the runner's process alone (runner, pipeline, publisher): "
              f"{runner[0][1]:.0f} -> {runner[-1][1]:.0f} MiB, trend {runner_slope:+.2f} MiB/min")
        if engine_steady:
            print(f"  the shared engine's process: {engine_steady[0][1]:.0f} -> "
                  f"{engine_steady[-1][1]:.0f} MiB, trend {slope_per_min(engine_steady):+.2f} "
                  f"MiB/min")
        rest = [(s, m - r - e) for (s, m), (_, r), (_, e) in zip(memory, runner, engine,
                                                                 strict=True)
                if s >= args.settle_min * 60]
        if rest:
            print(f"  the rest of the tree (the Pub/Sub emulator and its JVM): "
                  f"{rest[0][1]:.0f} -> {rest[-1][1]:.0f} MiB, "
                  f"trend {slope_per_min(rest):+.2f} MiB/min")
    print(f"accounting: {len(soak_rows)} rows + {len(soak_letters)} dead letters + {duplicates} "
          f"duplicates = {n} published (expected {plan['row']} + {plan['dead_letter']} + "
          f"{plan['duplicate']}); missing {len(missing)}, written twice {len(repeated)}: "
          f"{'every message accounted for' if accounted else 'NOT ACCOUNTED'}")
    print(f"ledger (python -m pipeline.ledger): {report.totals['messages_in']} messages in = "
          f"{report.totals['rows_written']} rows + {report.totals['dead_lettered']} dead letters + "
          f"{report.totals['duplicates']} duplicates over {report.totals['windows']} windows: "
          f"{'balanced' if report.ok else 'PROBLEMS: ' + '; '.join(report.problems[:5])}")
    print(f"results: {out_file}")
    return 0 if accounted else 1


if __name__ == "__main__":
    sys.exit(main())

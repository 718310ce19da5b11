"""Can the CPU side feed a GPU? Figures, not timed asserts. ``python -m benchmarks.feed``.

On the BBC articles in ../shared/data/bbc-news (repeated ``--repeat`` times, each copy its own ids),
in one run of this command:
  1. CPU-side cost per article of each stage, one thread, CPU time: parse, prepare (normalize) and
     tokenize, now and as before the fast paths (tools/reference_prepare.py);
  2. the batch graph (FnApiRunner, ``--workers`` SDK worker processes, the engine shared across
     them in a process of its own) with a FREE engine that costs nothing, on one core and on two
     (CPU affinity, inherited by every process of the run), and the ratio;
  3. the same graph on every core with a MODELED engine (not a model, no GPU): each call holds no
     GIL and sleeps ``--per-call-ms`` plus its tokens at a given tokens/s, then returns fixed
     vectors. At rates from a fraction to a multiple of the CPU side's measured rate: articles/s
     and the engine's duty cycle (busy time over wall time).
Rates are measured over the embedding stage, from the engine's first call to its last: in steady
state (the middle 80% of that span, without the SDK workers' start-up and the tail of the last
bundles, which a job of a day's news amortizes) and over the whole span. Medians of ``--runs``.
Writes ``bench-results/feed-<time>.json``.

``--language ja`` measures Japanese instead: as many generated articles (``tools/japanese_text.py``,
about 2,200 characters each, no spaces) as there are BBC ones. ``--stages-only``: step 1 alone (no
graph, no engine; seconds).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import SMOKE_HELP
from benchmarks.batch import bbc_texts
from pipeline.config import REPO_ROOT, load
from tools.bench_results import write_results

# What the MODELED engine's rates stand for (assumptions, printed with the figures):
L4_BERT_BASE_TOKENS_PER_S = 500 * 405  # ~500 articles/s of bge-base at a 512-token cap
# (docs/performance.md)
L4_MINILM_TOKENS_PER_S = 10 * L4_BERT_BASE_TOKENS_PER_S  # a MiniLM-class model: ~10x less work


class ModeledEngine:
    """MODELED engine, not a model: stands for a GPU that computes while the CPU goes on. A call
    holds no GIL while it "computes": it sleeps ``per_call_s + tokens / tokens_per_s``. Each call's
    start and end go to ``log_path`` (appended), so the busy time is known whichever process
    serves the engine. ``tokens_per_s`` None: a FREE engine (no sleep)."""

    def __init__(self, settings, tokens_per_s, per_call_s, log_path):
        self.label = "modeled@0" if tokens_per_s else "free@0"
        self._tokens_per_s, self._per_call_s, self._log = tokens_per_s, per_call_s, log_path
        self._vector = np.eye(1, settings.output_dim, dtype=np.float32)[0]

    def embed(self, prompts):
        started = time.time()
        if self._tokens_per_s:
            time.sleep(self._per_call_s + sum(len(p) for p in prompts) / self._tokens_per_s)
        ended = time.time()
        with open(self._log, "a") as f:
            f.write(f"{started} {ended} {len(prompts)}\n")
        return [self._vector] * len(prompts)

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass


class ModeledEngineFactory:
    """Picklable: the SDK worker processes make the engine from it."""

    def __init__(self, tokens_per_s, per_call_s, log_path):
        self.tokens_per_s, self.per_call_s, self.log_path = tokens_per_s, per_call_s, log_path

    def __call__(self, settings):
        return ModeledEngine(settings, self.tokens_per_s, self.per_call_s, self.log_path)


STEADY_TRIM = 0.1  # the first and last tenth of the engine's span: worker start-up and the tail


def engine_log(path: Path, trim: float = 0.0) -> tuple[float, float, float, float]:
    """(start, end, documents, busy seconds) of the engine's span from a ModeledEngine log, with
    ``trim`` of that span cut at each end (documents and busy time of a call that straddles a cut
    are counted pro rata)."""
    calls = sorted(tuple(map(float, line.split())) for line in path.read_text().splitlines())
    first, last = calls[0][0], max(c[1] for c in calls)
    start, end = first + trim * (last - first), last - trim * (last - first)
    docs, busy, until = 0.0, 0.0, start
    for call_start, call_end, n in calls:  # calls are serialized; the union guards anyway
        inside = max(0.0, min(call_end, end) - max(call_start, start))
        if call_end == call_start:  # a FREE engine's call: an instant
            docs += n if start <= call_start <= end else 0
            continue
        docs += n * inside / (call_end - call_start)
        busy += max(0.0, min(call_end, end) - max(call_start, until))
        until = max(until, min(call_end, end))
    return start, end, docs, busy


def stage_costs(texts: list[str], config) -> dict:
    """µs of CPU per article of each stage, one thread, now and before the fast paths."""
    from tools import reference_prepare as reference
    from transforms.parse import parse_event
    from transforms.text import HeadTokenizer, compose_text

    payloads = [json.dumps({"id": f"b{i}", "body": t}).encode() for i, t in enumerate(texts)]

    def cpu_us(fn) -> tuple[float, object]:
        started = time.process_time()
        out = fn()
        return (time.process_time() - started) / len(texts) * 1e6, out

    skew = dt.timedelta(days=1)
    parse_us, events = cpu_us(lambda: [parse_event(p, max_payload_bytes=1 << 20,
                                                   max_future_skew=skew) for p in payloads])
    prepare_us, prepared = cpu_us(lambda: [compose_text(e) for e in events])
    before_prepare_us, before = cpu_us(lambda: [reference.compose_text(e.title, e.body)
                                                for e in events])
    assert prepared == before, "the fast paths changed a prepared text"
    tokenizer = HeadTokenizer(config.model)
    # warm-up: HeadTokenizer builds its table of single-token characters at first need (~0.1 s)
    tokenizer.batch(prepared[:128])

    def tokenize(fn):
        return [r for i in range(0, len(prepared), 128) for r in fn(prepared[i:i + 128])]

    tokenize_us, ids = cpu_us(lambda: tokenize(tokenizer.batch))
    before_tokenize_us, before_ids = cpu_us(lambda: tokenize(
        lambda b: reference.head_tokens(tokenizer._tok, b, config.model.max_tokens)))
    assert ids == before_ids, "the fast path changed token ids"
    now = {"parse": parse_us, "prepare": prepare_us, "tokenize": tokenize_us}
    was = {"parse": parse_us, "prepare": before_prepare_us, "tokenize": before_tokenize_us}
    return {"now_us": {**now, "total": sum(now.values())},
            "before_us": {**was, "total": sum(was.values())},
            "mean_tokens": statistics.mean(len(i) for i, _ in ids)}


def graph_rate(events_path: Path, config, work: Path, workers: int, tokens_per_s, per_call_s,
               smoke: bool = False):
    """Articles/s of the batch graph's embedding stage, and the engine's duty cycle there.
    ``smoke``: the SDK workers are threads, and the engine is in the runner's process (a smoke
    run starts no process)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch

    log = work / f"engine-{time.time_ns()}.log"
    model = config.model.model_copy(update={"share_across_processes": not smoke})
    run_config = config.model_copy(update={"input": str(events_path), "model": model,
                                           "output": str(work / f"out-{time.time_ns()}")})
    options = ["--runner=FnApiRunner", f"--direct_num_workers={workers}",
               f"--direct_running_mode={'multi_threading' if smoke else 'multi_processing'}"]
    run_batch(run_config, PipelineOptions(options),
              engine_factory=ModeledEngineFactory(tokens_per_s, per_call_s, str(log)))
    figures = {}
    for name, trim in (("whole", 0.0), ("steady", STEADY_TRIM)):
        start, end, docs, busy = engine_log(log, trim)
        figures[name] = {"docs_per_s": docs / (end - start), "duty_cycle": busy / (end - start),
                         "engine_capacity_docs_per_s": docs / busy if busy else None,
                         "seconds": end - start, "docs": docs}
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.feed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local.yaml"))
    parser.add_argument("--repeat", type=int, default=3, help="copies of the BBC articles")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4 * len(os.sched_getaffinity(0)),
                        help="SDK worker processes (FnApiRunner runs one bundle at a time in "
                             "each); default 4 per core, the bundles a Dataflow worker runs per "
                             "vCPU with the configs' 4 harness threads")
    parser.add_argument("--per-call-ms", type=float, default=2.0,
                        help="the modeled engine's fixed cost per call (launch, scheduling)")
    parser.add_argument("--rates", default="0.5,0.75,1,1.5,2",
                        help="modeled engine rates, as multiples of the CPU side's rate")
    parser.add_argument("--language", choices=("en", "ja"), default="en",
                        help="en: the BBC articles; ja: as many generated Japanese articles")
    parser.add_argument("--stages-only", action="store_true",
                        help="measure the CPU cost per article of each stage only")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:  # one modeled rate, the L4 of the table alone, no process (graph_rate)
        args.repeat, args.runs, args.workers, args.rates = 1, 1, 2, "1"

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one core per worker process
    config = load(args.config)
    texts = bbc_texts(128 if args.smoke else None)  # a smoke run: a few engine calls
    if args.language == "ja":
        from tools import japanese_text as japanese

        texts = [f"{title}\n{body}" for title, body in japanese.articles(len(texts))]
    work = Path(tempfile.mkdtemp(prefix="newsvec-feed-"))
    events = work / "events.jsonl"
    with open(events, "w", encoding="utf-8") as f:
        for copy in range(args.repeat):
            for i, text in enumerate(texts):
                f.write(json.dumps({"id": f"bbc-{copy}-{i:05d}", "body": text}) + "\n")
    n = len(texts) * args.repeat
    results: dict = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "cpus": os.cpu_count(), "articles": n, "runs": args.runs,
                     "per_call_ms": args.per_call_ms, "workers": args.workers,
                     "language": args.language,
                     "mean_chars": statistics.mean(len(t) for t in texts)}

    costs = stage_costs(texts, config)
    results["stage_costs"] = costs
    print(f"CPU per article ({args.language}, {len(texts)} articles of "
          f"{results['mean_chars']:.0f} characters on average), one thread (µs):  now / before "
          "the fast paths")
    for stage in ("parse", "prepare", "tokenize", "total"):
        print(f"  {stage:9s} {costs['now_us'][stage]:7.0f} / {costs['before_us'][stage]:7.0f}")
    tokens_per_article = costs["mean_tokens"]
    if args.stages_only:
        print(f"results: {write_results(results, args.results, 'feed')}")
        return 0

    def median_run(workers, tokens_per_s, per_call_s, cores=None):
        cpus = os.sched_getaffinity(0)
        if cores:  # the SDK workers and the engine's process inherit it
            os.sched_setaffinity(0, sorted(cpus)[:cores])
        try:
            runs = [graph_rate(events, config, work, workers, tokens_per_s, per_call_s,
                               args.smoke)
                    for _ in range(args.runs)]
        finally:
            os.sched_setaffinity(0, cpus)
        out = {}
        for span in ("steady", "whole"):
            out[span] = {key: statistics.median(r[span][key] or float("inf") for r in runs)
                         for key in ("docs_per_s", "duty_cycle", "engine_capacity_docs_per_s")}
        return {**out, "runs": runs}

    workers = args.workers
    one, two = median_run(workers, None, 0.0, cores=1), median_run(workers, None, 0.0, cores=2)
    scaling = {span: two[span]["docs_per_s"] / one[span]["docs_per_s"]
               for span in ("steady", "whole")}
    results["free_engine"] = {"1_core": one, "2_cores": two}
    results["free_engine_scaling_1_to_2_cores"] = scaling
    print(f"batch graph, FREE engine, {workers} worker processes, articles/s steady (whole run): "
          f"1 core {one['steady']['docs_per_s']:.0f} ({one['whole']['docs_per_s']:.0f}), 2 cores "
          f"{two['steady']['docs_per_s']:.0f} ({two['whole']['docs_per_s']:.0f}): "
          f"x{scaling['steady']:.2f} (x{scaling['whole']:.2f}); goal >= 1.8")

    cpu_rate = two["steady"]["docs_per_s"]  # the CPU side's rate, both cores, this graph
    sweep = []
    print(f"MODELED engine ({workers} workers, {args.per_call_ms:g} ms a call, "
          f"{tokens_per_article:.0f} tokens an article; CPU side {cpu_rate:.0f} articles/s); "
          "steady state (whole run):")
    for multiple in (float(m) for m in args.rates.split(",")):
        engine_rate = multiple * cpu_rate  # articles/s the modeled engine does, calls apart
        run = median_run(workers, engine_rate * tokens_per_article, args.per_call_ms / 1000)
        steady, whole = run["steady"], run["whole"]
        # The engine's capacity as it ran (its calls' fixed cost included), against the CPU's.
        bound = min(steady["engine_capacity_docs_per_s"], cpu_rate)
        sweep.append({"engine_over_cpu": multiple, "engine_articles_per_s": engine_rate,
                      "of_the_bound": steady["docs_per_s"] / bound, **run})
        print(f"  engine {multiple:4.2f} x CPU ({engine_rate:6.0f} articles/s, "
              f"{steady['engine_capacity_docs_per_s']:6.0f} with its per-call cost): "
              f"{steady['docs_per_s']:6.0f} ({whole['docs_per_s']:6.0f}) articles/s = "
              f"{steady['docs_per_s'] / bound:.2f} ({whole['docs_per_s'] / bound:.2f}) of "
              f"min(engine, CPU); duty cycle {steady['duty_cycle']:.2f} "
              f"({whole['duty_cycle']:.2f})")
    results["modeled_sweep"] = sweep
    l4 = {}
    l4_models = (("L4, BERT-base", L4_BERT_BASE_TOKENS_PER_S),
                 ("L4, MiniLM-class", L4_MINILM_TOKENS_PER_S))
    for name, tokens_per_s in l4_models[:1] if args.smoke else l4_models:
        run = median_run(workers, tokens_per_s, args.per_call_ms / 1000)
        l4[name] = {"tokens_per_s": tokens_per_s, **run}
        print(f"  {name} (assumed {tokens_per_s:,} tokens/s, i.e. "
              f"{tokens_per_s / tokens_per_article:.0f} of these articles/s): "
              f"{run['steady']['docs_per_s']:.0f} ({run['whole']['docs_per_s']:.0f}) articles/s, "
              f"duty cycle {run['steady']['duty_cycle']:.2f} ({run['whole']['duty_cycle']:.2f})")
    results["modeled_l4"] = l4
    out_file = write_results(results, args.results, "feed")
    print(f"results: {out_file}")
    return 0


if __name__ == "__main__":
    # Run from the module's importable name, so that the pickled factory's class is found by name.
    from benchmarks import feed

    sys.exit(feed.main())

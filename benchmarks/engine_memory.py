"""Does the engine's process grow with the calls it serves? Figures, not timed asserts.
``python -m benchmarks.engine_memory [--minutes 5] [--shapes varied|repeated] [--no-trim]``.

A soak's engine process (``model.share_across_processes``) grew through a 90-minute run while the
runner's stayed nearly flat. This takes the runner, Beam and the proxy away: the engine of
``configs/local-streaming.yaml`` (real vLLM) in this process, called as fast as it goes with
micro-batches of BBC article heads like the soak's (1 to 40 articles, within the token budget).
``--shapes varied`` draws a new batch for every call, so the call's total token count (the shape
the CPU kernels see) keeps changing; ``--shapes repeated`` cycles through 20 batches drawn once.
Each minute it prints the calls made, the distinct token counts seen, this process's resident and
anonymous memory, and the time the engine spent giving freed memory back (``FreedMemory``, glibc's
``malloc_trim`` every few seconds); ``--no-trim`` turns that off, to see what it saves and costs.
The engine's environment is the config's ``model.engine_env`` (oneDNN's primitive cache capacity
there bounds the kernels kept per shape); run it again with another value set in the shell.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from benchmarks import SMOKE_HELP
from benchmarks.batch import bbc_texts
from pipeline.config import REPO_ROOT, load
from tools.bench_results import record


def memory_mib() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {name: round(int(fields[key].split()[0]) / 1024)
            for name, key in (("rss_mib", "VmRSS"), ("anon_mib", "RssAnon"))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_memory",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=int, default=5)
    parser.add_argument("--shapes", choices=("varied", "repeated"), default="varied")
    parser.add_argument("--no-trim", action="store_true",
                        help="the engine does not give freed memory back (FreedMemory off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local-streaming.yaml"),
                        help="the config whose engine is measured")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    minute_s = 60  # each row of the output covers a minute; a smoke run's rows one second
    if args.smoke:
        args.minutes, minute_s = 2, 1
    from transforms.engines import base as engines
    from transforms.engines.registry import process_engine
    from transforms.text import text_tools

    settings = load(args.config).model
    heads = [ids for ids, _ in text_tools(settings).head.batch(
        bbc_texts(100 if args.smoke else None))]
    rng = random.Random(args.seed)

    def draw() -> list:
        batch: list = []
        for _ in range(rng.randint(1, 40)):
            ids = rng.choice(heads)
            if sum(map(len, batch)) + len(ids) > settings.token_budget:
                break
            batch.append(ids)
        return batch

    fixed = [draw() for _ in range(20)]
    trims: list[float] = []
    trim = engines.FREED_MEMORY.trim

    def timed_trim() -> None:
        started = time.perf_counter()
        trim()
        trims.append(time.perf_counter() - started)

    engines.FREED_MEMORY.trim = None if args.no_trim else timed_trim
    try:
        rows = _calls(process_engine(settings, None), args, draw, fixed, trims, minute_s)
    finally:
        engines.FREED_MEMORY.trim = trim  # as it was: this process may go on (a test)
    if len(rows) >= 2:
        span = rows[-1]["minute"] - rows[0]["minute"]
        print(json.dumps({
            "shapes": args.shapes, "trim": not args.no_trim,
            "articles_per_s": round(rows[-1]["articles"] / (minute_s * args.minutes), 1),
            "rss_mib_per_minute_after_minute_1": round(
                (rows[-1]["rss_mib"] - rows[0]["rss_mib"]) / span, 2),
            "rss_kib_per_call_after_minute_1": round(
                1024 * (rows[-1]["rss_mib"] - rows[0]["rss_mib"])
                / max(1, rows[-1]["calls"] - rows[0]["calls"]), 1)}))
    path = record("engine_memory", {"shapes": args.shapes, "minutes": rows}, argv, args.results)
    print(f"results: {path}")
    return 0


def _calls(engine, args, draw, fixed: list, trims: list[float], minute_s: float) -> list[dict]:
    """The engine called as fast as it goes for ``args.minutes`` rows of ``minute_s`` seconds,
    a row printed at the end of each."""
    from transforms.engines import base as engines

    engine.embed(fixed[0])  # the first call's one-off set-up is not counted
    first = memory_mib()
    print(json.dumps({"shapes": args.shapes, "trim": not args.no_trim,
                      "trim_every_s": engines.FREED_MEMORY.every_s, "after_load": first,
                      "onednn_primitive_cache_capacity": os.environ.get(  # as the engine has it
                          "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024 (oneDNN's default)")}),
          flush=True)
    calls, articles, seen, rows = 0, 0, set(), []
    begin = time.monotonic()
    for minute in range(1, args.minutes + 1):
        while time.monotonic() < begin + minute_s * minute:
            batch = draw() if args.shapes == "varied" else fixed[calls % len(fixed)]
            engine.embed(batch)
            calls, articles = calls + 1, articles + len(batch)
            seen.add(sum(map(len, batch)))
        row = {"minute": minute, "calls": calls, "articles": articles,
               "distinct_token_counts": len(seen), **memory_mib(), "trims": len(trims),
               "trim_ms_median": round(1000 * statistics.median(trims), 1) if trims else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

"""Streaming compaction, measured: figures, not timed asserts.
``python -m benchmarks.compaction [--messages 20000] [--hours 2] [--shards 4] [--runs 5]``.

Writes a streaming output of ``--messages`` messages with the real streaming writer
(``WriteStreaming`` on Beam's local runner) from micro-batches of one-minute windows over
``--hours`` hours and ``--shards`` shards (every third window with a late pane; one message in 20 a
dead letter, one in 25 a duplicate), with FAKE embeddings (random unit vectors: no engine runs;
``tools/streaming_output.py``). That is the output today's code leaves. Then, on copies of it:
  - files under the output, before and after ``newsvec compact`` of its hours;
  - DuckDB over ``vectors/**/*.parquet``: ``count(*)``, and the 10 nearest rows to a query vector
    by ``array_cosine_similarity`` (median of ``--runs``, a new connection each run);
  - ``newsvec ledger`` (with verification) and the key listing the nightly job reads
    (``current_key_files``), before and after;
  - the compaction's own time (median over ``--runs`` copies).
Checks that the counts, the top 10 and the ledger totals are the same before and after. Writes
``bench-results/compaction-<time>.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import SMOKE_HELP
from pipeline import compact, ledger
from pipeline.config import REPO_ROOT
from tools import streaming_output
from tools.bench_results import write_results
from transforms.output.compaction import current_key_files


def _timed(fn, runs: int):
    times, value = [], None
    for _ in range(runs):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), value


def _duckdb(outputs: dict[str, Path], query: np.ndarray, runs: int) -> dict:
    """DuckDB over each output's ``vectors/**/*.parquet``, the outputs taken in turn within each
    run (so that a noisy neighbour slows both alike): medians, and each output's answers."""
    import duckdb

    dim = len(query)
    q = "[" + ",".join(f"{x:.8f}" for x in query) + f"]::FLOAT[{dim}]"
    queries = {
        "count_star": "SELECT count(*) FROM read_parquet('{glob}')",
        "top10_cosine": (f"SELECT id, array_cosine_similarity(embedding::FLOAT[{dim}], {q}) AS s "
                         "FROM read_parquet('{glob}') ORDER BY s DESC LIMIT 10")}
    times: dict = {(name, kind): [] for name in outputs for kind in queries}
    answers: dict = {}
    for _ in range(runs):
        for name, output in outputs.items():
            for kind, sql in queries.items():
                t0 = time.perf_counter()
                with duckdb.connect() as con:
                    rows = con.execute(sql.format(glob=f"{output}/vectors/**/*.parquet")).fetchall()
                times[(name, kind)].append(time.perf_counter() - t0)
                answers[(name, kind)] = rows[0][0] if kind == "count_star" else [r[0] for r in rows]
    return {name: {**{f"{kind}_s": round(statistics.median(times[(name, kind)]), 4)
                      for kind in queries},
                   "rows": answers[(name, "count_star")], "top10": answers[(name, "top10_cosine")]}
            for name in outputs}


def _files(output: Path) -> int:
    return sum(1 for p in output.rglob("*") if p.is_file())


def _measure(output: Path, runs: int) -> dict:
    ledger_s, report = _timed(lambda: ledger.check(str(output)), 1)
    keys_s, keys = _timed(lambda: current_key_files(str(output)), runs)
    return {"files": _files(output),
            "vectors_files": sum(1 for _ in (output / "vectors").rglob("*.parquet")),
            "ledger_check_s": round(ledger_s, 3), "ledger_ok": report.ok,
            "ledger_totals": report.totals,
            "key_files_listed": len(keys), "key_listing_s": round(keys_s, 4)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compaction",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--hours", type=int, default=2, help="of one-minute windows")
    parser.add_argument("--shards", type=int, default=4, help="streaming.batch_shards")
    parser.add_argument("--row-group-rows", type=int, default=16384)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.messages, args.hours, args.shards, args.runs = 200, 1, 1, 1

    work = Path(tempfile.mkdtemp(prefix="newsvec-compaction-"))
    source = work / "stream"
    batches = streaming_output.micro_batches(args.messages, windows=60 * args.hours,
                                             shards=args.shards)
    t0 = time.perf_counter()
    streaming_output.write(str(source), batches, row_group_rows=args.row_group_rows)
    write_s = time.perf_counter() - t0
    print(f"wrote {args.messages} messages as {len(batches)} micro-batches in {write_s:.1f} s",
          file=sys.stderr)
    query = np.random.default_rng(7).standard_normal(384).astype(np.float32)
    query /= np.linalg.norm(query)

    start = streaming_output.START
    end = start + dt.timedelta(hours=args.hours)
    later = end + dt.timedelta(days=1)
    compact_times = []
    for i in range(args.runs):
        copy = work / f"copy-{i}"
        shutil.copytree(source, copy)
        t0 = time.perf_counter()
        compact.compact_range(str(copy), start, end, args.row_group_rows, now=later)
        compact_times.append(time.perf_counter() - t0)
        if i:
            shutil.rmtree(copy)
    compacted = work / "copy-0"
    before, after = _measure(source, args.runs), _measure(compacted, args.runs)
    queried = _duckdb({"before": source, "after": compacted}, query, args.runs)
    before.update(queried["before"])
    after.update(queried["after"])
    shutil.rmtree(work)

    results = {
        "messages": args.messages, "micro_batches": len(batches), "hours": args.hours,
        "shards": args.shards, "runs": args.runs, "row_group_rows": args.row_group_rows,
        "before": before, "after": after,
        "compaction_s_median": round(statistics.median(compact_times), 3),
        "same_count": before["rows"] == after["rows"],
        "same_top10": before["top10"] == after["top10"],
        "same_ledger_totals": before["ledger_totals"] == after["ledger_totals"],
    }
    path = write_results(results, args.results, "compaction")
    print(f"{'':24s} {'before':>10s} {'after':>10s}")
    for key in ("files", "vectors_files", "count_star_s", "top10_cosine_s", "ledger_check_s",
                "key_files_listed", "key_listing_s"):
        print(f"{key:24s} {before[key]:>10} {after[key]:>10}")
    print(f"compaction (median of {args.runs}): {results['compaction_s_median']} s; same count: "
          f"{results['same_count']}, same top 10: {results['same_top10']}, same ledger totals: "
          f"{results['same_ledger_totals']}, ledger ok after: {after['ledger_ok']}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Streaming dedup state, MODELED: the cost of one micro-batch against the number of keys held.
``python -m benchmarks.dedup [--held 1000 1000000] [--docs 100] [--batches 7]``.

Driving a million keys through a local runner is too slow here, so this calls the DoFns' own
``process`` (and timer) methods against a MODELED state store: each state cell is held as encoded
bytes; a read decodes them with the state spec's coder, a write encodes, a bag appends one encoded
value and reads them all back. That is the least work any runner's state backend does (Dataflow
adds a round trip to its state service per cell read, unless its cache holds it); the figures are
that work and the DoFns' own, nothing of a runner's.

Two designs, each in a steady state of ``--held`` keys held (in one shard: the old design's worst
case; the new one has no shards in its state):
- ``PerShardDictDedup (before)``: the code before (``_KeepFirstPerShard``, now the local runner's
  layout only), one ``{key: expiry}`` dict per shard in one pickled cell, read and written whole
  per micro-batch, and by its prune timer;
- ``PerKeyState (now)``: ``transforms.dedup``: a verdict per document from state keyed by the
  dedup key (with a timer per key), and the micro-batch put together again by its id.

Each micro-batch has ``--docs`` documents: 90% new keys, 5% redeliveries of held keys, 5% second
copies within the batch. After it, the watermark passes the expiry of as many held keys as it kept
(the prune timer of the old design fires once; the new design's per-key timers fire once each), so
the number of keys held stays the same. Reports the median wall time per micro-batch (that and the
timers), the bytes decoded and encoded, and each design's ratio of the largest ``--held`` to the
smallest. Writes ``bench-results/dedup-<time>.json``.
"""
from __future__ import annotations

import argparse

from benchmarks import SMOKE_HELP
from pipeline.config import REPO_ROOT
from tools.bench_results import write_results
from tools.dedup_state_model import DESIGNS, MODEL_NOTE, measure


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dedup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--held", type=int, nargs="+", default=[1000, 1_000_000])
    parser.add_argument("--docs", type=int, default=100, help="documents per micro-batch")
    parser.add_argument("--batches", type=int, default=7, help="micro-batches timed per figure")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.held, args.docs, args.batches = [100, 1000], 20, 1

    print(MODEL_NOTE)
    print(f"{args.docs} documents per micro-batch; median of {args.batches} micro-batches, each "
          "with the timers it makes due")
    print(f"{'design':<28} {'keys held':>10} {'ms/batch':>10} {'reads':>6} {'decoded B':>12} "
          f"{'encoded B':>12}")
    rows = []
    for design in DESIGNS.values():
        for row in measure(design, args.held, args.batches, args.docs):
            rows.append(row)
            print(f"{row['design']:<28} {row['keys_held']:>10,} "
                  f"{row['ms_per_micro_batch']:>10.3f} "
                  f"{row['state_reads']:>6.0f} {row['bytes_decoded']:>12,.0f} "
                  f"{row['bytes_encoded']:>12,.0f}", flush=True)
    ratios = {}
    for name in DESIGNS:
        mine = [r for r in rows if r["design"] == name]
        low, high = min(mine, key=lambda r: r["keys_held"]), max(mine, key=lambda r: r["keys_held"])
        ratios[name] = high["ms_per_micro_batch"] / low["ms_per_micro_batch"]
        print(f"{name}: {high['keys_held']:,} / {low['keys_held']:,} keys held = "
              f"{ratios[name]:.2f}x per micro-batch")
    out = write_results({"model": MODEL_NOTE, "rows": rows, "ratios": ratios}, args.results,
                        "dedup")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Incremental embedding, measured: figures, not timed asserts.
``python -m benchmarks.incremental [--changed 0.05] [--added 0.05]``.

On the 2,225 BBC articles in ../shared/data/bbc-news, in one run of this command (the engine loaded
once, by a warm-up run):
  1. day 1: every article, into ``<work>/<model>/dt=2026-12-01`` (a daily config consulting
     ``<work>/<model>/dt=*``);
  2. day 2: the same articles with ``--changed`` of them corrected (a sentence added) and
     ``--added`` new ones: only those are embedded, the rest are counted as unchanged;
  3. a full re-embed of day 2's articles into a separate output, without the key index.
Reports the embedding time (inside ``LLM.embed``) and wall time of each run, day 2's over day 1's,
and checks that the current vectors across days 1 and 2 (``pipeline.current``) are those of the full
re-embed: the same ids and texts, cosine >= 0.9999. Writes
``bench-results/incremental-<time>.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from benchmarks import write_results
from benchmarks.batch import bbc_texts
from pipeline.config import REPO_ROOT, IncrementalSettings, fill_date, fill_model, load


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def _vectors(table) -> dict[str, np.ndarray]:
    matrix = table["embedding"].combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    return dict(zip(table["id"].to_pylist(), matrix, strict=True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.incremental",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local.yaml"))
    parser.add_argument("--changed", type=float, default=0.05, help="share of articles corrected")
    parser.add_argument("--added", type=float, default=0.05, help="share of new articles")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    args = parser.parse_args(argv)

    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.current import current_vectors
    from pipeline.run import run_batch

    work = Path(tempfile.mkdtemp(prefix="newsvec-incremental-"))
    texts = bbc_texts(None)
    day_1 = [{"id": f"bbc-{i:05d}", "body": t} for i, t in enumerate(texts)]
    rng = random.Random(7)
    changed = set(rng.sample(range(len(day_1)), round(args.changed * len(day_1))))
    added = round(args.added * len(day_1))
    day_2 = [{**r, "body": r["body"] + " This article was corrected on 2 December."}
             if i in changed else r for i, r in enumerate(day_1)]
    day_2 += [{"id": f"new-{i:05d}", "body": texts[i] + " A follow-up, published a day later."}
              for i in rng.sample(range(len(texts)), added)]
    base = load(args.config)
    daily = base.model_copy(update={
        "input": str(work / "in" / "dt={date}" / "news.jsonl"),
        "output": str(work / "{model}" / "dt={date}"),
        "incremental": IncrementalSettings(previous_outputs=[str(work / "{model}" / "dt=*")])})
    daily = fill_model(daily)
    options = PipelineOptions(["--runner=FnApiRunner"])
    _write(work / "warm.jsonl", day_1[:32])
    run_batch(base.model_copy(update={"input": str(work / "warm.jsonl"),
                                      "output": str(work / "warm")}), options)

    def run(day: str, rows: list[dict]) -> dict:
        _write(work / "in" / f"dt={day}" / "news.jsonl", rows)
        summary = run_batch(fill_date(daily, day), options)
        return {"counts": summary["counts"], "embed_s": summary["timings"]["embed_s"],
                "run_s": summary["timings"]["run_s"], "output": summary["output"]}

    first, second = run("2026-12-01", day_1), run("2026-12-02", day_2)
    _write(work / "full" / "news.jsonl", day_2)
    full = run_batch(base.model_copy(update={"input": str(work / "full" / "news.jsonl"),
                                             "output": str(work / "full-out")}), options)
    full = {"counts": full["counts"], "embed_s": full["timings"]["embed_s"],
            "run_s": full["timings"]["run_s"]}

    current = current_vectors(str(Path(first["output"]).parent))
    reference = pq.read_table(sorted((work / "full-out" / "vectors").glob("*.parquet")))
    got, want = _vectors(current), _vectors(reference)
    same_ids = sorted(got) == sorted(want)
    same_texts = (dict(zip(current["id"].to_pylist(), current["text_sha256"].to_pylist(),
                           strict=True))
                  == dict(zip(reference["id"].to_pylist(), reference["text_sha256"].to_pylist(),
                              strict=True)))
    cosine = min(float(np.dot(got[i], want[i])) for i in want) if same_ids else None
    ratio = second["embed_s"] / first["embed_s"]
    print(f"day 1: {first['counts']['written']} written in {first['run_s']:.1f} s "
          f"(embedding {first['embed_s']:.1f} s)")
    print(f"day 2: {len(changed)} corrected + {added} new of {len(day_2)}: "
          f"{second['counts']['written']} written, {second['counts']['unchanged']} unchanged, in "
          f"{second['run_s']:.1f} s (embedding {second['embed_s']:.1f} s)")
    print(f"full re-embed of day 2: {full['run_s']:.1f} s (embedding {full['embed_s']:.1f} s)")
    print(f"day 2 embedding time / day 1's: {ratio:.3f} (target <= 0.15); wall time: "
          f"{second['run_s'] / first['run_s']:.3f}")
    print(f"current vectors (days 1 and 2) against the full re-embed: same ids {same_ids}, same "
          f"texts {same_texts}, min cosine {cosine:.6f} (target >= 0.9999)")
    results = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "articles": len(day_1), "changed": len(changed), "added": added,
               "day_1": first, "day_2": second, "full_reembed": full,
               "embed_time_ratio": ratio, "wall_time_ratio": second["run_s"] / first["run_s"],
               "current_equals_full": {"same_ids": same_ids, "same_texts": same_texts,
                                       "min_cosine": cosine}}
    out_file = write_results(results, args.results, "incremental")
    print(f"results: {out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

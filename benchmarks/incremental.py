"""Incremental embedding, measured: figures, not timed asserts.
``python -m benchmarks.incremental [--changed 0.05] [--added 0.05]``, or, for the cost of a large
key set, ``python -m benchmarks.incremental --previous-keys 10000000`` (below).

On the 2,225 BBC articles in ../shared/data/bbc-news, in one run of this command (the engine loaded
once, by a warm-up run):
  1. day 1: every article, into ``<work>/<model>/dt=2026-12-01`` (a daily config consulting
     ``<work>/<model>/dt=*``);
  2. day 2: the same articles with ``--changed`` of them corrected (a sentence added) and
     ``--added`` new ones: only those are embedded, the rest are counted as unchanged;
  3. a full re-embed of day 2's articles into a separate output, without the key index.
Reports the embedding time (inside ``LLM.embed``) and wall time of each run, day 2's over day 1's,
and checks that the current vectors across days 1 and 2 (``transforms.output.current_vectors``) are
those of the full re-embed: the same ids and texts, cosine >= 0.9999. Writes
``bench-results/incremental-<time>.json``.

With ``--previous-keys N``: N synthetic keys in the real layout (a committed batch output whose
manifest names ``keys/part-<run>-*.parquet``, about a million rows a file), and the 2,225 BBC
articles as one day. The CLI's run (``pipeline.run.run``, ``--config``: configs/local.yaml with
that input) runs in a subprocess, once with no previous outputs and once with the N keys as
``incremental.previous_outputs`` (none of them an article's: every article is embedded in both).
For each: the peak RSS of the whole process tree (polled every 0.2 s), the wall time, the time
from launch to the first engine call, and the run's own skip figures (``key_index_*``,
``skip_us_per_article``, from its metrics). Then, in this process, the index's load time and size,
and the skip's cost per article (the key and the lookup), for articles absent and present.
``--code DIR`` runs the subprocesses from another checkout (e.g. main's, for the figures before a
change); ``--work DIR`` keeps the synthetic keys for the next invocation. Writes
``bench-results/incremental-keys-<time>.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import SMOKE_HELP, tree_rss
from benchmarks.batch import bbc_texts
from pipeline.config import REPO_ROOT, fill, load
from tools.bench_results import write_results
from transforms.settings import IncrementalSettings


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
    parser.add_argument("--previous-keys", type=int, default=0,
                        help="measure a run against this many synthetic previous keys instead")
    parser.add_argument("--repeats", type=int, default=1, help="--previous-keys: runs of each")
    parser.add_argument("--code", default=str(REPO_ROOT),
                        help="--previous-keys: the checkout the runs use (the figures before)")
    parser.add_argument("--work", default=None, help="--previous-keys: where to keep the keys")
    parser.add_argument("--smoke", action="store_true",
                        help=SMOKE_HELP + "; no warm-up run; with --previous-keys, keys files "
                        "of 1,000 and a FAKE engine in the runs")
    args = parser.parse_args(argv)
    if args.previous_keys:
        return previous_keys(args)

    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch
    from transforms.output.current_vectors import current_vectors

    work = Path(tempfile.mkdtemp(prefix="newsvec-incremental-"))
    texts = bbc_texts(SMOKE_ARTICLES if args.smoke else None)
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
    options = PipelineOptions(["--runner=FnApiRunner"])
    if not args.smoke:  # a smoke run times nothing: no warm-up
        _write(work / "warm.jsonl", day_1[:32])
        run_batch(base.model_copy(update={"input": str(work / "warm.jsonl"),
                                          "output": str(work / "warm")}), options)

    def run(day: str, rows: list[dict]) -> dict:
        _write(work / "in" / f"dt={day}" / "news.jsonl", rows)
        summary = run_batch(fill(daily, day), options)
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


SMOKE_ARTICLES = 24
_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
# The run in a subprocess: the CLI's ``run`` with a config file; the engine's creation and first
# call noted, and where the code has it, the key index's load. A third argument (a smoke run):
# a FAKE engine that costs nothing (benchmarks.feed.ModeledEngine) stands in for vLLM's.
_CHILD = """
import json, os, sys, time
from transforms.engines import vllm as engine
marks = {}
def noting(cls, name, first, last=None):
    original = getattr(cls, name)
    def wrapped(*args, **kwargs):
        marks.setdefault(first, time.time())
        try:
            return original(*args, **kwargs)
        finally:
            if last:
                marks.setdefault(last, time.time())
    setattr(cls, name, wrapped)
noting(engine.Engine, "embed", "first_engine_call")
noting(engine.Engine, "__init__", "engine_ready")
try:
    from transforms.output import key_index
    noting(key_index.KeyIndex, "build", "key_load_start", "key_load_end")
except ImportError:
    pass
if len(sys.argv) > 3:
    from benchmarks.feed import ModeledEngine
    def fake_engine(settings):
        marks.setdefault("engine_ready", time.time())
        return ModeledEngine(settings, None, 0.0, os.devnull)
    from transforms.engines import registry
    registry.ENGINES["vllm"] = fake_engine  # the registry holds the factory, not the module
from pipeline.run import run
summary = run(["--config", sys.argv[1]])
with open(sys.argv[2], "w") as f:
    json.dump({**marks, "summary": summary}, f, default=str)
"""


def _hex_strings(raw: np.ndarray) -> pa.Array:
    """(n, b) random bytes -> n strings of 2b hex, without a Python loop."""
    n, width = raw.shape[0], raw.shape[1] * 2
    chars = np.empty((n, width), dtype=np.uint8)
    chars[:, 0::2], chars[:, 1::2] = _HEX_DIGITS[raw >> 4], _HEX_DIGITS[raw & 15]
    offsets = np.arange(0, n * width + 1, width, dtype=np.int32)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(chars.tobytes()))


def synthetic_output(prefix: Path, n: int, per_file: int = 1_000_000) -> list[str]:
    """A committed batch output holding ``n`` random keys (``key_schema``) in the real layout;
    returns its key files. Kept for the next invocation if already there with ``n`` keys. The
    columns besides the key, id and text hash are null (a run with near duplicates off)."""
    from transforms.output.layout import new_run_id
    from transforms.output.manifest import COMMITTED, Manifest, read_manifest, write_manifest
    from transforms.output.parquet import key_schema

    existing = read_manifest(str(prefix)) if prefix.exists() else None
    if existing is not None and existing.counts.get("written") == n:
        return [str(prefix / p) for p in existing.keys]
    shutil.rmtree(prefix, ignore_errors=True)
    (prefix / "keys").mkdir(parents=True)
    run_id, rng = new_run_id(), np.random.default_rng(22)
    files, count = [], -(-n // per_file)
    for i in range(count):
        rows = min(per_file, n - i * per_file)
        ids = pa.array(np.arange(i * per_file, i * per_file + rows)).cast(pa.string())
        columns = {"key": _hex_strings(rng.integers(0, 256, (rows, 16), dtype=np.uint8)),
                   "id": ids,
                   "text_sha256": _hex_strings(rng.integers(0, 256, (rows, 32), dtype=np.uint8))}
        table = pa.table({field.name: columns[field.name] if field.name in columns
                          else pa.nulls(rows, field.type) for field in key_schema()},
                         schema=key_schema())
        name = f"keys/part-{run_id}-{i:05d}-of-{count:05d}.parquet"
        pq.write_table(table, prefix / name, compression="zstd")
        files.append(name)
    write_manifest(str(prefix), Manifest(
        run_id=run_id, state=COMMITTED, started_at=time.time(), vectors=[], dead_letter=[],
        summary="_summary.json", counts={"written": n}, committed_at=str(time.time()), keys=files))
    return [str(prefix / f) for f in files]


def _measured_run(code: str, config_file: Path, marks_file: Path, log_file: Path,
                  fake_engine: bool = False) -> dict:
    """One CLI run in a subprocess: peak RSS of its process tree, wall time, first engine call.
    ``fake_engine``: a FAKE engine in place of vLLM's (a smoke run)."""
    import psutil

    launched = time.time()
    fake = ["fake-engine"] if fake_engine else []
    with open(log_file, "wb") as log:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(config_file), str(marks_file),
                                  *fake],
                                 cwd=code, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONPATH": code})
        process, peak = psutil.Process(child.pid), 0
        while child.poll() is None:
            peak = max(peak, tree_rss(process))
            time.sleep(0.2)
    wall = time.time() - launched
    if child.returncode != 0:
        raise RuntimeError(f"the run failed (rc {child.returncode}): see {log_file}")
    marks = json.loads(marks_file.read_text())
    timings, counts = marks["summary"]["timings"], marks["summary"]["counts"]
    return {"peak_rss_gb": peak / 1e9, "wall_s": wall,
            **{f"{k}_s": marks[k] - launched for k in ("engine_ready", "first_engine_call",
                                                       "key_load_start", "key_load_end")
               if k in marks},
            "written": counts["written"], "unchanged": counts["unchanged"],
            **{k: timings[k] for k in ("model_load_s", "embed_s", "key_index_load_s",
                                       "key_index_wait_s", "skip_us_per_article")
               if k in timings}}


def _skip_cost(files: list[str], present: list[str], texts: list[str]) -> dict:
    """In this process: the index's load and size, and µs per article of the skip's work (the
    key, then the lookup) for articles absent from it and present in it."""
    try:
        from transforms.output.key_index import KeyIndex
    except ImportError:  # the code before the change: a dict in a side input
        return {}
    from transforms.incremental import embedding_key

    started = time.perf_counter()
    index = KeyIndex.build([files])
    load_s = time.perf_counter() - started
    absent = [(f"bbc-{i:05d}", f"{hash(t):x}") for i, t in enumerate(texts)]

    def per_article(work) -> float:
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            for item in work:
                index.lookup(embedding_key(*item, "model", "{}") if isinstance(item, tuple)
                             else item)
            runs.append((time.perf_counter() - started) / len(work) * 1e6)
        return statistics.median(runs)

    key_and_lookup = per_article(absent)
    hit = per_article(present)
    assert all(index.lookup(k) == 0 for k in present[:1000])
    return {"index_load_s": load_s, "index_mb": index.nbytes / 1e6,
            "skip_us_absent": key_and_lookup, "lookup_us_present": hit}


def previous_keys(args) -> int:
    from benchmarks.batch import write_events
    from transforms.settings import IncrementalSettings

    work = Path(args.work or tempfile.mkdtemp(prefix="newsvec-keys-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    files = synthetic_output(work / f"previous-{args.previous_keys}", args.previous_keys,
                             **({"per_file": 1000} if args.smoke else {}))
    print(f"{args.previous_keys:,} synthetic keys in {len(files)} files "
          f"({time.perf_counter() - started:.0f} s, {work})")
    texts = bbc_texts(SMOKE_ARTICLES if args.smoke else None)
    write_events(texts, work / "bbc.jsonl")
    base = load(args.config)
    variants = {"none": [], f"{args.previous_keys:,} keys": [str(work / f"previous-"
                                                                    f"{args.previous_keys}")]}
    figures: dict[str, list[dict]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        for i, (name, previous) in enumerate(variants.items()):
            config = base.model_copy(update={
                "input": str(work / "bbc.jsonl"), "output": str(work / f"out-{i}"),
                "incremental": IncrementalSettings(previous_outputs=previous)})
            config_file = work / f"config-{i}.yaml"
            config_file.write_text(json.dumps(json.loads(config.model_dump_json())))
            figures[name].append(_measured_run(args.code, config_file, work / f"marks-{i}.json",
                                               work / f"run-{i}-{repeat}.log", args.smoke))
            print(f"  {name}: {figures[name][-1]}", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
               for name, runs in figures.items()}
    table = pq.read_table(files[0], columns=["key"]).column(0).to_pylist()[:2225]
    # the index of this checkout, measured here: only when the runs used it too
    same_code = Path(args.code).resolve() == REPO_ROOT.resolve()
    skip = _skip_cost(files, table, texts) if same_code else {}
    names = list(medians)
    print(f"\nBBC day ({len(texts)} articles), code {args.code}, median of {args.repeats}:")
    print(f"{'':34}" + "".join(f"{n:>18}" for n in names))
    for key in sorted({k for m in medians.values() for k in m}):
        print(f"{key:34}" + "".join(f"{medians[n].get(key, float('nan')):>18.3f}"
                                     for n in names))
    rise = medians[names[1]]["peak_rss_gb"] - medians[names[0]]["peak_rss_gb"]
    print(f"peak RSS with the keys - without: {rise:+.2f} GB (target <= +1 GB)")
    if skip:
        print(f"in this process: index of {args.previous_keys:,} keys loaded in "
              f"{skip['index_load_s']:.1f} s, {skip['index_mb']:.0f} MB; the skip "
              f"(key + lookup) {skip['skip_us_absent']:.1f} µs per article absent, a lookup "
              f"{skip['lookup_us_present']:.1f} µs per article present (target <= 100 µs)")
    results = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "previous_keys": args.previous_keys, "code": args.code, "runs": figures,
               "medians": medians, "rss_rise_gb": rise, "skip": skip}
    print(f"results: {write_results(results, args.results, 'incremental-keys')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

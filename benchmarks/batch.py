"""Batch benchmark: figures, not timed asserts. ``python -m benchmarks.batch [--runs 3]``.

On the BBC articles in ../shared/data/bbc-news (2,225), in one run of this command:
  1. raw in-process ``LLM.embed()`` on the prepared texts (one call, vLLM batching everything);
  2. the pipeline end to end (FnApiRunner), with start-up and model load reported apart (a warm-up
     run of 64 articles loads the model first);
  3. sentence-transformers on the same texts and model, fp32 and bf16, at its best batch size, in a
     separate process (as a home-made server would run it).
Raw and pipeline runs alternate, and medians are taken, because this machine is shared and noisy.
Prints the ratios and writes everything to ``bench-results/batch-<time>.json``.

``--tiny bert|llama|qwen3`` runs it on a tiny model built on the spot (tools/tiny_models.py: random
weights, nothing downloaded) instead of the config's: a decoder (causal attention, byte-level BPE,
last-token pooling) beside the BERT of the same machinery. Such a model costs the engine little,
so the ratio weighs the pipeline's CPU side more than a real model's would.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import SMOKE_HELP, plots
from pipeline.config import REPO_ROOT, load
from tools.bench_results import write_results
from transforms.engines.model import resolve_model_path

BBC = Path(os.environ.get("NEWSVEC_BBC_DIR") or REPO_ROOT.parent / "shared" / "data" / "bbc-news")
ST_BATCH_SIZES = (16, 32, 64, 128)


class OneEngine:
    """EngineFactory: the one vLLM ``Engine`` of this process, loaded on first use and returned
    afterwards, so that the raw ``LLM.embed()`` baseline and the pipeline embed with the same loaded
    engine (no second load). Picklable by reference: the runner's copy of the factory finds the
    same class, hence the same engine (this module runs from its importable name, see the end)."""

    engine = None

    def __call__(self, settings):
        from transforms.engines.vllm import load_vllm

        if OneEngine.engine is None:
            OneEngine.engine = load_vllm(settings)
        return OneEngine.engine


TINY_MODELS = {"bert": ("build_bert", 128), "llama": ("build_llama", 64),
               "qwen3": ("build_qwen3", 64)}  # builder in tools.tiny_models, its dimensions


def tiny_model_config(config, kind: str, folder: Path):
    """``config`` with its model replaced by the tiny ``kind`` built in ``folder``: the same
    dtype and ``max_tokens``, no prefixes (the Qwen3's query prompt is left out: no query here)."""
    from tools import tiny_models

    builder, dim = TINY_MODELS[kind]
    path = getattr(tiny_models, builder)(folder / kind, seed=1,
                                         max_length=max(512, config.model.max_tokens))
    model = config.model.model_copy(update={
        "name": f"tiny/{kind}", "path": str(path), "dim": dim, "sha256": None, "revision": None,
        "document_prefix": "", "query_prefix": "", "dimensions": None,
        "unused_prompts": ["query", "document"] if kind == "qwen3" else []})
    return config.model_copy(update={"model": model})


def bbc_texts(limit: int | None) -> list[str]:
    texts = []
    for split in ("train", "val", "test"):
        with open(BBC / f"{split}.csv", encoding="utf-8") as f:
            texts += [row["text"] for row in csv.DictReader(f)]
    return texts[:limit] if limit else texts


def write_events(texts: list[str], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"bbc-{i:05d}", "body": text, "source": "bbc",
                                "language": "en", "published_at": "2005-01-01T00:00:00Z"}) + "\n")


def prepared_texts(texts: list[str]) -> list[str]:
    from transforms.text import compose_text
    from transforms.types import NewsEvent

    return [compose_text(NewsEvent(id=str(i), body=t)) for i, t in enumerate(texts)]


def sentence_transformers_docs_per_s(model_path: str, texts: list[str], dtype: str, runs: int,
                                     max_tokens: int) -> dict:
    """In this process: the best batch size on a subset, then the median of ``runs`` full passes."""
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_path, device="cpu")
    model.max_seq_length = max_tokens
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    subset = texts[:256]
    sweep = {}
    for batch_size in ST_BATCH_SIZES:
        model.encode(subset[:32], batch_size=batch_size)  # warm-up
        started = time.perf_counter()
        model.encode(subset, batch_size=batch_size, normalize_embeddings=True)
        sweep[batch_size] = len(subset) / (time.perf_counter() - started)
    best = max(sweep, key=sweep.get)
    rates = []
    for _ in range(runs):
        started = time.perf_counter()
        model.encode(texts, batch_size=best, normalize_embeddings=True)
        rates.append(len(texts) / (time.perf_counter() - started))
    return {"dtype": dtype, "best_batch_size": best, "sweep_docs_per_s": sweep,
            "docs_per_s_runs": rates, "docs_per_s": statistics.median(rates)}


def _st_subprocess(args, model_path: str, dtype: str, max_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.batch", "--st-only", dtype, "--runs", str(args.runs),
           "--model-path", model_path, "--max-tokens", str(max_tokens)]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO_ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local.yaml"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="use the first N articles only")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--skip-st", action="store_true", help="skip sentence-transformers")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--tiny", choices=sorted(TINY_MODELS),
                        help="run on a tiny model built on the spot (random weights): a decoder "
                        "(llama, qwen3) or the BERT, instead of the config's")
    parser.add_argument("--st-only", choices=("float32", "bfloat16"), help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--max-tokens", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:  # sentence-transformers at float32 alone (bf16 is emulated on some CPUs)
        args.limit, args.runs = 8, 1
    texts = bbc_texts(args.limit)

    if args.st_only:
        result = sentence_transformers_docs_per_s(args.model_path, prepared_texts(texts),
                                                  args.st_only, args.runs, args.max_tokens)
        print(json.dumps(result))
        return 0

    logging.basicConfig(level=logging.WARNING)
    config = load(args.config)
    if args.tiny:
        config = tiny_model_config(config, args.tiny,
                                   Path(tempfile.mkdtemp(prefix="newsvec-bench-tiny-")))
    model_path = resolve_model_path(config.model.path)
    results: dict = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                     "docs": len(texts), "runs": args.runs, "cpus": os.cpu_count(),
                     "model": config.model.model_dump(), "tiny": args.tiny}

    st = {}
    if not args.skip_st:  # first, while vLLM is not loaded in this process
        for dtype in ("float32",) if args.smoke else ("float32", "bfloat16"):
            st[dtype] = _st_subprocess(args, model_path, dtype, config.model.max_tokens)
            print(f"sentence-transformers {dtype}: {st[dtype]['docs_per_s']:.1f} docs/s "
                  f"(batch {st[dtype]['best_batch_size']})", flush=True)
    results["sentence_transformers"] = st

    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch

    work = Path(tempfile.mkdtemp(prefix="newsvec-bench-"))
    events = work / "events.jsonl"
    write_events(texts, events)
    prepared = prepared_texts(texts)

    # A warm-up run on a few articles loads the model (timed apart) and warms its kernels, so the
    # measured pipeline and raw runs alike start from a loaded, warm engine.
    warmup_events = work / "warmup.jsonl"
    write_events(texts[:64], warmup_events)
    started = time.perf_counter()
    warmup = run_batch(config.model_copy(update={"input": str(warmup_events),
                                                 "output": str(work / "out-warmup")}),
                       PipelineOptions(["--runner=FnApiRunner"]), engine_factory=OneEngine())
    results["startup"] = {"warmup_run_s": time.perf_counter() - started,
                          "model_load_s": warmup["timings"]["model_load_s"]}
    print(f"model load {warmup['timings']['model_load_s']:.1f} s "
          f"(warm-up run of 64 articles: {results['startup']['warmup_run_s']:.1f} s)", flush=True)

    raw_rates, pipe_rates, pipe_runs = [], [], []
    for run in range(args.runs):
        output = work / f"out-{run}"
        summary = run_batch(config.model_copy(update={"input": str(events), "output": str(output)}),
                            PipelineOptions(["--runner=FnApiRunner"]), engine_factory=OneEngine())
        t = summary["timings"]
        steady_s = t["run_s"] - t["model_load_s"]
        pipe_rates.append(len(texts) / steady_s)
        pipe_runs.append({"startup_s": t["startup_s"], "model_load_s": t["model_load_s"],
                          "run_s": t["run_s"], "embed_s": t["embed_s"], "steady_s": steady_s,
                          "written": summary["counts"]["written"],
                          "mean_batch_fill": summary["batches"]["mean_fill"]})
        print(f"pipeline run {run + 1}: {pipe_rates[-1]:.1f} docs/s "
              f"(graph construction {t['startup_s']:.1f} s apart)", flush=True)

        llm = OneEngine()(config.model).llm  # the engine the pipeline loaded: no second load
        started = time.perf_counter()
        llm.embed(prepared, tokenization_kwargs={"truncation": True,
                                                 "max_length": config.model.max_tokens},
                  use_tqdm=False)
        raw_rates.append(len(texts) / (time.perf_counter() - started))
        print(f"raw LLM.embed run {run + 1}: {raw_rates[-1]:.1f} docs/s", flush=True)

    raw, pipe = statistics.median(raw_rates), statistics.median(pipe_rates)
    best_st = max((v["docs_per_s"] for v in st.values()), default=None)
    results.update({
        "raw_llm_embed": {"docs_per_s_runs": raw_rates, "docs_per_s": raw},
        "pipeline": {"docs_per_s_runs": pipe_rates, "docs_per_s": pipe, "runs_detail": pipe_runs},
        "ratios": {"pipeline_over_raw": pipe / raw,
                   "pipeline_over_best_sentence_transformers": pipe / best_st if best_st else None},
        "targets": {"pipeline_over_raw": 0.95, "pipeline_over_best_sentence_transformers": 1.2},
    })
    out_file = write_results(results, args.results, "batch")
    print(f"\nraw LLM.embed:  {raw:7.1f} docs/s (median of {args.runs})")
    print(f"pipeline:       {pipe:7.1f} docs/s (median, model load and start-up excluded)")
    print(f"pipeline / raw: {pipe / raw:.3f}   (target >= 0.95)")
    if best_st:
        print(f"pipeline / best sentence-transformers ({best_st:.1f} docs/s): {pipe / best_st:.3f}"
              f"   (target >= 1.2)")
    print(f"plot: {plots.batch(results, out_file)}")
    print(f"results: {out_file}")
    return 0


if __name__ == "__main__":
    # Run from the module's importable name: a class defined in __main__ is pickled by value, and
    # the runner's copy of OneEngine would load a second engine.
    from benchmarks import batch

    sys.exit(batch.main())

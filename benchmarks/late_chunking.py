"""Throughput of late chunking (``chunking.mode: late``) against chunks mode, through the Embedder.
``python -m benchmarks.late_chunking [--articles 200] [--runs 3] [--chunk-tokens 128]``.

On the first ``--articles`` BBC articles (``NEWSVEC_BBC_DIR``, default ../shared/data/bbc-news),
their text composed as ``benchmarks.batch`` does and chunked by PrepareText's chunker (the same
spans in both modes), the real vLLM engine of ``--config`` embeds them through
``transforms.embed.Embedder`` in chunks mode (each chunk alone, plus the head) and in late mode (one
``token_embed`` pass over each head, its chunks pooled from it; the chunks past the head alone),
taking turns (the first mode alternates), each run timed after a warm-up call per engine (the two
modes hold two engines: vLLM serves one pooling task per loaded model). Prints the medians of
``--runs`` runs: articles/s and chunk vectors/s per mode, the ratio, the tokens each mode sends the
engine, and how many chunks the head holds (only those get a late vector; with MiniLM's 256-token
head that is the first few of a long article). Writes them with the command and machine to
``bench-results/late_chunking-<time>.json``. """
from __future__ import annotations

import argparse
import hashlib
import statistics
import time

from benchmarks import SMOKE_HELP
from benchmarks.batch import bbc_texts, prepared_texts
from pipeline.config import REPO_ROOT, load
from tools.bench_results import record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.late_chunking",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local.yaml"))
    parser.add_argument("--articles", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=128,
                        help="tokens per chunk (the config's overlap_tokens is kept)")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.articles, args.runs = 8, 1

    from transforms.embed import Embedder, model_inputs
    from transforms.engines.devices import resolved_dtype
    from transforms.text import text_tools
    from transforms.types import NewsEvent, PreparedDoc

    config = load(args.config)
    model = config.model
    chunking = {mode: config.chunking.model_copy(update={"mode": mode,
                                                         "chunk_tokens": args.chunk_tokens})
                for mode in ("chunks", "late")}
    texts = prepared_texts(bbc_texts(args.articles))
    chunker = text_tools(model, chunking["late"]).chunker
    assert chunker is not None
    docs = [PreparedDoc(event=NewsEvent(id=f"bbc-{i:05d}", body=text), text=text,
                        text_sha256=hashlib.sha256(text.encode()).hexdigest(),
                        token_ids=head, truncated=cut, chunks=spans)
            for i, (text, (head, cut, spans)) in enumerate(zip(texts, chunker.split(texts),
                                                               strict=True))]
    chunks = sum(len(d.chunks) for d in docs)
    held = sum(chunker.late_span(len(d.token_ids), c) is not None
               for d in docs for c in d.chunks)
    embedders = {mode: Embedder(model, doc_vector=config.chunking.doc_vector,
                                late=chunking[mode] if mode == "late" else None)
                 for mode in chunking}
    started = time.perf_counter()
    engines = {mode: e.load_engine() for mode, e in embedders.items()}
    for mode, embedder in embedders.items():  # the first call's one-off set-up is not counted
        embedder.embed_docs(engines[mode], docs[:4])
    load_s = time.perf_counter() - started
    tokens = {"chunks": sum(len(ids) for d in docs
                            for ids in model_inputs(d, config.chunking.doc_vector)),
              "late": sum(len(d.token_ids) + sum(
                  len(c.token_ids) for c in d.chunks
                  if chunker.late_span(len(d.token_ids), c) is None) for d in docs)}
    seconds: dict[str, list[float]] = {mode: [] for mode in embedders}
    for run in range(args.runs):
        order = ["chunks", "late"] if run % 2 == 0 else ["late", "chunks"]
        for mode in order:
            began = time.perf_counter()
            results = embedders[mode].embed_docs(engines[mode], docs)
            seconds[mode].append(time.perf_counter() - began)
            failed = sum(not isinstance(r, list) for r in results)
            assert not failed, f"{failed} articles failed in {mode} mode"
            print(f"run {run + 1} {mode:6s}: {seconds[mode][-1]:6.2f} s  "
                  f"{len(docs) / seconds[mode][-1]:6.1f} articles/s", flush=True)

    median = {mode: statistics.median(s) for mode, s in seconds.items()}
    figures = {
        "articles": len(docs), "chunks": chunks, "chunks_held_by_the_head": held,
        "chunk_tokens": args.chunk_tokens, "overlap_tokens": config.chunking.overlap_tokens,
        "doc_vector": config.chunking.doc_vector, "model": model.name,
        "dtype": resolved_dtype(model), "max_tokens": model.max_tokens, "runs": args.runs,
        "load_and_warm_up_s": round(load_s, 1),
        "engine_tokens": tokens,
        "seconds": {mode: [round(s, 2) for s in v] for mode, v in seconds.items()},
        "articles_per_s": {mode: round(len(docs) / m, 1) for mode, m in median.items()},
        "chunk_vectors_per_s": {mode: round(chunks / m, 1) for mode, m in median.items()},
        "late_over_chunks_articles_per_s": round(median["chunks"] / median["late"], 3),
    }
    print(f"{len(docs)} articles, {chunks} chunks of {args.chunk_tokens} tokens "
          f"({held} held by the {model.max_tokens}-token head), {model.name} "
          f"{resolved_dtype(model)}, medians of {args.runs}:")
    for mode in ("chunks", "late"):
        print(f"  {mode:6s} {figures['articles_per_s'][mode]:6.1f} articles/s  "
              f"{figures['chunk_vectors_per_s'][mode]:7.1f} chunk vectors/s  "
              f"{tokens[mode]:,} tokens to the engine")
    print(f"late / chunks, articles/s: {figures['late_over_chunks_articles_per_s']:.3f}")
    print(f"results: {record('late_chunking', figures, argv, args.results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

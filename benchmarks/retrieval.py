"""Retrieval evaluation of head and chunks mode, through newsvec's own output.
``python -m benchmarks.retrieval [--k 10] [--limit N] [--chunk-modes chunks late]``.

On the BBC articles in ../shared/data/bbc-news, in one run of this command:
  1. the batch pipeline in head mode, then in chunks mode (``doc_vector: mean``), and in late mode
     (``chunking.mode: late``, the same chunks) with ``--chunk-modes ... late``, each timed (after
     warm-up runs that load the model), each writing its Parquet output;
  2. a query per article: a sentence from the last third of its prepared text (the one nearest the
     middle of that third, of at least 6 words), embedded with the same engine and settings;
  3. for each query, where its article ranks among all articles by cosine similarity, scored by:
     head-only (the head-mode vector), best chunk (the article's best chunk in chunks/), and mean of
     chunks (the chunks-mode document vector), each again for late mode (``..._late``); recall@1 and
     recall@k of each.
Prints the recalls and the throughput of each chunking mode over head mode (articles/s, same
process), and writes them to ``bench-results/retrieval-<time>.json``.

``--compact`` (issue 24) instead runs the pipeline in head mode four times, ``sink.vector_dtype``
float32 and float16 times the model's full dimension and 128 (``model.dimensions``, truncated
knowingly: MiniLM declares no Matryoshka), and reports per run the bytes per row of the written
``vectors/`` files (zstd) and recall@1 / recall@k by the same queries, embedded at the run's
dimension. Results: ``bench-results/retrieval-compact-<time>.json``.

``--stories`` (same-story copies) instead mixes reprints into the corpus: for a share of the
articles (``--copied-share``, 0.3 by default: reprints are 30-40% of news), 1 to ``--max-copies``
copies each (``tools.near_copies.copy_of``, at strengths drawn from light, medium, heavy and
beyond), all drawn from ``--seed``. It runs the pipeline in head mode on originals and copies,
marks each row's story (the ``story_id`` the pipeline wrote, or, where it wrote none,
``transforms.stories.StoryIndex`` with the config's ``near_duplicates`` settings, originals first,
then copies) and counts the marks that disagree with which article each copy was made from. Each
original's query then ranks all rows, by every row, and collapsed by story (``story_id``, else
``id``: the best-scoring row of each), as ``newsvec search`` does: per query the distinct stories
(true ones) among the top k, and recall@1 / recall@k of the query's story (any row of it). The same
queries over the originals alone give the recalls without copies. Results:
``bench-results/retrieval-stories-<time>.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from benchmarks import SMOKE_HELP
from benchmarks.batch import bbc_texts
from pipeline.config import REPO_ROOT, load
from tools.bench_results import write_results
from tools.story_figures import (
    STRENGTH_NAMES,
    mark_errors,
    story_figures,
    with_copies,
)
from transforms.engines.devices import resolved_dtype
from transforms.output.parquet import vector_matrix
from transforms.settings import ChunkingSettings

_SENTENCE = re.compile(r"[^.!?]+[.!?]+[\"'”’)]*")
MIN_QUERY_WORDS = 6


def tail_query(text: str) -> str | None:
    """The sentence of the last third of ``text`` nearest that third's middle (whole sentences only,
    of at least MIN_QUERY_WORDS words), or None."""
    third = 2 * len(text) / 3
    middle = (third + len(text)) / 2
    candidates = [(abs((m.start() + m.end()) / 2 - middle), m.group().strip())
                  for m in _SENTENCE.finditer(text)
                  if m.start() >= third and len(m.group().split()) >= MIN_QUERY_WORDS]
    return min(candidates)[1] if candidates else None


def _vectors(paths) -> tuple[list[str], np.ndarray]:
    table = pq.read_table(sorted(paths))
    return table["id"].to_pylist(), vector_matrix(table)  # float32, whatever was written


def recall(ranks: np.ndarray, k: int) -> float:
    return float((ranks < k).mean())


def ranks_by_document(scores: np.ndarray, doc_ids: list[str], targets: list[str]) -> np.ndarray:
    """Per query row of ``scores`` (one column per document), the rank of its target document."""
    column = {d: i for i, d in enumerate(doc_ids)}
    target = scores[np.arange(len(targets)), [column[t] for t in targets]]
    return (scores > target[:, None]).sum(axis=1)


def best_chunk_scores(scores: np.ndarray, chunk_doc_ids: list[str]) -> tuple[np.ndarray, list[str]]:
    """Per query, the best chunk score of each document: columns grouped by document."""
    order = np.argsort(np.array(chunk_doc_ids), kind="stable")
    sorted_ids = [chunk_doc_ids[i] for i in order]
    starts = [i for i, d in enumerate(sorted_ids) if i == 0 or d != sorted_ids[i - 1]]
    best = np.maximum.reduceat(scores[:, order], starts, axis=1)
    return best, [sorted_ids[i] for i in starts]


COMPACT_DIMENSIONS = 128


def compact_runs(config, events: Path, work: Path, queries: list[str], targets: list[str],
                 k: int, options) -> list[dict]:
    """``--compact``: per (vector_dtype, dimensions), the bytes per written row and the recalls."""
    from pipeline.run import run_batch
    from transforms.engines.registry import load_engine
    from transforms.text import HeadTokenizer

    head = config.chunking.model_copy(update={"mode": "head"})
    tokenizer = HeadTokenizer(config.model)
    query_ids = [ids for ids, _ in tokenizer.batch(queries)]
    rows = []
    for dimensions in (None, COMPACT_DIMENSIONS):
        model = config.model.model_copy(update={
            "dimensions": dimensions, "truncate_dimensions_knowingly": dimensions is not None})
        query_vectors = np.stack(load_engine(model).embed(query_ids))
        for vector_dtype in ("float32", "float16"):
            out = work / f"{vector_dtype}-{model.output_dim}"
            summary = run_batch(config.model_copy(update={
                "input": str(events), "output": str(out), "chunking": head, "model": model,
                "sink": config.sink.model_copy(update={"vector_dtype": vector_dtype})}), options)
            files = sorted((out / "vectors").glob("*.parquet"))
            written = summary["counts"]["written"]
            ids, matrix = _vectors(files)
            ranks = ranks_by_document(query_vectors @ matrix.T, ids, targets)
            rows.append({"vector_dtype": vector_dtype, "dim": model.output_dim,
                         "rows": written,
                         "bytes_per_row": sum(f.stat().st_size for f in files) / written,
                         "recall@1": recall(ranks, 1), f"recall@{k}": recall(ranks, k)})
            print(f"{vector_dtype} {model.output_dim:4d} dims: "
                  f"{rows[-1]['bytes_per_row']:7.0f} B/row  recall@1 {rows[-1]['recall@1']:.3f}"
                  f"  recall@{k} {rows[-1][f'recall@{k}']:.3f}")
    return rows


def story_marks(ids: list[str], texts: list[str], settings) -> list[str]:
    """Each article's ``story_id`` by ``StoryIndex``, marked in the given order."""
    from transforms.stories import StoryIndex, signatures

    index = StoryIndex(settings)
    return [index.mark(article_id, signature).story_id
            for article_id, signature in zip(ids, signatures(texts, settings), strict=True)]


def skip_figures(table, config, work: Path, options, mark_s: float) -> dict:
    """What ``near_duplicates.action: skip`` leaves out of the engine: from the ``mark`` run's rows
    (those at ``skip_threshold`` or above: their share of rows and of the engine's tokens, which
    is its share of the engine's time for one model), and a second run of the same corpus with
    ``action: skip`` (its counts, whether it balances, its pipeline time against the ``mark``
    run's)."""
    from pipeline.run import run_batch

    threshold = config.near_duplicates.skip_threshold
    similarity = [s or 0.0 for s in table["similarity"].to_pylist()]
    tokens = table["token_count"].to_pylist()
    left_out = [s >= threshold for s in similarity]
    skip_config = config.model_copy(update={
        "output": str(work / "stories-skip"),
        "near_duplicates": config.near_duplicates.model_copy(update={"action": "skip"})})
    summary = run_batch(skip_config, options)
    return {"skip_threshold": threshold, "rows_left_out": sum(left_out),
            "share_of_rows_left_out": sum(left_out) / len(left_out),
            "share_of_tokens_left_out": sum(t for t, out in zip(tokens, left_out, strict=True)
                                            if out) / sum(tokens),
            "skip_run_counts": summary["counts"], "skip_run_balances": summary["invariant_holds"],
            "skip_run_s": round(summary["timings"]["run_s"], 1),
            "mark_run_s": round(mark_s, 1)}


def story_runs(config, work: Path, texts: list[str], args, options) -> dict:
    """``--stories``: the corpus with copies, through the pipeline in head mode, ranked by every
    row and collapsed by story."""
    from pipeline.run import run_batch
    from transforms.engines.registry import load_engine
    from transforms.text import HeadTokenizer, compose_text
    from transforms.types import NewsEvent

    started = time.perf_counter()
    unique = list(dict.fromkeys(texts))  # the pipeline drops exact duplicates; the set has some
    corpus = with_copies(unique, args.seed, args.copied_share, args.max_copies)
    origins = {article_id: origin for article_id, _, origin, _ in corpus}
    events = work / "stories.jsonl"
    with open(events, "w", encoding="utf-8") as f:
        for article_id, body, _, _ in corpus:
            f.write(json.dumps({"id": article_id, "body": body}) + "\n")
    queries, targets = [], []
    for article_id, body, origin, _ in corpus:
        query = tail_query(compose_text(NewsEvent(id=article_id, body=body))) \
            if origin == article_id else None
        if query:
            queries.append(query)
            targets.append(article_id)
    out = work / "stories"
    head = config.model_copy(update={
        "input": str(events), "output": str(out),
        "chunking": config.chunking.model_copy(update={"mode": "head"})})
    summary = run_batch(head, options)
    mark_s = summary["timings"]["run_s"]
    table = pq.read_table(sorted((out / "vectors").glob("*.parquet")))
    skip = skip_figures(table, head, work, options, mark_s)
    ids, matrix = table["id"].to_pylist(), vector_matrix(table)
    written = table["story_id"].to_pylist() if "story_id" in table.column_names else []
    if written and all(written):
        stories, marked_by = written, "the pipeline (story_id of vectors/)"
    else:  # the pipeline wrote no marks: the same marks, made here
        by_id = {article_id: body for article_id, body, _, _ in corpus}
        marking = time.perf_counter()
        order = sorted(ids, key=lambda i: (origins[i] != i, i))  # originals first
        story_of = dict(zip(order, story_marks(
            order, [compose_text(NewsEvent(id=i, body=by_id[i])) for i in order],
            config.near_duplicates), strict=True))
        stories = [story_of[i] for i in ids]
        marked_by = (f"transforms.stories.StoryIndex in the benchmark "
                     f"({time.perf_counter() - marking:.1f} s)")
    errors = mark_errors(ids, stories, origins)
    held = set(ids)  # an article the pipeline dropped (an exact duplicate once prepared)
    queries = [q for q, t in zip(queries, targets, strict=True) if t in held]
    targets = [t for t in targets if t in held]
    truth = [origins[i] for i in ids]
    tokenizer, engine = HeadTokenizer(config.model), load_engine(config.model)
    query_vectors = np.stack(engine.embed([q for q, _ in tokenizer.batch(queries)]))
    scores = query_vectors @ matrix.T
    originals = [c for c, i in enumerate(ids) if origins[i] == i]
    k = args.k
    ranked = {
        "originals_only": story_figures(scores[:, originals], [truth[c] for c in originals],
                                        targets, None, k),
        "every_row": story_figures(scores, truth, targets, None, k),
        "collapsed_by_story": story_figures(scores, truth, targets, stories, k),
        "collapsed_by_true_story": story_figures(scores, truth, targets, truth, k),
    }
    by_strength = {article_id: strength for article_id, _, _, strength in corpus}
    strengths: dict[str, int] = {}
    for _, _, _, strength in corpus:
        if strength:
            strengths[strength] = strengths.get(strength, 0) + 1
    result = {
        "articles": len(unique), "exact_duplicates_left_out": len(texts) - len(unique),
        "copied_articles": len({o for i, o in origins.items() if i != o}),
        "copies": len(corpus) - len(unique), "copies_by_strength": strengths,
        "rows_written": summary["counts"]["written"], "queries": len(queries), "k": k,
        "seed": args.seed, "copied_share": args.copied_share, "max_copies": args.max_copies,
        "marked_by": marked_by, "near_duplicates": config.near_duplicates.model_dump(),
        "stories_marked": len(set(stories)), "stories_true": len(set(truth)),
        "action_skip": skip,
        "mark_errors": {name: len(found) for name, found in errors.items()},
        "copy_mark_errors_by_strength": {
            name: {strength: sum(by_strength[found.split(" -> ")[0]] == strength
                                 for found in errors[name]) for strength in STRENGTH_NAMES}
            for name in ("copies_missed", "copies_split_off", "copies_in_another_story")},
        "mark_error_examples": {name: found[:20] for name, found in errors.items()},
        "ranked": ranked, "run_s": summary["timings"]["run_s"],
        "total_s": time.perf_counter() - started}
    print(f"{len(unique)} articles, {result['copies']} copies of {result['copied_articles']} "
          f"({strengths}); {len(ids)} rows; {len(queries)} queries; pipeline "
          f"{result['run_s']:.1f} s; marks by {marked_by}")
    print(f"marks: {result['stories_marked']} stories against {result['stories_true']} true; "
          f"wrong: {result['mark_errors']}; copies by strength: "
          f"{result['copy_mark_errors_by_strength']}")
    print(f"action skip: {skip['rows_left_out']} rows left out "
          f"({skip['share_of_rows_left_out']:.1%} of rows, {skip['share_of_tokens_left_out']:.1%} "
          f"of the engine's tokens); pipeline {skip['skip_run_s']} s against "
          f"{skip['mark_run_s']} s marking; balances: {skip['skip_run_balances']}")
    for name, figures in ranked.items():
        print(f"  {name:24s} distinct stories@{k} {figures[f'distinct_stories@{k}_mean']:.2f} "
              f"(min {figures[f'distinct_stories@{k}_min']})  recall@1 {figures['recall@1']:.3f}"
              f"  recall@{k} {figures[f'recall@{k}']:.3f}")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.retrieval",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local.yaml"))
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--limit", type=int, default=None, help="the first N articles only")
    parser.add_argument("--chunk-tokens", type=int, default=None,
                        help="default: the config's chunking.chunk_tokens, or model.max_tokens")
    parser.add_argument("--overlap-tokens", type=int, default=None)
    parser.add_argument("--sentence-end-slack-tokens", type=int, default=None)
    parser.add_argument("--chunk-modes", nargs="+", choices=("chunks", "late"),
                        default=["chunks"],
                        help="the chunking modes scored beside head mode (late: late chunking, "
                             "the same chunks pooled from one pass over the head)")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--compact", action="store_true",
                        help="head mode only: float32/float16 x full/128 dimensions, bytes per "
                             "row and recall")
    parser.add_argument("--stories", action="store_true",
                        help="head mode only: copies of a share of the articles mixed in; "
                             "distinct stories in the top k and recall of the query's story, by "
                             "every row and collapsed by story")
    parser.add_argument("--copied-share", type=float, default=0.3,
                        help="--stories: the share of articles reprinted")
    parser.add_argument("--max-copies", type=int, default=5,
                        help="--stories: copies of a reprinted article, 1 to this many")
    parser.add_argument("--seed", type=int, default=40, help="--stories: draws the copies")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; no warm-up runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.limit = 24

    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch
    from transforms.engines.registry import load_engine
    from transforms.text import HeadTokenizer, compose_text
    from transforms.types import NewsEvent

    config = load(args.config)
    overrides = {key: value for key, value in (
        ("chunk_tokens", args.chunk_tokens), ("overlap_tokens", args.overlap_tokens),
        ("sentence_end_slack_tokens", args.sentence_end_slack_tokens)) if value is not None}
    chunking = config.chunking.model_copy(update={"mode": "chunks", "doc_vector": "mean",
                                                  **overrides})
    ChunkingSettings.model_validate(chunking.model_dump())
    texts = bbc_texts(args.limit)
    work = Path(tempfile.mkdtemp(prefix="newsvec-retrieval-"))
    events, queries, targets = work / "events.jsonl", [], []
    with open(events, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            doc_id = f"bbc-{i:05d}"
            f.write(json.dumps({"id": doc_id, "body": text}) + "\n")
            query = tail_query(compose_text(NewsEvent(id=doc_id, body=text)))
            if query:
                queries.append(query)
                targets.append(doc_id)
    options = PipelineOptions(["--runner=FnApiRunner"])
    warm = work / "warm.jsonl"
    warm.write_text("".join(events.read_text().splitlines(keepends=True)[:32]))
    if not args.smoke:  # a smoke run times nothing: no warm-up
        run_batch(config.model_copy(update={"input": str(warm), "output": str(work / "warm")}),
                  options)  # loads the model, kept for the runs below
    if "late" in args.chunk_modes and not args.smoke:  # late mode's engine is another LLM
        run_batch(config.model_copy(update={
            "input": str(warm), "output": str(work / "warm-late"),
            "chunking": chunking.model_copy(update={"mode": "late"})}), options)

    if args.stories:
        stories = story_runs(config, work, texts, args, options)
        out_file = write_results({
            "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "model": config.model.name, "dtype": resolved_dtype(config.model), **stories},
            args.results, "retrieval-stories")
        print(f"results: {out_file}")
        return 0

    if args.compact:
        compact = compact_runs(config, events, work, queries, targets, args.k, options)
        out_file = write_results({
            "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "k": args.k, "queries": len(queries), "articles": len(texts),
            "model": config.model.name, "dtype": resolved_dtype(config.model),
            "runs": compact}, args.results, "retrieval-compact")
        print(f"results: {out_file}")
        return 0

    runs = {}
    modes = [("head", config.chunking.model_copy(update={"mode": "head"}))] + [
        (mode, chunking.model_copy(update={"mode": mode})) for mode in args.chunk_modes]
    for mode, run_chunking in modes:
        out = work / mode
        summary = run_batch(config.model_copy(update={
            "input": str(events), "output": str(out), "chunking": run_chunking}), options)
        runs[mode] = {"output": str(out), "articles": summary["counts"]["written"],
                      "chunks": summary["counts"]["chunks_written"],
                      "run_s": summary["timings"]["run_s"],
                      "articles_per_s": summary["counts"]["written"] / summary["timings"]["run_s"]}
        print(f"{mode}: {runs[mode]['articles']} articles, {runs[mode]['chunks']} chunks in "
              f"{runs[mode]['run_s']:.1f} s: {runs[mode]['articles_per_s']:.1f} articles/s")

    tokenizer, engine = HeadTokenizer(config.model), load_engine(config.model)
    query_vectors = np.stack(engine.embed([ids for ids, _ in tokenizer.batch(queries)]))
    head_ids, head = _vectors((work / "head" / "vectors").glob("*.parquet"))
    ranks = {"head_only": ranks_by_document(query_vectors @ head.T, head_ids, targets)}
    for mode in args.chunk_modes:
        suffix = "" if mode == "chunks" else f"_{mode}"
        mean_ids, mean = _vectors((work / mode / "vectors").glob("*.parquet"))
        chunk_ids, chunks = _vectors((work / mode / "chunks").glob("*.parquet"))
        best, best_ids = best_chunk_scores(query_vectors @ chunks.T, chunk_ids)
        ranks[f"best_chunk{suffix}"] = ranks_by_document(best, best_ids, targets)
        ranks[f"mean_of_chunks{suffix}"] = ranks_by_document(query_vectors @ mean.T, mean_ids,
                                                             targets)
    recalls = {name: {"recall@1": recall(r, 1), f"recall@{args.k}": recall(r, args.k)}
               for name, r in ranks.items()}
    cost = {mode: runs[mode]["articles_per_s"] / runs["head"]["articles_per_s"]
            for mode in args.chunk_modes}
    print(f"{len(queries)} queries (a sentence from the last third of each article), "
          f"{len(head_ids)} articles, {runs[args.chunk_modes[0]]['chunks']} chunks:")
    for name, r in recalls.items():
        print(f"  {name:20s} recall@1 {r['recall@1']:.3f}  recall@{args.k} "
              f"{r[f'recall@{args.k}']:.3f}")
    for mode, ratio in cost.items():
        print(f"{mode} mode / head mode, articles/s: {ratio:.2f}")
    results = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "k": args.k, "queries": len(queries), "articles": len(head_ids),
               "model": config.model.name, "dtype": resolved_dtype(config.model),
               "chunking": chunking.model_dump(), "chunk_modes": args.chunk_modes,
               "recalls": recalls, "runs": runs,
               **{f"{mode}_over_head_articles_per_s": ratio for mode, ratio in cost.items()}}
    out_file = write_results(results, args.results, "retrieval")
    print(f"results: {out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The store (PostgreSQL + pgvector): figures, not timed asserts.
``python -m benchmarks.store --part bulk|bbc|streaming``.

Each part starts its own PostgreSQL with pgvector (``tools.emulators.PostgresServer``) on loopback:
  bulk       100,000 synthetic rows (384 dims) loaded into an empty table in one load (COPY,
             upsert, then the HNSW index built after the rows): rows/s; then the same load again
             (its key is recorded: a no-op), seconds;
  bbc        the 2,225 BBC articles (../shared/data/bbc-news) embedded by a batch run (head mode)
             and loaded; a query per article from its last third (``benchmarks.retrieval``'s
             ``tail_query``); recall@10 of the HNSW index (``hnsw.ef_search`` = ``store.ef_search``)
             against exact search over the same vectors, and query latency p50/p95 (one
             connection, the query vector given, embedding not included);
  streaming  the streaming job (Pub/Sub emulator, local runner, real vLLM) with the store on,
             articles published at a steady rate: publish-to-searchable latency per article (first
             seen in the store by a poller, minus the message's publish time), p50/p95.
Writes ``bench-results/store-<part>-<time>.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from benchmarks import write_results
from benchmarks.batch import bbc_texts
from pipeline.config import REPO_ROOT, load
from tools.emulators import postgres_server
from transforms.schema import vector_schema
from transforms.store import LoadRows, Store, StoreSettings

DSN_ENV = "NEWSVEC_BENCH_STORE_DSN"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def synthetic_rows(n: int, dim: int = 384, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((n, dim)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    now = dt.datetime.now(dt.timezone.utc)
    ids = [f"doc-{i:07d}" for i in range(n)]
    schema = vector_schema(dim)
    columns = {
        "id": ids, "url": [f"https://example.com/{i}" for i in ids], "source": ["bench"] * n,
        "title": [f"Title of {i}" for i in ids], "published_at": [now] * n,
        "language": ["en"] * n, "model": ["bench"] * n, "dim": [dim] * n,
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), dim),
        "text_sha256": [f"{i:064x}" for i in range(n)], "token_count": [200] * n,
        "truncated": [False] * n, "embedded_at": [now] * n, "pubsub_message_id": [None] * n,
        "pubsub_publish_time": [None] * n, "pubsub_attributes": [None] * n,
        "doc_vector": ["head"] * n, "chunk_count": [0] * n, "updated_at": [None] * n}
    return pa.table(columns, schema=schema)


def _settings(config_store: StoreSettings) -> StoreSettings:
    return config_store.model_copy(update={"enabled": True, "dsn_env": DSN_ENV})


def bulk(work: Path, n: int, index_build_memory_mb: int | None) -> dict:
    rows = synthetic_rows(n)
    with postgres_server(work) as server:
        os.environ[DSN_ENV] = server.create_database("bench")
        store = Store(_settings(StoreSettings(index_build_memory_mb=index_build_memory_mb)))
        load = store.load(LoadRows(rows, None, dt.date.today()), "run:bulk")
        again = store.load(LoadRows(rows, None, dt.date.today()), "run:bulk")
    results = {"rows": n, "index_build_memory_mb": index_build_memory_mb,
               "load_s": load.seconds, "rows_per_s": n / load.seconds,
               "noop_reload_s": again.seconds, "noop": again.already_loaded}
    print(f"bulk: {n} rows in {load.seconds:.1f} s ({n / load.seconds:.0f} rows/s, HNSW index "
          f"built after the rows, maintenance_work_mem "
          f"{index_build_memory_mb or 'of the server'} MB); the same load again: "
          f"{again.seconds:.3f} s (no-op)")
    return results


def bbc(work: Path, config_path: str, k: int, limit: int | None) -> dict:
    from apache_beam.options.pipeline_options import PipelineOptions
    from psycopg import sql

    from benchmarks.retrieval import _vectors, tail_query
    from pipeline.load import load_run
    from pipeline.run import run_batch
    from transforms.engine import load_engine
    from transforms.schema import NewsEvent
    from transforms.text import HeadTokenizer, compose_text

    base = load(config_path)
    texts = bbc_texts(limit)
    events = work / "events.jsonl"
    queries = []
    with open(events, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            doc_id = f"bbc-{i:05d}"
            f.write(json.dumps({"id": doc_id, "body": text}) + "\n")
            query = tail_query(compose_text(NewsEvent(id=doc_id, body=text)))
            if query:
                queries.append(query)
    with postgres_server(work) as server:
        os.environ[DSN_ENV] = server.create_database("bench")
        config = base.model_copy(update={"input": str(events), "output": str(work / "out"),
                                         "store": _settings(base.store)})
        summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]))  # loads it too
        loaded = load_run(config, summary["run_id"])  # again: a no-op, timed
        tokenizer, engine = HeadTokenizer(config.model), load_engine(config.model)
        query_vectors = np.stack(engine.embed([ids for ids, _ in tokenizer.batch(queries)]))
        doc_ids, matrix = _vectors((work / "out" / "vectors").glob("*.parquet"))
        exact = np.argsort(-(query_vectors @ matrix.T), axis=1)[:, :k]
        store = Store(config.store)
        hits, latencies = [], []
        with store.connect() as conn:
            conn.execute(sql.SQL("SET hnsw.ef_search = {}").format(
                sql.Literal(max(config.store.ef_search, k))))
            statement = sql.SQL("SELECT id FROM {} ORDER BY embedding <=> %s::vector LIMIT %s") \
                .format(sql.Identifier(config.store.schema_name, config.store.table))
            for vector in query_vectors:
                text = "[" + ",".join(repr(float(x)) for x in vector) + "]"
                started = time.perf_counter()
                found = conn.execute(statement, (text, k)).fetchall()
                latencies.append(time.perf_counter() - started)
                hits.append([r[0] for r in found])
            conn.commit()
    recalls = [len(set(h) & {doc_ids[j] for j in e}) / k for h, e in zip(hits, exact, strict=True)]
    results = {"articles": len(doc_ids), "queries": len(queries), "k": k,
               "ef_search": max(config.store.ef_search, k), "hnsw_m": config.store.hnsw_m,
               "hnsw_ef_construction": config.store.hnsw_ef_construction,
               f"recall@{k}": float(np.mean(recalls)),
               "query_p50_ms": 1000 * percentile(latencies, 0.5),
               "query_p95_ms": 1000 * percentile(latencies, 0.95),
               "noop_reload_s": loaded.seconds}
    print(f"bbc: {len(doc_ids)} articles, {len(queries)} queries: HNSW recall@{k} against exact "
          f"{results[f'recall@{k}']:.3f} (ef_search {results['ef_search']}); query p50 "
          f"{results['query_p50_ms']:.2f} ms, p95 {results['query_p95_ms']:.2f} ms")
    return results


def streaming(work: Path, config_path: str, n: int, rate: float) -> dict:
    import psycopg

    from benchmarks.batch import write_events
    from tools.emulators import emulated_streaming_job
    from tools.publish import publish_file

    base = load(config_path)
    texts = bbc_texts(None)[:n]
    events = work / "events.jsonl"
    write_events(texts, events)
    warm = work / "warm.jsonl"
    warm.write_text("".join(json.dumps({"id": f"warm-{i}", "body": t}) + "\n"
                            for i, t in enumerate(texts[:32])))
    seen: dict[str, float] = {}
    with postgres_server(work) as server:
        dsn = server.create_database("bench")
        os.environ[DSN_ENV] = dsn
        config = base.model_copy(update={
            "output": str(work / "out"), "store": _settings(base.store),
            "streaming": base.streaming.model_copy(update={
                "subscription": "projects/newsvec-bench/subscriptions/news"})})
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                try:
                    with psycopg.connect(dsn) as conn:
                        while not stop.is_set():
                            now = time.time()
                            for (doc_id,) in conn.execute(
                                    f"SELECT id FROM {config.store.table}").fetchall():
                                seen.setdefault(doc_id, now)
                            conn.commit()
                            time.sleep(0.2)
                except psycopg.Error:  # the table is not there yet
                    time.sleep(0.5)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        with emulated_streaming_job(config, work) as topic:
            publish_file(topic, warm, rate=0)
            deadline = time.monotonic() + 300
            while sum(1 for i in seen if i.startswith("warm-")) < 32 and \
                    time.monotonic() < deadline:
                time.sleep(0.5)
            publish_file(topic, events, rate=rate)
            deadline = time.monotonic() + 600
            while sum(1 for i in seen if i.startswith("bbc-")) < n and \
                    time.monotonic() < deadline:
                time.sleep(0.5)
        stop.set()
        with psycopg.connect(dsn) as conn:
            published = dict(conn.execute(
                f"SELECT id, pubsub_publish_time FROM {config.store.table} WHERE id LIKE 'bbc-%'"
            ).fetchall())
    from benchmarks.streaming import _rows

    latencies = [seen[i] - t.timestamp() for i, t in published.items() if i in seen]
    # The same articles' publish-to-Parquet latency (the file's rename time), for the ratio.
    in_files = [mtime - p.timestamp() for i, mtime, p in _rows(work / "out") if i in published]
    results = {"articles": n, "rate": rate, "stored": len(published),
               "window_s": config.streaming.window_s, "max_wait_s": config.streaming.max_wait_s,
               "searchable_p50_s": percentile(latencies, 0.5),
               "searchable_p95_s": percentile(latencies, 0.95),
               "parquet_p50_s": percentile(in_files, 0.5),
               "parquet_p95_s": percentile(in_files, 0.95)}
    print(f"streaming: {len(published)}/{n} articles at {rate:g}/s: publish-to-searchable p50 "
          f"{results['searchable_p50_s']:.1f} s, p95 {results['searchable_p95_s']:.1f} s; "
          f"publish-to-Parquet p50 {results['parquet_p50_s']:.1f} s, p95 "
          f"{results['parquet_p95_s']:.1f} s (window {config.streaming.window_s:g} s)")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("bulk", "bbc", "streaming"), required=True)
    parser.add_argument("--config", default=None, help="default: configs/local.yaml (bulk, bbc), "
                        "configs/local-streaming.yaml (streaming)")
    parser.add_argument("--rows", type=int, default=100_000, help="bulk: rows loaded")
    parser.add_argument("--index-build-memory-mb", type=int, default=None,
                        help="bulk: store.index_build_memory_mb (default: the server's, 64 MB)")
    parser.add_argument("--k", type=int, default=10, help="bbc: recall@k")
    parser.add_argument("--limit", type=int, default=None, help="bbc: the first N articles")
    parser.add_argument("--articles", type=int, default=600, help="streaming: articles")
    parser.add_argument("--rate", type=float, default=20, help="streaming: published per second")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="newsvec-store-bench-"))
    config = args.config or str(REPO_ROOT / "configs" / (
        "local-streaming.yaml" if args.part == "streaming" else "local.yaml"))
    if args.part == "bulk":
        results = bulk(work, args.rows, args.index_build_memory_mb)
    elif args.part == "bbc":
        results = bbc(work, config, args.k, args.limit)
    else:
        results = streaming(work, config, args.articles, args.rate)
    results = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "part": args.part, "cpus": os.cpu_count(), **results}
    print(f"results: {write_results(results, args.results, f'store-{args.part}')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

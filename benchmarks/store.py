"""The store (PostgreSQL + pgvector): figures, not timed asserts.
``python -m benchmarks.store --part bulk|bbc|streaming|microbatch``.

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
             seen in the store by a poller, minus the message's publish time), p50/p95;
  microbatch one streaming micro-batch's load (``--batch-rows`` rows, new articles and a few
             corrected ones) into a table that already holds each of ``--sizes`` articles (384
             dims, filled with SQL ``generate_series``), the median of ``--loads`` loads: it must
             not grow with the table. The HNSW index is left out (a btree stands in under its
             name, so the load's ``CREATE INDEX IF NOT EXISTS`` is a no-op): building one over a
             million rows takes hours here, and its inserts cost the same per row whatever the
             load does; what is measured is everything else a load does under the table's lock.
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

from benchmarks import SMOKE_HELP
from benchmarks.batch import bbc_texts
from pipeline.config import REPO_ROOT, load
from tools.bench_results import write_results
from tools.emulators import postgres_server
from transforms.output.parquet import vector_schema
from transforms.stores.base import LoadRows
from transforms.stores.pgvector import Store, StoreSettings, pgvector_schema

DSN_ENV = "NEWSVEC_BENCH_STORE_DSN"


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def synthetic_rows(n: int, dim: int = 384, seed: int = 0, ids: list[str] | None = None
                   ) -> pa.Table:
    """``n`` rows of ``vectors/`` with random unit vectors; the columns not set here are null (a
    run with near duplicates off)."""
    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((n, dim)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    now = dt.datetime.now(dt.timezone.utc)
    ids = ids or [f"doc-{i:07d}" for i in range(n)]
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
    return pa.table({field.name: columns[field.name] if field.name in columns
                     else pa.nulls(n, field.type) for field in schema}, schema=schema)


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


def _fill(dsn: str, n: int, dim: int) -> float:
    """``n`` articles into the (empty but for a row) articles' table, by one INSERT ...
    generate_series; the HNSW indexes replaced by btrees of the same names. Returns seconds."""
    import psycopg

    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in ("news_vectors", "news_vectors_chunks"):
            conn.execute(f"DROP INDEX {table}_embedding_hnsw")
            conn.execute(f"CREATE INDEX {table}_embedding_hnsw ON {table} (dt)")  # a stand-in
        conn.execute(
            "INSERT INTO news_vectors (id, url, source, title, published_at, language, model, "
            "dim, embedding, text_sha256, token_count, truncated, embedded_at, doc_vector, "
            "chunk_count, dt, load_key) "
            "SELECT 'fill-' || g, 'https://example.com/fill-' || g, 'bench', "
            "'Title of fill ' || g, now(), 'en', 'bench', %s, "
            "(SELECT ('[' || array_to_string(array_fill(0.05::real, ARRAY[%s]), ',') || ']')"
            "::vector), md5(g::text) || md5(g::text), 200, false, now(), 'head', 0, "
            "current_date, 'run:fill-' || (g / 1000) FROM generate_series(1, %s) g",
            (dim, dim, n))
        conn.execute("VACUUM ANALYZE news_vectors")
    return time.perf_counter() - started


def microbatch(work: Path, sizes: list[int], batch_rows: int, loads: int) -> dict:
    import psycopg

    day = dt.date.today()
    results: dict = {"batch_rows": batch_rows, "loads": loads, "dim": 384,
                     "hnsw": "left out (a btree under its name)", "sizes": {}}
    with postgres_server(work) as server:
        for size in sizes:
            dsn = server.create_database(f"bench_{size}")
            os.environ[DSN_ENV] = dsn
            store = Store(_settings(StoreSettings()))
            store.load(LoadRows(synthetic_rows(1, ids=["first"]), None, day), "run:create")
            fill_s = _fill(dsn, size, 384)
            timings = []
            for i in range(loads):
                # New articles, and a few corrections of articles the table holds.
                ids = [f"mb-{i}-{j}" for j in range(batch_rows - 5)] + [
                    f"fill-{1 + (i * 7919 + j * 104729) % size}" for j in range(5)]
                rows = synthetic_rows(batch_rows, seed=i + 1, ids=ids)
                timings.append(store.load(LoadRows(rows, None, day), f"mb:bench:{i}").seconds)
            with psycopg.connect(dsn) as conn:
                found = conn.execute("SELECT pg_total_relation_size('news_vectors')").fetchone()
                table_mb = (found[0] if found else 0) / 2**20
            results["sizes"][str(size)] = {
                "fill_s": fill_s, "table_mb": table_mb, "load_p50_s": percentile(timings, 0.5),
                "load_min_s": min(timings), "load_max_s": max(timings)}
            print(f"microbatch: {batch_rows} rows into a table of {size:,} articles "
                  f"({table_mb:,.0f} MB): load p50 {percentile(timings, 0.5):.3f} s "
                  f"(min {min(timings):.3f}, max {max(timings):.3f}, {loads} loads); "
                  f"filled in {fill_s:.0f} s")
    return results


def bbc(work: Path, config_path: str, k: int, limit: int | None) -> dict:
    from apache_beam.options.pipeline_options import PipelineOptions
    from psycopg import sql

    from benchmarks.retrieval import _vectors, tail_query
    from pipeline.load import load_run
    from pipeline.run import run_batch
    from transforms.engines.registry import load_engine
    from transforms.text import HeadTokenizer, compose_text
    from transforms.types import NewsEvent

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
            # pgvector's names with its schema: a store connection's search_path is pg_catalog
            pgvector = pgvector_schema(conn) or "public"
            statement = sql.SQL("SELECT id FROM {} ORDER BY embedding OPERATOR({}.<=>) %s::{} "
                                "LIMIT %s").format(
                sql.Identifier(config.store.schema_name, config.store.table),
                sql.Identifier(pgvector), sql.Identifier(pgvector, "vector"))
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
    warm_n = min(32, len(texts))
    warm.write_text("".join(json.dumps({"id": f"warm-{i}", "body": t}) + "\n"
                            for i, t in enumerate(texts[:warm_n])))
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
            while sum(1 for i in seen if i.startswith("warm-")) < warm_n and \
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
    parser.add_argument("--part", choices=("bulk", "bbc", "streaming", "microbatch"),
                        required=True)
    parser.add_argument("--config", default=None, help="default: configs/local.yaml (bulk, bbc), "
                        "configs/local-streaming.yaml (streaming)")
    parser.add_argument("--rows", type=int, default=100_000, help="bulk: rows loaded")
    parser.add_argument("--index-build-memory-mb", type=int, default=None,
                        help="bulk: store.index_build_memory_mb (default: the server's, 64 MB)")
    parser.add_argument("--k", type=int, default=10, help="bbc: recall@k")
    parser.add_argument("--limit", type=int, default=None, help="bbc: the first N articles")
    parser.add_argument("--articles", type=int, default=600, help="streaming: articles")
    parser.add_argument("--rate", type=float, default=20, help="streaming: published per second")
    parser.add_argument("--sizes", default="10000,1000000",
                        help="microbatch: the table sizes, comma-separated")
    parser.add_argument("--batch-rows", type=int, default=200, help="microbatch: its rows")
    parser.add_argument("--loads", type=int, default=7, help="microbatch: loads per size")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.limit, args.articles, args.rate = 200, 24, 16, 50
        args.sizes, args.batch_rows, args.loads = "100,1000", 20, 1
    work = Path(tempfile.mkdtemp(prefix="newsvec-store-bench-"))
    config = args.config or str(REPO_ROOT / "configs" / (
        "local-streaming.yaml" if args.part == "streaming" else "local.yaml"))
    if args.part == "bulk":
        results = bulk(work, args.rows, args.index_build_memory_mb)
    elif args.part == "bbc":
        results = bbc(work, config, args.k, args.limit)
    elif args.part == "microbatch":
        results = microbatch(work, [int(x) for x in args.sizes.split(",")], args.batch_rows,
                             args.loads)
    else:
        results = streaming(work, config, args.articles, args.rate)
    results = {"when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "part": args.part, "cpus": os.cpu_count(), **results}
    print(f"results: {write_results(results, args.results, f'store-{args.part}')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

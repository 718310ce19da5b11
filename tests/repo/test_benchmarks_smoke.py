"""Every benchmark still runs: each command of docs/benchmarks.md (each ``--part`` and mode its
table uses) at its ``--smoke`` size (tiny inputs, one run), so that a change that breaks one fails
here rather than when its figure is next measured. Their figures are not checked: a smoke run's
mean nothing.

Each runs in this process (``main(argv)``, found by name: tests/ imports nothing of benchmarks/,
tests/repo/test_layering.py), so that the session's one vLLM model serves them all: their configs
are configs/local*.yaml at float32, the engine in the runner's process, as tests/conftest.py's
``make_config``. A benchmark with a FAKE or MODELED engine runs it. Each must return 0, keep its
run in the ``--results`` folder it is given, and write nothing into the repository (its work goes
to temporary folders). The BBC articles and the emulators a benchmark starts (Pub/Sub,
PostgreSQL, fake-gcs-server) skip it where missing, and fail it under CI=true."""
from __future__ import annotations

import contextlib
import importlib
import os

import pytest

from tests.common import REPO, bbc_file
from tests.emulators import skip_or_fail
from tools.emulators import EmulatorMissing

# (benchmark, its arguments besides --smoke and --results); {local} and {streaming} are the
# configs of the ``configs`` fixture.
SMOKES = [
    ("batch", ["--config", "{local}"]),
    ("compaction", []),
    ("dedup", []),
    ("duty", ["--config", "{streaming}"]),
    ("engine_memory", ["--config", "{streaming}"]),
    ("feed", ["--config", "{local}"]),
    ("feed", ["--config", "{local}", "--language", "ja", "--stages-only"]),
    ("hostile_text", []),
    ("incremental", ["--config", "{local}"]),
    ("incremental", ["--config", "{local}", "--previous-keys", "2500"]),
    ("late_chunking", ["--config", "{local}"]),
    ("model_fetch", []),
    ("near_duplicates", []),
    ("publisher", []),
    ("retrieval", ["--config", "{local}", "--chunk-modes", "chunks", "late"]),
    ("retrieval", ["--config", "{local}", "--compact"]),
    ("retrieval", ["--config", "{local}", "--stories"]),
    ("serve", ["--config", "{local}"]),
    ("soak", ["--config", "{streaming}"]),
    ("state_coders", []),
    ("store", ["--part", "bulk"]),
    ("store", ["--part", "bbc", "--config", "{local}"]),
    ("store", ["--part", "streaming", "--config", "{streaming}"]),
    ("store", ["--part", "microbatch"]),
    ("streaming", ["--config", "{streaming}"]),
    ("uptime", ["--config", "{streaming}"]),
]

# Not the benchmarks' to write: git's, Python's byte code, the linters' caches, a venv.
_NOT_WATCHED = {".git", "__pycache__", ".venv", ".pytest_cache", ".mypy_cache", ".ruff_cache"}


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    """configs/local.yaml and configs/local-streaming.yaml at float32 (the session's model), the
    streaming engine in the runner's process and micro-batches waiting 1 s at most."""
    folder = tmp_path_factory.mktemp("smoke-configs")
    local, streaming = folder / "local.yaml", folder / "streaming.yaml"
    local.write_text(f"extends: {REPO / 'configs' / 'local.yaml'}\nmodel:\n  dtype: float32\n")
    streaming.write_text(f"extends: {REPO / 'configs' / 'local-streaming.yaml'}\n"
                         "model:\n  dtype: float32\n  share_across_processes: false\n"
                         "streaming:\n  max_wait_s: 1\n")
    return {"local": str(local), "streaming": str(streaming)}


def repo_files() -> dict[str, tuple[int, int]]:
    """Every file of the repository but those of _NOT_WATCHED: (modified ns, size)."""
    found = {}
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in _NOT_WATCHED and not d.endswith(".egg-info")]
        for name in files:
            path = os.path.join(root, name)
            stat = os.stat(path)
            found[os.path.relpath(path, REPO)] = (stat.st_mtime_ns, stat.st_size)
    return found


@contextlib.contextmanager
def process_state_kept():
    """The environment and Google's credential lookup as they were: a benchmark points clients
    at its emulators (and answers credentials at once) for the rest of its process."""
    import google.auth

    environment, default = dict(os.environ), google.auth.default
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
        google.auth.default = default


@pytest.mark.parametrize("name, args", SMOKES,
                         ids=[" ".join([name, *args]).replace("{", "").replace("}", "")
                              for name, args in SMOKES])
def test_the_benchmark_runs_at_its_smoke_size_and_writes_only_its_results(
        name, args, configs, tmp_path, monkeypatch):
    bbc_file("train.csv")
    results = tmp_path / "results"
    argv = [arg.format(**configs) for arg in args] + ["--smoke", "--results", str(results)]
    monkeypatch.chdir(REPO)  # a path relative to the working folder lands in the repository
    before = repo_files()
    with process_state_kept():
        try:
            status = importlib.import_module(f"benchmarks.{name}").main(argv)
        except EmulatorMissing as exc:
            skip_or_fail(str(exc))
    assert status == 0, f"python -m benchmarks.{name} {' '.join(argv)} returned {status}"
    assert list(results.glob("*.json")), f"no run kept in {results}"
    after = repo_files()
    written = sorted(path for path in after.keys() | before.keys()
                     if before.get(path) != after.get(path))
    assert not written, f"written in the repository, not in --results: {written}"

"""Benchmarks and evaluations of newsvec: figures, not timed asserts. Run from the repository root:
``python -m benchmarks.<name>`` (or the Makefile targets). Not installed into the worker image.
Every run is kept in bench-results/ (``tools.bench_results.record``), or in the folder
``--results`` names: a benchmark writes nowhere else but temporary folders. ``--smoke`` runs one
on tiny inputs, once, so that CI sees it still runs (tests/repo/test_benchmarks_smoke.py)."""

from __future__ import annotations

SMOKE_HELP = ("tiny inputs, one run: checks that the benchmark runs (tests/"
              "test_benchmarks_smoke.py); its figures mean nothing")


def tree_rss(process=None) -> int:
    """Resident bytes of a process (default: this one) and all its descendants (an engine)."""
    import psutil

    process = process or psutil.Process()
    total = 0
    for p in [process, *process.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # a child that ended meanwhile
            pass
    return total

"""Benchmarks and evaluations of newsvec: figures, not timed asserts. Run from the repository root:
``python -m benchmarks.<name>`` (or the Makefile targets). Not installed into the worker image."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path


def write_results(results: dict, directory: str, name: str) -> Path:
    """``<directory>/<name>-<UTC time>.json``, the file a benchmark's plot is drawn next to."""
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / f"{name}-{dt.datetime.now(dt.timezone.utc):%Y%m%dT%H%M%SZ}.json"
    out_file.write_text(json.dumps(results, indent=2, default=str))
    return out_file


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

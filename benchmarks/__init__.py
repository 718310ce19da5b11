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

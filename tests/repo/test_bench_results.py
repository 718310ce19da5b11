"""docs/benchmarks.md's table of current figures and the runs kept in bench-results/ agree, and
``bench_results.record`` keeps a run with what made it.

- Every row of the table (benchmark, figure) has a record in ``bench-results/`` whose ``name`` is
  that benchmark and which holds that figure with the same value and date; where several records
  hold it, the one measured last must match (a newer run shows in the table, or the test fails).
- Every figure of a record transcribed from the doc is in the table (none left behind).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from tools import bench_results

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "benchmarks.md"
COLUMNS = ["benchmark", "figure", "value", "target", "met?", "machine", "measured", "command"]


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first table under '## Current figures', keyed by its header."""
    section = text.split("\n## Current figures\n", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    split = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    header, rows = split[0], split[2:]
    assert header == COLUMNS, header
    return [dict(zip(header, row, strict=True)) for row in rows]


def records(folder: Path = REPO / "bench-results") -> list[dict]:
    return [json.loads(path.read_text()) | {"_file": path.name}
            for path in sorted(folder.glob("*.json"))]


def latest(name: str, figure: str, kept: list[dict]) -> tuple[dict, dict] | None:
    """The record measured last among those named ``name`` that hold ``figure``, and the figure."""
    holding = [(record, record["figures"][figure]) for record in kept
               if record.get("name") == name and figure in record.get("figures", {})]
    if not holding:
        return None
    return max(holding, key=lambda pair: str(pair[1].get("measured", pair[0]["measured"]))
               if isinstance(pair[1], dict) else str(pair[0]["measured"]))


def test_every_figure_of_the_table_is_kept_with_the_same_value():
    rows, kept = table_rows(DOC.read_text()), records()
    assert len(rows) >= 20
    wrong = []
    for row in rows:
        found = latest(row["benchmark"], row["figure"], kept)
        if found is None:
            wrong.append(f"{row['benchmark']}: {row['figure']!r}: no record in bench-results/")
            continue
        record, figure = found
        value = figure["value"] if isinstance(figure, dict) else str(figure)
        measured = figure.get("measured", record["measured"]) if isinstance(figure, dict) \
            else record["measured"]
        if value != row["value"] or not str(measured).startswith(row["measured"]):
            wrong.append(f"{row['benchmark']}: {row['figure']!r}: the table says "
                         f"{row['value']} ({row['measured']}), {record['_file']} says "
                         f"{value} ({measured})")
    assert not wrong, "\n".join(wrong)


def test_every_transcribed_figure_is_in_the_table():
    shown = {(row["benchmark"], row["figure"]) for row in table_rows(DOC.read_text())}
    transcribed = [r for r in records() if r.get("source") == "transcribed from docs/benchmarks.md"]
    assert transcribed
    missing = [f"{r['_file']}: {figure!r}" for r in transcribed for figure in r["figures"]
               if (r["name"], figure) not in shown]
    assert not missing, "\n".join(missing)


def test_a_changed_value_in_the_table_is_caught(tmp_path):
    rows = table_rows(DOC.read_text())
    row = rows[0]
    kept = records()
    record, figure = latest(row["benchmark"], row["figure"], kept)
    assert figure["value"] == row["value"]
    newer = {"name": row["benchmark"], "measured": "2999-01-01T00:00:00+00:00",
             "figures": {row["figure"]: {"value": "something else", "measured": "2999-01-01"}}}
    record, figure = latest(row["benchmark"], row["figure"], [*kept, newer])
    assert figure["value"] == "something else"  # a newer run wins: the table must follow it


def test_record_keeps_the_figures_the_command_and_the_machine(tmp_path):
    path = bench_results.record("probe", {"docs_per_s": 41.8}, ["--runs", "3"], tmp_path)
    assert re.fullmatch(r"probe-\d{8}T\d{6}Z\.json", path.name)
    kept = json.loads(path.read_text())
    assert kept["name"] == "probe"
    assert kept["figures"] == {"docs_per_s": 41.8}
    assert kept["command"].endswith("--runs 3")
    assert kept["measured"][:4].isdigit()
    machine = kept["machine"]
    assert set(machine) >= {"cpu", "cores", "python", "vllm", "apache-beam", "commit"}
    if Path("/proc/cpuinfo").exists():
        assert machine["cores"] >= 1 and machine["cpu"]

"""Every ``newsvec`` sub-command as a user runs it (a process of its own, so that vLLM and Beam set
up their logging there): standard output holds the command's result alone, which parses (JSON,
JSON lines, YAML, or the documented result lines); its logs go to standard error, the INFO lines
of vLLM, torch and Beam only with ``--verbose``.

One real batch run (real vLLM: about 15 s) of the 40-article sample, as a daily config's day, is
shared by run, search, backfill (the day is skipped: no engine), cleanup and load; ledger and
compact read a streaming output written with FAKE embeddings (tests/streaming_output.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.common import REPO, SAMPLE_EVENTS, make_config
from tools import streaming_output as so

DAY = "2026-12-01"
BATTERY_QUERY = "a factory for solid-state batteries is being built where a steelworks used to be"
# A log line of vLLM ("(MainProcess pid=1) INFO 12-07 ..."), of Python's logging as newsvec formats
# it ("2026-12-07 02:24:43,805 INFO name: ...") or Beam's default ("INFO:apache_beam...").
_LOG_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?(\S+ \S+ )?(DEBUG|INFO|WARNING|ERROR)\b|"
                       r"^(DEBUG|INFO|WARNING|ERROR):", re.M)
_VLLM_INFO = re.compile(r"^\(\w+ pid=\d+\) INFO ", re.M)
_BEAM_INFO = re.compile(r"^(\S+ \S+ INFO apache_beam|INFO:apache_beam)", re.M)


def newsvec(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``newsvec ARGS`` in a fresh process, with no logging setting of the caller's."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_LOGGING_STREAM", "VLLM_LOGGING_LEVEL")}
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def parsed(done: subprocess.CompletedProcess, form: str = "json"):
    """The standard output of a command that exited 0, parsed whole; no log line in it."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert not _LOG_LINE.search(done.stdout), done.stdout[:3000]
    if form == "json":
        return json.loads(done.stdout)
    if form == "json lines":
        return [json.loads(line) for line in done.stdout.splitlines()]
    return yaml.safe_load(done.stdout)


def _write_config(path, **changes) -> str:
    path.write_text(yaml.safe_dump(json.loads(make_config(**changes).model_dump_json())))
    return str(path)


@pytest.fixture(scope="module")
def daily(tmp_path_factory):
    """A daily config ({date} in input and output) and its day DAY run once by ``newsvec run``."""
    root = tmp_path_factory.mktemp("daily")
    (root / "in").mkdir()
    shutil.copy(SAMPLE_EVENTS, root / "in" / f"{DAY}.jsonl")
    config = _write_config(root / "config.yaml", input=str(root / "in" / "{date}.jsonl"),
                           output=str(root / "out" / "dt={date}"))
    done = newsvec("run", "--config", config, "--input_date", DAY)
    return {"config": config, "output": str(root / "out" / f"dt={DAY}"), "run": done,
            "root": root}


def test_run_prints_its_counts_alone_and_quiets_vllm_and_beam(daily):
    done = daily["run"]
    counts = parsed(done)
    assert counts["written"] == 40 and counts["in"] == 54
    assert not _VLLM_INFO.search(done.stderr), done.stderr[-3000:]
    assert not _BEAM_INFO.search(done.stderr), done.stderr[-3000:]
    assert "progress:" in done.stderr  # newsvec's own lines stay


def test_run_verbose_shows_vllm_info_on_stderr_only(tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(SAMPLE_EVENTS.read_text().splitlines(True)[:3]))
    config = _write_config(tmp_path / "config.yaml", input=str(tmp_path / "in.jsonl"),
                           output=str(tmp_path / "out"))
    done = newsvec("--verbose", "run", "--config", config)
    assert parsed(done)["in"] == 3
    assert _VLLM_INFO.search(done.stderr), done.stderr[-3000:]


def test_search_prints_hits_alone(daily):
    hits = parsed(newsvec("search", "--config", daily["config"], "--output", daily["output"],
                          "--k", "3", "--json", BATTERY_QUERY), "json lines")
    assert [hit["id"] for hit in hits][:1] == ["sample-0007"] and len(hits) == 3
    done = newsvec("search", "--config", daily["config"], "--output", daily["output"], "--k", "2",
                   BATTERY_QUERY)
    parsed(done, "lines")
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all(re.match(r"\d\.\d{4}  sample-\d{4}  \S", line)
                                   for line in lines), lines


def test_config_prints_the_config_alone(daily):
    shown = parsed(newsvec("config", "--config", daily["config"]), "yaml")
    assert shown["input"].endswith("{date}.jsonl") and shown["model"]["dim"] == 384


def test_backfill_prints_its_summary_alone_and_its_progress_on_stderr(daily):
    """The day is committed with the same model: skipped, no engine started. Before, the
    progress lines came first on standard output."""
    done = newsvec("backfill", "--config", daily["config"], "--from", DAY, "--until", DAY)
    summary = parsed(done)
    assert summary["days_skipped"] == 1 and summary["days_run"] == 0
    assert "already embedded" in done.stderr


def test_cleanup_prints_what_it_did_alone(daily):
    report = parsed(newsvec("cleanup", "--output", daily["output"]))
    assert report["missing"] == [] and report["refused"] is None


def test_load_prints_what_it_loaded_alone(daily, store_settings, tmp_path):
    summary = json.loads((daily["root"] / "out" / f"dt={DAY}" / "_summary.json").read_text())
    root = daily["root"]
    config = _write_config(tmp_path / "store.yaml", input=str(root / "in" / "{date}.jsonl"),
                           output=str(root / "out" / "dt={date}"), store=store_settings)
    loaded = parsed(newsvec("load", "--config", config, "--run-id", summary["run_id"],
                            "--input_date", DAY))
    assert loaded["rows"] == 40 and loaded["load_key"] == f"run:{summary['run_id']}"


@pytest.fixture(scope="module")
def streaming(tmp_path_factory):
    output = str(tmp_path_factory.mktemp("streaming") / "out")
    so.write(output, so.micro_batches(40, windows=2))
    return output


def test_ledger_and_compact_print_json_alone(streaming):
    totals = parsed(newsvec("ledger", "--output", streaming))
    assert totals["messages_in"] == 40
    hours = parsed(newsvec("compact", "--output", streaming, "--from", "2026-12-01T09:00:00Z",
                           "--until", "2026-12-01T10:00:00Z"), "json lines")
    assert len(hours) == 1 and "error" not in hours[0], hours

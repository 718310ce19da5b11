"""The ``newsvec`` command (pipeline/cli.py) and what a newcomer runs first: every sub-command's
help, the config explained from its one schema (and README.md's table generated from it), a config
checked, a search over the sample's output, the progress of a local batch run, and the one-command
streaming demo (tools/streaming_demo.py) on Google's Pub/Sub emulator with real vLLM."""
from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import cli
from pipeline import config as config_lib
from pipeline.run import run_batch
from pipeline.search import search
from tests.common import REPO, SAMPLE_EVENTS, make_config
from transforms.settings import ChunkingSettings

BATTERY_QUERY = "a factory for solid-state batteries is being built where a steelworks used to be"


def test_newsvec_is_installed_as_a_console_script():
    script = Path(sys.executable).parent / "newsvec"
    assert script.exists(), "setup.py's console script (make setup installs it)"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for command in ("run", "config", "search", "ledger", "cleanup", "backfill"):
        assert f"  {command} " in out.stdout


@pytest.mark.parametrize("command, options", [
    ("run", ["--config", "--input", "--output", "--subscription", "--input_date"]),
    ("config", ["--config", "--explain"]),
    ("search", ["--config", "--k", "--output", "--store", "query"]),
    ("ledger", ["--output", "--from", "--until", "--no-verify", "--store", "--config"]),
    ("load", ["--config", "--run-id", "--output"]),
    ("cleanup", ["--output", "--older-than-s"]),
    ("backfill", ["--config", "--from", "--until", "--force"]),
    ("serve", ["--config", "--host", "--port", "--output", "--input_date"]),
])
def test_every_sub_command_lists_its_options(command, options, capsys):
    try:
        code = cli.main([command, "--help"])
    except SystemExit as exc:  # argparse's own --help
        code = exc.code
    assert code == 0
    shown = capsys.readouterr().out
    assert all(option in shown for option in options), shown


SUB_COMMANDS = ("run", "config", "search", "ledger", "load", "cleanup", "compact", "backfill",
                "serve")


@pytest.mark.parametrize("command", SUB_COMMANDS)
def test_every_sub_command_help_is_written_for_users(command, monkeypatch, capsys):
    """``newsvec SUB --help``: usage says ``newsvec SUB`` (not ``python -m pipeline.ledger``), no
    reStructuredText double backticks or developer wording, every option has help text, and a
    list in the description keeps its line breaks."""
    import argparse

    parsers = []
    format_help = argparse.ArgumentParser.format_help

    def recorded(parser):
        parsers.append(parser)
        return format_help(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "format_help", recorded)
    try:
        code = cli.main([command, "--help"])
    except SystemExit as exc:
        code = exc.code
    assert code == 0
    shown = capsys.readouterr().out
    (parser,) = {id(p): p for p in parsers}.values()
    assert parser.prog == f"newsvec {command}" and shown.startswith(f"usage: newsvec {command} ")
    for wording in ("``", "python -m", "setup.py", "console script"):
        assert wording not in shown, wording
    no_help = [action.option_strings or action.dest for action in parser._actions
               if not isinstance(action, argparse._HelpAction)
               and (not action.help or action.help == argparse.SUPPRESS)]
    assert no_help == []
    assert "--verbose" in shown
    if command in ("ledger", "cleanup", "backfill"):  # their descriptions hold a list
        assert re.search(r"\n  (-|1\.) \S", shown), shown


def test_newsvec_help_is_written_for_users_and_version_prints_the_package_version(capsys):
    from importlib.metadata import version

    assert cli.main(["--help"]) == 0
    shown = capsys.readouterr().out
    assert "``" not in shown and "setup.py" not in shown and "console script" not in shown
    assert all(f"\n  {command} " in shown for command in SUB_COMMANDS)
    assert "--version" in shown and "--verbose" in shown
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"newsvec {version('newsvec')}\n"


def test_config_explain_lists_every_key_and_readme_shows_the_same_table(capsys):
    assert cli.main(["config", "--explain"]) == 0
    shown = capsys.readouterr().out
    keys = [key for key, _, _ in config_lib.explain()]
    assert len(keys) > 40 and all(f"{key}\n" in shown for key in keys)
    assert all(meaning for _, _, meaning in config_lib.explain()), "every key has a meaning"
    for nested in ("model.query_prefix", "chunking.doc_vector", "incremental.previous_outputs",
                   "streaming.batch_shards", "sink.store_chunk_text"):
        assert nested in keys
    readme = (REPO / "docs" / "configuration.md").read_text()
    assert config_lib.explain_markdown() in readme, "docs/configuration.md's config table is " \
        "generated: paste `newsvec config --explain --markdown` between its config-table markers"


def test_config_prints_a_config_that_loads_back_the_same(tmp_path, capsys):
    assert cli.main(["config", "--config", str(REPO / "configs" / "local.yaml")]) == 0
    path = tmp_path / "again.yaml"
    path.write_text(capsys.readouterr().out)
    assert config_lib.load(path) == config_lib.load(REPO / "configs" / "local.yaml")
    assert cli.main(["config", "--config", str(tmp_path / "missing.yaml")]) == 2


@pytest.fixture(scope="module")
def sample_outputs(tmp_path_factory):
    """The sample embedded in head mode and in chunks mode (real vLLM)."""
    out = {mode: tmp_path_factory.mktemp(mode) for mode in ("head", "chunks")}
    options = PipelineOptions(["--runner=FnApiRunner"])
    run_batch(make_config(input=str(SAMPLE_EVENTS), output=str(out["head"])), options)
    run_batch(make_config(input=str(SAMPLE_EVENTS), output=str(out["chunks"]),
                          chunking=ChunkingSettings(mode="chunks", chunk_tokens=128)), options)
    return out


def test_search_finds_the_sample_article_a_query_is_about(sample_outputs, capsys):
    config = make_config()
    hits = search(config, BATTERY_QUERY, k=5, output=str(sample_outputs["head"]))
    assert hits[0]["id"] == "sample-0007" and hits[0]["chunk_index"] is None
    assert "battery" in hits[0]["title"] and len(hits) == 5
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    # Through the command, on chunks: the best chunk of each article.
    config_file = Path(sample_outputs["chunks"]) / "config.yaml"
    config_file.write_text(yaml.safe_dump(json.loads(make_config(
        input="x", output=str(sample_outputs["chunks"])).model_dump_json())))
    assert cli.main(["search", "--config", str(config_file), "--k", "3", "--json",
                     BATTERY_QUERY]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["id"] == "sample-0007" and lines[0]["chunk_index"] is not None
    assert len(lines) == 3


def test_search_json_in_a_fresh_process_prints_json_lines_alone(sample_outputs, tmp_path):
    """``newsvec search --json`` as a user runs it (a process of its own, so vLLM configures its
    logging there): every line of standard output is a hit, as ``jq`` reads it; vLLM's log lines
    go to standard error. Before, vLLM wrote its INFO lines to standard output first."""
    import os

    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(json.loads(make_config(
        input="x", output=str(sample_outputs["head"])).model_dump_json())))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_STREAM"}
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "search", "--config",
                           str(config_file), "--k", "2", "--json", BATTERY_QUERY],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    hits = [json.loads(line) for line in done.stdout.splitlines()]
    assert [hit["id"] for hit in hits][:1] == ["sample-0007"] and len(hits) == 2


def test_search_puts_model_query_prefix_before_the_query():
    """e5 and bge expect a prefix on queries: the query is embedded as prefix + query, the
    counterpart of ``document_prefix`` on articles (same engine: prefixes are not engine
    settings)."""
    import numpy as np

    from pipeline.search import embed_query

    plain = make_config()
    prefixed = make_config(model=plain.model.model_copy(update={"query_prefix": "query: "}))
    with_prefix = embed_query(prefixed, "solid-state batteries")
    assert np.allclose(with_prefix, embed_query(plain, "query: solid-state batteries"), atol=1e-6)
    assert float(np.dot(with_prefix, embed_query(plain, "solid-state batteries"))) < 0.999


def test_a_local_batch_run_reports_its_progress(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="newsvec.progress")
    run_batch(make_config(input=str(SAMPLE_EVENTS), output=str(tmp_path)),
              PipelineOptions(["--runner=FnApiRunner"]))
    lines = [r.getMessage() for r in caplog.records if r.name == "newsvec.progress"]
    assert lines and lines[-1].startswith("progress: 54/54 articles (100%)"), lines
    assert "articles/s" in lines[-1] and "ETA" in lines[-1]


def test_the_streaming_demo_runs_end_to_end(tmp_path, capsys):
    from tests.emulators import skip_or_fail
    from tools import emulators, streaming_demo

    if shutil.which("gcloud") is None:
        skip_or_fail("the Pub/Sub emulator (gcloud) is not installed")
    assert emulators  # the demo starts it itself
    # The demo's config at float32 and with its engine in this process, so that it shares the
    # session's engine (configs/local-streaming.yaml spawns one of its own).
    raw = yaml.safe_load((REPO / "configs" / "local-streaming.yaml").read_text())
    raw["extends"] = str(REPO / "configs" / raw["extends"])  # the copy is elsewhere
    raw["model"].update(dtype="float32", share_across_processes=False)
    config = tmp_path / "streaming.yaml"
    config.write_text(yaml.safe_dump(raw))
    code = streaming_demo.main(["--config", str(config), "--output", str(tmp_path / "out"),
                                "--rate", "0", "--timeout-s", "400"])
    shown = capsys.readouterr().out
    assert code == 0, shown
    start = shown.index("\n{") + 1  # after the demo's progress lines
    totals = json.loads(shown[start:shown.index("\n}", start) + 2])
    sample = [line for line in SAMPLE_EVENTS.read_bytes().splitlines() if line.strip()]
    assert totals["published"] == totals["messages_in"] == len(sample)
    assert totals["rows_written"] == 40 and totals["balanced"]
    assert list((tmp_path / "out" / "vectors").rglob("*.parquet"))


def test_the_streaming_demo_says_how_to_install_a_missing_emulator(tmp_path, monkeypatch, capsys):
    from tools import emulators, streaming_demo

    monkeypatch.setattr(emulators.shutil, "which", lambda name: None)
    assert streaming_demo.main(["--output", str(tmp_path / "out")]) == 2
    assert "gcloud components install pubsub-emulator" in capsys.readouterr().err


HOSTILE_HITS = [
    {"score": 0.9, "id": "\x1b]0;owned\x07\x1b[2Jfake-id", "title": "a \x9b31mred\u202etxt.exe",
     "chunk_index": None},
    {"score": 0.8, "id": "ok-id", "title": "日本語の見出し\x00\x7f", "chunk_index": 2},
]


@pytest.mark.parametrize("json_lines", [False, True])
def test_search_prints_no_terminal_control_character_of_the_data(monkeypatch, capsys, json_lines):
    """Ids and titles are the publishers' text: an escape sequence in them (a terminal title, a
    cleared screen, C1's CSI, a right-to-left override) is written out as an escape, never sent
    to the terminal; printable text (Japanese) stays as it is, and --json still parses to the same
    values. Before: printed raw (and --json, with ensure_ascii off, kept C1 and U+202E raw)."""
    import pipeline.search

    monkeypatch.setattr(pipeline.search, "search",
                        lambda config, query, k, output=None: HOSTILE_HITS)
    argv = ["search", "--config", str(REPO / "configs" / "local.yaml"), "q"]
    assert cli.main(argv + (["--json"] if json_lines else [])) == 0
    out = capsys.readouterr().out
    assert all(ch.isprintable() for line in out.splitlines() for ch in line), repr(out)
    assert "日本語の見出し" in out
    if json_lines:
        assert [json.loads(line) for line in out.splitlines()] == HOSTILE_HITS
    else:
        assert "\\x1b]0;owned\\x07\\x1b[2Jfake-id" in out and "\\u202e" in out

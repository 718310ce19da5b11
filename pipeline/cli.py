"""The ``newsvec`` command: the pipeline and what operators run beside it, one sub-command each
(``_DELEGATED``: a module's own ``main``; ``config`` and ``search`` here). ``HELP`` is what
``newsvec --help`` shows. Every sub-command takes ``--verbose`` (``pipeline.command_logging``)
and writes its result alone on standard output, its logs on standard error.

Demos, the publisher and the benchmarks are not part of the installed runtime: run them from the
repository (``make run-streaming``, ``python -m tools.publish``, ``make benchmark``...).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

import yaml

from pipeline import config as config_lib
from pipeline import logs_to_stderr, parse_command
from pipeline.terminal import escaped, json_escaped
from transforms.stores.base import StoreError

_DELEGATED = {  # sub-command -> its module, whose main parses its own options
    "run": "pipeline.run",
    "load": "pipeline.load",
    "ledger": "pipeline.ledger",
    "cleanup": "pipeline.cleanup",
    "compact": "pipeline.compact",
    "backfill": "pipeline.backfill",
    "check-model": "pipeline.check_model",
    "serve": "pipeline.serve.main",
}


HELP = """\
usage: newsvec [--version] [--verbose] SUB-COMMAND [options]

newsvec turns news articles into embedding vectors (Parquet files, and optionally a pgvector
store), in batch or streaming, and checks and searches what it wrote.

sub-commands:
  run       run the pipeline: batch, or streaming when a subscription is set
  config    check a config, or list every key (--explain)
  search    the nearest articles of an output (or of the store) to a query
  load      load a committed batch run into the store (after a failed load; again)
  ledger    check a streaming output against its ledger (and the store against it)
  cleanup   clean what killed workers and runs left in an output
  compact   rewrite a streaming output's closed hours into few large files
  backfill  embed an archive of daily inputs, one run per day
  check-model  embed a sample as the pipeline would and with sentence-transformers, and
            compare: run it before a model (a fine-tuned checkpoint) serves
  serve     serve the model over HTTP: embeddings (OpenAI's API) for queries and documents,
            search, /info for clients to check themselves against the corpus

Each sub-command prints its result on standard output (JSON where it is data) and its logs on
standard error; the INFO logs of vLLM, torch and Beam only with --verbose.

options:
  -h, --help   show this help and exit
  --version    print newsvec's version and exit
  --verbose    also show the INFO logs of vLLM, torch and Beam (any sub-command takes it)

`newsvec SUB-COMMAND --help` lists a sub-command's options."""


def version() -> str:
    """The installed package's version (setup.py's, from its metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("newsvec")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed: pip install -e .)"


def _config_command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="newsvec config", description="Check a config file and print it with every default "
        "filled in, or list every config key with its default and meaning (--explain).")
    parser.add_argument("--config", default=str(config_lib.DEFAULT_CONFIG),
                        help="a config file, local or gs:// (default: configs/local.yaml)")
    parser.add_argument("--explain", action="store_true",
                        help="list every config key, its default and its meaning")
    parser.add_argument("--markdown", action="store_true",
                        help="with --explain: as a Markdown table (the one in "
                        "docs/configuration.md)")
    args = parse_command(parser, argv)
    if args.explain:
        if args.markdown:
            print(config_lib.explain_markdown())
            return 0
        for key, default, meaning in config_lib.explain():
            print(f"{key}\n    default: {default or '-'}\n    {meaning}")
        return 0
    config = config_lib.load(args.config)  # runs none of the config's code (no model import)
    print(yaml.safe_dump(json.loads(config.model_dump_json()), sort_keys=False), end="")
    for line in config_lib.checks_left_to_the_run(config):
        print(f"newsvec config: {line}", file=sys.stderr)
    return 0


def _search_command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="newsvec search", description="Embed a query as the config's model embeds an "
        "article (with model.query_prefix before it) and print the nearest stories of the "
        "output, best first: score, id and title of each story's nearest article and how many "
        "copies of it the output holds, one a line (or JSON lines with --json).")
    parser.add_argument("query", help="the query text, in any language the model reads; `-`: "
                        "read it from stdin (UTF-8)")
    parser.add_argument("--config", default=str(config_lib.DEFAULT_CONFIG),
                        help="the config whose model and output to use")
    parser.add_argument("--k", type=int, default=10, help="how many stories (default 10; "
                        "articles with --all-copies)")
    parser.add_argument("--output", help="search this output prefix instead of the config's")
    parser.add_argument("--input_date", help="fills {date} in the config's output, as the run "
                        "(default yesterday)")
    parser.add_argument("--store", action="store_true", help="search the store (the config's "
                        "store: section, its HNSW index) instead of the Parquet output")
    parser.add_argument("--all-copies", action="store_true", help="every article, each copy "
                        "of a story on its own line, instead of one line per story (its "
                        "nearest article)")
    parser.add_argument("--json", action="store_true", help="print JSON lines (UTF-8, "
                        "non-ASCII text as it is, not as \\u escapes)")
    args = parse_command(parser, argv)
    from pipeline.search import search, search_store

    config = config_lib.load_for_command(args.config, output=args.output,
                                         input_date=args.input_date)
    query = _query_text(args.query)
    every: dict[str, Any] = {"all_copies": True} if args.all_copies else {}  # else by story
    hits = (search_store(config, query, args.k, **every) if args.store
            else search(config, query, args.k, **every))  # --output: filled by the loader
    for hit in hits:
        if args.json:  # a Japanese title as it reads; a control character as a \u escape
            _print_line(json_escaped(json.dumps(hit, ensure_ascii=False)))
        else:
            where = f"  (chunk {hit['chunk_index']})" if hit["chunk_index"] is not None else ""
            copies = hit.get("copies") or 0
            if copies:
                where += f"  (+{copies} cop{'y' if copies == 1 else 'ies'})"
            _print_line(f"{hit['score']:.4f}  {escaped(str(hit['id']))}  "
                        f"{escaped(hit['title'] or '')}{where}")
    return 0


def _query_text(arg: str) -> str:
    """The query as typed. ``-``: stdin, read as UTF-8 whatever the locale. An argument that holds
    surrogates is one the interpreter could not decode in a locale that is not UTF-8 (it keeps the
    bytes as surrogates): its bytes are decoded as UTF-8, as the terminal sent them."""
    if arg == "-":
        return sys.stdin.buffer.read().decode("utf-8", errors="replace")
    try:
        arg.encode("utf-8")
        return arg
    except UnicodeEncodeError:
        pass
    try:
        return os.fsencode(arg).decode("utf-8", errors="replace")
    except UnicodeEncodeError:  # a surrogate that no undecodable byte became
        return arg.encode("utf-8", errors="replace").decode("utf-8")


def _print_line(line: str) -> None:
    """Print one result line; as UTF-8 bytes when stdout's encoding cannot hold it (a locale that
    is not UTF-8, ``PYTHONIOENCODING=ascii``: a Japanese title), rather than fail after the
    search."""
    try:
        print(line)
    except UnicodeEncodeError:  # nothing was written: the line is encoded whole first
        sys.stdout.flush()
        sys.stdout.buffer.write(line.encode("utf-8") + b"\n")
        sys.stdout.buffer.flush()


def main(argv: Optional[Sequence[str]] = None) -> int:
    logs_to_stderr()
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"run", "config", "search", *_DELEGATED}
    verbose = False
    while argv and argv[0] in ("--verbose", "--version"):
        if argv.pop(0) == "--version":
            print(f"newsvec {version()}")
            return 0
        verbose = True
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"newsvec: no sub-command {argv[0]!r}", file=sys.stderr)
        print(HELP, file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:] + (["--verbose"] if verbose else [])
    try:
        if command == "config":
            return _config_command(rest)
        if command == "search":
            return _search_command(rest)
        import importlib

        return importlib.import_module(_DELEGATED[command]).main(rest)
    except config_lib.ConfigError as exc:
        print(f"newsvec: bad config: {exc}", file=sys.stderr)
        return 2
    except StoreError as exc:  # its message scrubbed of the connection string, nothing chained
        print(f"newsvec {command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

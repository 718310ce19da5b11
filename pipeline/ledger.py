"""Check a streaming output against its ledger: ``python -m pipeline.ledger --output PREFIX
[--from T] [--until T] [--no-verify]``.

Each micro-batch of a streaming job writes a ledger record (``ledger/dt=../hour=../*.json``) after
its data files. This sums the records whose window starts in ``[--from, --until)`` (RFC 3339, UTC;
both optional), prints the totals as JSON, and exits 1, naming each window, if:
- a record does not balance (``messages_in != rows_written + dead_lettered + duplicates``), or its
  dead letters by reason, or by language and reason, do not add up to its dead letters;
- a record names a file that is missing or, with verification on (the default), holds another number
  of rows (Parquet footer) or dead letters (lines) than the record says;
- a record's keys do not match its rows (``keys/``: the index the nightly incremental job trusts);
- a data file under ``vectors/``, ``chunks/``, ``keys/`` or ``dead_letter/`` has no record that
  names it;
- with verification on, one Pub/Sub message is held by two files: a row in two vectors files, a
  dead letter in two dead-letter files, or a row in one and a dead letter in another (written
  twice; each copy counted in its record, so each record balances);
- a compacted hour (``newsvec compact``) holds a compacted file that its manifest does not name, or
  a micro-batch file that its manifest says was replaced: an unfinished compaction, which a rerun
  of ``newsvec compact`` finishes. Over compacted hours the records are read from the compacted
  ledger files and each record's files resolved through the manifest
  (``transforms.output.compaction``).
- with ``--store --config C``: a record with rows has no store load, its load key is not in the
  store's ``<table>_loads`` (or with another row count or other rejected rows), its stored rows
  and the rows the store refused (``store_rejected``) do not add up to its rows; with
  verification on, an article of its vectors file (compacted or not) is not in the store, or is
  there as another version that is not a later one (``schema.VERSION_ORDER``); or the store
  holds a row, loaded under a micro-batch's key, that the micro-batch's files do not hold (a
  message dead-lettered there, or an earlier attempt's row).
A window still being written (the job is running, a late pane may come) can show a data file whose
record is not written yet; check windows older than ``allowed_lateness_s`` plus a few minutes, or a
drained job.
"""
from __future__ import annotations

import argparse
import json
import sys

from transforms.output.ledger_check import check
from transforms.types import utc_time

HELP = """\
Check a streaming output against its ledger.

Each micro-batch of a streaming job writes a ledger record after its data files. This sums the
records whose window starts in [--from, --until) (both optional) and prints the totals as JSON.
It exits with status 1, naming each window on standard error, when:
  - a record does not balance (messages in = rows written + dead letters + duplicates), or its
    dead letters by reason, or by language and reason, do not add up;
  - a record names a file that is missing or (unless --no-verify) holds another number of rows
    or dead letters than the record says;
  - a record's keys do not match its rows;
  - a data file has no record that names it;
  - (unless --no-verify) one Pub/Sub message is held by two files;
  - a compacted hour is unfinished (run newsvec compact again to finish it);
  - with --store: a micro-batch with rows is not loaded into the store, or the store's rows do
    not match its files.
A window still being written can show a data file whose record is not written yet: check windows
older than streaming.allowed_lateness_s plus a few minutes, or a drained job."""


def main(argv=None) -> int:
    from pipeline import parse_command

    parser = argparse.ArgumentParser(prog="newsvec ledger", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="the streaming job's output prefix (default: the "
                        "config's, with --config)")
    parser.add_argument("--config", help="the job's config (needed with --store)")
    parser.add_argument("--store", action="store_true",
                        help="also check the store (the config's store: section) against the "
                             "ledger: every micro-batch loaded, every article of its files there")
    parser.add_argument("--from", dest="start", metavar="TIME",
                        help="first window start, RFC 3339 (UTC)")
    parser.add_argument("--until", dest="end", metavar="TIME",
                        help="end of the range (exclusive), RFC 3339")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not open data files to count their rows")
    args = parse_command(parser, argv)
    config = None
    if args.config:
        from pipeline import config as config_lib

        config = config_lib.load_for_command(args.config, output=args.output)
    if args.store and config is None:
        parser.error("--store needs --config (its store: section)")
    output = config.output if config else args.output
    if output is None:
        parser.error("give --output (or --config)")
    report = check(output, utc_time(args.start), utc_time(args.end),
                   verify=not args.no_verify, store=config.store if args.store and config else None)
    print(json.dumps(report.totals, indent=2))
    for problem in report.problems:
        print(problem, file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

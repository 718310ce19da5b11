"""Compact a streaming output's closed hours: ``newsvec compact (--config C | --output PREFIX)
[--day D | --hour H | --from T --until T]``.

Rewrites each hour's micro-batch files (vectors, chunks, keys, dead letters, ledger records) into
one file per kind, row groups of ``sink.row_group_rows`` (``transforms/output/compaction.py``),
under the output's publish lease, one hour at a time, every change fenced by it (a run whose lease
is taken over stops, its line says ``LeaseLost``, and the taker or the next run finishes its hour).
Readers that follow the ledger or the compaction manifest (``newsvec ledger``, the nightly
incremental job's key listing) see either the hour before or the hour after, whenever it is killed;
a rerun finishes it; an hour with nothing new is left as it is. Hours that are not closed yet (their
end plus ``streaming.allowed_lateness_s`` plus the grouping's grace plus 5 minutes is after now) are
skipped unless ``--closed-after-s 0``: compacting one is safe (a micro-batch written later stays and
is merged by the next run) but wastes a rewrite.

Plain Python (pyarrow over Beam's FileSystems, local or gs://), no Beam pipeline: an hour of output
is read once and written once, streaming row groups, so it needs one CPU and memory for about two
row groups, whatever the hour's size. Prints one JSON line per hour; exits 1 if an hour could not
be compacted (its line says why; the other hours are compacted all the same).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import logging
import sys
from typing import Optional

import pyarrow as pa

from pipeline import config as config_lib
from pipeline.cleanup import checked_argument
from transforms.output.compaction import CompactionResult, Hook, compact_partition
from transforms.output.layout import new_run_id, partition_hour, partitions_between
from transforms.output.lease import LeaseLost, PublishLease
from transforms.settings import SinkSettings, StreamingSettings
from transforms.timing_floors import require_lease_s
from transforms.types import utc_time
from transforms.windowing import GROUPING_GRACE_S

CLOSED_MARGIN_S = 300
_LOG = logging.getLogger(__name__)


def hour_range(day: Optional[str], hour: Optional[str], start: Optional[str],
               end: Optional[str], now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """``[start, end)`` of the hours to compact: a day (YYYY-MM-DD, today, yesterday; UTC), an hour
    (YYYY-MM-DDTHH), or two RFC 3339 times."""
    if hour is not None:
        first = dt.datetime.strptime(hour, "%Y-%m-%dT%H").replace(tzinfo=dt.timezone.utc)
        return first, first + dt.timedelta(hours=1)
    if start is not None or end is not None:
        if start is None or end is None:
            raise config_lib.ConfigError("give both --from and --until, or neither")
        return utc_time(start), utc_time(end)
    date = config_lib.parse_input_date(day or "yesterday", now)
    first = dt.datetime.combine(date, dt.time(), dt.timezone.utc)
    return first, first + dt.timedelta(days=1)


def default_closed_after_s(streaming: StreamingSettings) -> float:
    """How long after its end an hour is closed: late panes may come until then."""
    return streaming.allowed_lateness_s + GROUPING_GRACE_S + CLOSED_MARGIN_S


def hour_closed(hour: dt.datetime, closed_after_s: float, now: dt.datetime) -> bool:
    """Whether the hour that starts at ``hour`` is closed at ``now``: one a compaction takes."""
    return hour + dt.timedelta(hours=1, seconds=closed_after_s) <= now


def compact_range(output: str, start: dt.datetime, end: dt.datetime, row_group_rows: int,
                  lease_s: float = 600, closed_after_s: float = 0,
                  now: Optional[dt.datetime] = None, hook: Optional[Hook] = None
                  ) -> list[dict]:
    """Compact every closed hour of ``[start, end)``, one at a time, under the publish lease."""
    now = now or dt.datetime.now(dt.timezone.utc)
    out = []
    with PublishLease(output, f"compact-{new_run_id()}", lease_s) as lease:
        for partition in partitions_between(start, end):
            hour = partition_hour(partition)
            if not hour_closed(hour, closed_after_s, now):
                out.append({"partition": partition, "skipped": "not closed yet"})
                continue
            try:
                result: CompactionResult = compact_partition(output, partition, lease,
                                                             row_group_rows, hook)
            except LeaseLost as exc:
                # Taken over (this run stalled): not one more change, in this hour or the next.
                # What it left is finished by the taker or the next run.
                _LOG.error("%s: not compacted, and no hour after it: %s", partition, exc)
                out.append({"partition": partition, "error": f"LeaseLost: {exc}"})
                break
            except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
                # One hour that cannot be compacted (a record naming a missing file, two schemas
                # in one hour) holds up no other; the run reports it and exits non-zero.
                _LOG.error("%s: not compacted: %s", partition, exc)
                out.append({"partition": partition, "error": f"{type(exc).__name__}: {exc}"})
                continue
            out.append(dataclasses.asdict(result))
    return out


HELP = ("Rewrite a streaming output's closed hours into one file per kind (vectors, chunks, keys, "
        "dead letters, ledger records), one hour at a time, under the output's publish lease. "
        "Readers that follow the ledger see the hour either as it was or as it is after, "
        "whenever the command is killed; running it again finishes the hour. Hours not closed "
        "yet are skipped unless --closed-after-s 0. Prints one JSON line per hour; exits with "
        "status 1 if an hour could not be compacted (its line says why).")


def parser() -> argparse.ArgumentParser:
    from pipeline import VERBOSE_HELP

    parser = argparse.ArgumentParser(prog="newsvec compact", description=HELP)
    parser.add_argument("--config", help="the streaming job's config (its output, "
                                         "sink.row_group_rows, sink.commit_lease_s, "
                                         "streaming.allowed_lateness_s), local or gs://")
    parser.add_argument("--output", help="the streaming output prefix (instead of the config's)")
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--day", help="YYYY-MM-DD, today or yesterday (UTC; default yesterday)")
    when.add_argument("--hour", help="one hour, YYYY-MM-DDTHH (UTC)")
    when.add_argument("--from", dest="start", metavar="TIME",
                      help="with --until: the hours of [from, until), RFC 3339")
    parser.add_argument("--until", dest="end", metavar="TIME",
                        help="end of the range (exclusive), RFC 3339")
    parser.add_argument("--row-group-rows", type=int,
                        help="rows per row group of the compacted files (default: the config's "
                             "sink.row_group_rows, or 16384)")
    parser.add_argument("--lease-s", type=checked_argument(require_lease_s),
                        help="the output's publish lease (default: sink.commit_lease_s, 600; at "
                             "least 360)")
    parser.add_argument("--closed-after-s", type=float,
                        help="an hour is closed this long after its end (default: "
                             "allowed_lateness_s + 3600 s of grouping grace + 300 s)")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return parser


def main(argv=None) -> int:
    from pipeline import command_logging

    args = parser().parse_args(argv)
    command_logging(args.verbose)
    try:
        if args.config:
            config = config_lib.load_for_command(args.config, output=args.output)
            output, sink, streaming = config.output, config.sink, config.streaming
        elif args.output:
            output = args.output
            sink, streaming = SinkSettings(), StreamingSettings()
        else:
            raise config_lib.ConfigError("give --config or --output")
        if args.end and not args.start:
            raise config_lib.ConfigError("--until needs --from")
        now = dt.datetime.now(dt.timezone.utc)
        start, end = hour_range(args.day, args.hour, args.start, args.end, now)
    except (config_lib.ConfigError, ValueError) as exc:
        print(f"newsvec compact: {exc}", file=sys.stderr)
        return 2
    closed_after_s = (args.closed_after_s if args.closed_after_s is not None
                      else default_closed_after_s(streaming))
    results = compact_range(output, start, end, args.row_group_rows or sink.row_group_rows,
                            args.lease_s or sink.commit_lease_s, closed_after_s, now)
    for result in results:
        print(json.dumps(result))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

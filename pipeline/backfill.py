"""Backfill: embed an archive of daily inputs, one batch run per day, resumable.
``python -m pipeline.backfill --config C --from YYYY-MM-DD --until YYYY-MM-DD [--force]
[Beam flags]``.

The config is a daily batch config: ``input`` and ``output`` hold ``{date}`` (and ``output`` usually
``{model}``, so that a new model's vectors go to a place of their own, beside the old model's). Each
day of ``[--from, --until]`` runs as its own batch job, in order, and commits on its own (see
Reruns), so an interrupted backfill loses at most the day it was in:
- a day whose output already holds a committed run with the same model and embedding settings is
  skipped (``--force`` runs it again);
- with ``incremental.previous_outputs`` (e.g. ``out/{model}/dt=*``), an article that another day
  already embedded with the same text, model and settings is counted as unchanged, not embedded
  again: exactly one row per article and model across the archive.
Progress (days and articles done out of the total, articles/s, ETA) is logged after each day; the
summary is printed as JSON at the end. Locally the days run here, one after another; with
``--runner=DataflowRunner`` each day is a Dataflow job, waited for before the next.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import time
from typing import Optional, Sequence

from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import config as config_lib
from pipeline import parse_command
from transforms.engines.model import model_folder, model_label
from transforms.output.manifest import SummaryUnavailable, published_summary
from transforms.output.summary import RunSummary
from transforms.read import count_lines
from transforms.types import Counts

_LOG = logging.getLogger("newsvec.backfill")


def days(start: dt.date, end: dt.date) -> list[dt.date]:
    if end < start:
        raise config_lib.ConfigError(f"--until {end} is before --from {start}")
    return [start + dt.timedelta(days=i) for i in range((end - start).days + 1)]


def already_done(config: config_lib.Config) -> Optional[RunSummary]:
    """The summary of the committed run in this day's output, if it was made with this model and
    these embedding settings. A summary that is not the committed run's (``published_summary``
    then gives only the manifest's counts) says neither: the day is run again."""
    try:
        summary = published_summary(config.output)
    except SummaryUnavailable:  # nothing committed there (yet)
        return None
    label = model_label(config.model, model_folder(config.model))
    try:
        signature = summary.embedding_signature
    except ValueError:  # recorded, but not a signature: not this config's run
        return None
    same = summary.model_label == label and signature == config_lib.signature_of(config)
    return summary if same else None


def backfill(config: config_lib.Config, start: dt.date, end: dt.date, options: PipelineOptions,
             force: bool = False, engine_factory=None, log=print) -> dict:
    from pipeline.run import run_batch

    if not config.input:
        raise config_lib.ConfigError("a backfill needs an input (with {date})")
    plan = [(day, config_lib.fill(config, day.isoformat())) for day in days(start, end)]
    sizes = {day: count_lines(day_config.input) for day, day_config in plan if day_config.input}
    total = sum(sizes.values())
    totals = Counts()
    done, ran, skipped, started = 0, 0, 0, time.monotonic()
    embedded_articles = 0  # articles of the days run here: the rate
    for i, (day, day_config) in enumerate(plan, 1):
        summary = None if force else already_done(day_config)
        if summary is not None:
            skipped += 1
            log(f"[{i}/{len(plan)}] {day}: already embedded with this model and these settings "
                f"(run {summary.run_id}), skipped")
        else:
            summary = RunSummary.from_dict(run_batch(day_config, options,
                                                     engine_factory=engine_factory))
            ran += 1
            if summary.counts is None:  # a newer run of the day holds it, or a job described
                done += sizes[day]
                why = (f"the newer run {summary.superseded_by} holds the day"
                       if summary.superseded_by else "the job was described, not run here")
                log(f"[{i}/{len(plan)}] {day}: run {summary.run_id} published nothing: {why}")
                continue
            embedded_articles += summary.counted().articles_in
        counts = summary.counted()
        totals += counts
        done += sizes[day]
        elapsed = time.monotonic() - started
        rate = embedded_articles / elapsed if embedded_articles else 0.0
        left = total - done
        eta = f"{left / rate:.0f} s" if rate else "unknown"
        log(f"[{i}/{len(plan)}] {day}: {counts.written} written, "
            f"{counts.unchanged} unchanged; {done}/{total} articles "
            f"({100 * done / total if total else 100:.0f}%), {rate:.1f} articles/s, ETA {eta}")
    elapsed = time.monotonic() - started
    return {"from": start.isoformat(), "until": end.isoformat(), "days": len(plan),
            "days_run": ran, "days_skipped": skipped, "articles": total,
            "counts": totals.to_summary(),
            "seconds": round(elapsed, 1),
            "articles_per_s": round(embedded_articles / elapsed, 2) if elapsed else None,
            "output": config.output}


HELP = """\
Embed an archive of daily inputs, one batch run per day, resumable.

The config is a daily batch config: its input and output hold {date} (and the output usually
{model}, so that a new model's vectors go to a place of their own). Each day from --from to
--until runs as its own batch job and commits on its own, so an interrupted backfill loses at
most the day it was in:
  - a day whose output already holds a committed run with the same model and embedding settings
    is skipped (--force runs it again);
  - with incremental.previous_outputs (e.g. out/{model}/dt=*), an article that another day
    already embedded with the same text, model and settings is counted as unchanged, not
    embedded again.
Progress (days and articles done, articles/s, ETA) goes to standard error after each day; the
summary is printed as JSON at the end. Beam flags may follow: with --runner=DataflowRunner each
day is a Dataflow job, waited for before the next."""


def main(argv: Optional[Sequence[str]] = None) -> int:

    parser = argparse.ArgumentParser(prog="newsvec backfill", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True,
                        help="a daily batch config whose input and output hold {date}")
    parser.add_argument("--from", dest="start", required=True, type=dt.date.fromisoformat,
                        metavar="DAY",
                        help="first day, YYYY-MM-DD")
    parser.add_argument("--until", dest="end", required=True, type=dt.date.fromisoformat,
                        metavar="DAY",
                        help="last day, YYYY-MM-DD, inclusive")
    parser.add_argument("--force", action="store_true",
                        help="run days that are already embedded again")
    args, beam_args = parse_command(parser, argv, known_only=True)
    logging.basicConfig(level=logging.WARNING)
    config = config_lib.load_for_command(args.config, run_model_code=True, each_day=True)
    if "{date" not in (config.input or "") or "{date" not in config.output:
        raise config_lib.ConfigError(
            f"{args.config}: a backfill needs {{date}} in input and output")
    options = PipelineOptions(config.beam_flags() + beam_args)
    summary = backfill(config, args.start, args.end, options, force=args.force,
                       log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Entry point: config + flags -> pipeline options -> graph -> run -> ``_summary.json``."""
from __future__ import annotations

import json
import logging
import time
from typing import Optional, Sequence

import apache_beam as beam
from apache_beam.ml.inference.base import ModelHandler
from apache_beam.options.pipeline_options import (GoogleCloudOptions, PipelineOptions,
                                                  StandardOptions, TestOptions)

from pipeline import config as config_lib
from pipeline.graph import build_batch, build_streaming
from pipeline.options import NewsvecOptions
from pipeline.summary import AccountingError, build_summary, write_summary
from transforms.sinks import new_run_id

_LOG = logging.getLogger("newsvec")


def resolve(argv: Optional[Sequence[str]] = None) -> tuple[config_lib.Config, PipelineOptions]:
    """The validated config and the Beam options. Command-line flags override the config file;
    a flag that neither newsvec nor Beam knows fails here (Beam alone would ignore it). ``{date}``
    in the input and output is filled from ``--input_date`` (UTC, now)."""
    argv = list(argv or [])
    ours = NewsvecOptions(argv)
    path = ours.config or str(config_lib.DEFAULT_CONFIG)
    config = config_lib.load(path, subscription=ours.subscription, input=ours.input,
                             output=ours.output)
    config = config_lib.fill_date(config, ours.input_date)
    # Flags after the config's beam: section win, as argparse keeps the last value.
    options = PipelineOptions(config.beam_flags() + argv)
    unknown = sorted(set(options.get_all_options(retain_unknown_options=True))
                     - config_lib.known_beam_options())
    if unknown:
        raise config_lib.ConfigError(f"command line: --{unknown[0]} is not a newsvec or Beam option")
    return config, options


def run(argv: Optional[Sequence[str]] = None, test_pipeline: Optional[beam.Pipeline] = None,
        handler: Optional[ModelHandler] = None) -> dict:
    """Run the job from command-line flags. Batch: to completion, returning its summary (also
    written to the output). Streaming (a subscription is set): until cancelled or drained."""
    config, options = resolve(argv)
    if config.streaming.subscription:
        result = run_streaming(config, options, test_pipeline, handler)
        if _runs_elsewhere(options):
            # Dataflow (or a template launch): the job runs on its own until drained or cancelled;
            # waiting here, a Ctrl-C would cancel it.
            return {"run_id": None, "state": str(result.state), "launched": True}
        try:
            result.wait_until_finish()
        except KeyboardInterrupt:
            _LOG.info("cancelling the streaming job")
            result.cancel()
        return {"run_id": None, "state": str(result.state)}
    return run_batch(config, options, test_pipeline, handler)


def run_streaming(config: config_lib.Config, options: PipelineOptions,
                  test_pipeline: Optional[beam.Pipeline] = None,
                  handler: Optional[ModelHandler] = None):
    """Start the streaming job and return its PipelineResult without waiting."""
    options.view_as(StandardOptions).streaming = True
    run_id = new_run_id()
    pipeline = test_pipeline or beam.Pipeline(options=options)
    build_streaming(pipeline, config, run_id, handler)
    _LOG.info("newsvec streaming run %s: %s -> %s", run_id, config.streaming.subscription,
              config.output)
    return pipeline.run()


def run_batch(config: config_lib.Config, options: PipelineOptions,
              test_pipeline: Optional[beam.Pipeline] = None,
              handler: Optional[ModelHandler] = None) -> dict:
    """Build, run to completion and summarize one batch job.

    A job that this process only describes (a Flex Template launch passes ``--template_location``;
    ``--dry_run=True`` builds the Dataflow request without sending it) is not waited for and has no
    summary here: its counts are in the Dataflow job's metrics (namespace ``newsvec``)."""
    started = time.perf_counter()
    run_id = new_run_id()
    pipeline = test_pipeline or beam.Pipeline(options=options)
    build_batch(pipeline, config, run_id, handler)
    _LOG.info("newsvec run %s: %s -> %s", run_id, config.input, config.output)
    run_started = time.perf_counter()
    result = pipeline.run()
    if _only_described(options):
        _LOG.info("newsvec run %s: job described, not run here (template or dry run)", run_id)
        return {"run_id": run_id, "state": str(result.state), "launched": True}
    result.wait_until_finish()
    finished = time.perf_counter()
    summary = build_summary(result, config, run_id, {
        "startup_s": run_started - started,
        "run_s": finished - run_started,
        "total_s": finished - started,
    })
    path = write_summary(config.output, summary)
    _LOG.info("summary written to %s", path)
    if not summary["invariant_holds"]:
        raise AccountingError(f"in={summary['counts']['in']} but written + dead_lettered + "
                              f"duplicates = {summary['counts']['accounted']}; see {path}")
    return summary


def _only_described(options: PipelineOptions) -> bool:
    """This process writes the job (template) or builds it (dry run); it never sees it run."""
    return bool(options.view_as(GoogleCloudOptions).template_location
                or options.view_as(TestOptions).dry_run)


def _runs_elsewhere(options: PipelineOptions) -> bool:
    runner = options.view_as(StandardOptions).runner or ""
    return _only_described(options) or runner.rsplit(".", 1)[-1] in ("DataflowRunner",
                                                                    "TestDataflowRunner")


def main(argv: Optional[Sequence[str]] = None) -> int:
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = run(sys.argv[1:] if argv is None else argv)
    except config_lib.ConfigError as exc:
        print(f"newsvec: bad config: {exc}", file=sys.stderr)
        return 2
    # A batch run's counts; a launched job (Flex Template, Dataflow streaming): its state.
    print(json.dumps(summary.get("counts", summary), indent=2))
    return 0

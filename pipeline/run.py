"""Entry point: config + flags -> pipeline options -> graph -> run -> ``_summary.json``."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Optional, Sequence

import apache_beam as beam
from apache_beam.options.pipeline_options import (
    DirectOptions,
    GoogleCloudOptions,
    PipelineOptions,
    StandardOptions,
    TestOptions,
)

from pipeline import VERBOSE_HELP, command_logging
from pipeline import config as config_lib
from pipeline.graph import build_batch, build_streaming
from pipeline.options import NewsvecOptions
from pipeline.progress import ProgressReporter
from pipeline.summary import job_statistics
from transforms import incremental as incremental_lib
from transforms.engines.base import EngineFactory
from transforms.output.layout import SUMMARY_FILE, join_path, new_run_id
from transforms.output.manifest import SummaryUnavailable, published_summary, read_manifest
from transforms.output.summary import RunSummary
from transforms.read import count_lines
from transforms.stores import store_for
from transforms.stores.base import StoreError, StoreLoadFailed, batch_load_key, loaded

_LOG = logging.getLogger("newsvec")


def resolve(argv: Optional[Sequence[str]] = None) -> tuple[config_lib.Config, PipelineOptions]:
    """The validated config and the Beam options. Command-line flags override the config file;
    a flag that neither newsvec nor Beam knows fails here (Beam alone would ignore it). ``{date}``
    in the input and output is filled from ``--input_date`` (UTC, now)."""
    argv = list(argv or [])
    ours = NewsvecOptions(argv)
    path = ours.config or str(config_lib.DEFAULT_CONFIG)
    config = config_lib.load_for_command(
        path, input=ours.input, output=ours.output, subscription=ours.subscription,
        input_date=ours.input_date, run_model_code=True)
    # Flags after the config's beam: section win, as argparse keeps the last value.
    options = PipelineOptions(config.beam_flags() + argv)
    unknown = sorted(set(options.get_all_options(retain_unknown_options=True))
                     - config_lib.known_beam_options())
    if unknown:
        raise config_lib.ConfigError(
            f"command line: --{unknown[0]} is not a newsvec or Beam option")
    _check_dsn_reaches_the_workers(config, options)
    return config, options


def _check_dsn_reaches_the_workers(config: config_lib.Config, options: PipelineOptions) -> None:
    """A job on Dataflow loads its store on the workers (the batch run's ``LoadCommittedRun``
    step, the streaming writer), which have neither the launcher's environment nor its files:
    ``store.enabled`` needs ``store.dsn_secret`` there, refused at launch rather than after a
    day's embedding, when every worker fails to open the store."""
    if config.store.enabled and not config.store.dsn_secret and _runs_elsewhere(options):
        raise config_lib.ConfigError(
            "store.enabled on Dataflow needs store.dsn_secret: the workers load the store (a "
            "batch run's load step, the streaming writer) and read the connection string there, "
            f"where neither the environment variable store.dsn_env ({config.store.dsn_env}) nor "
            "the file store.dsn_file of this machine exists. Set store.dsn_secret to a Secret "
            "Manager secret version (projects/P/secrets/S/versions/latest) that the worker "
            "service account may read (roles/secretmanager.secretAccessor): docs/store.md")


def run(argv: Optional[Sequence[str]] = None, test_pipeline: Optional[beam.Pipeline] = None,
        engine_factory: Optional[EngineFactory] = None) -> dict:
    """Run the job from command-line flags. Batch: to completion, returning its summary (also
    written to the output). Streaming (a subscription is set): until cancelled or drained."""
    config, options = resolve(argv)
    if config.streaming.subscription:
        result = run_streaming(config, options, test_pipeline, engine_factory)
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
    return run_batch(config, options, test_pipeline, engine_factory)


def run_streaming(config: config_lib.Config, options: PipelineOptions,
                  test_pipeline: Optional[beam.Pipeline] = None,
                  engine_factory: Optional[EngineFactory] = None):
    """Start the streaming job and return its PipelineResult without waiting."""
    options.view_as(StandardOptions).streaming = True
    if not _runs_elsewhere(options) and os.environ.get("PUBSUB_EMULATOR_HOST"):
        lift_emulator_receive_limit()
    run_id = new_run_id()
    pipeline = test_pipeline or beam.Pipeline(options=options)
    build_streaming(pipeline, config, run_id, engine_factory)
    _LOG.info("newsvec streaming run %s: %s -> %s", run_id, config.streaming.subscription,
              config.output)
    return pipeline.run()


def run_batch(config: config_lib.Config, options: PipelineOptions,
              test_pipeline: Optional[beam.Pipeline] = None,
              engine_factory: Optional[EngineFactory] = None) -> dict:
    """Build and run one batch job to completion, and return its summary: the ``_summary.json``
    that the job's CommitRun step wrote once it had checked and published the run, with the
    timings and micro-batch statistics seen from here (Beam metrics) added.

    A job that this process only describes (a Flex Template launch passes ``--template_location``;
    ``--dry_run=True`` builds the Dataflow request without sending it) is not waited for: its
    ``_summary.json`` is written by the job itself."""
    started = time.perf_counter()
    check_previous_outputs(config)
    run_id = new_run_id()
    pipeline = test_pipeline or beam.Pipeline(options=options)
    build_batch(pipeline, config, run_id, engine_factory)
    _LOG.info("newsvec run %s: %s -> %s", run_id, config.input, config.output)
    run_started = time.perf_counter()
    with _progress(config, options):
        result = pipeline.run()
        if _only_described(options):
            _LOG.info("newsvec run %s: job described, not run here (template or dry run)", run_id)
            return {"run_id": run_id, "state": str(result.state), "launched": True}
        result.wait_until_finish()
    finished = time.perf_counter()
    # The committed run's summary, never another run's (``manifest.published_summary``).
    summary = _summary_after(config.output, run_id)
    if summary.run_id != run_id:
        _LOG.warning("run %s succeeded, but run %s has published into %s since", run_id,
                     summary.run_id, config.output)
    else:
        _LOG.info("run %s committed: %s", run_id, join_path(config.output, SUMMARY_FILE))
    if config.store.enabled and summary.run_id == run_id and summary.is_published:
        summary = summary.replace(store={**(summary.store or {}), **_store_record(config, run_id)})
    return {**summary.to_dict(), **job_statistics(result, config.model.token_budget, {
        "startup_s": run_started - started,
        "run_s": finished - run_started,
        "total_s": finished - started,
    })}


def check_previous_outputs(config: config_lib.Config) -> None:
    """Each ``incremental.previous_outputs`` entry must match a newsvec output (or name the run's
    own, or be in ``incremental.may_be_absent``): checked here, in the launcher, before the job
    starts (``transforms.incremental.check_previous_outputs``). A ``ConfigError`` naming each
    entry that does not, which ``newsvec run`` reports as a bad config (exit status 2)."""
    settings = config.incremental
    if not settings.previous_outputs:
        return
    try:
        incremental_lib.check_previous_outputs(settings.previous_outputs, settings.may_be_absent,
                                               config.output)
    except incremental_lib.PreviousOutputMissing as exc:
        raise config_lib.ConfigError(str(exc)) from None


def _store_record(config: config_lib.Config, run_id: str) -> dict:
    """The store's record of the run's load, which the job's LoadCommittedRun step made (a job
    whose load failed has failed before this): what the summary's ``store`` shows here. Read
    only; a store this process cannot read is said, never a failure of the run."""
    key = batch_load_key(run_id)
    failure = None
    try:
        record = loaded(store_for(config.store), key)
    except StoreError as exc:
        failure = str(exc)
    if failure is not None:
        _LOG.warning("run %s: cannot read the store's record of its load %s: %s", run_id, key,
                     failure)
        return {"load_key": key, "unread": failure}
    if record is None:  # loaded by a newer run of the output, or not at all
        return {"load_key": key, "loaded": False}
    return record.to_json()


def _progress(config: config_lib.Config, options: PipelineOptions):
    """A progress bar (or log lines) for a batch job that runs in this process; nothing for one
    that runs elsewhere (Dataflow: the job's articles_done and events_in metrics) or in worker
    processes (their counts are theirs)."""
    mode = options.view_as(DirectOptions).direct_running_mode
    if _runs_elsewhere(options) or mode == "multi_processing":
        return contextlib.nullcontext()
    assert config.input, "build_batch has refused a batch config without an input"
    return ProgressReporter(count_lines(config.input))


def lift_emulator_receive_limit() -> None:
    """Let the local runner pull Pub/Sub messages of up to Pub/Sub's 10 MB from the emulator.

    google-cloud-pubsub opens its channel to an emulator with gRPC's defaults, which refuse to
    receive more than 4 MiB (its channel to Pub/Sub itself has no limit): a pull holding a 5 MB
    message fails with RESOURCE_EXHAUSTED, again at each retry, and holds up every message behind
    it. Beam's local Pub/Sub read builds its SubscriberClient itself, so the subscriber module's
    channel factory is given the option here. Dataflow reads Pub/Sub with its own service."""
    import grpc
    from google.pubsub_v1.services.subscriber import client as subscriber

    if getattr(subscriber.grpc, "newsvec_unlimited", False):
        return

    class _UnlimitedReceive:
        newsvec_unlimited = True

        def __getattr__(self, name):
            return getattr(grpc, name)

        @staticmethod
        def insecure_channel(target, options=None, **kwargs):
            options = [*(options or ()), ("grpc.max_receive_message_length", -1)]
            return grpc.insecure_channel(target, options=options, **kwargs)

    subscriber.grpc = _UnlimitedReceive()


def _summary_after(output: str, run_id: str) -> RunSummary:
    """The committed run's summary once run ``run_id`` has ended; where a newer run is publishing
    into the output meanwhile (this one, older, published nothing, or was cut off by it), what
    this run can say: that it was superseded, by whom."""
    try:
        return published_summary(output)
    except SummaryUnavailable:
        current = read_manifest(output)
        if current is None or current.run_id <= run_id:
            raise
        _LOG.warning("run %s succeeded, but the newer run %s is publishing into %s", run_id,
                     current.run_id, output)
        return RunSummary(run_id=run_id, published=False, superseded_by=current.run_id)


def _only_described(options: PipelineOptions) -> bool:
    """This process writes the job (template) or builds it (dry run); it never sees it run."""
    return bool(options.view_as(GoogleCloudOptions).template_location
                or options.view_as(TestOptions).dry_run)


def _runs_elsewhere(options: PipelineOptions) -> bool:
    runner = options.view_as(StandardOptions).runner or ""
    return _only_described(options) or runner.rsplit(".", 1)[-1] in ("DataflowRunner",
                                                                    "TestDataflowRunner")


def usage() -> str:
    """newsvec's own options (``NewsvecOptions``, also the Flex Template's parameters)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="newsvec run",
        description="Run the pipeline: batch over the config's input, or streaming when a "
                    "subscription is set. Flags override the config file. Any Beam pipeline "
                    "option may follow (--runner, --project, ...); one that neither newsvec nor "
                    "Beam knows fails at start. Every config key: newsvec config --explain. "
                    "Prints the run's counts as JSON (a launched job: its state).")
    NewsvecOptions._add_argparse_args(parser)
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return parser.format_help()


def main(argv: Optional[Sequence[str]] = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    command_logging("--verbose" in argv)  # before vLLM is imported
    argv = [arg for arg in argv if arg != "--verbose"]  # newsvec's, not a Beam option
    if "-h" in argv or "--help" in argv:
        print(usage())
        return 0
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = run(argv)
    except config_lib.ConfigError as exc:
        print(f"newsvec: bad config: {exc}", file=sys.stderr)
        return 2
    except StoreLoadFailed:  # logged with what to run; the Parquet is committed
        return 1
    # A batch run's counts (and its store load); a launched job (Flex Template, Dataflow
    # streaming): its state.
    shown = summary.get("counts", summary)
    if "counts" in summary and "store" in summary:
        shown = {**shown, "store": summary["store"]}
    print(json.dumps(shown, indent=2))
    return 0

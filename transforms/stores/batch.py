"""A committed batch run into the store: ``LoadCommittedRun``, the batch graph's step after
``CommitRun``, and the reading of a run's rows that it shares with ``newsvec load``.

The step loads the run that CommitRun published, from the files its manifest names, once, under
the run's load key ``run:<run_id>`` (the key ``newsvec load`` uses), so a Flex Template or
scheduled job loads the store with nothing run after it, and:
- a retried bundle, a rerun of the step or a later ``newsvec load`` of the run changes nothing:
  a load is one transaction with its record under the key (``base``), so a bundle retried after a
  try that failed midway finds nothing of it stored, and one retried after a try whose commit
  succeeded (its response lost) finds the key loaded;
- a run that published nothing (a newer run holds the output: CommitRun's ``published: false``),
  or that a newer run replaced before its load (the store holds the newer run's load, or the
  output's manifest names the newer run), loads nothing: the newer run's own load stores the
  output, and an older run's rows never replace it;
- a load that fails otherwise (the store cannot be reached within ``retry_s``, it refuses too
  many rows) fails the step, so the job fails (on Dataflow, after its retries of the bundle)
  with the Parquet committed and published: ``_summary.json`` names the load key the store lacks,
  and ``newsvec load --config C --output O --run-id R`` (``O``: the run's output, its ``{date}``
  filled) loads the run alone;
- the rows read must be as many as the manifest committed (its ``counts``): vector files
  replaced after the commit with another number of rows are refused, never loaded as the run (a
  replacement with as many rows is not caught: the manifest holds no checksum of its files).

The connection string is read where the step runs (``setup``: on Dataflow, the worker, from
``store.dsn_secret``), never carried in the graph.
"""
from __future__ import annotations

import datetime as dt
import logging
import shlex
from typing import Any, Optional

import apache_beam as beam
import pyarrow as pa

from transforms.metrics import STORE_LOAD_FAILURES, STORE_LOADS, STORE_ROWS_LOADED
from transforms.output.layout import day_of_path, join_path, open_output_file, read_parquet
from transforms.output.manifest import COMMITTED, read_manifest
from transforms.output.summary import RunSummary
from transforms.stores import store_for
from transforms.stores.base import (
    BatchOutput,
    LoadRows,
    StoreLoad,
    StoreLoadFailed,
    VectorStore,
    batch_load_key,
)

_LOG = logging.getLogger("newsvec")


def run_day(output: str, run_id: str, filled: Optional[dt.date] = None) -> dt.date:
    """The day a batch run's rows stand for, the first order of the current-vector rule
    (``VERSION_ORDER``'s ``dt``): the day that filled ``{date}`` in the run's config
    (``filled``: its ``--input_date``, ``Config.filled_day``), else the ``dt=YYYY-MM-DD`` folder
    of the output prefix (``output: .../dt=2026-11-30``, as ``transforms.output.current_vectors``
    reads it), else the run's launch day (its id begins with it). The graph records it in the
    run's summary (``day``), and the load takes it from there (``recorded_day``): an output
    written as ``{date:%Y/%m/%d}``, or a backfill's runs, all launched one day, stand for their
    own days."""
    if filled is not None:
        return filled
    day = day_of_path(output)
    if day is not None:
        return day
    return dt.datetime.strptime(run_id[:8], "%Y%m%d").date()


def recorded_day(output: str, run_id: str, manifest: Any) -> Optional[dt.date]:
    """The day run ``run_id`` recorded in its summary (``day``: ``run_day`` at its launch), or
    None where it recorded none: a summary written before 0.3, or one that cannot be read or is
    another run's (logged); the load then takes ``run_day`` of the output and run id."""
    path = join_path(output, manifest.summary)
    try:
        with open_output_file(output, path) as f:
            summary = RunSummary.from_json(f.read())
        if summary.run_id != run_id:
            raise ValueError(f"it is not run {run_id}'s summary")
        return summary.recorded_day
    except (OSError, ValueError, TypeError) as exc:  # gone, torn, refused, not a date
        _LOG.warning("run %s: its day could not be read from %s (%s: %s); its rows' dt is the "
                     "output's dt= folder, else the run's launch day", run_id, path,
                     type(exc).__name__, exc)
        return None


def _read(output: str, relative: list[str]) -> Optional[pa.Table]:
    """The files the manifest names, as one table (``layout.read_parquet``)."""
    return read_parquet(output, [join_path(output, path) for path in relative])


def load_command(output: str, run_id: str) -> str:
    """The command that loads run ``run_id`` alone, whatever day it is typed: the run's output
    named (its ``{date}`` filled), not left to the config."""
    return f"newsvec load --config CONFIG --output {shlex.quote(output)} --run-id {run_id}"


def _check_counts(output: str, run_id: str, manifest: Any, vectors: Optional[pa.Table],
                  chunks: Optional[pa.Table]) -> None:
    """The rows read are as many as the manifest committed (``counts.written``,
    ``counts.chunks_written``): files replaced after the commit with another number of rows are
    a ``StoreLoadFailed`` naming them, never loaded as the run."""
    for what, files, table, key in (("vector", manifest.vectors, vectors, "written"),
                                    ("chunk", manifest.chunks, chunks, "chunks_written")):
        committed = manifest.counts.get(key)
        read = 0 if table is None else table.num_rows
        if committed is not None and read != committed:
            raise StoreLoadFailed(
                f"run {run_id} in {output}: its {what} files ({', '.join(files) or 'none'}) hold "
                f"{read} rows, but the run committed {committed} (the manifest's counts.{key}): "
                "they were changed after the commit; nothing was loaded. Rerun the day: a new "
                "run publishes files of its own")


def _holds(output: str, run_id: str):
    """The output's manifest, which must hold ``run_id`` committed."""
    manifest = read_manifest(output)
    if manifest is None or manifest.run_id != run_id or manifest.state != COMMITTED:
        held = "nothing" if manifest is None else f"run {manifest.run_id} ({manifest.state})"
        raise StoreLoadFailed(f"{output} does not hold run {run_id} committed (it holds {held}): "
                              "only the run an output holds can be loaded")
    return manifest


def batch_output(output: str, run_id: str) -> BatchOutput:
    """What the store records of the output a run's load is of: its prefix (``{date}`` filled),
    and the run."""
    return BatchOutput(prefix=output.rstrip("/"), run_id=run_id)


def run_rows(output: str, run_id: str) -> LoadRows:
    """The rows of ``run_id`` in ``output``, which must hold it committed from before the read
    to after it. A newer run may publish into the output meanwhile and delete these files: the
    manifest is read again after the files, and a read that failed or raced such a publish is a
    ``StoreLoadFailed`` that says what to run, never a storage error of its own."""
    retry = f"load it alone once it can be read: {load_command(output, run_id)}"
    failure: Optional[StoreLoadFailed] = None
    try:
        manifest = _holds(output, run_id)
        vectors = _read(output, manifest.vectors)
        chunks = _read(output, manifest.chunks)
        day = run_day(output, run_id, recorded_day(output, run_id, manifest))
        after = read_manifest(output)
    except StoreLoadFailed:
        raise
    except Exception as exc:  # pylint: disable=broad-except  # any storage or Parquet error
        failure = StoreLoadFailed(f"cannot read run {run_id} from {output} "
                                  f"({type(exc).__name__}: {exc}); {retry}")
    if failure is not None:
        try:
            _holds(output, run_id)  # a newer run published meanwhile: say so instead
        except StoreLoadFailed as newer:
            failure = StoreLoadFailed(f"{newer} (a run published into it while this one was "
                                      "read: that run's own load stores it)")
        except Exception:  # pylint: disable=broad-except  # the first failure says enough
            pass
        raise failure
    if after != manifest:
        held = "nothing" if after is None else f"run {after.run_id} ({after.state})"
        raise StoreLoadFailed(f"{output} changed while run {run_id} was read (it now holds "
                              f"{held}): nothing was loaded; if it still holds the run, {retry}")
    if vectors is None:
        raise StoreLoadFailed(f"run {run_id} wrote no vector files")
    _check_counts(output, run_id, manifest, vectors, chunks)
    return LoadRows(vectors=vectors, chunks=chunks, dt=day)


def load_run(store: VectorStore, output: str, run_id: str, rows: LoadRows,
             reload: bool = False) -> StoreLoad:
    """``rows``, run ``run_id``'s of ``output``, into ``store`` under the run's load key,
    replacing the previous run's load of the output; what it did is logged."""
    result = store.load(rows, batch_load_key(run_id), output=batch_output(output, run_id),
                        reload=reload)
    _LOG.info("store: run %s %s (%d rows, %d chunk rows, %d articles current, %d rows refused, "
              "%d articles of %s withdrawn) in %.2f s", run_id,
              "was loaded already" if result.already_loaded else "loaded", result.rows,
              result.chunk_rows, result.articles_current, len(result.rejected),
              len(result.withdrawn), result.replaces or "no earlier run", result.seconds)
    for item in () if result.already_loaded else result.rejected:
        _LOG.warning("run %s: the store refused article %s (%s: %s); its Parquet row stands",
                     run_id, item["id"], item["reason"], item["detail"])
    if result.rejected and result.already_loaded:
        _LOG.warning("store: run %s was loaded with %d rows refused; once the table takes them, "
                     "store them with: %s --reload",
                     run_id, len(result.rejected), load_command(output, run_id))
    return result


def _newer_run(output: str, run_id: str) -> Optional[str]:
    """The run the output holds now, where it is newer than ``run_id``."""
    manifest = read_manifest(output)
    return manifest.run_id if manifest is not None and manifest.run_id > run_id else None


class _LoadCommittedRunFn(beam.DoFn):
    def __init__(self, output: str, run_id: str, settings: Any):
        self._output, self._run_id, self._settings = output, run_id, settings
        self._store: Optional[VectorStore] = None

    def setup(self):
        self._store = store_for(self._settings)  # the connection string read here, never pickled

    def process(self, summary: RunSummary):
        assert self._store is not None
        newer = summary.superseded_by
        if summary.run_id == self._run_id and summary.is_published:
            try:
                rows = run_rows(self._output, self._run_id)
                loaded = load_run(self._store, self._output, self._run_id, rows)
            except StoreLoadFailed as exc:
                STORE_LOAD_FAILURES.inc()
                newer = _newer_run(self._output, self._run_id)
                if newer is None:
                    _LOG.error("run %s is committed in %s, but its store load failed: %s. Load "
                               "it alone with: %s", self._run_id, self._output, exc,
                               load_command(self._output, self._run_id))
                    raise
            else:
                STORE_LOADS.inc()
                STORE_ROWS_LOADED.inc(loaded.rows)
                yield loaded.to_json()
                return
        beam.metrics.Metrics.counter("newsvec", "store_loads_skipped").inc()
        _LOG.warning("run %s: not loaded into the store: the newer run %s holds %s, and its own "
                     "load stores it", self._run_id, newer, self._output)
        yield {"load_key": batch_load_key(self._run_id), "skipped": True, "superseded_by": newer}


class LoadCommittedRun(beam.PTransform):
    """The batch job's store load (see the module docstring), applied to CommitRun's output (the
    run's summary). ``settings``: the config's ``store:`` section. Output: what the load did
    (``StoreLoad.to_json()``), or ``skipped`` with the newer run that holds the output."""

    def __init__(self, output: str, run_id: str, settings: Any):
        super().__init__()
        self._fn = _LoadCommittedRunFn(output, run_id, settings)

    def expand(self, summaries):
        # A fusion break: a retried load never runs the commit again.
        return (summaries | "AfterCommit" >> beam.Reshuffle()
                | "Load" >> beam.ParDo(self._fn))

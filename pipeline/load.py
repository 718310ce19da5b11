"""Load a committed batch run into the store: ``newsvec load --config C --run-id R``.

A batch run with ``store.enabled`` loads itself once its Parquet is committed (``pipeline.run``).
When that load fails, the Parquet stays committed, the run exits 1 (``StoreLoadFailed``), and this
command loads the run alone, from the files its manifest names. The load key is ``run:<run_id>``:
a run loaded already changes nothing, unless ``--reload`` asks for it again (the rows the store
refused, once the table is fixed). A run's load replaces the previous run's load of the same
output (its rows that the run does not hold are withdrawn), as the run's files replaced that
run's files (transforms/store.py, docs/store.md).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import re
import sys
from typing import Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import VERBOSE_HELP, command_logging
from pipeline import config as config_lib
from transforms.layout import join_path, open_output_file
from transforms.manifest import COMMITTED, read_manifest
from transforms.store import BatchOutput, LoadRows, StoreLoad, StoreLoadFailed, store_of

_LOG = logging.getLogger("newsvec")
_DAY_IN_PATH = re.compile(r"(?:^|/)dt=([0-9]{4}-[0-9]{2}-[0-9]{2})(?:/|$)")


def run_day(output: str, run_id: str) -> dt.date:
    """The day a batch run's rows stand for, the first order of the current-vector rule: the
    ``dt=YYYY-MM-DD`` folder of the output prefix (``output: .../dt={date}``, as
    ``pipeline.current`` reads it), else the run's launch day (its id begins with it)."""
    found = _DAY_IN_PATH.findall(output.rstrip("/"))
    if found:
        return dt.date.fromisoformat(found[-1])
    return dt.datetime.strptime(run_id[:8], "%Y%m%d").date()


def load_key(run_id: str) -> str:
    return f"run:{run_id}"


def _read(output: str, relative: list[str]) -> Optional[pa.Table]:
    """The files the manifest names, each a regular file of the output (``open_output_file``: a
    symlink or FIFO in place of one is an ``UnsafePath`` naming it, never read or waited on)."""
    tables = []
    for path in relative:
        with open_output_file(output, join_path(output, path)) as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables) if tables else None


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
    retry = (f"load it alone once it can be read: newsvec load --config CONFIG --run-id {run_id}")
    failure: Optional[StoreLoadFailed] = None
    try:
        manifest = _holds(output, run_id)
        vectors = _read(output, manifest.vectors)
        chunks = _read(output, manifest.chunks)
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
    return LoadRows(vectors=vectors, chunks=chunks, dt=run_day(output, run_id))


def load_run(config: config_lib.Config, run_id: str, reload: bool = False) -> StoreLoad:
    """Load a committed batch run into the store; ``StoreLoadFailed`` (its message scrubbed of the
    connection string) when it cannot. ``reload``: load it again although it was loaded."""
    store = store_of(config.store)
    rows = run_rows(config.output, run_id)
    result = store.load(rows, load_key(run_id), output=batch_output(config.output, run_id),
                        reload=reload)
    _LOG.info("store: run %s %s (%d rows, %d chunk rows, %d articles current, %d rows refused, "
              "%d articles of %s withdrawn) in %.2f s", run_id,
              "was loaded already" if result.already_loaded else "loaded", result.rows,
              result.chunk_rows, result.articles_current, len(result.rejected),
              len(result.withdrawn), result.replaces or "no earlier run", result.seconds)
    if result.rejected and result.already_loaded:
        _LOG.warning("store: run %s was loaded with %d rows refused; once the table takes them, "
                     "store them with: newsvec load --config CONFIG --run-id %s --reload",
                     run_id, len(result.rejected), run_id)
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="newsvec load", description="Load a committed batch run's vectors (and chunks) into "
        "the store of the config (store: section; the connection string from its dsn_secret, "
        "dsn_file or dsn_env). Loading a run twice changes nothing (unless --reload). The load "
        "replaces the previous run's load of the same output. Prints what it loaded as JSON.")
    parser.add_argument("--config", required=True, help="the config the run ran with")
    parser.add_argument("--run-id", required=True, help="the run (its _summary.json's run_id)")
    parser.add_argument("--output", help="the output prefix, if not the config's")
    parser.add_argument("--input_date", help="the date that fills {date} in the config's output, "
                        "as the run's (YYYY-MM-DD, today or yesterday)")
    parser.add_argument("--reload", action="store_true",
                        help="load the run again although it was loaded: the rows the store "
                        "refused then (once the table is fixed) and the articles withdrawn since "
                        "are stored; the rest changes nothing")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    args = parser.parse_args(argv)
    command_logging(args.verbose)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_lib.fill_date(config_lib.fill_model(config_lib.load(
        args.config, output=args.output)), args.input_date)
    try:
        result = load_run(config, args.run_id, reload=args.reload)
    except StoreLoadFailed as exc:
        _LOG.error("store load failed: %s", exc)
        print(f"newsvec load: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_json(), indent=2))
    return 0

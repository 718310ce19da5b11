"""Load a committed batch run into the store: ``newsvec load --config C --run-id R``.

A batch run with ``store.enabled`` loads itself once its Parquet is committed (the graph's
``LoadCommittedRun`` step, ``transforms.stores.batch``). When that load fails, the Parquet stays
committed, the job fails, and this command loads the run alone, from the files its manifest
names. The load key is ``run:<run_id>``:
a run loaded already changes nothing, unless ``--reload`` asks for it again (the rows the store
refused, once the table is fixed). A run's load replaces the previous run's load of the same
output (its rows that the run does not hold are withdrawn), as the run's files replaced that
run's files (transforms/stores/, docs/store.md).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional, Sequence

from pipeline import config as config_lib
from pipeline import parse_command
from transforms.stores import batch, store_for
from transforms.stores.base import StoreLoad, StoreLoadFailed
from transforms.stores.batch import run_rows

_LOG = logging.getLogger("newsvec")


def load_run(config: config_lib.Config, run_id: str, reload: bool = False) -> StoreLoad:
    """Load a committed batch run into the store; ``StoreLoadFailed`` (its message scrubbed of the
    connection string) when it cannot. ``reload``: load it again although it was loaded."""
    store = store_for(config.store)
    return batch.load_run(store, config.output, run_id, run_rows(config.output, run_id),
                          reload=reload)


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
    args = parse_command(parser, argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_lib.load_for_command(args.config, output=args.output,
                                         input_date=args.input_date)
    try:
        result = load_run(config, args.run_id, reload=args.reload)
    except StoreLoadFailed as exc:
        _LOG.error("store load failed: %s", exc)
        print(f"newsvec load: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result.to_json(), indent=2))
    return 0

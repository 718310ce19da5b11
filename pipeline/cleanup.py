"""Clean an output prefix after killed workers and runs: ``python -m pipeline.cleanup --output
PREFIX [--older-than-s 86400]``.

1. A batch publish that was killed midway (``_manifest.json`` still says ``publishing``) is finished
   from its staged files, so readers that glob ``vectors/`` see the whole run again; first its
   snapshot check, for an incremental run: if an output it skipped articles for has changed since,
   its manifest is withdrawn instead (the previous one put back), and the command says so and
   exits with status 1 (rerun that run).
2. Files in the published folders that the committed manifest does not name (what a publisher that
   lost its lease may have landed late) are deleted.
3. Files under ``_temp/`` (a streaming file a killed worker was writing) last written more than
   ``--older-than-s`` ago, and the staging folders ``_staging/<run_id>/`` (a batch run killed
   before it committed) whose newest file is that old, are deleted; ``--older-than-s`` is at least
   an hour (``transforms.output.manifest.MIN_STALE_AGE_S``): younger files may be a live run's. Ages
   on GCS are counted on GCS's clock. Published data is never touched.
4. Every file the committed manifest names (and the summary) must be there: any that is not is
   named (``missing``), logged as an error, and the command exits with status 1; rerun that
   output's run.
On GCS, a lifecycle rule does step 3 for temporary files without a command:
``configs/gcs-lifecycle.json`` (docs/dataflow.md).
Every delete is fenced by the output's publish lease, held throughout. Prints what it did as JSON:
every file and folder it removed (``removed``, in order; of which ``repair_removed``: the
published folders' old files and the staging folder, its files and folders, of a repaired
publish; ``strays_deleted``; ``deleted_files``).
Nothing outside the output is ever touched: a manifest that names a run id or a path no newsvec
run writes (``layout.InvalidManifest``), or a symlinked ``_temp/``, ``_staging/`` or published
folder (``layout.UnsafePath``), is refused before anything is changed through it; the command
says which (``refused``) and exits with status 1.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from transforms.output.layout import InvalidManifest, UnsafePath
from transforms.output.lease import PublishLease
from transforms.output.manifest import (
    SnapshotChanged,
    clean_stale,
    missing_files,
    remove_strays,
    repair,
    require_stale_age,
)
from transforms.timing_floors import require_lease_s

_LOG = logging.getLogger(__name__)


def checked_argument(check):
    """An argparse ``type`` that reads a float and checks it: a ``ValueError`` becomes a usage
    error that argparse prints with the option's name, not a traceback."""
    def parse(text: str) -> float:
        try:
            return check(float(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


HELP = """\
Clean a newsvec output (local or gs://) after killed workers and runs, under its publish lease:
  1. finish a batch publish that was killed midway, so readers see the whole run again (or, for
     an incremental run whose earlier outputs changed since, withdraw it: exit status 1, rerun
     that run);
  2. delete files in the published folders that the committed manifest does not name;
  3. delete temporary files and staged runs older than --older-than-s (published data is never
     touched);
  4. name every file the committed manifest lists that is missing (exit status 1: rerun that
     output's run).
Prints what it did as JSON. A manifest or folder that points outside the output is refused before
anything is changed (exit status 1). On GCS a lifecycle rule can do step 3 without this command
(configs/gcs-lifecycle.json, docs/dataflow.md)."""


def main(argv=None) -> int:
    from pipeline import parse_command

    parser = argparse.ArgumentParser(prog="newsvec cleanup", description=HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="a newsvec output prefix, local or gs://")
    parser.add_argument("--older-than-s", type=checked_argument(require_stale_age),
                        default=86400,
                        help="delete temporary files and staged runs older than this (default: a "
                             "day, longer than any batch job runs; at least an hour)")
    parser.add_argument("--lease-s", type=checked_argument(require_lease_s), default=600,
                        help="the output's publish lease (sink.commit_lease_s): a run that holds "
                             "it is waited for, one killed while publishing for this long on GCS "
                             "(at least 360)")
    args = parse_command(parser, argv)
    withdrawn = refused = repaired = None
    strays: list[str] = []
    deleted: list[str] = []
    missing: list[str] = []
    repair_removed: list[str] = []
    # Under the output's publish lease: never beside a run that publishes.
    with PublishLease(args.output, "cleanup", args.lease_s) as lease:
        try:
            try:
                repaired = repair(args.output, lease)
            except SnapshotChanged as exc:
                repaired, withdrawn = None, str(exc)
                _LOG.error("%s", exc)
            repair_removed = list(lease.removed)
            strays = remove_strays(args.output, lease)
            deleted = clean_stale(args.output, args.older_than_s, lease)
            missing = missing_files(args.output)
        except (InvalidManifest, UnsafePath) as exc:
            refused = f"{type(exc).__name__}: {exc}"
            _LOG.error("%s: refused, nothing more done: %s", args.output, refused)
        removed = list(lease.removed)
    if missing:
        _LOG.error("%s: the committed manifest names %d files that are not there (%s): readers "
                   "that follow it fail, readers that glob miss their rows; rerun the run that "
                   "writes this output", args.output, len(missing), ", ".join(missing[:10]))
    print(json.dumps({"repaired_run": repaired.run_id if repaired else None,
                      "withdrawn": withdrawn, "repair_removed": repair_removed,
                      "strays_deleted": strays,
                      "deleted": len(deleted), "deleted_files": deleted,
                      "missing": missing, "refused": refused,
                      "removed": removed}, indent=2))
    return 1 if withdrawn or missing or refused else 0


if __name__ == "__main__":
    sys.exit(main())

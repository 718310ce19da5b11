"""Clean an output prefix after killed workers and runs: ``python -m pipeline.cleanup --output
PREFIX [--older-than-s 86400]``.

1. A batch publish that was killed midway (``_manifest.json`` still says ``publishing``) is finished
   from its staged files, so readers that glob ``vectors/`` see the whole run again.
2. Files under ``_temp/`` (a streaming file a killed worker was writing) and ``_staging/<run_id>/``
   (a batch run killed before it committed) last written more than ``--older-than-s`` ago are
   deleted. Published data is never touched.
On GCS, a lifecycle rule does step 2 without a command: ``configs/gcs-lifecycle.json``
(docs/dataflow.md).
Prints what it did as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys

from transforms.lease import PublishLease
from transforms.manifest import clean_stale, repair


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.cleanup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="a newsvec output prefix, local or gs://")
    parser.add_argument("--older-than-s", type=float, default=86400,
                        help="delete temporary and staged files older than this (default: a day; "
                             "longer than any batch job runs)")
    parser.add_argument("--lease-s", type=float, default=600,
                        help="the output's publish lease (sink.commit_lease_s): a run that holds "
                             "it is waited for, one killed while publishing for this long on GCS")
    args = parser.parse_args(argv)
    # Under the output's publish lease: never beside a run that publishes.
    with PublishLease(args.output, "cleanup", args.lease_s) as lease:
        repaired = repair(args.output, lease)
        lease.check()
        deleted = clean_stale(args.output, args.older_than_s)
    print(json.dumps({"repaired_run": repaired.run_id if repaired else None,
                      "deleted": len(deleted), "deleted_files": deleted}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A batch run that is killed midway, for tests/output/test_reruns.py: ``python -m tests.killed_run
--input GLOB --output PREFIX --kill-at write|publish``.

It runs the batch pipeline in this process with a FAKE engine (the test is about storage, not the
model) and one row per Parquet row group, and kills its own process with SIGKILL, as a preempted or
out-of-memory worker dies (no Python exception, no clean-up), either
- ``write``: just after the first row group of the run's Parquet file is written, or
- ``publish``: just after the commit has published the run's first file.
With STORAGE_EMULATOR_HOST set, Google's credential lookup is answered with anonymous credentials.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys


def _kill_after_first(owner, name: str) -> None:
    original = getattr(owner, name)

    def then_die(*args, **kwargs):
        result = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, then_die)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--kill-at", choices=("write", "publish"), required=True)
    args = parser.parse_args()
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        import google.auth
        from google.auth.credentials import AnonymousCredentials

        google.auth.default = lambda *a, **k: (AnonymousCredentials(), "test")

    import pyarrow.parquet as pq
    from apache_beam.options.pipeline_options import PipelineOptions

    from pipeline.run import run_batch
    from tests.common import make_config
    from tests.fakes import FakeEngine
    from transforms.output import manifest

    if args.kill_at == "write":
        _kill_after_first(pq.ParquetWriter, "write_table")
    else:
        _kill_after_first(manifest, "_copy_whole")
    config = make_config(input=args.input, output=args.output)
    config = config.model_copy(update={"sink": config.sink.model_copy(update={
        "row_group_rows": 1})})
    run_batch(config, PipelineOptions(["--runner=FnApiRunner"]), engine_factory=FakeEngine)
    return 3  # not killed: the test fails on this


if __name__ == "__main__":
    sys.exit(main())

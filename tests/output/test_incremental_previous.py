"""An ``incremental.previous_outputs`` entry that matches no newsvec output is said, not skipped
(transforms/incremental.py, ``resolve_previous_output``): a typo, a disk or bucket not mounted, a
folder of bare ``keys/`` files fail the launch naming the entry, before the pipeline starts, and
fail the job the same way where the job finds it so (an output gone between the launch and the
read); an entry in ``incremental.may_be_absent`` is a warning naming it instead, counted in
``_summary.json``. The first day of a daily job, whose ``dt=*`` entry matches only the run's own
output, still runs.

Before, each of these ran, read "0 keys from 0 files of 0 outputs", and embedded everything again.
The engine is FAKE (tests/fakes.py): what is under test is which outputs are read, not vectors."""
from __future__ import annotations

import json
import logging
import os
import shutil

import apache_beam as beam
import pydantic
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import config as config_lib
from pipeline.graph import build_batch
from pipeline.run import run_batch
from tests.common import make_config
from tests.fakes import FakeEngine
from tests.output.test_reruns import write_input
from transforms.output.layout import new_run_id
from transforms.settings import IncrementalSettings

OPTIONS = PipelineOptions(["--runner=FnApiRunner"])
DAY_1, DAY_2 = "2026-12-01", "2026-12-02"


def events(ids) -> list[dict]:
    return [{"id": i, "title": f"Story {i}", "body": f"Body of story {i}."} for i in ids]


def daily(root: str, day: str, previous: list[str], may_be_absent=()) -> config_lib.Config:
    """A daily config (output ``out/dt={date}``) filled for ``day``, its input written."""
    write_input(root, f"in/dt={day}", events([f"{day}-a", f"{day}-b"]))
    config = make_config(input=f"{root}/in/dt={{date}}/news.jsonl",
                         output=f"{root}/out/dt={{date}}",
                         incremental=IncrementalSettings(previous_outputs=previous, **(
                             {"may_be_absent": list(may_be_absent)} if may_be_absent else {})))
    return config_lib.fill_date(config, day)


def run(config) -> dict:
    return run_batch(config, OPTIONS, engine_factory=FakeEngine)


def written_summary(output: str) -> dict:
    with open(os.path.join(output, "_summary.json"), encoding="utf-8") as f:
        return json.load(f)


def test_day_one_of_a_daily_job_runs_and_day_two_reads_day_one(tmp_path, caplog):
    """``out/dt=*`` on the first day matches nothing but the run's own output (not even ``out/``
    exists): the first day of the series, not a typo."""
    root = str(tmp_path)
    previous = [f"{root}/out/dt=*"]
    with caplog.at_level(logging.WARNING):
        first = run(daily(root, DAY_1, previous))
    assert first["counts"]["written"] == 2 and first["invariant_holds"]
    assert not [r for r in caplog.records if "previous_outputs" in r.getMessage()]
    assert first["incremental"]["absent"] == [] and first["incremental"]["outputs_read"] == 0
    second = run(daily(root, DAY_2, previous))
    assert second["incremental"]["outputs_read"] == 1
    assert written_summary(f"{root}/out/dt={DAY_2}")["incremental"]["outputs_read"] == 1


def test_a_typod_entry_fails_the_launch_naming_it(tmp_path):
    root = str(tmp_path)
    run(daily(root, DAY_1, []))
    typo = f"{root}/ouptut/dt=*"
    with pytest.raises(config_lib.ConfigError) as raised:
        run(daily(root, DAY_2, [f"{root}/out/dt=*", typo]))
    message = str(raised.value)
    assert typo in message and "matches nothing" in message, message
    assert f"{root}/out/dt=*" not in message.replace(typo, ""), "the good entry is not named"
    assert not os.path.exists(f"{root}/out/dt={DAY_2}"), "the pipeline did not start"


def test_a_folder_of_bare_keys_files_is_not_a_newsvec_output(tmp_path):
    root = str(tmp_path)
    run(daily(root, DAY_1, []))
    bare = f"{root}/copied"
    shutil.copytree(f"{root}/out/dt={DAY_1}/keys", f"{bare}/keys")  # keys/ alone, no manifest
    with pytest.raises(config_lib.ConfigError) as raised:
        run(daily(root, DAY_2, [bare]))
    message = str(raised.value)
    assert bare in message and "not a newsvec output" in message and "keys/" in message, message
    assert not os.path.exists(f"{root}/out/dt={DAY_2}")


def test_an_entry_that_may_be_absent_is_a_warning_naming_it_counted_in_the_summary(tmp_path,
                                                                                  caplog):
    """A streaming output that has not written its first key file yet (a new deployment)."""
    root = str(tmp_path)
    run(daily(root, DAY_1, []))
    stream = f"{root}/stream"
    with caplog.at_level(logging.WARNING, logger="transforms.incremental"):
        summary = run(daily(root, DAY_2, [f"{root}/out/dt=*", stream], may_be_absent=[stream]))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(stream in w and "may_be_absent" in w for w in warnings), warnings
    assert summary["counts"]["written"] == 2 and summary["invariant_holds"]
    for seen in (summary, written_summary(f"{root}/out/dt={DAY_2}")):
        assert seen["incremental"]["absent"] == [stream]
        assert seen["incremental"]["absent_count"] == 1
        assert seen["incremental"]["outputs_read"] == 1


def test_may_be_absent_names_entries_of_previous_outputs_filled_alike():
    with pytest.raises(pydantic.ValidationError, match="out/stream.*previous_outputs"):
        IncrementalSettings(previous_outputs=["out/dt=*"], may_be_absent=["out/stream"])
    config = config_lib.fill_model(make_config(incremental=IncrementalSettings(
        previous_outputs=["out/{model}/dt=*", "out/{model}/stream"],
        may_be_absent=["out/{model}/stream"])))
    assert config.incremental.may_be_absent == [config.incremental.previous_outputs[1]]
    assert "{model}" not in config.incremental.may_be_absent[0]


def test_an_output_gone_between_the_launch_and_the_read_fails_the_job_naming_it(tmp_path):
    """The job resolves the entries again when it reads the keys (a rerun published since is read
    as it now is): one that matches nothing by then fails the job the same way."""
    root = str(tmp_path)
    run(daily(root, DAY_1, []))
    gone = f"{root}/out/dt={DAY_1}"
    pipeline = beam.Pipeline(options=OPTIONS)
    build_batch(pipeline, daily(root, DAY_2, [gone]), new_run_id(), engine_factory=FakeEngine)
    shutil.rmtree(gone)
    with pytest.raises(Exception, match="matches nothing") as raised:
        pipeline.run().wait_until_finish()
    assert gone in str(raised.value)
    assert not os.path.exists(f"{root}/out/dt={DAY_2}/_manifest.json")


def test_the_rule_on_local_disk_and_gcs(root, caplog):
    """``resolve_previous_output`` by the listing (local disk, then the GCS emulator): outputs
    found; the first day of a series; a typo; bare ``keys/``; a bucket that does not exist."""
    from apache_beam.io.filesystems import FileSystems

    from transforms.incremental import (
        PreviousOutputMissing,
        check_previous_outputs,
        resolve_previous_output,
    )

    for name in ("out/dt=2026-12-01/_manifest.json", "copied/keys/part-r-00000-of-00001.parquet"):
        with FileSystems.create(f"{root}/{name}") as f:
            f.write(b"x")
    found = resolve_previous_output(f"{root}/out/dt=*", f"{root}/out/dt=2026-12-02")
    assert found.prefixes == (f"{root}/out/dt=2026-12-01",) and found.missing is None
    first = resolve_previous_output(f"{root}/new/dt=*", f"{root}/new/dt=2026-12-01")
    assert first.prefixes == () and first.missing is None, "the first day of its series"
    typo = resolve_previous_output(f"{root}/nwe/dt=*", f"{root}/new/dt=2026-12-01")
    assert typo.missing is not None and typo.missing.startswith("matches nothing")
    bare = resolve_previous_output(f"{root}/copied", f"{root}/out/dt=2026-12-02")
    assert bare.missing is not None and "not a newsvec output" in bare.missing
    with caplog.at_level(logging.WARNING, logger="transforms.incremental"):
        mixed = resolve_previous_output(f"{root}/**", f"{root}/out/dt=2026-12-02")
    assert mixed.prefixes == (f"{root}/out/dt=2026-12-01",) and mixed.missing is None
    assert any(f"{root}/copied" in r.getMessage() and "not a newsvec output" in r.getMessage()
               for r in caplog.records), "bare keys/ beside outputs: a warning naming them"
    if root.startswith("gs://"):
        missing_bucket = "gs://newsvec-no-such-bucket/out/dt=*"
        with pytest.raises(PreviousOutputMissing, match="newsvec-no-such-bucket") as raised:
            check_previous_outputs([missing_bucket], [missing_bucket], f"{root}/out/dt=2026-12-02")
        assert "could not be listed" in str(raised.value), "refused, even where it may be absent"

"""What a worker killed mid-write leaves (SIGKILL: no Python exception) is never where readers look,
and is cleaned up: by ``python -m pipeline.cleanup`` (any storage), and on GCS by the lifecycle rule
in configs/gcs-lifecycle.json, which matches every temporary name newsvec writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from pipeline import cleanup
from tests.common import REPO
from transforms.output import manifest
from transforms.output.lease import PublishLease
from transforms.output.summary import RunSummary

RUN_ID = "20261201T093000Z-1a2b3c4d"
LIFECYCLE = REPO / "configs" / "gcs-lifecycle.json"

# A streaming worker writing one micro-batch's Parquet file, killed after its first row group.
KILLED_WRITER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from transforms import sinks
    from transforms.output.parquet import vector_schema
    from tests.streaming.test_sinks_streaming import row

    schema = vector_schema(384)

    def tables():
        yield sinks.to_table([row("a")], schema)
        os.kill(os.getpid(), signal.SIGKILL)  # preempted, out of memory: no exception
        yield sinks.to_table([row("b")], schema)

    out = sys.argv[1]
    sinks.write_file(out, "{run}", out + "/vectors/dt=2026-12-01/hour=09", "part-x.parquet",
                     sinks.ParquetTableSink(schema, 1), tables())
""").format(run=RUN_ID)


def files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_a_killed_streaming_writer_leaves_only_a_temp_file_which_cleanup_removes(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = files(tmp_path)
    assert len(left) == 1 and left[0].startswith(f"_temp/{RUN_ID}/"), left  # never in vectors/
    rules = json.loads(LIFECYCLE.read_text())["rule"]
    assert any(left[0].endswith(s)
               for r in rules for s in r["condition"].get("matchesSuffix", ())), \
        "the GCS lifecycle rule matches it"
    # A fresh temp file may belong to a live writer: the default (a day) keeps it.
    assert cleanup.main(["--output", str(tmp_path)]) == 0
    assert files(tmp_path) == left
    assert cleanup.main(["--output", str(tmp_path), "--older-than-s", "0"]) == 0
    assert files(tmp_path) == []


def test_clean_stale_never_touches_published_data_or_a_run_being_published(tmp_path):
    for name in ("vectors/part-a.parquet", "dead_letter/part-a.jsonl", "_summary.json",
                 "_staging/20261130T000000Z-00000000/vectors/x.parquet",
                 "_staging/20261201T000000Z-11111111/vectors/y.parquet", "_temp/z.tmp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    publishing = manifest.Manifest(run_id="20261201T000000Z-11111111", state="publishing",
                                 started_at=time.time(), vectors=[], dead_letter=[],
                                 summary="_summary.json", counts={})
    manifest.write_manifest(str(tmp_path), publishing)
    with PublishLease(str(tmp_path), "cleanup", lease_s=30) as lease:
        deleted = manifest.clean_stale(str(tmp_path), older_than_s=0, lease=lease,
                                       now=time.time() + 10)
    assert sorted(os.path.relpath(p, tmp_path) for p in deleted) == [
        "_staging/20261130T000000Z-00000000/vectors/x.parquet", "_temp/z.tmp"]
    assert set(files(tmp_path)) == {"vectors/part-a.parquet", "dead_letter/part-a.jsonl",
                                    "_summary.json", "_manifest.json",
                                    "_staging/20261201T000000Z-11111111/vectors/y.parquet"}


def test_the_lifecycle_rule_is_one_gcs_accepts():
    from google.cloud import storage

    bucket = storage.Bucket(client=None, name="b")
    bucket._set_properties({"lifecycle": json.loads(LIFECYCLE.read_text())})
    (rule,) = list(bucket.lifecycle_rules)
    assert isinstance(rule, storage.bucket.LifecycleRuleDelete)
    assert rule["condition"] == {"age": 1, "matchesSuffix": [".tmp"]}


def _stale(path, age_s: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    past = time.time() - age_s
    os.utime(path, (past, past))


def test_cleanup_checks_the_lease_before_each_delete(tmp_path, monkeypatch):
    """A clean-up whose lease is taken over midway (it stalled; the next holder took over) stops
    before its next delete. Before, it checked once, then deleted everything in one go."""
    from transforms.output import lease as lease_lib
    from transforms.output import manifest as manifest_lib
    from transforms.output.lease import LeaseLost, LocalLockStore

    for i in range(150):
        _stale(tmp_path / "_temp" / f"{i:03d}.tmp", 7200)
    real_delete, real_fenced = manifest_lib._delete_local, getattr(LocalLockStore, "fenced", None)
    requests: list = []

    def delete(paths, *rest):
        requests.append(len(paths))
        return real_delete(paths, *rest)

    def fenced(self):
        if len(requests) == 1:  # after the first delete request, another
            generation, body = self.read()  # holder takes the lease over
            self.replace({**body, "holder": "the-next-holder"}, generation)
            requests.append(0)
        return real_fenced(self)

    monkeypatch.setattr(manifest_lib, "_delete_local", delete)
    monkeypatch.setattr(lease_lib.LocalLockStore, "fenced", fenced, raising=False)
    with pytest.raises(LeaseLost, match="the-next-holder"):
        cleanup.main(["--output", str(tmp_path), "--older-than-s", "3600"])
    assert requests[1:] == [0], "not one more delete once the lease was lost"
    assert len(list((tmp_path / "_temp").iterdir())) == 150 - requests[0] > 0


def test_cleanup_never_deletes_the_staging_of_a_run_still_writing(tmp_path):
    """A batch run that is still writing has old staged files beside new ones (its first shards
    an hour ago, its last just now). Before, each file was judged by its own age, and the clean-up
    deleted the old half of a live run's staging, failing it at its commit."""
    live, dead = "20261201T000000Z-11111111", "20261130T000000Z-00000000"
    _stale(tmp_path / "_staging" / live / "vectors" / "part-0.parquet", 7200)
    _stale(tmp_path / "_staging" / live / "vectors" / "part-1.parquet", 10)
    _stale(tmp_path / "_staging" / dead / "vectors" / "part-0.parquet", 7200)
    _stale(tmp_path / "_staging" / dead / "keys" / "part-0.parquet", 7000)
    assert cleanup.main(["--output", str(tmp_path), "--older-than-s", "3600"]) == 0
    assert files(tmp_path) == [f"_staging/{live}/vectors/part-0.parquet",
                               f"_staging/{live}/vectors/part-1.parquet"]


def test_cleanup_names_the_files_the_committed_manifest_names_that_are_gone(tmp_path, capsys):
    """An output whose committed manifest names a file that is not there (lost to a storage
    fault, an operator, or a publisher's undo of an earlier release) fails every reader that
    follows the manifest, and readers that glob miss its rows. Before, cleanup said nothing and
    exited 0."""
    from tests.output.test_concurrent_commits import hand_staged_run
    from transforms.commit import _CommitFn

    output = str(tmp_path / "out")
    run_id = "20261201T000000Z-0000000c"
    staged, tallies = hand_staged_run(output, run_id, ["a", "b"])
    list(_CommitFn(output, run_id, RunSummary(), lease_s=30).process(None, staged, tallies))
    assert cleanup.main(["--output", output]) == 0
    capsys.readouterr()
    lost = f"vectors/part-{run_id}-00000-of-00001.parquet"
    os.remove(f"{output}/{lost}")
    assert cleanup.main(["--output", output]) == 1
    assert json.loads(capsys.readouterr().out)["missing"] == [lost]


def test_on_gcs_cleanup_counts_ages_on_the_storages_clock(gcs, tmp_path, monkeypatch):
    """Staged files' ages on GCS are their ``updated`` times, GCS's clock. Before, they were
    compared with this machine's clock: one two hours fast took a live run's staging, written
    just now, for a dead run's, and deleted it. Now ages are counted on the clock of the storage
    (the lock object this clean-up just wrote)."""
    from apache_beam.io.filesystems import FileSystems

    from tests.common import GCS_BUCKET

    output = f"gs://{GCS_BUCKET}/{tmp_path.name}"
    live = f"{output}/_staging/20261201T000000Z-11111111/vectors/part-0.parquet"
    with FileSystems.create(live) as f:
        f.write(b"x")
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 7200)  # this machine, 2 h fast
    assert cleanup.main(["--output", output, "--older-than-s", "3600"]) == 0
    monkeypatch.setattr(time, "time", real_time)
    assert FileSystems.exists(live), "a file written just now is not an hour old"


def test_on_gcs_each_fenced_delete_is_one_batch_request(gcs, tmp_path, monkeypatch):
    """The lease's floor assumes one storage request per fenced change. Before, a fenced change of
    100 deletes was Beam's ``FileSystems.delete``: a listing and a batch request per file, 200
    requests; now one batch request of up to 100, the lease checked before each."""
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.io.gcp.gcsio import GcsIO

    from tests.common import GCS_BUCKET
    from tests.output.test_concurrent_commits import committed_manifest

    output = f"gs://{GCS_BUCKET}/{tmp_path.name}"
    committed_manifest(output, "20261201T000000Z-0000000d")
    strays = [f"{output}/vectors/part-stray-{i:03d}.parquet" for i in range(120)]
    for path in strays:
        with FileSystems.create(path) as f:
            f.write(b"x")
    batches: list = []
    real_batch = GcsIO.delete_batch

    def delete_batch(self, paths):
        batches.append(len(paths))
        return real_batch(self, paths)

    monkeypatch.setattr(GcsIO, "delete_batch", delete_batch)
    with PublishLease(output, "cleanup", lease_s=30) as lease:
        checks: list = []
        real_check = lease.fenced

        def counted():
            checks.append(len(batches))
            return real_check()

        monkeypatch.setattr(lease, "fenced", counted)
        assert sorted(manifest.remove_strays(output, lease)) == strays
    assert batches == [100, 20], batches
    assert checks == [0, 1], "the lease checked before each batch"
    assert not FileSystems.match([f"{output}/vectors/**"])[0].metadata_list

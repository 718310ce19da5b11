"""Incremental runs read their previous outputs as committed snapshots (transforms/incremental.py),
and never count an article unchanged unless a committed output still holds its vector:
- a previous output rerun and committed between a run's launch and its read of the keys: the run
  reads the new committed run, instead of failing on files the rerun removed;
- two reruns of different days that both hold article X, each consulting the other's output, racing
  (each reads the other's old run, then they commit one after the other): the second publishes
  nothing and fails, naming the output that changed, so X stays in a committed output; its rerun
  embeds X. Before, each skipped X because the other held it, and X ended in no output while both
  ledgers balanced.
Real vLLM (the session's engine): a key holds the model's label, which a fake engine's rows lack."""
from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import apache_beam as beam
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import cleanup
from pipeline.graph import build_batch
from pipeline.run import run_batch
from tests.common import make_config
from tests.output.test_concurrent_commits import committed_manifest, embedded, hand_staged_run
from tests.output.test_reruns import listing, rows_of, write_input
from transforms import commit
from transforms.output.layout import new_run_id
from transforms.output.manifest import SnapshotChanged, read_manifest
from transforms.output.summary import RunSummary
from transforms.settings import IncrementalSettings


def events(ids) -> list[dict]:
    return [{"id": i, "title": f"Story {i}", "body": f"Body of story {i}."} for i in ids]


DAY_A = events(["a1", "a2", "x"])
DAY_B = events(["b1", "b2", "x"])  # x: the same article, text and all, on both days


def config(root: str, day: str, previous: list[str]):
    return make_config(input=f"{root}/in/{day}/news.jsonl", output=f"{root}/out/{day}",
                       incremental=IncrementalSettings(previous_outputs=previous))


def run(cfg) -> dict:
    return run_batch(cfg, PipelineOptions(["--runner=FnApiRunner"]))


def ids_in(output: str) -> list[str]:
    return sorted(rows_of(listing(output))["id"].to_pylist())


def test_a_previous_output_republished_after_launch_is_read_as_committed(tmp_path):
    root = str(tmp_path)
    write_input(root, "in/a", DAY_A)
    write_input(root, "in/b", DAY_B)
    run(config(root, "a", []))
    # Day b's job is launched (its graph built) while day a is as first committed...
    pipeline = beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"]))
    build_batch(pipeline, config(root, "b", [f"{root}/out/a"]), new_run_id())
    # ...then day a is rerun, and its first run's files are gone before day b reads them.
    write_input(root, "in/a", events(["a1", "x"]))
    rerun_a = run(config(root, "a", []))
    pipeline.run().wait_until_finish()
    summary = read_manifest(f"{root}/out/b")
    assert summary is not None and summary.state == "committed"
    assert summary.counts["unchanged"] == 1, "x, found in day a's committed rerun"
    assert ids_in(f"{root}/out/b") == ["b1", "b2"]
    assert read_manifest(f"{root}/out/a").run_id == rerun_a["run_id"]


class _OneAfterTheOther:
    """Holds both commits until both runs have reached theirs (each has read the other's old
    keys by then), then lets day a's commit go first and day b's after it."""

    def __init__(self, first_output: str):
        self.first_output = first_output
        self.reached = threading.Barrier(2)
        self.first_done = threading.Event()

    def lease(self, original):
        sequence = self

        class Lease:
            def __init__(self, output, run_id, *args, **kwargs):
                self._output, self._inner = output, original(output, run_id, *args, **kwargs)

            def __enter__(self):
                sequence.reached.wait(300)
                if self._output != sequence.first_output:
                    assert sequence.first_done.wait(300)
                return self._inner.__enter__()

            def __exit__(self, *exc):
                self._inner.__exit__(*exc)
                if self._output == sequence.first_output:
                    sequence.first_done.set()

        return Lease


def test_racing_reruns_of_two_days_never_lose_an_article_both_hold(tmp_path, monkeypatch):
    root = str(tmp_path)
    out_a, out_b = f"{root}/out/a", f"{root}/out/b"
    write_input(root, "in/a", DAY_A)
    write_input(root, "in/b", DAY_B)
    run(config(root, "a", []))
    first_b = run(config(root, "b", []))
    assert "x" in ids_in(out_a) and "x" in ids_in(out_b)
    sequence = _OneAfterTheOther(out_a)
    monkeypatch.setattr(commit, "PublishLease", sequence.lease(commit.PublishLease))
    results: dict = {}

    def rerun(day, previous):
        try:
            results[day] = run(config(root, day, previous))
        except Exception as exc:  # noqa: BLE001 -- the test reads it
            results[day] = exc

    threads = [threading.Thread(target=rerun, args=("a", [out_b])),
               threading.Thread(target=rerun, args=("b", [out_a]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert isinstance(results["a"], dict), results["a"]
    assert results["a"]["counts"]["unchanged"] == 1, "a skipped x: day b's committed run held it"
    assert isinstance(results["b"], Exception), "b read day a's old run, which a replaced"
    assert "republished" in str(results["b"]) and out_a in str(results["b"])
    assert read_manifest(out_b).run_id == first_b["run_id"], "day b as it was, nothing published"
    assert "x" in ids_in(out_b), "x is still in a committed output"
    monkeypatch.undo()
    again = run(config(root, "b", [out_a]))
    assert again["counts"]["unchanged"] == 0 and "x" in ids_in(out_b), \
        "day b's rerun reads day a's new run, which lacks x, and embeds x"


# Every path that publishes an incremental run checks its snapshots first (FAKE engine, staged
# runs built by hand: what is tested is the commit and the storage).

PREVIOUS = "20261101T000000Z-00000000"  # what day a's output held before
B1, B2 = "20261201T000000Z-bbbbbbb1", "20261202T000000Z-bbbbbbb2"  # day b, then its rerun
OLDER, RUN_A = "20261202T000000Z-aaaaaaa0", "20261202T000001Z-aaaaaaa1"  # two launches of day a


def _fails_with(exc: Exception):
    def still_holds(self):
        raise exc
    return still_holds


@pytest.mark.parametrize("finisher", ["its retry", "newsvec cleanup", "an older run"])
def test_a_cut_off_incremental_publish_is_checked_by_whoever_finishes_it(tmp_path, monkeypatch,
                                                                         finisher):
    """The review's F1 sequence. Day a's run skipped article x because day b's committed run B1
    held it. Its commit wrote its ``publishing`` manifest, then its snapshot check failed on a
    storage error (or its worker died): the manifest stays. Day b is rerun meanwhile, without x
    (B2). Before, the retried commit, ``newsvec cleanup``, or an older launch of day a that found
    the cut-off publish published it with no check: x counted unchanged, held by no output. Now
    each checks the recorded snapshots first, puts the previous manifest back, and the run
    fails."""
    from transforms.commit import _CommitFn
    from transforms.output.manifest import Snapshot

    out_a, out_b = f"{tmp_path}/a", f"{tmp_path}/b"
    committed_manifest(out_b, B1)
    before = committed_manifest(out_a, PREVIOUS)
    if finisher == "an older run":
        older_staged, older_tallies = hand_staged_run(out_a, OLDER, ["o1"])
    staged, tallies = hand_staged_run(out_a, RUN_A, ["a1"], unchanged=1)  # x: skipped
    skipped = [Snapshot(out_b, B1)]
    attempt = _CommitFn(out_a, RUN_A, RunSummary(), lease_s=30)
    with monkeypatch.context() as patch:
        patch.setattr(Snapshot, "still_holds", _fails_with(OSError("503 Service Unavailable")))
        with pytest.raises(OSError, match="503"):
            list(attempt.process(None, staged, tallies, skipped))
    cut_off = read_manifest(out_a)
    assert (cut_off.run_id, cut_off.state) == (RUN_A, "publishing")
    committed_manifest(out_b, B2)  # day b rerun: its committed run no longer holds x
    if finisher == "its retry":
        with pytest.raises(SnapshotChanged, match=out_b):
            list(attempt.process(None, staged, tallies, skipped))
    elif finisher == "newsvec cleanup":
        assert cleanup.main(["--output", out_a]) == 1, "it says the run was withdrawn"
    else:
        summary = list(_CommitFn(out_a, OLDER, RunSummary(), lease_s=30).process(
            None, older_staged, older_tallies))[0]
        assert summary.run_id == OLDER and summary.superseded_by is None
    after = read_manifest(out_a)
    if finisher == "an older run":
        assert (after.run_id, after.state) == (OLDER, "committed"), \
            "the newer run withdrawn, the older publishes"
    else:
        assert after == before, "the previous manifest put back"
    assert not [p for p in Path(out_a).rglob("*.parquet")
                if RUN_A in p.name and "_staging" not in p.parts], "nothing of the run published"


def test_a_micro_batch_redone_without_an_article_fails_the_run_that_skipped_it(root, tmp_path,
                                                                              monkeypatch):
    """The review's F13 sequence: the nightly batch skips x because the streaming output's
    micro-batch M holds its key; before the batch commits, M is redone and dead-letters x this
    time, so the writer rewrites M's key file without x. Before, a streaming snapshot always held,
    and the batch published x as unchanged, held by no output. Now the snapshot pins each
    micro-batch key file it read by its checksum: a redo with the same outcome (the same bytes)
    changes nothing, one that withdraws a key fails the run."""
    from pipeline.config import signature_of
    from tests.fakes import FakeEngine
    from tests.streaming.test_sinks_streaming import letter, micro_batch
    from tools import streaming_output
    from transforms.engines.model import model_label, resolve_model_path
    from transforms.text import compose_text
    from transforms.types import NewsEvent

    stream, out = f"{root}/stream", f"{root}/out"
    x, y, z = events(["x", "y", "z"])
    config = make_config(input=write_input(str(tmp_path), "in", [x, y]), output=out,
                         incremental=IncrementalSettings(previous_outputs=[stream]))
    label = model_label(config.model, resolve_model_path(config.model.path))

    def row(article):
        text = compose_text(NewsEvent(**article))
        return embedded(article["id"], text=text, model=label)

    batch = micro_batch(0, rows=[row(x), row(z)])  # the streaming job embedded x and z
    redone_same = batch
    redone_without_x = dataclasses.replace(batch, rows=(row(z),),
                                           dead_letters=(letter("x", "embedding_failed"),))
    streaming_output.write(stream, [batch], signature=signature_of(config))
    redo: list = []
    original = commit.PublishLease

    def redone_before_the_commit(output, run_id, *args, **kwargs):
        streaming_output.write(stream, [redo.pop()], signature=signature_of(config))
        return original(output, run_id, *args, **kwargs)

    monkeypatch.setattr(commit, "PublishLease", redone_before_the_commit)
    redo.append(redone_same)
    first = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]), engine_factory=FakeEngine)
    assert first["counts"]["unchanged"] == 1, "x skipped: M holds it, redone the same"
    redo.append(redone_without_x)
    with pytest.raises(Exception, match="changed since") as failed:
        run_batch(config, PipelineOptions(["--runner=FnApiRunner"]), engine_factory=FakeEngine)
    assert stream in str(failed.value)
    assert read_manifest(out).run_id == first["run_id"], "the rerun published nothing"


def test_previous_output_globs_never_take_a_staged_run_for_a_streaming_output(tmp_path):
    """F14: a ``**`` glob matched the key files of runs staged under ``_staging/<run>/keys/`` (never
    committed) and took each for a streaming output whose snapshot always held; and an output
    under a folder named ``keys`` was cut at that folder."""
    from transforms.incremental import output_prefixes

    root = tmp_path / "root"
    for name in ("day1/_manifest.json", "day1/keys/part-r1-00000-of-00001.parquet",
                 "day1/_staging/r2/keys/part-r2-00000-of-00001.parquet",
                 "day2/_staging/r3/keys/part-r3-00000-of-00001.parquet",
                 "day2/_staging/r3/keys/dt=2026-12-01/hour=09/part-x.parquet",
                 "keys/stream/keys/dt=2026-12-01/hour=09/part-y.parquet",
                 "own/_manifest.json"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    assert output_prefixes(f"{root}/**", str(root / "own")) == [
        str(root / "day1"), str(root / "keys" / "stream")]


def test_a_micro_batch_not_finished_yet_is_never_skipped_against(tmp_path):
    """A streaming micro-batch's files are written before its store load and its ledger record;
    a load that fails fails the bundle, which is retried and may end otherwise. Before, the
    nightly batch pinned the unfinished micro-batch's key file as it was, skipped x against it,
    and its commit check passed (nothing had changed yet); the micro-batch's retry then
    dead-lettered x and rewrote the key file without it: x was in no output. Now only a
    micro-batch with its ledger record is skipped against: the nightly embeds x itself."""
    import glob
    import os

    from pipeline.config import signature_of
    from tests.fakes import FakeEngine
    from tests.streaming.test_sinks_streaming import letter, micro_batch
    from tools import streaming_output
    from transforms.engines.model import model_label, resolve_model_path
    from transforms.output import compaction
    from transforms.text import compose_text
    from transforms.types import NewsEvent

    stream, out = f"{tmp_path}/stream", f"{tmp_path}/out"
    x, y, z = events(["x", "y", "z"])
    config = make_config(input=write_input(str(tmp_path), "in", [x, y]), output=out,
                         incremental=IncrementalSettings(previous_outputs=[stream]))
    label = model_label(config.model, resolve_model_path(config.model.path))

    def row(article):
        return embedded(article["id"], text=compose_text(NewsEvent(**article)), model=label)

    first_attempt = micro_batch(0, rows=[row(x), row(z)])
    streaming_output.write(stream, [first_attempt], signature=signature_of(config))
    for record in glob.glob(f"{stream}/ledger/**/*.json", recursive=True):
        os.remove(record)  # its store load failed: files written, no record (yet)
    nightly = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]),
                        engine_factory=FakeEngine)
    retry = dataclasses.replace(first_attempt, rows=(row(z),),
                                dead_letters=(letter("x", "embedding_failed"),))
    streaming_output.write(stream, [retry], signature=signature_of(config))
    streamed = [i for f in compaction.current_files(stream, "vectors")
                for i in pq.read_table(f, columns=["id"]).column(0).to_pylist()]
    assert "x" not in streamed
    assert "x" in ids_in(out), "x is held by a committed output: the nightly's"
    assert nightly["counts"]["unchanged"] == 0


def test_a_streaming_snapshot_takes_only_micro_batches_settled_for_the_margin(tmp_path):
    """A micro-batch whose record is younger than the settling margin may still be redone by a
    retry of its bundle: it is left out of the snapshot (its articles embedded again), and taken
    once its record has stood that long."""
    import os
    import time

    from tools import streaming_output
    from transforms.incremental import STREAMING_SETTLE_S, streaming_snapshot

    stream = str(tmp_path / "stream")
    streaming_output.write(stream, streaming_output.micro_batches(8, windows=2, shards=1))
    _, fresh = streaming_snapshot(stream, settle=STREAMING_SETTLE_S)
    assert fresh == (), "written just now: nothing skipped against yet"
    _, none_needed = streaming_snapshot(stream, settle=0)
    assert len(none_needed) == 2
    old = time.time() - STREAMING_SETTLE_S - 60
    for record in (tmp_path / "stream" / "ledger").rglob("*.json"):
        os.utime(record, (old, old))
    snapshot, settled = streaming_snapshot(stream, settle=STREAMING_SETTLE_S)
    assert settled == none_needed and len(snapshot.pins) == 2


def test_a_pinned_key_file_reached_through_a_symlinked_keys_folder_is_not_held(tmp_path):
    """A publishing manifest's snapshot names a local streaming output and the key files it
    pinned; before the publish, each must still be there with its bytes. Reached through a
    symlinked ``keys/`` (a writer of that output, or a crafted manifest naming a prefix whose
    ``keys`` leads elsewhere), the file is not the output's: the snapshot does not hold. Before,
    the walk followed the symlink (hashing every file it led to, under the lease) and it held."""
    import hashlib
    import os

    from transforms.output.manifest import Snapshot

    name = "keys/dt=2026-12-01/hour=09/part-20261201T095900Z-001-00000-of-00004-0a.parquet"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / name).parent.mkdir(parents=True)
    (elsewhere / name).write_bytes(b"not this output's keys")
    checksum = hashlib.sha256(b"not this output's keys").hexdigest()
    prev = tmp_path / "prev"
    prev.mkdir()
    os.symlink(elsewhere / "keys", prev / "keys")
    assert not Snapshot(str(prev), None, ((name, checksum),)).still_holds()
    from transforms.output.key_checksums import key_file_checksums

    assert key_file_checksums(str(prev)) == {}, "the files a symlinked keys/ leads to are hashed"
    os.unlink(prev / "keys")
    (prev / name).parent.mkdir(parents=True)
    (prev / name).write_bytes(b"not this output's keys")
    assert Snapshot(str(prev), None, ((name, checksum),)).still_holds()
    assert key_file_checksums(str(prev)) == {name: checksum}

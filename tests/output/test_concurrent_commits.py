"""One publisher at a time per output, enforced by the storage (transforms/output/lease.py), and
what that guarantees when runs, retried commit attempts and clean-ups meet in one output
(transforms/commit.py, transforms/output/manifest.py):
- the lease on local disk and on fake-gcs-server (which enforces GCS preconditions): a second
  holder waits; a lease renewed while its holder works is never taken over; one that stands
  unrenewed is taken over, and its stalled holder is fenced (it may not change one more file);
- two runs of different inputs racing into one output, the older slowed inside its copy for longer
  than the lease: the output ends as exactly one run, the newest, and its manifest names exactly
  the files present;
- the newest run wins even when it commits first;
- ``newsvec cleanup`` run while a rerun publishes waits for it and takes nothing of it;
- two attempts of one commit (a work item executed twice at once) publish once, and an attempt of
  an older run never publishes over a newer one.
The runs use a FAKE engine: what is tested is storage."""
from __future__ import annotations

import contextlib
import datetime as dt
import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import cleanup
from pipeline.run import run_batch
from tests.common import REPO, make_config
from tests.emulators import fake_gcs_with_client
from tests.fakes import FakeEngine
from tests.output.test_reruns import DAY_1, DAY_2, check_is_run, listing, write_input
from transforms import commit
from transforms.output import manifest
from transforms.output.lease import GcsLockStore, LeaseLost, LocalLockStore, PublishLease
from transforms.output.summary import RunSummary

BUCKET = "newsvec-leases"


@pytest.fixture(scope="module")
def fake_gcs(tmp_path_factory):
    with fake_gcs_with_client(BUCKET, tmp_path_factory.mktemp("fake-gcs-log")) as endpoint:
        yield endpoint


@pytest.fixture(params=["local", "fake-gcs"])
def store_factory(request, tmp_path):
    """A lock store maker for one output: local disk, or an object in fake-gcs-server."""
    if request.param == "fake-gcs":
        request.getfixturevalue("fake_gcs")
        return lambda: GcsLockStore(f"gs://{BUCKET}/{tmp_path.name}/_publish.lock")
    return lambda: LocalLockStore(str(tmp_path / "_publish.lock"))


def lease(store_factory, run_id: str, lease_s: float = 2.0, **kwargs) -> PublishLease:
    return PublishLease("out", run_id, lease_s, poll_s=0.05, store=store_factory(), **kwargs)


def test_the_storage_refuses_a_second_create_and_a_stale_replace(store_factory):
    store, other = store_factory(), store_factory()
    generation = store.create({"holder": "a"})
    assert generation is not None
    assert other.create({"holder": "b"}) is None, "create-if-absent"
    newer = store.replace({"holder": "a"}, generation)
    assert newer is not None and newer != generation
    assert other.replace({"holder": "b"}, generation) is None, "a stale generation is refused"
    assert store_factory().read() == (newer, {"holder": "a"})


def test_a_second_holder_waits_until_the_first_releases(store_factory):
    first = lease(store_factory, "20261201T000000Z-aaaaaaaa")
    first.acquire()
    second = lease(store_factory, "20261201T000001Z-bbbbbbbb")
    got = threading.Event()
    waiter = threading.Thread(target=lambda: (second.acquire(), got.set()), daemon=True)
    waiter.start()
    time.sleep(3.0)  # longer than the lease: renewals keep it the first's
    assert not got.is_set(), "a renewed lease is never taken over"
    first.check()
    first.release()
    assert got.wait(5), "and it is taken once released"
    second.check()
    second.release()


def test_a_stalled_holder_is_taken_over_and_fenced(store_factory):
    stalled = lease(store_factory, "20261201T000000Z-aaaaaaaa")
    stalled.acquire()
    stalled._stop.set()  # its renewals stop, as in a process frozen by a long pause
    stalled._renewer.join()
    started = time.monotonic()
    taker = lease(store_factory, "20261201T000001Z-bbbbbbbb")
    taker.acquire()
    assert time.monotonic() - started >= 2.0, "not before the lease has stood unrenewed"
    with pytest.raises(LeaseLost):
        stalled.check()
    stalled.release()  # releases nothing: the lease is the taker's
    taker.check()
    assert store_factory().read()[1]["holder"] == taker.holder
    taker.release()


def test_a_holder_whose_renewal_is_refused_stops(store_factory):
    holder = lease(store_factory, "20261201T000000Z-aaaaaaaa", lease_s=0.8)
    holder.acquire()
    store = store_factory()
    generation, body = store.read()
    assert store.replace({**body, "holder": "intruder"}, generation) is not None
    time.sleep(0.6)  # a renewal runs every lease_s / 4 and finds the generation changed
    with pytest.raises(LeaseLost, match="taken over"):
        holder.check()
    holder.release()
    assert store.read()[1]["holder"] == "intruder", "a holder that lost releases nothing"


# Whole runs on local disk (Beam's GCS filesystem cannot run against fake-gcs-server, and
# gcp-storage-emulator, which it can, does not enforce preconditions).

def _options():
    return PipelineOptions(["--runner=FnApiRunner"])


def _config(input_path: str, output: str, lease_s: float = 600):
    config = make_config(input=input_path, output=output)
    return config.model_copy(update={"sink": config.sink.model_copy(update={
        "commit_lease_s": lease_s})})


def _slow_copies_of(monkeypatch, seconds: float, started: threading.Event) -> list:
    """Each staged file that the first run to publish copies takes ``seconds`` more; ``started``
    is set at its first copy. Returns a list that holds that run's id once it copies."""
    original = manifest._copy_whole
    slowed: list = []

    def slow(output, source, target, lease, *rest):
        staged_run = source.split("/_staging/", 1)[1].split("/", 1)[0]
        if not slowed:
            slowed.append(staged_run)
        if staged_run == slowed[0]:
            started.set()
            time.sleep(seconds)
        return original(output, source, target, lease, *rest)

    monkeypatch.setattr(manifest, "_copy_whole", slow)
    return slowed


def _in_thread(fn, *args):
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 -- the test reads it
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, result


def _manifest_names_what_is_there(output: str) -> dict:
    files = listing(output)
    committed = json.loads(files["_manifest.json"])
    assert committed["state"] == "committed"
    present = sorted(n for n in files
                     if n.startswith(("vectors/", "dead_letter/", "chunks/", "keys/")))
    named = sorted(committed["vectors"] + committed["dead_letter"] + committed["chunks"]
                   + committed["keys"])
    assert named == present, "the manifest names exactly the files present"
    return committed


def test_racing_runs_end_as_the_newest_run_whole(tmp_path, monkeypatch):
    """The older run publishes slowly (each copy longer than the whole lease); the newer starts
    committing meanwhile. Before the lease, the newer took over the older's publish after
    ``commit_lease_s`` and both copied into vectors/ at once."""
    root, output = str(tmp_path), f"{tmp_path}/out"
    copying = threading.Event()
    slowed = _slow_copies_of(monkeypatch, 1.5, copying)
    older, older_result = _in_thread(run_batch, _config(write_input(root, "in1", DAY_1), output,
                                                        lease_s=1.0), _options(), None, FakeEngine)
    assert copying.wait(120), "the older run reached its copy"
    newer = run_batch(_config(write_input(root, "in2", DAY_2), output, lease_s=1.0), _options(),
                      engine_factory=FakeEngine)
    older.join(300)
    assert "error" not in older_result, older_result.get("error")
    assert newer["run_id"] > slowed[0], "the run launched second is the newer"
    assert _manifest_names_what_is_there(output)["run_id"] == newer["run_id"]
    check_is_run(output, DAY_2, newer)


def test_a_run_that_ends_while_a_newer_one_publishes_says_it_was_superseded(tmp_path,
                                                                             monkeypatch):
    """The older run has ended (its commit published nothing, or was cut off) and reads the
    output's summary while a newer run's manifest says publishing: it reports that it was
    superseded, by which run. Before, it raised SummaryUnavailable, the job's work all done (this
    is how the racing test above failed on a loaded machine)."""
    import pipeline.run as run_module
    from transforms.output.layout import STAGING_DIR, join_path, new_run_id

    output = f"{tmp_path}/out"
    newer: list = []
    real = run_module.published_summary

    def a_newer_run_publishes_first(out):
        newer.append(new_run_id())
        manifest.write_manifest(out, manifest.Manifest(
            run_id=newer[0], state=manifest.PUBLISHING, started_at=time.time(), vectors=[],
            dead_letter=[], summary=join_path(STAGING_DIR, newer[0], "_summary.json"),
            counts={}))
        return real(out)

    monkeypatch.setattr(run_module, "published_summary", a_newer_run_publishes_first)
    summary = run_batch(_config(write_input(str(tmp_path), "in1", DAY_1), output), _options(),
                        engine_factory=FakeEngine)
    assert summary["published"] is False and summary["superseded_by"] == newer[0], summary
    assert summary["run_id"] < newer[0]


def test_a_run_from_the_future_in_the_output_fails_the_run_not_silently_wins(tmp_path):
    """An output whose manifest names a run launched, by its id, years from now (a launching
    machine's clock, or someone else's manifest): every later run would be older, publish nothing
    and report success (``published: False``) for ever. The run fails instead, and says why;
    the output is left as it was."""
    output = f"{tmp_path}/out"
    future = "29991231T235959Z-00012345"
    manifest.write_manifest(output, manifest.Manifest(
        run_id=future, state=manifest.COMMITTED, started_at=time.time(), vectors=[],
        dead_letter=[], summary="_summary.json", counts={},
        committed_at="2026-12-06T00:00:00+00:00"))
    before = listing(output)
    with pytest.raises(Exception, match="launched .* h from now") as failure:
        run_batch(_config(write_input(str(tmp_path), "in1", DAY_1), output), _options(),
                  engine_factory=FakeEngine)
    assert future in str(failure.value)
    after = listing(output)
    assert after["_manifest.json"] == before["_manifest.json"]


def test_a_newer_run_launched_on_a_clock_a_little_ahead_still_wins(tmp_path):
    """A clock difference below ``FUTURE_RUN_SKEW_S`` between two launching machines is normal:
    the newer run (ten minutes ahead) keeps the output and this run publishes nothing."""
    import datetime as _dt

    from transforms.output.layout import new_run_id

    output = f"{tmp_path}/out"
    ahead = new_run_id(_dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(minutes=10))
    manifest.write_manifest(output, manifest.Manifest(
        run_id=ahead, state=manifest.COMMITTED, started_at=time.time(), vectors=[],
        dead_letter=[], summary="_summary.json", counts={},
        committed_at="2026-12-06T00:00:00+00:00"))
    summary = run_batch(_config(write_input(str(tmp_path), "in1", DAY_1), output), _options(),
                        engine_factory=FakeEngine)
    assert summary["run_id"] == ahead, "the summary is the newer run's, the output's"
    assert json.loads(listing(output)["_manifest.json"])["run_id"] == ahead


def test_the_newest_run_wins_when_it_commits_first(tmp_path, monkeypatch):
    """An older launch (a slow job, or a Cloud Scheduler launch retried) that reaches its commit
    after a newer one has committed publishes nothing; before, whichever committed last won."""
    root, output = str(tmp_path), f"{tmp_path}/out"
    may_commit = threading.Event()
    original = commit.PublishLease
    first_lease: list = []

    def held_back(output_, run_id, *args, **kwargs):
        if not first_lease:  # the first launch's commit waits for the newer run to commit
            first_lease.append(run_id)
            assert may_commit.wait(300)
        return original(output_, run_id, *args, **kwargs)

    monkeypatch.setattr(commit, "PublishLease", held_back)
    older, older_result = _in_thread(run_batch, _config(write_input(root, "in1", DAY_1), output),
                                     _options(), None, FakeEngine)
    deadline = time.monotonic() + 120
    while not first_lease and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first_lease, "the older run reached its commit"
    time.sleep(1.1)  # run ids order launches by the second (then at random)
    newer = run_batch(_config(write_input(root, "in2", DAY_2), output), _options(),
                      engine_factory=FakeEngine)
    may_commit.set()
    older.join(300)
    assert "error" not in older_result, older_result.get("error")
    assert first_lease[0] < newer["run_id"]
    assert older_result["value"]["run_id"] == newer["run_id"], \
        "the older launch returns the output's summary: the newer run's"
    check_is_run(output, DAY_2, newer)


def test_cleanup_while_a_rerun_publishes_waits_and_takes_nothing(tmp_path, monkeypatch):
    """Before the lease, ``newsvec cleanup`` repaired the rerun's young publishing manifest
    beside the rerun itself, and deleted its staging under it."""
    root, output = str(tmp_path), f"{tmp_path}/out"
    run_batch(_config(write_input(root, "in1", DAY_1), output), _options(),
              engine_factory=FakeEngine)
    time.sleep(1.1)  # run ids order launches by the second (then at random): the rerun is newer
    copying = threading.Event()
    _slow_copies_of(monkeypatch, 0.5, copying)
    rerun, rerun_result = _in_thread(run_batch, _config(write_input(root, "in2", DAY_2), output),
                                     _options(), None, FakeEngine)
    assert copying.wait(120), ("the rerun is publishing", rerun_result.get("error"))
    assert cleanup.main(["--output", output, "--older-than-s", "0"]) == 0
    rerun.join(300)
    assert "error" not in rerun_result, rerun_result.get("error")
    assert _manifest_names_what_is_there(output)["run_id"] == rerun_result["value"]["run_id"]
    check_is_run(output, DAY_2, rerun_result["value"])


def _staged_run(tmp_path, monkeypatch):
    """A batch run stopped just before its commit: its staged files, and the commit's inputs."""
    root, output = str(tmp_path), f"{tmp_path}/out"
    captured: dict = {}

    def capture(self, _, staged, tallies):
        captured.update(fn=self, staged=list(staged), tallies=dict(tallies))
        yield {}

    with monkeypatch.context() as patch, pytest.raises(FileNotFoundError, match="_summary.json"):
        patch.setattr(commit._CommitFn, "process", capture)
        run_batch(_config(write_input(root, "in2", DAY_2), output), _options(),
                  engine_factory=FakeEngine)  # nothing committed: no summary to read
    return output, captured


def test_two_attempts_of_one_commit_publish_once(tmp_path, monkeypatch):
    output, captured = _staged_run(tmp_path, monkeypatch)
    fn, barrier = captured["fn"], threading.Barrier(2)

    def attempt():
        barrier.wait(30)
        return list(fn.process(None, captured["staged"], captured["tallies"]))

    copies: list = []
    original = manifest._copy_whole
    monkeypatch.setattr(manifest, "_copy_whole", lambda *a: (copies.append(a[2]), time.sleep(0.2),
                                                             original(*a))[-1])
    threads = [_in_thread(attempt) for _ in range(2)]
    for thread, _ in threads:
        thread.join(120)
    results = [result for _, result in threads]
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    summaries = [r["value"][0] for r in results]
    assert summaries[0] == summaries[1], "both attempts return the one published summary"
    assert len(copies) == len(set(copies)), "each file copied once: one attempt published"
    check_is_run(output, DAY_2, summaries[0].to_dict())


def test_an_attempt_of_an_older_run_never_publishes_over_a_newer_one(tmp_path, monkeypatch):
    output, captured = _staged_run(tmp_path, monkeypatch)
    newer = run_batch(_config(write_input(str(tmp_path), "in1", DAY_1), output), _options(),
                      engine_factory=FakeEngine)
    late = list(captured["fn"].process(None, captured["staged"], captured["tallies"]))[0]
    assert late.published is False and late.superseded_by == newer["run_id"]
    check_is_run(output, DAY_1, newer)


# A stalled publisher cannot overwrite the newer run: the fencing of each change, the clock, lost
# responses, the local lock's limits. Small staged runs built by hand (no Beam), short leases (the
# test override of the lease floor, set for the session by tests/conftest.py).

def embedded(event_id: str, text: str = None, model: str = "fake@0", sha: str = None):
    """One vector row: ``text`` as prepared, ``sha`` its hash (default: of ``text``)."""
    import datetime as dt
    import hashlib

    import numpy as np

    from transforms.types import EmbeddedDoc, NewsEvent, PreparedDoc

    text = text if text is not None else f"text of {event_id}"
    event = NewsEvent(id=event_id, body=text)
    doc = PreparedDoc(event=event, text=text,
                      text_sha256=sha or hashlib.sha256(text.encode()).hexdigest(),
                      token_ids=(101, 7, 102), truncated=False)
    return EmbeddedDoc.of(doc, np.ones(384, np.float32) / np.sqrt(384), model,
                          dt.datetime(2026, 12, 1, 10, 5, tzinfo=dt.timezone.utc))


def hand_staged_run(output: str, run_id: str, ids, unchanged: int = 0) -> tuple[list, dict]:
    """A batch run stopped just before its commit, its files written by hand: one vectors and one
    keys file of ``ids``. Returns the commit's inputs (staged files, tallies)."""
    import pyarrow.parquet as pq
    from apache_beam.io.filesystems import FileSystems

    from transforms.incremental import KeysTable
    from transforms.output.parquet import key_schema, vector_schema
    from transforms.sinks import to_table

    rows = [embedded(i) for i in ids]
    staging = f"{output}/_staging/{run_id}"
    staged = []
    for subdir, table in (("vectors", to_table(rows, vector_schema(384))),
                          ("keys", KeysTable("sig")(rows, key_schema()))):
        path = f"{staging}/{subdir}/part-{run_id}-00000-of-00001.parquet"
        if not path.startswith("gs://"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with FileSystems.create(path) as f:
            pq.write_table(table, f)
        staged.append((subdir, path))
    with FileSystems.create(f"{staging}/_summary.json") as f:
        f.write(json.dumps({"run_id": run_id}).encode())
    return staged, {"in": len(rows) + unchanged, "rows": len(rows), "unchanged": unchanged}


def committed(run_id: str) -> manifest.Manifest:
    """The manifest of a committed run (no files; what matters is the manifest)."""
    return manifest.Manifest(run_id=run_id, state="committed", started_at=1.0, vectors=[],
                             dead_letter=[], summary="_summary.json", counts={},
                             committed_at="2026-12-01T00:00:00+00:00")


def committed_manifest(output: str, run_id: str) -> manifest.Manifest:
    """An output as a committed run left it."""
    done = committed(run_id)
    manifest.write_manifest(output, done)
    return done


def published_files(output: str) -> list[str]:
    root = Path(output)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.parts[len(root.parts)] in PUBLISHED)


PUBLISHED = ("vectors", "dead_letter", "chunks", "keys")
OLD_RUN, NEW_RUN = "20261201T000000Z-0000000a", "20261201T000001Z-0000000b"

# The older run's holder, in a process of its own: it publishes its staged run, and stops itself
# (SIGSTOP, as a suspend, a paused VM or a long GC would) at the moment its manifest write reaches
# the storage: on local disk the rename of the manifest into place.
STALLED_PUBLISHER = textwrap.dedent("""
    import inspect, os, signal, sys, json
    from apache_beam.io.filesystems import FileSystems
    from transforms.output import manifest
    from transforms.output.lease import PublishLease

    out, run_id = sys.argv[1], sys.argv[2]
    staged = json.loads(sys.argv[3])
    real_rename = FileSystems.rename
    stopped = []

    def rename(sources, targets, *args, **kwargs):
        if targets[0].endswith("_manifest.json") and not stopped:
            stopped.append(1)
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_rename(sources, targets, *args, **kwargs)

    FileSystems.rename = staticmethod(rename)
    from transforms.output import layout
    real_rename_inside = getattr(layout, "rename_inside", None)

    def rename_inside(output, source, target):  # local renames, through no symlink
        if target.endswith("_manifest.json") and not stopped:
            stopped.append(1)
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_rename_inside(output, source, target)

    if real_rename_inside is not None:
        layout.rename_inside = rename_inside
    intent = manifest.Manifest(run_id=run_id, state="publishing", started_at=0.0,
                               vectors=[p for k, p in staged if k == "vectors"], dead_letter=[],
                               keys=[p for k, p in staged if k == "keys"],
                               summary=f"_staging/{run_id}/_summary.json", counts={})
    with PublishLease(out, run_id, lease_s=2.0) as lease:
        # As the commit does (transforms/commit.py): its intent, then the publish.
        if "lease" in inspect.signature(manifest.write_manifest).parameters:
            manifest.write_manifest(out, intent, lease)
        else:  # the code before the fencing: a check, then the write
            lease.check()
            manifest.write_manifest(out, intent)
        manifest.publish(out, intent, lease)
""")


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_publisher_stalled_at_its_manifest_write_never_lands_it_over_the_newer_run(tmp_path):
    """The review's SIGSTOP sequence: the older run stops at its manifest write; the newer run
    wants the lease meanwhile. Before, the newer run took the lease over after 2 s and published,
    then the older run's write landed: the output's manifest said the older run, publishing, over
    the newer run's files (and a clean-up would then have deleted them). Now the check and the
    write are one step under the lock a takeover needs: the newer run publishes after it, and
    wins."""
    output = str(tmp_path / "out")
    old_staged, _ = hand_staged_run(output, OLD_RUN, ["a"])
    new_staged, _ = hand_staged_run(output, NEW_RUN, ["b"])
    relative = [(k, os.path.relpath(p, output)) for k, p in old_staged]
    holder = subprocess.Popen([sys.executable, "-c", STALLED_PUBLISHER, output, OLD_RUN,
                               json.dumps(relative)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _stopped(holder.pid):
            assert holder.poll() is None and time.monotonic() < deadline, holder.stderr.read()
            time.sleep(0.05)
        newer: dict = {}

        def publish_newer():
            intent = manifest.Manifest(
                run_id=NEW_RUN, state="publishing", started_at=0.0,
                vectors=[os.path.relpath(p, output) for k, p in new_staged if k == "vectors"],
                keys=[os.path.relpath(p, output) for k, p in new_staged if k == "keys"],
                dead_letter=[], summary=f"_staging/{NEW_RUN}/_summary.json", counts={})
            with PublishLease(output, NEW_RUN, lease_s=2.0, poll_s=0.05) as held:
                newer["acquired"] = time.monotonic()
                if "lease" in inspect.signature(manifest.write_manifest).parameters:
                    manifest.write_manifest(output, intent, held)
                else:
                    manifest.write_manifest(output, intent)
                manifest.publish(output, intent, held)

        thread, result = _in_thread(publish_newer)
        thread.join(6.0)  # three leases: long enough to take over a holder that is not renewing
        continued = time.monotonic()
        os.kill(holder.pid, signal.SIGCONT)
        thread.join(60)
        holder.wait(60)
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
    assert "error" not in result, result.get("error")
    final = manifest.read_manifest(output)
    assert (final.run_id, final.state) == (NEW_RUN, "committed"), \
        "the stalled older run's manifest write did not land over the newer run"
    assert published_files(output) == sorted(final.vectors + final.keys)
    assert all(NEW_RUN in name for name in published_files(output)), "the newer run's files"
    assert newer["acquired"] > continued, "no takeover while the holder was inside its change"
    assert cleanup.main(["--output", output]) == 0
    assert manifest.read_manifest(output).run_id == NEW_RUN, "and a clean-up keeps it"


# On GCS (fake-gcs-server enforces preconditions): the manifest written only if unchanged since
# the holder last saw it; the holder stops itself just before the upload leaves.
STALLED_GCS_WRITER = textwrap.dedent("""
    import os, signal, sys
    from google.cloud.storage import Blob
    from tests.emulators import _clients_pointed_at
    from transforms.output import manifest
    from transforms.output.lease import LeaseLost, PublishLease

    out, run_id, endpoint = sys.argv[1], sys.argv[2], sys.argv[3]
    real_upload = Blob.upload_from_string
    stopped = []

    def upload(self, *args, **kwargs):
        if self.name.endswith("_manifest.json") and not stopped:
            stopped.append(1)
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_upload(self, *args, **kwargs)

    Blob.upload_from_string = upload
    with _clients_pointed_at(endpoint):
        with PublishLease(out, run_id, lease_s=2.0) as lease:
            current = manifest.read_manifest(out, lease)
            intent = manifest.Manifest(run_id=run_id, state="publishing", started_at=0.0,
                                       vectors=[], dead_letter=[], summary="_summary.json",
                                       counts={})
            try:
                manifest.write_manifest(out, intent, lease)
            except LeaseLost as exc:
                print("refused:", exc)
                sys.exit(3)
""")


def test_a_manifest_write_delayed_past_a_takeover_is_refused_by_gcs(fake_gcs, tmp_path):
    output = f"gs://{BUCKET}/{tmp_path.name}"
    holder = subprocess.Popen([sys.executable, "-c", STALLED_GCS_WRITER, output, OLD_RUN,
                               fake_gcs], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _stopped(holder.pid):
            assert holder.poll() is None and time.monotonic() < deadline, holder.stderr.read()
            time.sleep(0.05)
        with PublishLease(output, NEW_RUN, lease_s=2.0, poll_s=0.05) as taker:
            manifest.read_manifest(output, taker)
            manifest.write_manifest(output, committed(NEW_RUN), taker)
        os.kill(holder.pid, signal.SIGCONT)
        out, err = holder.communicate(timeout=60)
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
    assert holder.returncode == 3 and "refused" in out, err[-2000:]
    from transforms.gcs import gcs_read

    _, data = gcs_read(f"{output}/_manifest.json")
    final = json.loads(data)
    assert (final["run_id"], final["state"]) == (NEW_RUN, "committed"), \
        "the stalled holder's write, sent after the takeover, did not land"


class _ScriptedLock:
    """A lock store on a fake clock: a holder renewed it every second until ``dies_at``; a read
    started in ``slow`` takes ``slow_s`` (GCS retries through a brown-out), and answers with the
    lock as it is when the read ends."""

    exclusive = True

    def __init__(self, clock: list, dies_at: float, slow: tuple, slow_s: float):
        self.clock, self.dies_at, self.slow, self.slow_s = clock, dies_at, slow, slow_s
        self.taken_at = None

    def _generation(self) -> int:
        return int(min(self.clock[0], self.dies_at))

    def read(self):
        if self.slow[0] <= self.clock[0] < self.slow[1]:
            self.clock[0] += self.slow_s
        else:
            self.clock[0] += 0.01
        if self.taken_at is not None:
            return 10**6, {"holder": "taker"}
        return self._generation(), {"holder": "renewing-holder"}

    def replace(self, body, generation):
        if generation != self._generation():
            return None
        self.taken_at = self.clock[0]
        return 10**6

    def create(self, body):
        return None

    def release(self, body, generation):
        pass

    def holder_is_gone(self, body):
        return False

    @contextlib.contextmanager
    def fenced(self):
        yield self.read()


def test_the_takers_clock_starts_after_the_read_that_saw_the_last_renewal(monkeypatch):
    """The holder's last renewal lands at t=10, during a read of the taker's that started at 8.5
    and took 2 s. Before, the taker counted the lease from the start of that read (8.5), and took
    over at 11.5, 1.5 s before the lease had stood unrenewed for its 3 s."""
    from transforms.output import lease as lease_lib

    clock = [0.0]
    store = _ScriptedLock(clock, dies_at=10.0, slow=(8.5, 9.0), slow_s=2.0)
    monkeypatch.setattr(lease_lib, "now", lambda: clock[0], raising=False)
    monkeypatch.setattr(lease_lib.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(lease_lib.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(lease_lib.random, "uniform", lambda a, b: 1.0)
    taker = PublishLease("out", "20261201T000001Z-bbbbbbbb", 3.0, poll_s=0.5, store=store)
    clock[0] = 8.5 - 0.5  # the taker's first read, just before the slow one
    taker.acquire()
    taker._stop.set()  # no renewals on a fake clock
    assert store.taken_at >= 10.0 + 3.0, f"taken over at {store.taken_at}"


def test_a_holder_frozen_by_a_suspend_stops_when_it_wakes(store_factory, monkeypatch):
    """A suspended machine's ``time.monotonic`` does not advance (CLOCK_MONOTONIC), while the taker
    elsewhere counts real time: before, a holder that woke from a suspend longer than its lease
    measured no staleness and went on writing. The lease's clock is CLOCK_BOOTTIME. The suspend is
    played by freezing ``time.monotonic`` in the holder."""
    from transforms.output import lease as lease_lib

    holder = lease(store_factory, "20261201T000000Z-aaaaaaaa", lease_s=1.0)
    holder.acquire()
    holder._stop.set()  # its renewals stop with it
    holder._renewer.join()
    frozen = time.monotonic()
    monkeypatch.setattr(lease_lib.time, "monotonic", lambda: frozen)
    time.sleep(0.7)  # the suspend: more than half the lease
    with pytest.raises(LeaseLost, match="not renewed"):
        holder.check()
    monkeypatch.undo()
    holder.release()


class _LostResponses:
    """A lock store whose conditional writes are applied, but answered as refused: the response
    of the first request was lost, and google-cloud-storage's retry of it got 412."""

    def __init__(self, store, creates: bool = True, replaces: bool = True):
        self._store, self.exclusive = store, getattr(store, "exclusive", True)
        self._creates, self._replaces = creates, replaces
        self.lost = 0

    def create(self, body):
        generation = self._store.create(body)
        if self._creates and generation is not None:
            self.lost += 1
            return None
        return generation

    def replace(self, body, generation):
        new = self._store.replace(body, generation)
        if self._replaces and new is not None:
            self.lost += 1
            return None
        return new

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_lost_response_is_not_a_lost_lease(store_factory, monkeypatch):
    """Before, a renewal applied but answered 412 read as "taken over": LeaseLost mid-publish,
    the lock never released; and a create answered 412 made the run wait a whole lease for its
    own lock. Now a refused change is followed by a read, and a lock with this holder's body is
    its own."""
    from transforms.output import lease as lease_lib

    store = _LostResponses(store_factory())
    holder = PublishLease("out", "20261201T000000Z-aaaaaaaa", 0.8, poll_s=0.05, store=store)
    real_sleep = time.sleep

    def no_wait(seconds):
        raise AssertionError("the holder waited for its own lock")

    monkeypatch.setattr(lease_lib.time, "sleep", no_wait)
    holder.acquire()  # its create was applied: it holds the lease at once
    monkeypatch.setattr(lease_lib.time, "sleep", real_sleep)
    real_sleep(0.7)  # three renewals, each answered as refused
    assert store.lost >= 3
    holder.check()  # no LeaseLost
    holder.release()
    after = store_factory().read()
    assert after is None or after[1].get("released"), "and it released the lock"


def test_a_lost_response_on_gcs_is_recognised_by_the_body(fake_gcs, tmp_path, monkeypatch):
    """The same through google-cloud-storage against fake-gcs-server: each upload of the lock is
    sent twice (the first applied, its response lost), the second refused with 412."""
    from google.cloud.storage import Blob

    real_upload = Blob.upload_from_string
    sent: list = []

    def upload_twice(self, *args, **kwargs):
        real_upload(self, *args, **kwargs)
        sent.append(self.name)
        return real_upload(self, *args, **kwargs)  # the retry: 412 if conditional

    store = GcsLockStore(f"gs://{BUCKET}/{tmp_path.name}/_publish.lock")
    monkeypatch.setattr(Blob, "upload_from_string", upload_twice)
    holder = PublishLease("out", "20261201T000000Z-aaaaaaaa", 0.8, poll_s=0.05, store=store)
    acquiring, _ = _in_thread(holder.acquire)
    acquiring.join(10)  # before: it waited on its own lock, each takeover of it refused too
    assert not acquiring.is_alive(), "the holder never got its own lock"
    time.sleep(0.7)
    assert len(sent) >= 3, "a create and renewals, each retried"
    holder.check()
    holder.release()
    assert store.read()[1].get("released")


def test_a_live_holder_in_another_pid_namespace_is_not_taken_for_dead(tmp_path):
    """Containers that share the output volume and the hostname (host networking) see each other's
    pids as absent. Before, a holder recorded with this hostname and a pid absent here was judged
    dead and taken over at once."""
    import socket

    from transforms.output import lease as lease_lib

    store = LocalLockStore(str(tmp_path / "_publish.lock"))
    unused = 2 ** 22 + 12345  # above the default pid_max: no process has it here
    elsewhere = {"holder": "run/1", "run_id": "run", "host": socket.gethostname(), "pid": unused,
                 "pid_namespace": "pid:[1]", "boot_id": "another-boot"}
    assert not store.holder_is_gone(elsewhere), "another namespace: its pid means nothing here"
    assert not store.holder_is_gone({**elsewhere, "pid_namespace": None, "boot_id": None}), \
        "a holder that recorded no namespace is waited for"
    here = {**elsewhere, **lease_lib.process_identity(), "pid": unused}
    assert store.holder_is_gone(here), "this namespace, and the process has ended"


MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
40 27 0:45 / /mnt/shared rw,relatime - nfs4 server:/export rw,vers=4.2
41 27 0:46 / /mnt/bucket rw,relatime - fuse.gcsfuse my-bucket rw
42 27 8:2 / /mnt/shared/local\\040disk rw - xfs /dev/sdb1 rw
"""


def test_a_local_output_on_a_filesystem_several_machines_mount_is_refused(tmp_path):
    """flock does not span machines on NFS (and gcsfuse has none): two machines could both hold
    the lock. Before, such an output was accepted."""
    from transforms.output import lease as lease_lib

    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(MOUNTINFO)
    kind = lambda path: lease_lib.filesystem_type(path, str(mountinfo))  # noqa: E731
    assert kind("/mnt/shared/out") == "nfs4"
    assert kind("/mnt/bucket/newsvec/out") == "fuse.gcsfuse"
    assert kind("/mnt/shared/local disk/out") == "xfs", "the longest mount point above"
    assert kind("/home/me/out") == "ext4"
    for shared in ("nfs4", "fuse.gcsfuse"):
        with pytest.raises(ValueError, match="does not span machines"):
            LocalLockStore(str(tmp_path / "_publish.lock"), filesystem=shared)
    LocalLockStore(str(tmp_path / "_publish.lock"))  # this machine's own disk: accepted


def test_the_lease_and_the_clean_up_age_have_floors_no_config_can_lower(tmp_path, monkeypatch):
    """Before, any positive ``commit_lease_s`` was taken (the tests used 1 s), and ``newsvec
    cleanup --older-than-s 0`` deleted the staging of runs still writing. The floors give way only
    to the test suite's environment variable, which logs a warning."""
    from pipeline import config as config_lib

    monkeypatch.delenv("NEWSVEC_UNSAFE_TEST_TIMINGS", raising=False)
    config = make_config()
    data = json.loads(config.model_dump_json())
    data["sink"]["commit_lease_s"] = 60
    path = tmp_path / "short-lease.yaml"
    path.write_text(json.dumps(data))
    with pytest.raises(Exception, match="commit_lease_s"):
        config_lib.load(str(path))
    with pytest.raises(ValueError, match="floor"):
        PublishLease(str(tmp_path), "run", lease_s=60)
    with pytest.raises(SystemExit):
        cleanup.main(["--output", str(tmp_path), "--older-than-s", "0"])
    with pytest.raises(SystemExit):
        cleanup.main(["--output", str(tmp_path), "--lease-s", "60"])
    from pipeline import compact

    with pytest.raises(SystemExit) as usage:  # a usage error, not a ValueError's traceback
        compact.main(["--output", str(tmp_path), "--lease-s", "60"])
    assert usage.value.code == 2
    data["sink"]["commit_lease_s"] = 360
    path.write_text(json.dumps(data))
    assert config_lib.load(str(path)).sink.commit_lease_s == 360


def test_a_copy_that_ends_after_a_takeover_is_undone_on_gcs(gcs, tmp_path, monkeypatch):
    """On GCS a copy can land after the lease was taken over (the holder froze, or retried
    through a brown-out, in the middle of it). Before, the holder went on publishing (its next
    check looked only at its own clock); now it reads the lock after the copy, deletes what it
    copied, and stops. On gcp-storage-emulator (Beam's GCS filesystem runs there; the takeover
    needs no precondition)."""
    from apache_beam.io.filesystems import FileSystems

    from tests.common import GCS_BUCKET

    output = f"gs://{GCS_BUCKET}/{tmp_path.name}"
    staged, _ = hand_staged_run(output, OLD_RUN, ["a"])
    intent = manifest.Manifest(
        run_id=OLD_RUN, state="publishing", started_at=0.0, dead_letter=[],
        vectors=[p[len(output) + 1:] for k, p in staged if k == "vectors"],
        keys=[p[len(output) + 1:] for k, p in staged if k == "keys"],
        summary=f"_staging/{OLD_RUN}/_summary.json", counts={})
    real_copy = FileSystems.copy

    def copy_then_taken_over(sources, targets):
        real_copy(sources, targets)
        if "/vectors/" in targets[0]:  # the first copy lands after another run took over
            store = GcsLockStore(f"{output}/_publish.lock")
            generation, body = store.read()
            store.replace({**body, "holder": "the-newer-run"}, generation)

    real_gcs_copy = getattr(manifest, "gcs_copy", None)

    def gcs_copy_then_taken_over(source, target, *args):
        generation = real_gcs_copy(source, target, *args)
        if "/vectors/" in target:
            store = GcsLockStore(f"{output}/_publish.lock")
            current, body = store.read()
            store.replace({**body, "holder": "the-newer-run"}, current)
        return generation

    with PublishLease(output, OLD_RUN, lease_s=30) as holder:
        if "lease" in inspect.signature(manifest.write_manifest).parameters:
            manifest.write_manifest(output, intent, holder)
        else:
            manifest.write_manifest(output, intent)
        monkeypatch.setattr(FileSystems, "copy", staticmethod(copy_then_taken_over))
        if real_gcs_copy is not None:  # the copy through google-cloud-storage (its generation)
            monkeypatch.setattr(manifest, "gcs_copy", gcs_copy_then_taken_over)
        with pytest.raises(LeaseLost, match="the-newer-run"):
            manifest.publish(output, intent, holder)
    published = [m.path for m in FileSystems.match([f"{output}/vectors/**"])[0].metadata_list]
    assert published == [], "the late copy deleted again"


def test_run_ids_launched_in_one_second_sort_by_launch_time():
    """The newest run wins by run id. With the second and 8 random hex digits, two launches in one
    second (a test, a scheduler's retry) were ordered by chance: the later one was 'older' half the
    time and published nothing."""
    from transforms.output.layout import new_run_id

    t = dt.datetime(2026, 12, 1, 9, 30, 0, 1000, tzinfo=dt.timezone.utc)
    for ms in range(0, 998, 3):
        earlier, later = t + dt.timedelta(milliseconds=ms), t + dt.timedelta(milliseconds=ms + 1)
        assert new_run_id(earlier) < new_run_id(later), (earlier, later)
    # Within one millisecond, 5 random hex digits (20 bits): ten launches there collide with a
    # chance of 45 / 2**20 (a thousand would, 38% of the time: the birthday bound).
    assert len({new_run_id(t) for _ in range(10)}) == 10, "distinct within one millisecond"


# A late copy on GCS, and its undo, never take what the output's manifest names. Played in threads
# on gcp-storage-emulator (Beam's GCS filesystem), GCS's preconditions played by
# tests/gcs_preconditions.py: the frozen holder's renewals stop with it, and its request waits
# until the test lets it go.

class _Freezer:
    """Holds the thread ``frozen`` at the first call of a patched storage operation whose target
    matches, after its fence check: its leases' renewals stop (a frozen process renews nothing),
    and the request leaves when ``go`` is set."""

    def __init__(self, monkeypatch, matches):
        self.thread: threading.Thread = None
        self.frozen, self.go = threading.Event(), threading.Event()
        self._matches, self._leases = matches, []
        real_lease = commit.PublishLease

        def recorded(*args, **kwargs):
            held = real_lease(*args, **kwargs)
            self._leases.append((threading.current_thread(), held))
            return held

        monkeypatch.setattr(commit, "PublishLease", recorded)

    def wrap(self, real, target_of):
        def call(*args, **kwargs):
            if (threading.current_thread() is self.thread and not self.frozen.is_set()
                    and self._matches(target_of(args))):
                for thread, held in self._leases:
                    if thread is self.thread:
                        held._stop.set()  # pylint: disable=protected-access
                self.frozen.set()
                assert self.go.wait(60)
            return real(*args, **kwargs)
        return call


def _gcs_output(tmp_path) -> str:
    from tests.common import GCS_BUCKET

    return f"gs://{GCS_BUCKET}/{tmp_path.name}"


def _published_exists(output: str) -> dict:
    from apache_beam.io.filesystems import FileSystems

    final = manifest.read_manifest(output)
    return {name: FileSystems.exists(f"{output}/{name}")
            for name in final.vectors + final.keys + [final.summary]}


def test_a_late_copy_undone_never_deletes_the_file_its_other_attempt_published(gcs, tmp_path,
                                                                              monkeypatch):
    """Attempt 1 of run R freezes with its copy of a vectors file in flight; attempt 2 of R takes
    the lease over and publishes R; attempt 1 wakes before attempt 2 deletes R's staging. Before,
    its copy landed, its re-check raised LeaseLost, and its undo deleted the file by name: the
    committed manifest named a missing file (and keys/ still listed its articles). Now the copy is
    conditional on what attempt 1 listed (absent): GCS refuses it, and nothing is undone."""
    from apache_beam.io.filesystems import FileSystems

    from tests.gcs_preconditions import enforced
    from transforms.output import lease as lease_lib

    output = _gcs_output(tmp_path)
    staged, tallies = hand_staged_run(output, NEW_RUN, ["a1", "a2"])
    freezer = _Freezer(monkeypatch, lambda target: "/vectors/" in target)
    monkeypatch.setattr(FileSystems, "copy", staticmethod(
        freezer.wrap(FileSystems.copy, lambda args: args[1][0])))
    if hasattr(manifest, "gcs_copy"):
        monkeypatch.setattr(manifest, "gcs_copy", freezer.wrap(manifest.gcs_copy,
                                                               lambda args: args[1]))
    first: dict = {}

    def attempt_1():
        try:
            first["value"] = list(commit._CommitFn(output, NEW_RUN, RunSummary(),
                                                   lease_s=1.0).process(None, staged, tallies))
        except Exception as exc:  # pylint: disable=broad-except
            first["error"] = exc

    def wake_attempt_1_first(real):
        def call(*args, **kwargs):  # attempt 2, about to delete R's staging
            freezer.go.set()
            freezer.thread.join(60)
            return real(*args, **kwargs)
        return call

    for name in ("delete_tree_fenced", "delete_tree"):
        if hasattr(manifest, name):
            monkeypatch.setattr(manifest, name, wake_attempt_1_first(getattr(manifest, name)))
    with enforced():
        freezer.thread = threading.Thread(target=attempt_1, name="attempt-1")
        freezer.thread.start()
        assert freezer.frozen.wait(60), first
        second = list(commit._CommitFn(output, NEW_RUN, RunSummary(), lease_s=1.0).process(
            None, staged, tallies))[0]
    assert not freezer.thread.is_alive()
    assert isinstance(first.get("error"), lease_lib.LeaseLost), first
    assert second.run_id == NEW_RUN
    final = manifest.read_manifest(output)
    assert (final.run_id, final.state) == (NEW_RUN, "committed")
    assert all(_published_exists(output).values()), _published_exists(output)
    assert cleanup.main(["--output", output]) == 0


@pytest.mark.parametrize("then", ["undone", "killed before its undo"])
def test_a_stalled_older_runs_summary_never_replaces_or_removes_the_newer_runs(gcs, tmp_path,
                                                                              monkeypatch, then):
    """The older run O freezes with its write of ``_summary.json`` in flight (a copy, before);
    the newer run N takes the lease over and commits. Before, O's copy landed over N's summary
    and its undo deleted ``_summary.json`` (run.py then failed with FileNotFoundError after a
    successful job), or, O killed before its undo, N's output kept O's summary (backfill judged
    the day by O's settings). Now the summary is written conditionally, as the manifest is: O's
    late write is refused."""
    from apache_beam.io.filesystems import FileSystems

    from tests.gcs_preconditions import enforced
    from transforms.output import lease as lease_lib

    class Killed(BaseException):
        """The process dies here: nothing after it runs (no undo)."""

    output = _gcs_output(tmp_path)
    old_staged, old_tallies = hand_staged_run(output, OLD_RUN, ["o1"])
    new_staged, new_tallies = hand_staged_run(output, NEW_RUN, ["n1"])
    freezer = _Freezer(monkeypatch, lambda target: target.endswith("/_summary.json"))

    def then_killed(real, target_of):
        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            if (then != "undone" and threading.current_thread() is freezer.thread
                    and target_of(args).endswith("/_summary.json")):
                raise Killed()
            return result
        return call

    monkeypatch.setattr(FileSystems, "copy", staticmethod(freezer.wrap(
        then_killed(FileSystems.copy, lambda args: args[1][0]), lambda args: args[1][0])))
    monkeypatch.setattr(lease_lib, "gcs_write", freezer.wrap(
        then_killed(lease_lib.gcs_write, lambda args: args[0]), lambda args: args[0]))
    older: dict = {}

    def older_run():
        try:
            older["value"] = list(commit._CommitFn(output, OLD_RUN, RunSummary(),
                                                   lease_s=1.0).process(None, old_staged,
                                                                        old_tallies))
        except BaseException as exc:  # pylint: disable=broad-except  # Killed included
            older["error"] = exc

    with enforced():
        freezer.thread = threading.Thread(target=older_run, name="older-run")
        freezer.thread.start()
        assert freezer.frozen.wait(60), older
        newer = list(commit._CommitFn(output, NEW_RUN, RunSummary(), lease_s=1.0).process(
            None, new_staged, new_tallies))[0]
        freezer.go.set()
        freezer.thread.join(60)
    assert not freezer.thread.is_alive()
    assert newer.run_id == NEW_RUN and "error" in older
    final = manifest.read_manifest(output)
    assert (final.run_id, final.state) == (NEW_RUN, "committed")
    assert FileSystems.exists(f"{output}/_summary.json"), "the newer run's summary is there"
    with FileSystems.open(f"{output}/_summary.json") as f:
        assert json.loads(f.read())["run_id"] == NEW_RUN, "and it is the newer run's"
    assert all(_published_exists(output).values())


UNTRUSTED_MOUNTINFO = """\
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
60 27 0:70 / /data rw,nosuid,nodev - fuse my-bucket rw,user_id=0,group_id=0,allow_other
61 27 0:71 / /mnt/host rw,relatime - virtiofs mount0 rw
62 27 0:72 / /mnt/c rw,noatime - 9p drvfs rw,aname=drvfs;path=C:\\;uid=1000
63 27 0:73 / /var/lib/docker rw,relatime - overlay overlay rw
64 27 0:74 / /scratch rw,relatime - xfs /dev/sdb1 rw
"""


def test_the_local_lock_takes_only_local_filesystems_unless_told(tmp_path, monkeypatch):
    """Before, the refusal was a list of shared filesystems: GKE's Cloud Storage FUSE CSI mounts
    (type ``fuse``), virtiofs and 9p passed, and so did an output whose type could not be read
    (no /proc: macOS). Now only local filesystems are taken; any other only when the user names
    its type in NEWSVEC_LOCAL_LOCK_FILESYSTEMS."""
    from transforms.output import lease as lease_lib

    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(UNTRUSTED_MOUNTINFO)
    kind = lambda path: lease_lib.filesystem_type(path, str(mountinfo))  # noqa: E731
    assert [kind(p) for p in ("/data/out", "/mnt/host/out", "/mnt/c/out", "/var/lib/docker/o",
                              "/scratch/out", "/home/me")] == [
        "fuse", "virtiofs", "9p", "overlay", "xfs", "ext4"]
    assert lease_lib.filesystem_type("/anything", str(tmp_path / "no-proc")) is None, \
        "no mountinfo on Linux: unknown"
    monkeypatch.delenv("NEWSVEC_LOCAL_LOCK_FILESYSTEMS", raising=False)
    lock = str(tmp_path / "_publish.lock")
    for untrusted in ("fuse", "virtiofs", "9p", "fuse.gcsfuse", "nfs4", "unknown"):
        with pytest.raises(ValueError, match="NEWSVEC_LOCAL_LOCK_FILESYSTEMS") as refused:
            LocalLockStore(lock, filesystem=untrusted)
        assert untrusted in str(refused.value)
    monkeypatch.setattr(lease_lib, "filesystem_type", lambda path: None)  # no /proc, no mount
    with pytest.raises(ValueError, match="unknown"):
        LocalLockStore(lock)
    for local in ("ext4", "xfs", "btrfs", "tmpfs", "overlay", "apfs"):
        LocalLockStore(lock, filesystem=local)
    monkeypatch.setenv("NEWSVEC_LOCAL_LOCK_FILESYSTEMS", "virtiofs, unknown")
    LocalLockStore(lock, filesystem="virtiofs")  # the user says only this machine writes there
    LocalLockStore(lock)
    with pytest.raises(ValueError):
        LocalLockStore(lock, filesystem="fuse")


def test_who_waits_for_a_holder_frozen_inside_a_local_change_says_so(tmp_path, caplog):
    """A holder frozen inside a local change keeps the flock (by design: a change never lands
    after a takeover). Before, every other publisher and clean-up blocked on it without a word;
    now it logs whom it waits for."""
    import logging

    inside, leave = threading.Event(), threading.Event()
    holder = PublishLease(str(tmp_path), "20261201T000000Z-aaaaaaaa", lease_s=1.0, poll_s=0.05)

    def frozen_change():
        with holder:
            holder.change(lambda: (inside.set(), leave.wait(30)))

    thread, _ = _in_thread(frozen_change)
    assert inside.wait(30)
    waiter = PublishLease(str(tmp_path), "20261201T000001Z-bbbbbbbb", lease_s=1.0, poll_s=0.05)
    caplog.set_level(logging.WARNING, logger="transforms.output.lease")
    acquiring, _ = _in_thread(waiter.acquire)
    deadline = time.monotonic() + 30
    while "waiting" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.1)
    assert acquiring.is_alive(), "no takeover while the holder is inside its change"
    leave.set()
    thread.join(30)
    acquiring.join(30)
    waiter.release()
    assert "20261201T000000Z-aaaaaaaa" in caplog.text and "inside a change" in caplog.text


def test_an_output_folder_every_user_may_write_is_refused_before_anything_is_published(tmp_path):
    """Whoever may write the output folder may replace ``_publish.lock`` (naming a live holder on
    another host, with a rising generation: every run then waits for ever) or unlink
    ``_publish.lock.flock`` under its holder (the next process flocks a new file: two inside a
    change at once). Before, a world-writable output was taken as it was; now the lease refuses
    it, and the run fails saying how to fix it, with nothing published."""
    from transforms.output.layout import UnsafePath

    output = tmp_path / "out"
    output.mkdir()
    os.chmod(output, 0o777)
    with pytest.raises(UnsafePath, match="every user"):
        LocalLockStore(str(output / "_publish.lock"))
    with pytest.raises(Exception, match="chmod o-w"):
        run_batch(_config(write_input(str(tmp_path), "in1", DAY_1), str(output)), _options(),
                  engine_factory=FakeEngine)
    assert not (output / "_manifest.json").exists() and not (output / "vectors").exists()
    os.chmod(output, 0o775)  # a group it trusts may write it
    LocalLockStore(str(output / "_publish.lock"))


def test_a_commit_attempt_after_the_publish_returns_its_summary(tmp_path):
    """A second attempt of a commit that published (a work item retried after its worker was
    lost) finds the run's staging deleted by that publish: it returns the run's summary. Its
    check of the staged files before the lease (a symlink or a FIFO there is refused) takes a
    file that is gone for what it is, not for an error."""
    from transforms.commit import _CommitFn

    output = str(tmp_path / "out")
    run_id = "20261201T000000Z-0000000c"
    staged, tallies = hand_staged_run(output, run_id, ["a", "b"])
    first = list(_CommitFn(output, run_id, RunSummary(), lease_s=360).process(
        None, staged, tallies))
    assert not (tmp_path / "out" / "_staging" / run_id).exists()
    again = list(_CommitFn(output, run_id, RunSummary(), lease_s=360).process(
        None, staged, tallies))
    assert again[0].run_id == first[0].run_id == run_id
    assert again[0].counts == first[0].counts

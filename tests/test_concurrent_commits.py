"""One publisher at a time per output, enforced by the storage (transforms/lease.py), and what
that guarantees when runs, retried commit attempts and clean-ups meet in one output
(transforms/commit.py, transforms/manifest.py):
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

import json
import threading
import time

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import cleanup
from pipeline.run import run_batch
from tests.conftest import make_config
from tests.emulators import fake_gcs_with_client
from tests.fakes import FakeEngine
from tests.test_reruns import DAY_1, DAY_2, check_is_run, listing, write_input
from transforms import commit, manifest
from transforms.lease import GcsLockStore, LeaseLost, LocalLockStore, PublishLease

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

    def slow(output, source, target, lease):
        staged_run = source.split("/_staging/", 1)[1].split("/", 1)[0]
        if not slowed:
            slowed.append(staged_run)
        if staged_run == slowed[0]:
            started.set()
            time.sleep(seconds)
        return original(output, source, target, lease)

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
    copying = threading.Event()
    _slow_copies_of(monkeypatch, 0.5, copying)
    rerun, rerun_result = _in_thread(run_batch, _config(write_input(root, "in2", DAY_2), output),
                                     _options(), None, FakeEngine)
    assert copying.wait(120), "the rerun is publishing"
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
    check_is_run(output, DAY_2, summaries[0])


def test_an_attempt_of_an_older_run_never_publishes_over_a_newer_one(tmp_path, monkeypatch):
    output, captured = _staged_run(tmp_path, monkeypatch)
    newer = run_batch(_config(write_input(str(tmp_path), "in1", DAY_1), output), _options(),
                      engine_factory=FakeEngine)
    late = list(captured["fn"].process(None, captured["staged"], captured["tallies"]))[0]
    assert late["published"] is False and late["superseded_by"] == newer["run_id"]
    check_is_run(output, DAY_1, newer)

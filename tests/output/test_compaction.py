"""Compaction of a streaming output (``newsvec compact``, transforms/output/compaction.py): an hour
of micro-batch files becomes one file per kind; ``newsvec ledger`` gives the same totals and passes;
a rerun changes nothing; a run killed between any two steps leaves the old or the new state to
readers that follow the manifest (never a row twice or not at all) and a rerun finishes it; a
micro-batch that lands while it runs is kept and counted, and merged by the next run.

The output is written by the real streaming writer (WriteStreaming on the local runner) from
micro-batches with FAKE embeddings (tools/streaming_output.py).
"""
import datetime as dt
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from apache_beam.io.filesystems import FileSystems

from pipeline import cli, compact, ledger
from tools import streaming_output as so
from transforms.output import compaction
from transforms.output.lease import PublishLease

HOURS = (so.START, so.START + dt.timedelta(hours=2))
LATER = so.START + dt.timedelta(days=2)  # every hour closed
ROW_GROUP = 16
H09 = "dt=2026-12-01/hour=09"
KINDS = ("vectors", "chunks", "keys", "dead_letter", "ledger")
# 90 messages in 10-minute windows over 09:00-11:00 (two partitions), 2 shards, late panes.
BATCHES = so.micro_batches(90, windows=12, window_s=600, chunks=2)
LATE = so.micro_batches(30, windows=5, first_id=10_000, seed=1, chunks=1)  # more in 09:00


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stream") / "out"
    so.write(str(out), BATCHES, row_group_rows=ROW_GROUP)
    return out


@pytest.fixture(scope="module")
def late_written(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("late") / "out"
    so.write(str(out), LATE, row_group_rows=ROW_GROUP)
    return out


@pytest.fixture
def output(written, tmp_path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(written, out)
    return out


def run(output, hook=None, closed_after_s=0.0, lease_s=30.0):
    return compact.compact_range(str(output), *HOURS, ROW_GROUP, lease_s=lease_s,
                                 closed_after_s=closed_after_s, now=LATER, hook=hook)


def data_files(output: Path) -> dict:
    return {p.relative_to(output).as_posix(): p.read_bytes() for p in output.rglob("*")
            if p.is_file() and p.parts[len(output.parts)] in KINDS + ("_compaction",)}


def current_rows(output, kind: str, column: str) -> list:
    """What a reader that follows the manifest reads: every value of a column, each file once."""
    values = []
    for path in compaction.current_files(str(output), kind):
        with FileSystems.open(path) as f:  # local or gs:// (pyarrow's own GCS client would not
            values += pq.read_table(f, columns=[column]).column(0).to_pylist()  # find it)
    return sorted(values)


class Killed(Exception):
    pass


def test_an_hour_becomes_one_file_per_kind_and_the_ledger_holds(output):
    before = ledger.check(str(output))
    ids = current_rows(output, "vectors", "id")
    keys = current_rows(output, "keys", "key")
    assert before.ok and before.totals["rows_written"] == len(ids) > 70
    files_before = len(data_files(output))

    results = run(output)

    after = ledger.check(str(output))
    assert after.ok, after.problems
    assert after.totals == before.totals
    for kind in KINDS:
        names = sorted(p.name for p in (output / kind / H09).iterdir())
        assert len(names) == 1 and names[0].startswith("compacted-"), (kind, names)
    assert len(data_files(output)) == 2 * len(KINDS) + 2 < files_before / 5
    assert current_rows(output, "vectors", "id") == ids
    assert current_rows(output, "keys", "key") == keys
    assert [r["batches"] for r in results] == [
        sum(1 for b in BATCHES if b.window_start_us < so.START.timestamp() * 1e6 + 3600e6),
        sum(1 for b in BATCHES if b.window_start_us >= so.START.timestamp() * 1e6 + 3600e6)]
    vectors = pq.ParquetFile(next((output / "vectors" / H09).iterdir()))
    groups = [vectors.metadata.row_group(i).num_rows for i in range(vectors.num_row_groups)]
    assert groups[:-1] == [ROW_GROUP] * (len(groups) - 1) and 0 < groups[-1] <= ROW_GROUP
    # The vectors are the same, row for row.
    table = pq.read_table(next((output / "vectors" / H09).iterdir()), columns=["id", "embedding"])
    stored = dict(zip(table.column("id").to_pylist(),
                      table.column("embedding").to_numpy(zero_copy_only=False), strict=True))
    written = {r.id: r.embedding for b in BATCHES for r in b.rows if r.id in stored}
    assert len(written) == len(stored) and all(
        np.array_equal(stored[i], written[i]) for i in written)


def test_a_rerun_changes_nothing(output):
    run(output)
    once = data_files(output)
    results = run(output)
    assert data_files(output) == once
    assert all(r["batches"] == 0 and r["cleaned"] == 0 for r in results)


STEPS = ["write vectors", "write chunks", "write keys", "write dead_letter", "write ledger",
         "manifest", "delete"]


@pytest.mark.parametrize("merge", [False, True], ids=["first", "merge"])
@pytest.mark.parametrize("step", STEPS)
def test_a_run_killed_at_any_step_loses_nothing_and_a_rerun_finishes_it(output, late_written,
                                                                        step, merge):
    if merge:  # a compacted hour and new micro-batches: the killed run merges them
        run(output)
        shutil.copytree(late_written, output, dirs_exist_ok=True)
    before = ledger.check(str(output))
    ids = current_rows(output, "vectors", "id")
    keys = [str(p) for p in compaction.current_key_files(str(output))]

    def kill(at):
        if at == step:
            if at == "delete":  # midway: some of the replaced files are gone already
                for path in sorted((output / "vectors" / H09).glob("part-*"))[::2]:
                    path.unlink()
            raise Killed(at)

    with pytest.raises(Killed):
        run(output, hook=kill)

    # Readers that follow the manifest or the ledger see every row once: the old or the new state.
    killed = ledger.check(str(output))
    assert killed.totals == {**before.totals, "balanced": killed.ok}
    assert all("unfinished compaction" in p for p in killed.problems), killed.problems
    assert current_rows(output, "vectors", "id") == ids
    assert len(current_rows(output, "keys", "key")) == len(ids)
    assert keys  # listed before

    run(output)
    after = ledger.check(str(output))
    assert after.ok, after.problems
    assert after.totals == before.totals
    assert current_rows(output, "vectors", "id") == ids
    for kind in KINDS:
        assert len(list((output / kind / H09).iterdir())) == 1, kind


def test_a_micro_batch_that_lands_during_compaction_is_kept_and_merged_next_time(output, tmp_path):
    before = ledger.check(str(output))
    late = so.micro_batches(12, windows=1, shards=1, first_id=20_000, seed=2)
    # A micro-batch whose vectors file is written and whose record is not yet (its writer is
    # between the two): not taken, because only micro-batches with a record are.
    half = tmp_path / "half"
    half_batch = so.micro_batches(7, windows=1, shards=1, first_id=30_000, seed=3)
    half_batch = [so.with_pane(b, 5) for b in half_batch]
    so.write(str(half), half_batch)
    (vectors_only,) = (half / "vectors" / H09).iterdir()
    shutil.copy(vectors_only, output / "vectors" / H09)

    def land(at):
        if at == "manifest":  # a late pane written while the compacted files are being adopted
            so.write(str(output), late, row_group_rows=ROW_GROUP)

    run(output, hook=land)
    assert (output / "vectors" / H09 / vectors_only.name).exists()
    shutil.copytree(half, output, dirs_exist_ok=True)  # its writer finishes: keys, record
    report = ledger.check(str(output))
    assert report.ok, report.problems
    added = sum(b.messages_in for b in late + half_batch)
    assert report.totals["messages_in"] == before.totals["messages_in"] + added
    assert len(list((output / "vectors" / H09).glob("part-*"))) == 2  # late and half: still there

    chunks_file = sorted((output / "chunks" / H09).iterdir())
    run(output)  # the next run merges them with the compacted file
    # They have no chunks: the hour's compacted chunks file stays as it was, not rewritten.
    assert sorted((output / "chunks" / H09).iterdir()) == chunks_file
    again = ledger.check(str(output))
    assert again.ok and again.totals == report.totals
    assert [p.name[:10] for p in (output / "vectors" / H09).iterdir()] == ["compacted-"]
    assert len(current_rows(output, "vectors", "id")) == report.totals["rows_written"]


def test_the_ledger_names_a_compacted_file_that_does_not_hold_its_records_rows(output):
    run(output)
    (path,) = (output / "dead_letter" / H09).iterdir()
    path.write_text("".join(path.read_text().splitlines(keepends=True)[1:]))  # one lost
    report = ledger.check(str(output))
    assert any(path.name in p and "its ledger records say" in p for p in report.problems)


def test_two_compactions_never_run_at_once(output):
    with PublishLease(str(output), "another-compaction", lease_s=30):
        worker = threading.Thread(target=run, args=(output,), kwargs={"lease_s": 2.0})
        worker.start()
        time.sleep(1.0)
        assert not list(output.rglob("compacted-*")), "it waits for the lease"
    worker.join(timeout=60)
    assert list((output / "vectors" / H09).iterdir())[0].name.startswith("compacted-")


def test_open_hours_are_left_alone_by_default(output, capsys):
    # Now is 09:30 on the day: neither hour is closed (lateness 600 s + grace 3600 s + 300 s).
    results = compact.compact_range(str(output), *HOURS, ROW_GROUP, closed_after_s=4500,
                                    now=so.START + dt.timedelta(hours=1, minutes=30))
    assert [r.get("skipped") for r in results] == ["not closed yet"] * 2
    assert not list(output.rglob("compacted-*"))
    code = cli.main(["compact", "--output", str(output), "--day", "2026-12-01",
                     "--row-group-rows", "1000"])
    assert code == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == 24 and printed[9]["batches"] > 0 and ledger.check(str(output)).ok


def test_the_scheduler_body_runs_newsvec_compact_with_options_it_takes():
    body = json.loads((Path(__file__).parents[2] / "configs" / "scheduler-compact-run.json")
                      .read_text())
    (container,) = body["overrides"]["containerOverrides"]
    args = container["args"]
    assert args[0] == "compact"
    parsed = compact.parser().parse_args(args[1:])
    assert parsed.config.endswith("/dataflow-streaming.yaml") and parsed.day == "yesterday"


def test_on_gcs_a_killed_run_is_finished_by_the_next(gcs, tmp_path):
    # The same code through Beam's GCS filesystem and the lease's GCS store (gcp-storage-emulator).
    from tests.common import GCS_BUCKET

    output = f"gs://{GCS_BUCKET}/{tmp_path.name}"
    so.write(output, BATCHES[:6], row_group_rows=ROW_GROUP)
    before = ledger.check(output)
    keys = compaction.current_key_files(output)
    assert before.ok and len(keys) > 3

    def kill(at):
        if at == "delete":
            raise Killed(at)

    with pytest.raises(Killed):
        compact.compact_range(output, *HOURS, ROW_GROUP, lease_s=30, now=LATER, hook=kill)
    assert ledger.check(output).totals["rows_written"] == before.totals["rows_written"]
    compact.compact_range(output, *HOURS, ROW_GROUP, lease_s=30, now=LATER)
    after = ledger.check(output)
    assert after.ok and after.totals == before.totals, after.problems
    assert len(compaction.current_key_files(output)) == 1
    assert sum(pq.read_metadata(FileSystems.open(p)).num_rows
               for p in compaction.current_files(output, "vectors")) == after.totals["rows_written"]


def test_a_reader_listing_while_an_hour_is_compacted_again_sees_every_row_once(output,
                                                                               late_written,
                                                                               monkeypatch):
    """A reader lists an hour's files, and reads its manifest, while a compaction merges late
    micro-batches into that hour: read at two different times, the listing (before the new
    compacted file) and the manifest (after it, saying the listed files are replaced) would drop
    the whole hour. The reader reads the manifests before and after its listing, and again if
    they changed."""
    run(output)
    shutil.copytree(late_written, output, dirs_exist_ok=True)
    expected = sorted(set(current_rows(output, "keys", "key")))
    real_manifests = compaction._manifests  # pylint: disable=protected-access
    calls = []

    def manifests_then_compact_after_the_listing(out, partitions):
        calls.append(out)
        read = real_manifests(out, partitions)
        if len(calls) == 1:  # between this read and the next one, the reader lists
            real_match = compaction.FileSystems.match

            def listing_then_compaction(patterns):
                listed = real_match(patterns)
                monkeypatch.setattr(compaction.FileSystems, "match", real_match)
                run(output)  # merges the late micro-batches: new file, manifest, deletes
                return listed

            monkeypatch.setattr(compaction.FileSystems, "match", listing_then_compaction)
        return read

    monkeypatch.setattr(compaction, "_manifests", manifests_then_compact_after_the_listing)
    keys = []
    for path in compaction.current_files(str(output), "keys"):
        keys += pq.read_table(path, columns=["key"]).column(0).to_pylist()
    assert sorted(keys) == expected
    assert len(calls) >= 3, "the reader did not read the manifests again after they changed"


def test_an_hour_that_cannot_be_compacted_holds_up_no_other(output, capsys):
    victim = sorted((output / "vectors" / H09).glob("part-*.parquet"))[0]
    victim.unlink()  # its ledger record names a file that is gone
    assert compact.main(["--output", str(output), "--from", "2026-12-01T09:00:00Z",
                         "--until", "2026-12-01T11:00:00Z", "--closed-after-s", "0"]) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["partition"] for line in lines] == [H09, "dt=2026-12-01/hour=10"]
    assert "error" in lines[0] and "error" not in lines[1] and lines[1]["batches"] > 0


# A compaction frozen inside its manifest write (after the lease was checked: a SIGSTOP, a paused
# VM, a long GC) while a second compaction takes the lease over. Played in threads: the frozen
# one's renewals stop with it, and its write waits until the test lets it go.

def _freeze_in_manifest_write(monkeypatch, frozen_thread: list, frozen: threading.Event,
                              go: threading.Event) -> None:
    """The first compaction-manifest write of the thread in ``frozen_thread`` stops its lease's
    renewals (``frozen_thread[1]``), says so, and waits for ``go``: locally inside
    ``write_whole`` (under the fence), on GCS inside the conditional upload (``gcs_write``)."""
    from transforms.output import lease as lease_lib

    def freezing(real):
        def call(*args, **kwargs):
            target = args[1] if real is real_write_whole else args[0]
            if (threading.current_thread() is frozen_thread[0] and not frozen.is_set()
                    and target.endswith(compaction.MANIFEST_NAME)):
                frozen_thread[1]._stop.set()  # frozen: no renewal either  # pylint: disable=protected-access
                frozen.set()
                go.wait(60)
            return real(*args, **kwargs)
        return call

    real_write_whole = compaction.write_whole
    monkeypatch.setattr(compaction, "write_whole", freezing(real_write_whole))
    if hasattr(lease_lib, "gcs_write"):
        monkeypatch.setattr(lease_lib, "gcs_write", freezing(lease_lib.gcs_write))


def _race_two_compactions(output: str, monkeypatch, b_takes_over: bool = False) -> dict:
    """Compaction A of H09 frozen in its manifest write; compaction B of the same hours started
    meanwhile, given three of A's leases, then A let go. Returns what each ended with.
    ``b_takes_over`` (GCS: A's lease stands unrenewed, and B takes it over): B is let finish
    before A goes on (with 3 s, a loaded machine had B's manifest unwritten when A's came)."""
    a_lease = PublishLease(output, "compact-a", lease_s=1.0, poll_s=0.05)
    frozen_thread: list = [None, a_lease]
    frozen, go = threading.Event(), threading.Event()
    _freeze_in_manifest_write(monkeypatch, frozen_thread, frozen, go)
    ended: dict = {}

    def compaction_a():
        try:
            with a_lease:
                ended["a"] = compaction.compact_partition(output, H09, a_lease, ROW_GROUP)
        except Exception as exc:  # pylint: disable=broad-except
            ended["a"] = exc

    def compaction_b():
        try:
            ended["b"] = compact.compact_range(output, *HOURS, ROW_GROUP, lease_s=1.0,
                                               closed_after_s=0, now=LATER)
        except Exception as exc:  # pylint: disable=broad-except
            ended["b"] = exc

    a = threading.Thread(target=compaction_a, name="compaction-a")
    frozen_thread[0] = a
    a.start()
    assert frozen.wait(60), ended.get("a")
    b = threading.Thread(target=compaction_b, name="compaction-b")
    b.start()
    b.join(60 if b_takes_over else 3.0)
    go.set()
    a.join(60)
    b.join(60)
    assert not a.is_alive() and not b.is_alive()
    return ended


def _every_manifest_names_files_that_are_there(output: str) -> None:
    for partition in compaction.compacted_partitions(output):
        manifest = compaction.read_compaction(output, partition)
        for kind, entry in manifest.files.items():
            assert FileSystems.exists(f"{output}/{entry['path']}"), \
                f"{partition}'s manifest names {entry['path']} ({kind}), which is gone"


def test_a_compaction_frozen_in_its_manifest_write_never_lands_it_over_the_takers(output,
                                                                                 monkeypatch):
    """Local disk. Before, the lease was checked, then the manifest written, not under one flock:
    B took the lease over and compacted the hour, deleting A's compacted files (named by no
    manifest yet); then A's write landed, naming them: the hour was lost to every reader, the
    ledger failed, and the next compaction deleted the last copy. Now A's check and write are
    under the flock a takeover needs: B waits for A's write (saying who it waits for), then
    finds the hour compacted."""
    before = ledger.check(str(output))
    ids = current_rows(output, "vectors", "id")
    ended = _race_two_compactions(str(output), monkeypatch)
    assert not isinstance(ended["b"], Exception), ended["b"]
    _every_manifest_names_files_that_are_there(str(output))
    after = ledger.check(str(output))
    assert after.ok and after.totals == before.totals, after.problems
    assert current_rows(output, "vectors", "id") == ids
    run(output)  # and the next compaction keeps every row
    assert current_rows(output, "vectors", "id") == ids


def test_on_gcs_a_compaction_frozen_in_its_manifest_write_is_refused(gcs, tmp_path,
                                                                     monkeypatch):
    """The same on GCS (gcp-storage-emulator, GCS's preconditions played by
    tests/gcs_preconditions.py). Before, the manifest was written unconditionally: A's late
    write landed over B's. Now it is conditional on the generation A read, and B wrote the
    manifest before deleting A's unadopted files: A's write is refused (LeaseLost), B's stands."""
    from tests.common import GCS_BUCKET
    from tests.gcs_preconditions import enforced
    from transforms.output.lease import LeaseLost

    output = f"gs://{GCS_BUCKET}/{tmp_path.name}"
    so.write(output, BATCHES[:6], row_group_rows=ROW_GROUP)
    before = ledger.check(output)
    ids = current_rows(output, "vectors", "id")
    with enforced():
        ended = _race_two_compactions(output, monkeypatch, b_takes_over=True)
    assert not isinstance(ended["b"], Exception), ended["b"]
    assert isinstance(ended["a"], LeaseLost), ended["a"]
    _every_manifest_names_files_that_are_there(output)
    after = ledger.check(output)
    assert after.ok and after.totals == before.totals, after.problems
    assert current_rows(output, "vectors", "id") == ids

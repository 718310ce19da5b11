"""Batch reruns into one output replace, never append (transforms/commit.py,
transforms/output/manifest.py), on local disk and on gcp-storage-emulator:
- the same day run twice, the second time with changed input: the rows are exactly the second run's;
- a run killed (SIGKILL, no Python exception) while writing leaves the first run's output as it was;
- a run killed while publishing never shows two runs' rows to a reader that globs ``vectors/``, the
  manifest gives the whole new run meanwhile, and ``python -m pipeline.cleanup`` finishes it;
- a killed publish is taken over by the next holder of the lease
  (tests/output/test_concurrent_commits.py has the lease itself);
- DuckDB reads the committed run through the manifest (docs/output.md's query).
The runs here use a FAKE engine: what is tested is storage, and the real one is in
test_batch_pipeline.py (which now also runs through the commit)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import cleanup
from pipeline.run import run_batch
from tests.common import REPO, make_config
from tests.fakes import FakeEngine
from transforms.output import manifest as manifest_lib
from transforms.output.layout import PUBLISH_LOCK_FILE
from transforms.output.lease import PublishLease
from transforms.text import compose_text
from transforms.types import NewsEvent


def events(ids, changed=()) -> list[dict]:
    return [{"id": f"e{i}", "title": f"Story {i}",
             "body": f"Body of story {i}." + (" Corrected." if i in changed else ""),
             "published_at": "2026-11-30T09:00:00Z"} for i in ids]


DAY_1 = events(range(20)) + [{"id": "bad"}]  # one dead letter (missing text)
DAY_2 = events(list(range(15)) + list(range(20, 25)), changed={3})  # 5 gone, 5 new, e3 corrected


def write_input(root: str, name: str, rows: list[dict]) -> str:
    path = f"{root.rstrip('/')}/{name}/news.jsonl"
    with FileSystems.create(path) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    return path


def run(input_path: str, output: str) -> dict:
    return run_batch(make_config(input=input_path, output=output),
                     PipelineOptions(["--runner=FnApiRunner"]), engine_factory=FakeEngine)


def listing(output: str) -> dict[str, bytes]:
    """Every file under the output prefix (relative path -> bytes), but the publish lease's lock
    (``_publish.lock``: who published last, not data)."""
    prefix = output.rstrip("/") + "/"
    out = {}
    for m in FileSystems.match([prefix + "**"])[0].metadata_list:
        if m.path[len(prefix):].startswith(PUBLISH_LOCK_FILE):
            continue
        with FileSystems.open(m.path) as f:
            out[m.path[len(prefix):]] = f.read()
    return out


def rows_of(files: dict[str, bytes], folder="vectors") -> pa.Table:
    tables = [pq.read_table(io.BytesIO(data)) for name, data in sorted(files.items())
              if name.startswith(folder + "/") and name.endswith(".parquet")]
    return pa.concat_tables(tables) if tables else pa.table({"id": pa.array([], pa.string())})


def sha(row: dict) -> str:
    text = compose_text(NewsEvent(id=row["id"], title=row.get("title"), body=row.get("body")))
    return hashlib.sha256(text.encode()).hexdigest()


def check_is_run(output: str, rows: list[dict], summary: dict) -> None:
    """The output holds exactly this run: its rows once, its manifest, its summary, nothing else."""
    files = listing(output)
    table = rows_of(files)
    valid = [r for r in rows if r.get("body")]
    assert sorted(table["id"].to_pylist()) == sorted(r["id"] for r in valid), "exactly its rows"
    assert dict(zip(table["id"].to_pylist(), table["text_sha256"].to_pylist(), strict=True)) == {
        r["id"]: sha(r) for r in valid}, "the new text of a corrected article"
    manifest = json.loads(files["_manifest.json"])
    assert manifest["state"] == "committed" and manifest["run_id"] == summary["run_id"]
    data = sorted(n for n in files if n.startswith(("vectors/", "dead_letter/")))
    assert sorted(manifest["vectors"] + manifest["dead_letter"]) == data
    assert all(summary["run_id"] in n for n in data), "no file of another run"
    assert json.loads(files["_summary.json"])["run_id"] == summary["run_id"]
    assert not [n for n in files if n.startswith(("_staging/", "_temp/"))], "nothing left over"
    assert summary["counts"]["written"] == len(valid)


def kill_a_run(input_path: str, output: str, at: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.killed_run", "--input", input_path,
                           "--output", output, "--kill-at", at], cwd=REPO, env=os.environ.copy(),
                           capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, f"not killed (rc {proc.returncode}): {proc.stderr[-2000:]}"


def test_a_rerun_with_changed_input_replaces_the_first_run(root):
    output = f"{root}/out/dt=2026-11-30"
    first = run(write_input(root, "in1", DAY_1), output)
    check_is_run(output, DAY_1, first)
    second = run(write_input(root, "in2", DAY_2), output)
    assert second["run_id"] != first["run_id"]
    check_is_run(output, DAY_2, second)


def test_a_run_killed_while_writing_leaves_the_previous_output_unchanged(root):
    output = f"{root}/out"
    first = run(write_input(root, "in1", DAY_1), output)
    before = listing(output)
    kill_a_run(write_input(root, "in2", DAY_2), output, "write")
    after = listing(output)
    published = {n: b for n, b in after.items() if not n.startswith(("_staging/", "_temp/"))}
    assert published == before, "every published file, the manifest and the summary unchanged"
    # On local disk the killed writer leaves its partial Parquet file in its staging folder; on
    # GCS an object exists only once its upload completes, so a killed writer leaves none (files
    # the run finished before, such as its dead letters, may be staged either way).
    staged_parquet = [n for n in after if n.startswith("_staging/") and n.endswith(".parquet")]
    assert bool(staged_parquet) == (not output.startswith("gs://")), sorted(after)
    # The leftovers of the killed run go with cleanup (here: anything older than 0 s).
    assert cleanup.main(["--output", output, "--older-than-s", "0"]) == 0
    assert listing(output) == before
    check_is_run(output, DAY_1, first)


def test_a_run_killed_while_publishing_never_mixes_runs_and_is_finished_by_cleanup(tmp_path):
    # Local disk only (the GCS emulator runs the same code, in the other tests, for 20 s more).
    root = str(tmp_path)
    output = f"{root}/out"
    run(write_input(root, "in1", DAY_1), output)
    kill_a_run(write_input(root, "in2", DAY_2), output, "publish")
    files = listing(output)
    manifest = json.loads(files["_manifest.json"])
    assert manifest["state"] == "publishing"
    run_2 = manifest["run_id"]
    # A reader that globs vectors/ sees the new run's files only (some of them), never the old's.
    assert all(run_2 in n for n in files if n.startswith(("vectors/", "dead_letter/")))
    # A reader that follows the manifest gets the whole new run, from its staged files.
    staged = {n: files[n] for n in manifest["vectors"]}
    assert sorted(rows_of(staged, "_staging")["id"].to_pylist()) == sorted(
        r["id"] for r in DAY_2)
    assert cleanup.main(["--output", output, "--older-than-s", "0"]) == 0
    summary = json.loads(listing(output)["_summary.json"])
    check_is_run(output, DAY_2, summary)


def test_a_publish_killed_midway_is_taken_over_by_the_next_lease_holder(tmp_path):
    """A ``publishing`` manifest whose run holds no lease is a killed publish: the next holder of
    the lease (tests/output/test_concurrent_commits.py) publishes at once, however young
    it looks."""
    output = str(tmp_path)
    dead = manifest_lib.Manifest(run_id="20261130T000000Z-00000000", state="publishing",
                                 started_at=time.time(), vectors=[], dead_letter=[],
                                 summary="_staging/x/_summary.json", counts={})
    manifest_lib.write_manifest(output, dead)
    FileSystems.create(os.path.join(output, "_summary.json")).close()
    ours = manifest_lib.Manifest(run_id="20261130T000001Z-11111111", state="publishing",
                                 started_at=time.time(), vectors=[], dead_letter=[],
                                 summary="_summary.json", counts={})
    started = time.monotonic()
    with PublishLease(output, ours.run_id, lease_s=60) as lease:
        manifest_lib.publish(output, ours, lease)
    assert time.monotonic() - started < 5
    assert manifest_lib.read_manifest(output).state == "committed"
    assert manifest_lib.read_manifest(output).run_id == ours.run_id


def test_duckdb_reads_the_committed_run_through_the_manifest(tmp_path):
    import duckdb

    output = str(tmp_path / "out")
    summary = run(write_input(str(tmp_path), "in", DAY_1), output)
    con = duckdb.connect()
    # docs/output.md, "Reruns replace, never append"
    con.execute(f"""SET VARIABLE files = (SELECT list_transform(vectors, lambda f: '{output}/' || f)
                    FROM read_json('{output}/_manifest.json'))""")
    n, runs = con.execute("""SELECT count(*), count(DISTINCT model)
                             FROM read_parquet(getvariable('files'))""").fetchone()
    assert n == summary["counts"]["written"] == 20 and runs == 1


# The summary newsvec reads back is the committed run's, never another run's (a stalled older
# publisher of an earlier release could copy its own over it, or its undo delete it).


@pytest.mark.parametrize("summary_json", ["another run's", "gone"])
def test_a_run_reads_back_its_committed_runs_summary_never_another_runs(tmp_path, monkeypatch,
                                                                        summary_json):
    """Before, ``run_batch`` read ``_summary.json`` as it found it: another run's made it report
    that run (and skip the store load of its own, committed run); a missing one raised
    FileNotFoundError after a successful job. Now the summary is taken only if its run is the
    manifest's, else the manifest's counts are reported, with why."""
    from transforms import commit

    root, output = str(tmp_path), f"{tmp_path}/out"
    real_process = commit._CommitFn.process

    def then_clobbered(self, *args):
        yield from real_process(self, *args)
        path = f"{output}/_summary.json"
        if summary_json == "gone":
            os.remove(path)
        else:  # what a stalled older run's late copy, killed before its undo, left
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"run_id": "20261101T000000Z-00000000", "counts": {"in": 1}}, f)

    monkeypatch.setattr(commit._CommitFn, "process", then_clobbered)
    summary = run(write_input(root, "in", DAY_1), output)
    committed = manifest_lib.read_manifest(output)
    assert summary["run_id"] == committed.run_id, "the committed run, this one"
    assert summary["counts"] == committed.counts
    why = summary["summary_unavailable"]
    assert ("20261101T000000Z-00000000's" if summary_json == "another run's"
            else "could not be read") in why, why


def test_backfill_judges_a_day_by_its_committed_runs_summary(tmp_path):
    """Before, a day whose ``_summary.json`` was another run's was judged by that run's model and
    settings: skipped as done though its committed run may have been made otherwise."""
    from pipeline import backfill
    from transforms.engines.model import model_label, resolve_model_path
    from transforms.settings import embedding_signature

    config = make_config(output=str(tmp_path))
    label = model_label(config.model, resolve_model_path(config.model.path))
    signature = embedding_signature(config.model, config.chunking, config.text.unicode_form)
    run_id = "20261201T000000Z-aaaaaaaa"
    manifest_lib.write_manifest(str(tmp_path), manifest_lib.Manifest(
        run_id=run_id, state="committed", started_at=1.0, vectors=[], dead_letter=[],
        summary="_summary.json", counts={"in": 3}, committed_at="2026-12-01T00:00:00+00:00"))
    same_settings = {"model": {"label": label}, "counts": {"in": 3},
                     "incremental": {"embedding_signature": signature}}
    (tmp_path / "_summary.json").write_text(json.dumps(
        {**same_settings, "run_id": "20261101T000000Z-bbbbbbbb"}))
    assert backfill.already_done(config) is None, "another run's summary proves nothing"
    (tmp_path / "_summary.json").write_text(json.dumps({**same_settings, "run_id": run_id}))
    assert backfill.already_done(config).run_id == run_id

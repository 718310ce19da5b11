"""Input from and output to gs://, through gcp-storage-emulator started by the test on loopback:
a round trip, and a run during which storage goes away for several seconds."""
import io
import json
import threading
import time

import pyarrow.parquet as pq
import pytest
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.run import run_batch
from tests.common import SAMPLE_EVENTS, make_config
from tests.emulators import gcs_for_beam

BUCKET = "newsvec-test"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    # On disk, so that the outage test can stop and restart it without losing the objects.
    with gcs_for_beam(BUCKET, tmp_path_factory.mktemp("gcs-log"),
                      data_dir=tmp_path_factory.mktemp("gcs-data")) as emulator:
        yield emulator


def test_gs_input_and_output_round_trip(gcs):
    from google.cloud import storage

    client = storage.Client.create_anonymous_client()
    client.bucket(BUCKET).blob("news/2026-11-30/events.jsonl").upload_from_filename(SAMPLE_EVENTS)
    output = f"gs://{BUCKET}/runs/one"
    config = make_config(input=f"gs://{BUCKET}/news/*/events.jsonl", output=output)
    summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]))
    assert summary["invariant_holds"] and summary["counts"]["written"] > 0

    vector_files = FileSystems.match([f"{output}/vectors/*.parquet"])[0].metadata_list
    assert vector_files, "vectors were written to the bucket"
    rows = 0
    for meta in vector_files:
        with FileSystems.open(meta.path) as f:
            table = pq.read_table(io.BytesIO(f.read()))
        assert table.schema.field("embedding").type.list_size == 384
        rows += table.num_rows
    assert rows == summary["counts"]["written"]

    blobs = {b.name for b in client.list_blobs(BUCKET, prefix="runs/one/")}
    assert "runs/one/_summary.json" in blobs
    assert any(name.startswith("runs/one/dead_letter/") for name in blobs)
    assert not any("beam-temp" in name for name in blobs), "no temporary files left for readers"
    stored = json.loads(client.bucket(BUCKET).blob("runs/one/_summary.json").download_as_bytes())
    assert stored["counts"] == summary["counts"]


OUTAGE_S = 8


def test_storage_unavailable_mid_run_retries_and_loses_nothing(gcs):
    """The emulator is stopped once the job's first object appears (a temporary Parquet part, so
    the dead letters, the renames into place and the summary are still to come), and started again
    OUTAGE_S later. The job must retry through it, finish, and leave exactly one copy of each row
    in finished files, and nothing temporary, where readers look."""
    from google.cloud import storage

    client = storage.Client.create_anonymous_client()
    client.bucket(BUCKET).blob("news/outage/events.jsonl").upload_from_filename(SAMPLE_EVENTS)
    output = f"gs://{BUCKET}/runs/outage"
    outage: dict = {}

    def break_storage():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            seen = [b.name for b in client.list_blobs(BUCKET, prefix="runs/outage/")]
            if seen:
                outage["seen"] = seen
                break
            time.sleep(0.02)
        else:
            return
        gcs.stop()
        outage["stopped"] = time.time()
        time.sleep(OUTAGE_S)
        gcs.start()
        outage["restarted"] = time.time()

    breaker = threading.Thread(target=break_storage, daemon=True)
    breaker.start()
    config = make_config(input=f"gs://{BUCKET}/news/outage/*.jsonl", output=output)
    summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]))
    finished = time.time()
    breaker.join(60)

    assert "restarted" in outage, "the outage happened during the run"
    assert finished > outage["restarted"]
    assert all("beam-temp" in name for name in outage["seen"]), \
        f"storage went away before anything was final: {outage['seen']}"
    counts = summary["counts"]
    assert summary["invariant_holds"] and counts["written"] == 40

    names = sorted(b.name for b in client.list_blobs(BUCKET, prefix="runs/outage/"))
    assert not [n for n in names if "beam-temp" in n or n.endswith(".tmp")], names
    vector_files = [n for n in names if n.startswith("runs/outage/vectors/")]
    assert len(vector_files) == 1 and vector_files[0].endswith("-00000-of-00001.parquet"), names
    table = pq.read_table(io.BytesIO(
        client.bucket(BUCKET).blob(vector_files[0]).download_as_bytes()))
    ids = table["id"].to_pylist()
    assert len(ids) == len(set(ids)) == counts["written"], "every row once"
    letters = [line for n in names if n.startswith("runs/outage/dead_letter/")
               for line in client.bucket(BUCKET).blob(n).download_as_text().splitlines()]
    assert len(letters) == counts["dead_lettered"]
    stored = json.loads(client.bucket(BUCKET).blob("runs/outage/_summary.json").download_as_bytes())
    assert stored["counts"] == counts

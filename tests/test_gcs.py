"""Input from and output to gs://, through gcp-storage-emulator started by the test on loopback."""
import io
import json

import pyarrow.parquet as pq
import pytest
from apache_beam.io.filesystems import FileSystems
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.run import run_batch
from tests.conftest import SAMPLE_EVENTS, make_config
from tests.emulators import gcs_emulator

BUCKET = "newsvec-test"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    with gcs_emulator(BUCKET, tmp_path_factory.mktemp("gcs-log")) as endpoint:
        mp.setenv("STORAGE_EMULATOR_HOST", endpoint)
        mp.setenv("NO_GCE_CHECK", "true")
        # No credentials exist here: answer Google's credential lookup with anonymous credentials
        # at once, instead of Beam's four retries (about 23 s).
        import google.auth
        from google.auth.credentials import AnonymousCredentials

        mp.setattr(google.auth, "default", lambda *a, **k: (AnonymousCredentials(), "test"))
        yield endpoint
    mp.undo()


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

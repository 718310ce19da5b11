"""Incremental embedding (transforms/incremental.py): a batch run given other outputs' key index
embeds only what is new or changed; the current vector of every article across daily outputs;
{model} in output paths; a backfill interrupted and resumed; streaming writes its keys.

Real vLLM (float32, the session's engine), locally and on gcp-storage-emulator."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import signal
import subprocess
import sys
import time

import duckdb
import pyarrow.parquet as pq
import yaml
from apache_beam.io.filesystems import FileSystems
from apache_beam.io.gcp.pubsub import PubsubMessage
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.test_stream import TestStream
from apache_beam.transforms.window import TimestampedValue
from apache_beam.utils.timestamp import Timestamp

from pipeline import backfill as backfill_lib
from pipeline import config as config_lib
from pipeline.graph import embed_and_write_streaming
from pipeline.run import run_batch
from tests.common import REPO, make_config
from tests.fakes import FakeEngine
from tests.output.test_reruns import listing, rows_of, write_input
from transforms.engines.model import safe_model_label
from transforms.output.current_vectors import CURRENT_VECTORS_SQL, current_vectors
from transforms.output.parquet import key_schema
from transforms.settings import IncrementalSettings, StreamingSettings
from transforms.text import compose_text
from transforms.types import NewsEvent

OPTIONS = PipelineOptions(["--runner=FnApiRunner"])


def article(i: int, corrected: bool = False) -> dict:
    body = (f"Story {i}: the council approved a new budget for the harbour, after a debate that "
            f"lasted {i + 2} hours.") + (" Corrected: the vote was unanimous." if corrected else "")
    return {"id": f"e{i}", "title": f"Story {i}", "body": body}


def sha(row: dict) -> str:
    text = compose_text(NewsEvent(id=row["id"], title=row.get("title"), body=row.get("body")))
    return hashlib.sha256(text.encode()).hexdigest()


def daily_config(root: str, **changes):
    """A daily config: output {root}/{model}/dt={date}, consulting every other day's keys."""
    return make_config(input=f"{root}/in/dt={{date}}/news.jsonl",
                       output=f"{root}/{{model}}/dt={{date}}",
                       incremental=IncrementalSettings(previous_outputs=[f"{root}/{{model}}/dt=*"]),
                       **changes)


def run_day(config, day: str, rows: list[dict], root: str, engine_factory=None) -> dict:
    write_input(root, f"in/dt={day}", rows)
    filled = config_lib.fill_date(config_lib.fill_model(config), day)
    return run_batch(filled, OPTIONS, engine_factory=engine_factory)


def test_an_unchanged_a_changed_and_a_new_article_across_two_runs(root):
    config = daily_config(root)
    first = run_day(config, "2026-12-01", [article(i) for i in range(6)], root)
    assert first["counts"]["written"] == 6 and first["counts"]["unchanged"] == 0
    day_2 = [article(i) for i in (0, 1, 2, 4, 5)] + [article(3, corrected=True), article(9)]
    second = run_day(config, "2026-12-02", day_2, root)
    counts = second["counts"]
    assert (counts["in"], counts["written"], counts["unchanged"]) == (7, 2, 5)
    assert second["invariant_holds"] and counts["in"] == (
        counts["written"] + counts["dead_lettered"] + counts["duplicates"] + counts["unchanged"])
    label = safe_model_label(config.model)
    files = listing(f"{root}/{label}/dt=2026-12-02")
    rows = rows_of(files)
    assert dict(zip(rows["id"].to_pylist(), rows["text_sha256"].to_pylist(), strict=True)) == {
        "e3": sha(article(3, corrected=True)), "e9": sha(article(9))}
    keys = rows_of(files, "keys")
    assert keys.schema.equals(key_schema()) and sorted(keys["id"].to_pylist()) == ["e3", "e9"]
    # A rerun of day 2 replaces its output with the same rows: its own keys are never consulted.
    again = run_day(config, "2026-12-02", day_2, root)
    assert (again["counts"]["written"], again["counts"]["unchanged"]) == (2, 5)
    assert sorted(rows_of(listing(f"{root}/{label}/dt=2026-12-02"))["id"].to_pylist()) == [
        "e3", "e9"]


def test_the_current_vector_of_every_article_across_days(tmp_path):
    root = str(tmp_path)
    config = daily_config(root)
    run_day(config, "2026-12-01", [article(i) for i in range(4)], root)
    run_day(config, "2026-12-02", [article(1, corrected=True), article(2), article(7)], root)
    run_day(config, "2026-12-01", [article(i) for i in range(4)], root)  # an old day, rerun
    base = tmp_path / safe_model_label(config.model)
    expected = {**{f"e{i}": sha(article(i)) for i in range(4)},
                "e1": sha(article(1, corrected=True)), "e7": sha(article(7))}
    table = current_vectors(str(base))
    assert dict(zip(table["id"].to_pylist(), table["text_sha256"].to_pylist(),
                    strict=True)) == expected
    sql = CURRENT_VECTORS_SQL.format(files=f"'{base}/dt=*/vectors/*.parquet'")
    got = duckdb.connect().execute(f"SELECT id, text_sha256, dt FROM ({sql})").fetchall()
    assert {i: s for i, s, _ in got} == expected
    assert {i: str(d) for i, _, d in got}["e1"] == "2026-12-02", "the correction is current"
    readme = (REPO / "docs" / "incremental.md").read_text()
    assert CURRENT_VECTORS_SQL in readme, "docs/incremental.md shows the query the code defines"


def test_two_models_write_side_by_side(tmp_path):
    # The FAKE engine stands for both models: what is tested is where their outputs go.
    root = str(tmp_path)
    base = daily_config(root)
    other = base.model_copy(update={"model": base.model.model_copy(
        update={"name": "newsroom/minilm-finetuned", "revision": "v2"})})
    rows = [article(i) for i in range(3)]
    run_day(base, "2026-12-01", rows, root, FakeEngine)
    second = run_day(other, "2026-12-01", rows, root, FakeEngine)
    assert second["counts"]["written"] == 3, "the new model embeds everything again"
    labels = sorted(p.name for p in tmp_path.iterdir() if p.name != "in")
    assert labels == sorted([safe_model_label(base.model), safe_model_label(other.model)])
    assert all(
        set(label) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
        for label in labels)
    for label in labels:
        assert rows_of(listing(f"{root}/{label}/dt=2026-12-01")).num_rows == 3


def backfill_config_file(tmp_path, root: str) -> str:
    """The daily config as a file; a short commit lease, in case the kill lands mid-publish."""
    config = daily_config(root)
    config = config.model_copy(update={"sink": config.sink.model_copy(update={
        "commit_lease_s": 5})})
    path = tmp_path / "backfill.yaml"
    path.write_text(yaml.safe_dump(json.loads(config.model_dump_json())))
    return str(path)


def test_a_backfill_interrupted_and_resumed_writes_each_article_once(tmp_path):
    root = str(tmp_path / "archive")
    days = ["2026-11-01", "2026-11-02", "2026-11-03"]
    # Articles come back on later days, unchanged: each must be embedded once in all.
    inputs = {days[0]: range(0, 8), days[1]: range(4, 12), days[2]: range(8, 16)}
    for day, ids in inputs.items():
        write_input(root, f"in/dt={day}", [article(i) for i in ids])
    config_file = backfill_config_file(tmp_path, root)
    config = config_lib.fill_model(config_lib.load(config_file))
    first_day = config_lib.fill_date(config, days[0]).output
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.backfill", "--config", config_file,
                             "--from", days[0], "--until", days[2]], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while not backfill_lib.already_done(config_lib.fill_date(config, days[0])):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the first day never committed"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)  # interrupted on its way through day 2
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert FileSystems.exists(f"{first_day}/_manifest.json")
    lines = []
    summary = backfill_lib.backfill(config_lib.load(config_file), dt.date.fromisoformat(days[0]),
                                    dt.date.fromisoformat(days[2]), OPTIONS, log=lines.append)
    assert summary["days_skipped"] >= 1 and summary["days_run"] + summary["days_skipped"] == 3
    assert "already embedded" in lines[0] and "ETA" in lines[-1] and "24/24 articles" in lines[-1]
    ids = []
    for day in days:
        output = config_lib.fill_date(config, day).output
        day_summary = json.loads(listing(output)["_summary.json"])
        assert day_summary["invariant_holds"]
        ids += rows_of(listing(output))["id"].to_pylist()
    assert sorted(ids) == sorted(f"e{i}" for i in range(16)), "each article once, in all days"
    assert summary["counts"]["written"] + summary["counts"]["unchanged"] == 24


def test_streaming_writes_its_keys_and_the_nightly_batch_skips_them(tmp_path):
    stream_out, batch_out = tmp_path / "stream", tmp_path / "batch"
    t0 = Timestamp.of(1_764_590_400)
    rows = [article(i) for i in range(4)]
    messages = [TimestampedValue(PubsubMessage(json.dumps(r).encode(), {}, message_id=f"m{i}",
                                               publish_time=t0 + i), t0 + i)
                for i, r in enumerate(rows)]
    stream = TestStream().advance_watermark_to(t0).add_elements(messages) \
        .advance_watermark_to_infinity()
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    embed_and_write_streaming(p | stream, make_config(
        output=str(stream_out), streaming=StreamingSettings(batch_shards=1)),
        "20251201T120000Z-0e0e0e0e")
    p.run().wait_until_finish()
    keys = pq.read_table(sorted((stream_out / "keys").rglob("*.parquet")))
    assert sorted(keys["id"].to_pylist()) == ["e0", "e1", "e2", "e3"]
    assert all(f.parent.name.startswith("hour=") for f in (stream_out / "keys").rglob("*.parquet"))
    nightly = rows + [article(5)]
    path = write_input(str(tmp_path), "in", nightly)
    summary = run_batch(make_config(input=path, output=str(batch_out), incremental=
                                    IncrementalSettings(previous_outputs=[str(stream_out)])),
                        OPTIONS)
    assert (summary["counts"]["unchanged"], summary["counts"]["written"]) == (4, 1)
    vectors = pq.read_table(sorted((batch_out / "vectors").glob("*.parquet")))
    assert vectors["id"].to_pylist() == ["e5"]
    assert pq.read_table(sorted((stream_out / "vectors").rglob("*.parquet"))).num_rows == 4

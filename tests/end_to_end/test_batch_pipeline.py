"""The batch pipeline end to end, on the FnApiRunner with real vLLM (float32), over the repo's
sample events: rows, Parquet types, parity with sentence-transformers, dead letters, the summary,
DuckDB."""
import gzip
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.run import run, run_batch
from tests.common import SAMPLE_EVENTS, make_config
from transforms.output.parquet import vector_schema
from transforms.text import compose_text
from transforms.types import NewsEvent

# What the sample's deliberately bad lines must become (the sample file documents them).
EXPECTED_DEAD = {"invalid_json": 1, "not_a_json_object": 1, "missing_id": 1, "invalid_id": 1,
                 "no_text": 1, "invalid_field": 1, "published_at_in_future": 1,
                 # the sample's six Japanese articles, under the packaged English model
                 "unreadable_for_model": 6}
EXPECTED_DUPLICATES = 1
PART = re.compile(r"^part-\d{8}T\d{6}Z-[0-9a-f]{8}-\d{5}-of-\d{5}\.(parquet|jsonl)$")


def sample_lines() -> list[bytes]:
    return SAMPLE_EVENTS.read_bytes().splitlines()


def valid_events() -> dict[str, NewsEvent]:
    """The sample's valid events by id, parsed here independently of the pipeline's parse step."""
    events = {}
    for line in sample_lines():
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if isinstance(raw, dict) and isinstance(raw.get("id"), str):
            events.setdefault(raw["id"], raw)
    return events


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("batch")
    config = make_config(input=str(SAMPLE_EVENTS), output=str(out))
    summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]))
    return summary, out


def read_vectors(out: Path):
    return pq.read_table(sorted((out / "vectors").glob("*.parquet")))


def test_every_input_is_accounted_for(batch_run):
    summary, out = batch_run
    counts = summary["counts"]
    assert counts["in"] == len(sample_lines())
    assert counts["in"] == counts["written"] + counts["dead_lettered"] + counts["duplicates"]
    assert counts["dead_lettered_by_reason"] == EXPECTED_DEAD
    assert counts["duplicates"] == EXPECTED_DUPLICATES
    assert read_vectors(out).num_rows == counts["written"]
    letters = [json.loads(line) for f in (out / "dead_letter").glob("*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(letters) == counts["dead_lettered"]
    assert all(d["step"] == ("prepare_text" if d["reason"] == "unreadable_for_model" else "parse")
               and d["detail"] and d["payload"] for d in letters)


def test_rows_types_and_files(batch_run):
    summary, out = batch_run
    table = read_vectors(out)
    assert table.schema.equals(vector_schema(384))
    embedding = table.schema.field("embedding").type
    assert pa.types.is_float32(embedding.value_type) and embedding.list_size == 384
    assert not embedding.value_field.nullable, "BigQuery's vector index needs no NULL elements"
    assert len(set(table["id"].to_pylist())) == table.num_rows, "one row per article id"
    assert set(table["dim"].to_pylist()) == {384}
    vectors = table["embedding"].combine_chunks().flatten().to_numpy().reshape(-1, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4), "normalize: true"
    assert table["model"][0].as_py().startswith("sentence-transformers/all-MiniLM-L6-v2@sha256:")
    assert any(table["truncated"].to_pylist()), "the sample's long articles are truncated"
    assert max(table["token_count"].to_pylist()) == 256
    for f in list((out / "vectors").iterdir()) + list((out / "dead_letter").iterdir()):
        assert PART.match(f.name) and summary["run_id"] in f.name, f.name
    meta = pq.ParquetFile(next((out / "vectors").glob("*.parquet"))).metadata
    assert meta.row_group(0).column(0).compression == "ZSTD"


def test_vectors_equal_sentence_transformers(batch_run):
    from sentence_transformers import SentenceTransformer

    from transforms.engines.model import resolve_model_path

    _, out = batch_run
    table = read_vectors(out)
    events = valid_events()
    texts = [compose_text(NewsEvent(id=i, title=events[i].get("title"), body=events[i].get("body")))
             for i in table["id"].to_pylist()]
    model = SentenceTransformer(resolve_model_path(make_config().model.path), device="cpu")
    expected = model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)
    got = table["embedding"].combine_chunks().flatten().to_numpy().reshape(-1, 384)
    cosine = (got * expected).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert cosine.min() >= 0.9999, f"min cosine {cosine.min()}"


def test_summary_file_holds_counts_and_model_and_the_launcher_adds_timings(batch_run):
    summary, out = batch_run
    written = json.loads((out / "_summary.json").read_text())
    assert written["counts"] == summary["counts"] and written["invariant_holds"]
    assert written["run_id"] == summary["run_id"]
    assert written["model"]["dtype"] == "float32" and len(written["model"]["content_sha256"]) == 64
    assert written["counts"]["truncated"] == int(pc.sum(read_vectors(out)["truncated"]).as_py())
    # Seen from the launcher that waited (Beam metrics), not written: the job wrote the file.
    timings = summary["timings"]
    assert timings["run_s"] > timings["embed_s"] > 0 and timings["total_s"] >= timings["run_s"]
    assert 0 < summary["batches"]["mean_tokens"] <= written["model"]["token_budget"]
    assert summary["batches"]["max_tokens"] <= written["model"]["token_budget"]


def test_duckdb_reads_the_output_as_a_user_would(batch_run):
    import duckdb

    _, out = batch_run
    glob = str(out / "vectors" / "*.parquet")
    con = duckdb.connect()
    n, dims = con.execute(
        f"SELECT count(*), min(len(embedding)) FROM read_parquet('{glob}')").fetchone()
    assert (n, dims) == (read_vectors(out).num_rows, 384)
    # Nearest neighbour of an article is itself, with DuckDB's own array functions.
    nearest = con.execute(f"""
        WITH v AS (SELECT id, embedding::FLOAT[384] AS e FROM read_parquet('{glob}'))
        SELECT b.id, array_cosine_similarity(a.e, b.e) AS s FROM v a, v b
        WHERE a.id = 'sample-0002' ORDER BY s DESC LIMIT 1""").fetchone()
    assert nearest[0] == "sample-0002" and nearest[1] == pytest.approx(1.0, abs=1e-5)


def test_command_line_with_gzip_input_and_overrides(tmp_path):
    gz = tmp_path / "in" / "news.jsonl.gz"
    gz.parent.mkdir()
    with gzip.open(gz, "wb") as f:
        f.write(SAMPLE_EVENTS.read_bytes())
    config_path = tmp_path / "fp32.yaml"
    config_path.write_text(yaml.safe_dump(
        json.loads(make_config(input="ignored", output="ignored").model_dump_json())))
    out = tmp_path / "out"
    summary = run(["--config", str(config_path), "--input", str(tmp_path / "in" / "*.jsonl.gz"),
                   "--output", str(out)])
    assert summary["counts"]["in"] == len(sample_lines()) and summary["invariant_holds"]
    assert read_vectors(out).num_rows == summary["counts"]["written"]
    shutil.rmtree(out)


def test_the_engine_is_loaded_once_per_process(tmp_path):
    """A second run of a config in the process loads no model: it finds the first run's LLM."""
    from transforms.engines import vllm as engine

    config_path = tmp_path / "fp32.yaml"
    config_path.write_text(yaml.safe_dump(
        json.loads(make_config(input="ignored", output="ignored").model_dump_json())))
    run(["--config", str(config_path), "--input", str(SAMPLE_EVENTS),
         "--output", str(tmp_path / "first")])
    loaded = dict(engine._LLMS)
    assert loaded, "the run loaded no LLM into this process"
    summary = run(["--config", str(config_path), "--input", str(SAMPLE_EVENTS),
                   "--output", str(tmp_path / "second")])
    assert summary["counts"]["written"] > 0
    assert engine._LLMS == loaded, "the second run loaded another vLLM LLM"


def test_lines_fan_out_right_after_reading_and_nothing_groups_before_the_engine():
    """The batch graph ``python -m pipeline`` builds: the one shuffle between reading a file and
    the engine is right after its lines are read (a day in one .jsonl.gz is read on one thread,
    but parsed, prepared and embedded on every worker), and no grouping between parsing and
    embedding holds the engine back until the whole input is read."""
    import apache_beam as beam
    from apache_beam.portability import common_urns

    from pipeline import config as config_lib
    from pipeline.graph import build_batch

    pipeline = beam.Pipeline()
    build_batch(pipeline, config_lib.load(Path("configs/local.yaml")), "20261201T000000Z-0badc0de")
    transforms = [t for t in pipeline.to_runner_api().components.transforms.values()
                  if not t.subtransforms]
    producer = {pc: t for t in transforms for pc in t.outputs.values()}
    by_name = {t.unique_name: t for t in transforms}

    def upstream_path(name: str, stop: str) -> list[str]:
        """Names on the path from ``stop`` down to ``name``, nearest first (every step on it
        has one input in this config: no side inputs)."""
        path, t = [], by_name[name]
        while t.unique_name != stop:
            path.append(t.unique_name)
            (pc,) = t.inputs.values()
            t = producer[pc]
        return path

    is_grouping = {t.unique_name for t in transforms
                   if t.spec.urn == common_urns.primitives.GROUP_BY_KEY.urn}
    (embed,) = [n for n in by_name if n.endswith("/EmbedBatches")]
    (parse,) = [n for n in by_name if n.startswith("Parse/")]
    read = "ReadJsonLines/ReadLines"
    assert not is_grouping & set(upstream_path(embed, parse)), \
        "a grouping between parsing and embedding: a barrier in a batch job"
    assert [n for n in upstream_path(parse, read) if n in is_grouping] == \
        ["ReadJsonLines/SpreadLines/ReshufflePerKey/GroupByKey"], \
        "lines are redistributed before they are parsed"

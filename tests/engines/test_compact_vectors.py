"""Compact vectors (issue 24): ``model.dimensions`` (Matryoshka through vLLM, or the head of a
vector truncated knowingly), ``sink.vector_dtype: float16``, and an ``embedding`` column BigQuery's
vector index takes (its elements declared not null), read and compacted together with files written
before.

The real-vLLM runs use the session's one engine (float32, ``tests.common.make_config``); the
Matryoshka path has no offline model that declares it, so it is checked with a FAKE ``LLM``.
"""
from __future__ import annotations

import datetime as dt
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from apache_beam.internal import pickler
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import compact
from pipeline import config as config_lib
from pipeline.run import run_batch
from pipeline.search import search
from tests.common import SAMPLE_EVENTS, make_config
from tools import streaming_output as so
from transforms.engines import vllm as engine
from transforms.engines.model import Matryoshka, truncation
from transforms.output import compaction
from transforms.output.current_vectors import current_vectors
from transforms.output.parquet import (
    chunk_schema,
    common_schema,
    embedding_type,
    float32_embeddings,
    vector_matrix,
    vector_schema,
)

FP16_STEP = 2.0 ** -11  # float16's spacing in [0.5, 1): the largest rounding of a unit vector's


def _raw_config() -> dict:
    return yaml.safe_load(config_lib.DEFAULT_CONFIG.read_text())


def _validate(model: dict | None = None, sink: dict | None = None) -> config_lib.Config:
    raw = _raw_config()
    raw["model"].update(model or {})
    raw["sink"] = {**(raw.get("sink") or {}), **(sink or {})}
    config = config_lib.validate(raw, "test.yaml")
    config_lib.check_model(config, "test.yaml")  # a pypackage: model's files: when a run starts
    return config


# Config.

def test_the_defaults_write_what_was_written_before():
    config = _validate()
    assert config.model.dimensions is None and not config.model.truncate_dimensions_knowingly
    assert config.model.output_dim == config.model.dim == 384
    assert config.sink.vector_dtype == "float32"


def test_dimensions_of_a_model_that_does_not_declare_matryoshka_are_refused_unless_knowingly():
    with pytest.raises(config_lib.ConfigError, match="truncate_dimensions_knowingly") as refused:
        _validate({"dimensions": 128})
    assert "does not declare Matryoshka" in str(refused.value)
    config = _validate({"dimensions": 128, "truncate_dimensions_knowingly": True})
    assert config.model.output_dim == 128
    assert _validate({"dimensions": 384}).model.output_dim == 384  # the full size: no truncation


@pytest.mark.parametrize("dimensions", [0, -8, 385, 1024])
def test_dimensions_out_of_bounds_are_refused(dimensions):
    with pytest.raises(config_lib.ConfigError, match="dimensions"):
        _validate({"dimensions": dimensions, "truncate_dimensions_knowingly": True})


def test_vector_dtype_is_float32_or_float16():
    assert _validate(sink={"vector_dtype": "float16"}).sink.vector_dtype == "float16"
    with pytest.raises(config_lib.ConfigError, match="vector_dtype"):
        _validate(sink={"vector_dtype": "bfloat16"})


def test_who_truncates():
    settings = make_config().model.model_copy(update={"dimensions": 256})
    assert truncation(settings, Matryoshka(True)) == "vllm"
    assert truncation(settings, Matryoshka(True, (64, 256))) == "vllm"
    with pytest.raises(ValueError, match=r"only the Matryoshka dimensions \[64, 128\]"):
        truncation(settings, Matryoshka(True, (64, 128)))
    with pytest.raises(ValueError, match="does not declare"):
        truncation(settings, Matryoshka(False))
    knowing = settings.model_copy(update={"truncate_dimensions_knowingly": True})
    assert truncation(knowing, Matryoshka(False)) == "newsvec"
    assert truncation(knowing, Matryoshka(True)) == "vllm"  # the model's own way, when it has one
    assert truncation(make_config().model, Matryoshka(False)) == "none"
    assert Matryoshka.of_hf_config({"matryoshka_dimensions": [64, 768]}) == \
        Matryoshka(True, (64, 768))
    assert Matryoshka.of_hf_config(SimpleNamespace(is_matryoshka=True)) == Matryoshka(True)
    assert Matryoshka.of_hf_config({}) == Matryoshka(False)


# The engine, on a FAKE vLLM LLM.

class FakeLLM:
    """A FAKE ``vllm.LLM``: records the ``PoolingParams`` of each ``embed`` call and returns a
    fixed unit vector of 384 dimensions per prompt, cut to ``dimensions`` as vLLM would."""

    FULL = np.linspace(1.0, 2.0, 384, dtype=np.float32) / np.linalg.norm(
        np.linspace(1.0, 2.0, 384))

    def __init__(self, hf_config: dict):
        self.pooling_params: list = []
        model_config = SimpleNamespace(embedding_size=384,
                                       hf_config=SimpleNamespace(**hf_config))
        self.llm_engine = SimpleNamespace(model_config=model_config,
                                          engine_core=SimpleNamespace(shutdown=lambda: None))

    def get_tokenizer(self):
        return SimpleNamespace(encode=lambda text: [101, 7, 102])

    def embed(self, prompts, pooling_params=None, use_tqdm=False):
        self.pooling_params.append(pooling_params)
        vector = self.FULL
        if pooling_params.dimensions is not None:
            vector = vector[:pooling_params.dimensions] / np.linalg.norm(
                vector[:pooling_params.dimensions])
        return [SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                outputs=SimpleNamespace(embedding=vector.tolist()))
                for p in prompts]


@pytest.fixture
def fake_llms(monkeypatch):
    """load_vllm builds FakeLLMs (``hf_config`` set by the test); the session's real LLM is out
    of the way."""
    made: list[FakeLLM] = []
    hf_config: dict = {}

    def new_llm(settings):
        made.append(FakeLLM(hf_config))
        return made[-1]

    monkeypatch.setattr(engine, "_LLMS", {})
    monkeypatch.setattr(engine, "_new_llm", new_llm)
    return made, hf_config


def test_a_matryoshka_model_is_truncated_by_vllm_with_pooling_params(fake_llms):
    made, hf_config = fake_llms
    hf_config["matryoshka_dimensions"] = [128, 384]
    settings = make_config().model.model_copy(update={"name": "fake-matryoshka"})
    full = engine.load_vllm(settings)
    short = engine.load_vllm(settings.model_copy(update={"dimensions": 128}))
    assert len(made) == 1, "engines of two output dimensions share one LLM"
    (vector,) = short.embed([[101, 5, 102]])
    assert made[0].pooling_params[-1].dimensions == 128
    assert made[0].pooling_params[-1].use_activation is True
    assert vector.shape == (128,) and np.isclose(np.linalg.norm(vector), 1.0)
    (vector,) = full.embed([[101, 5, 102]])
    assert made[0].pooling_params[-1].dimensions is None and vector.shape == (384,)


def test_a_model_without_matryoshka_is_truncated_by_newsvec_only_knowingly(fake_llms):
    made, _ = fake_llms
    settings = make_config().model.model_copy(update={"name": "fake-plain", "dimensions": 128})
    with pytest.raises(ValueError, match="truncate_dimensions_knowingly"):
        engine.load_vllm(settings)
    knowing = engine.load_vllm(settings.model_copy(update={"truncate_dimensions_knowingly": True}))
    (vector,) = knowing.embed([[101, 5, 102]])
    assert made[-1].pooling_params[-1].dimensions is None, "vLLM would refuse the dimensions"
    expected = FakeLLM.FULL[:128] / np.linalg.norm(FakeLLM.FULL[:128])
    np.testing.assert_allclose(vector, expected, rtol=1e-6)
    assert len(made) == 1


# Schemas: BigQuery's rules, and pickling.

@pytest.mark.parametrize("vector_dtype", ["float32", "float16"])
def test_schemas_keep_the_not_null_elements_when_pickled(vector_dtype):
    """pyarrow 25 pickles a fixed_size_list as its value type and size only: without
    transforms.types's copyreg reducer the elements come back nullable (Beam pickles the schema
    to its workers)."""
    for schema in (vector_schema(384, vector_dtype), chunk_schema(128, vector_dtype)):
        for dumps, loads in ((pickle.dumps, pickle.loads),
                             (cloudpickle.dumps, cloudpickle.loads),
                             (pickler.dumps, pickler.loads)):
            back = loads(dumps(schema))
            assert back.equals(schema)
            assert not back.field("embedding").type.value_field.nullable


def _bigquery_problems(schema: pa.Schema) -> list[str]:
    """What BigQuery's vector index would refuse in a Parquet schema's ``embedding`` (loaded with
    --parquet_enable_list_inference as ARRAY<FLOAT64>): NULL elements, a non-float32 type (float16
    is not a Parquet type BigQuery reads)."""
    embedding = schema.field("embedding").type
    problems = []
    if embedding.value_field.nullable:
        problems.append("nullable elements")
    if not pa.types.is_float32(embedding.value_type):
        problems.append(f"elements of {embedding.value_type}")
    return problems


def test_a_written_file_meets_bigquerys_rules(batch_runs):
    path = sorted((batch_runs["float32"] / "vectors").glob("*.parquet"))[0]
    schema = pq.read_schema(path)
    assert _bigquery_problems(schema) == []
    table = pq.read_table(path, columns=["dim", "embedding"])
    assert set(table["dim"].to_pylist()) == {schema.field("embedding").type.list_size} == {384}, \
        "one dimension per table"
    assert table["embedding"].combine_chunks().flatten().null_count == 0
    old = pa.schema([pa.field("embedding", pa.list_(pa.float32(), 384))])
    assert _bigquery_problems(old) == ["nullable elements"]
    assert _bigquery_problems(vector_schema(384, "float16")) == ["elements of halffloat"]


# Real vLLM: float16 and truncated outputs.

@pytest.fixture(scope="module")
def batch_runs(tmp_path_factory) -> dict[str, Path]:
    """The sample through the batch pipeline: float32 (the default), float16, and 128 dimensions
    truncated knowingly. One engine: the session's."""
    runs = {}
    for name, model, sink in (("float32", {}, {}), ("float16", {}, {"vector_dtype": "float16"}),
                              ("dims128", {"dimensions": 128,
                                           "truncate_dimensions_knowingly": True}, {})):
        out = tmp_path_factory.mktemp(name)
        base = make_config()
        config = make_config(input=str(SAMPLE_EVENTS), output=str(out),
                             model=base.model.model_copy(update=model),
                             sink=base.sink.model_copy(update=sink))
        summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner"]))
        assert summary["vectors"] == {"dim": config.model.output_dim,
                                      "vector_dtype": config.sink.vector_dtype}
        runs[name] = out
    return runs


def _vectors(out: Path) -> tuple[pa.Table, np.ndarray]:
    table = pq.read_table(sorted((out / "vectors").glob("*.parquet"))).sort_by("id")
    return table, vector_matrix(table)


def test_float16_vectors_are_the_float32_ones_to_float16_precision(batch_runs):
    table32, full = _vectors(batch_runs["float32"])
    table16, half = _vectors(batch_runs["float16"])
    embedding = table16.schema.field("embedding").type
    assert pa.types.is_float16(embedding.value_type) and embedding.list_size == 384
    assert not embedding.value_field.nullable
    assert table16["id"].to_pylist() == table32["id"].to_pylist()
    assert np.abs(half - full).max() <= FP16_STEP
    np.testing.assert_allclose(np.linalg.norm(half, axis=1), 1.0, atol=2e-3)
    assert set(table16["dim"].to_pylist()) == {384}
    size = {name: (batch_runs[name] / "vectors").stat().st_size for name in batch_runs}
    assert size  # the files' sizes are compared in docs/benchmarks.md (benchmarks.retrieval)


def test_truncated_vectors_are_the_normalized_head_of_the_full_ones(batch_runs):
    table32, full = _vectors(batch_runs["float32"])
    table128, short = _vectors(batch_runs["dims128"])
    assert table128.schema.field("embedding").type == embedding_type(128)
    assert set(table128["dim"].to_pylist()) == {128}
    head = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    np.testing.assert_allclose(short, head, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)


def test_search_reads_float16_and_old_nullable_files_together(batch_runs, tmp_path):
    out = tmp_path / "mixed"
    shutil.copytree(batch_runs["float16"], out)
    table32, _ = _vectors(batch_runs["float32"])
    old = table32.cast(table32.schema.set(
        table32.schema.get_field_index("embedding"),
        pa.field("embedding", pa.list_(pa.float32(), 384), nullable=False)))
    pq.write_table(old, out / "vectors" / "part-before-issue-24.parquet")
    title = next(t for t in table32["title"].to_pylist() if t)
    config = make_config(output=str(out)).model_copy(
        update={"sink": make_config().sink.model_copy(update={"vector_dtype": "float16"})})
    hits = search(config, title, k=3)
    assert hits[0]["title"] == title and hits[0]["score"] > 0.5
    config128 = make_config(output=str(batch_runs["dims128"]), model=make_config().model
                            .model_copy(update={"dimensions": 128,
                                                "truncate_dimensions_knowingly": True}))
    hits = search(config128, title, k=3)
    assert hits[0]["title"] == title


# Compaction and readers: files from before (nullable elements) with new ones.

def _rewrite_nullable(path: Path) -> None:
    """A file as newsvec wrote it before its embedding's elements were declared not null."""
    table = pq.read_table(path)
    index = table.schema.get_field_index("embedding")
    old_type = pa.list_(pa.float32(), table.schema.field(index).type.list_size)
    pq.write_table(table.set_column(index, pa.field("embedding", old_type, nullable=False),
                                    table.column(index).cast(old_type)), path)


def test_compaction_mixes_files_from_before_with_new_ones(tmp_path):
    out = tmp_path / "out"
    so.write(str(out), so.micro_batches(40, windows=4, chunks=1), row_group_rows=16)
    files = sorted((out / "vectors").rglob("*.parquet"))
    for path in files[::2]:
        _rewrite_nullable(path)
    for path in sorted((out / "chunks").rglob("*.parquet"))[::2]:
        _rewrite_nullable(path)
    before = pa.concat_tables([float32_embeddings(pq.read_table(p)) for p in files])
    assert {pq.read_schema(p).field("embedding").type.value_field.nullable
            for p in files} == {True, False}
    results = compact.compact_range(str(out), so.START, so.START + dt.timedelta(hours=1), 16,
                                    lease_s=30, now=so.START + dt.timedelta(days=2))
    assert all("error" not in r for r in results), results
    (compacted,) = compaction.current_files(str(out), "vectors")
    table = pq.read_table(compacted)
    assert not table.schema.field("embedding").type.value_field.nullable
    assert table.num_rows == before.num_rows
    np.testing.assert_array_equal(vector_matrix(table.sort_by("id")),
                                  vector_matrix(before.sort_by("id")))


def test_float16_and_float32_files_are_read_and_compacted_as_float32():
    schemas = [vector_schema(8, "float16"), vector_schema(8, "float32"),
               pa.schema([pa.field("embedding", pa.list_(pa.float16(), 8))])]
    assert common_schema(schemas[:1]).equals(vector_schema(8, "float16"))
    assert common_schema(schemas[:2]).equals(vector_schema(8, "float32"))
    with pytest.raises(ValueError, match="another schema"):
        common_schema([vector_schema(8), vector_schema(16)])
    merged = common_schema([schemas[0], schemas[2]], merge_columns=True)
    assert merged.field("embedding").type == embedding_type(8, "float16")


def test_the_current_vector_reads_days_written_before_and_after(tmp_path):
    ids = ["a", "b"]
    for day, vector_dtype, nullable in (("2026-12-01", "float32", True),
                                        ("2026-12-02", "float16", False)):
        folder = tmp_path / f"dt={day}" / "vectors"
        folder.mkdir(parents=True)
        type_ = (pa.list_(pa.float32(), 2) if nullable else embedding_type(2, vector_dtype))
        values = np.array([1, 0, 0, 1] if day.endswith("1") else [0.6, 0.8, 0.8, 0.6])
        pq.write_table(pa.table({
            "id": ids if day.endswith("1") else ids[:1],
            "embedded_at": pa.array([so.START] * (2 if day.endswith("1") else 1),
                                    pa.timestamp("us", tz="UTC")),
            "embedding": pa.FixedSizeListArray.from_arrays(
                pa.array(values[:4 if day.endswith("1") else 2].astype(
                    np.float16 if vector_dtype == "float16" else np.float32)), type=type_)}),
            folder / "part.parquet")
    table = current_vectors(str(tmp_path)).sort_by("id")
    assert table["dt"].to_pylist() == ["2026-12-02", "2026-12-01"]
    np.testing.assert_allclose(vector_matrix(table), [[0.6, 0.8], [0.0, 1.0]], atol=1e-3)


def test_the_current_vector_reads_a_day_written_before_a_not_null_column_existed(tmp_path):
    # A day written before chunks mode has no chunk_count, which later files declare not null:
    # its rows read with a null there (as pyarrow's dataset read them), not a failed cast.
    old, new = tmp_path / "dt=2026-12-01" / "vectors", tmp_path / "dt=2026-12-02" / "vectors"
    for folder in (old, new):
        folder.mkdir(parents=True)
    stamp = pa.array([so.START], pa.timestamp("us", tz="UTC"))
    pq.write_table(pa.table({"id": ["a"], "embedded_at": stamp}), old / "part.parquet")
    pq.write_table(pa.Table.from_arrays(
        [pa.array(["b"]), stamp, pa.array([3], pa.int32())],
        schema=pa.schema([("id", pa.string()), ("embedded_at", stamp.type),
                          pa.field("chunk_count", pa.int32(), nullable=False)])),
        new / "part.parquet")
    table = current_vectors(str(tmp_path)).sort_by("id")
    assert table["id"].to_pylist() == ["a", "b"]
    assert table["chunk_count"].to_pylist() == [None, 3]


def test_search_refuses_an_output_of_another_dimension(tmp_path):
    (tmp_path / "vectors").mkdir()
    pq.write_table(pa.table({
        "id": ["a"], "title": ["t"],
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(np.ones(128, np.float32)),
                                                       type=embedding_type(128))}),
        tmp_path / "vectors" / "part.parquet")
    with pytest.raises(ValueError, match="128-dimensional vectors, but the config's queries are "
                                         "384-dimensional"):
        search(make_config(output=str(tmp_path)), "anything")

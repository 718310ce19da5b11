"""``newsvec search`` over Parquet outputs shows each story once (``story_id``, docs/output.md "The
same story, once"): the best-scoring article of each story, with how many copies of it the output
holds; ``--all-copies`` shows every article. Outputs are written directly with the schemas of
transforms/output/parquet.py (no pipeline run), and the query's vector is given (no model)."""
from __future__ import annotations

import datetime as dt
import io
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline import cli
from tests.common import make_config
from transforms.output.parquet import chunk_schema, vector_schema

CONFIG = make_config()
DIM = CONFIG.model.output_dim
T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)
QUERY = np.eye(DIM, dtype=np.float32)[0]


def near(score: float) -> list[float]:
    """A unit vector whose cosine similarity with ``QUERY`` is ``score``."""
    vector = np.zeros(DIM, np.float32)
    vector[0], vector[1] = score, np.sqrt(1 - score * score)
    return vector.tolist()


def table(schema: pa.Schema, rows: list[dict]) -> pa.Table:
    """``rows`` as a table of ``schema``: a column a row does not give is null where the schema
    allows it, else a plain value of its type."""
    def default(field: pa.Field):
        if field.nullable:
            return None
        if pa.types.is_timestamp(field.type):
            return T0
        if pa.types.is_boolean(field.type):
            return False
        if pa.types.is_integer(field.type):
            return 0
        return "x"

    return pa.table({f.name: [row.get(f.name, default(f)) for row in rows] for f in schema},
                    schema=schema)


def article(doc_id: str, score: float, story: str | None = None, **more) -> dict:
    """A ``vectors/`` row: ``story`` its story_id (None: a row of an output before 0.4, or with
    near duplicates off), ``near_duplicate_of`` set where it copies another article."""
    row = {"id": doc_id, "title": f"title {doc_id}", "embedding": near(score), "dim": DIM,
           "story_id": story}
    if story is not None and story != doc_id:
        row.update(near_duplicate_of=story, similarity=0.9)
    return {**row, **more}


def write(path: Path, schema: pa.Schema, rows: list[dict], drop: tuple = ()) -> None:
    """``drop``: columns left out of the file, as a file written before they existed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = table(schema, rows)
    pq.write_table(written.drop_columns(list(drop)), path)


STORY_COLUMNS = ("story_id", "near_duplicate_of", "similarity")


@pytest.fixture
def given_query(monkeypatch):
    monkeypatch.setattr("pipeline.search.embed_query", lambda config, query: QUERY)


@pytest.fixture
def streaming_output(tmp_path) -> Path:
    """A streaming output (``dt=/hour=`` partitions): an hour written before 0.4 (no story
    columns) holds the original ``wire`` and ``other``; a later hour holds two copies of
    ``wire`` (one nearer the query than the original) and ``local``, a story of its own."""
    out = tmp_path / "out"
    schema = vector_schema(DIM)
    write(out / "vectors" / "dt=2026-12-01" / "hour=08" / "part-0.parquet", schema,
          [article("wire", 0.90), article("other", 0.50)], drop=STORY_COLUMNS)
    write(out / "vectors" / "dt=2026-12-01" / "hour=09" / "part-0.parquet", schema,
          [article("wire-copy-1", 0.95, "wire"), article("wire-copy-2", 0.85, "wire"),
           article("local", 0.70, "local")])
    return out


def test_search_returns_one_hit_per_story_with_its_copies_and_k_counts_stories(
        given_query, streaming_output):
    """Old code: the three rows of the wire story took three of the k places, and no hit named
    its story or copies."""
    from pipeline.search import search

    hits = search(CONFIG, "q", k=3, output=str(streaming_output))
    assert [(h["id"], h["story_id"], h["copies"]) for h in hits] == [
        ("wire-copy-1", "wire", 2), ("local", "local", 0), ("other", "other", 0)]
    assert hits[0]["score"] == pytest.approx(0.95, abs=1e-4)
    assert hits[0]["title"] == "title wire-copy-1" and hits[0]["chunk_index"] is None


def test_all_copies_returns_every_article(given_query, streaming_output):
    from pipeline.search import search

    hits = search(CONFIG, "q", k=10, output=str(streaming_output), all_copies=True)
    assert [h["id"] for h in hits] == ["wire-copy-1", "wire", "wire-copy-2", "local", "other"]
    assert {h["id"]: h["copies"] for h in hits}["wire"] == 2


def test_a_chunks_output_collapses_each_articles_best_chunk_by_story(given_query, tmp_path):
    """Each article by its best chunk first, then each story by its best article: the copy's
    best chunk (index 1) beats the original's."""
    from pipeline.search import search

    out = tmp_path / "out"
    write(out / "vectors" / "part-0.parquet", vector_schema(DIM),
          [article("wire", 0.0, "wire"), article("copy", 0.0, "wire"),
           article("other", 0.0, None)])

    def chunk(doc_id: str, index: int, score: float) -> dict:
        return {"id": doc_id, "chunk_id": f"{doc_id}-{index}", "chunk_index": index,
                "embedding": near(score), "dim": DIM, "chunk_count": 2}

    write(out / "chunks" / "part-0.parquet", chunk_schema(DIM),
          [chunk("wire", 0, 0.80), chunk("wire", 1, 0.30), chunk("copy", 0, 0.10),
           chunk("copy", 1, 0.90), chunk("other", 0, 0.60), chunk("other", 1, 0.20)])
    hits = search(CONFIG, "q", k=10, output=str(out))
    assert [(h["id"], h["chunk_index"], h["story_id"], h["copies"]) for h in hits] == [
        ("copy", 1, "wire", 1), ("other", 0, "other", 0)]
    every = search(CONFIG, "q", k=10, output=str(out), all_copies=True)
    assert [(h["id"], h["chunk_index"]) for h in every] == [("copy", 1), ("wire", 0),
                                                            ("other", 0)]


def _run(streaming_output: Path, tmp_path: Path, monkeypatch, *argv: str) -> list[str]:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(json.loads(CONFIG.model_copy(update={
        "output": str(streaming_output)}).model_dump_json())))
    shown = io.StringIO()
    monkeypatch.setattr(sys, "stdout", shown)
    assert cli.main(["search", "--config", str(config_file), *argv, "q"]) == 0
    return shown.getvalue().splitlines()


def test_the_search_command_names_the_copies_and_all_copies_shows_them(
        given_query, streaming_output, tmp_path, monkeypatch):
    """Old code: --all-copies was an unknown option (argparse exits 2)."""
    lines = _run(streaming_output, tmp_path, monkeypatch, "--k", "2")
    assert lines == ["0.9500  wire-copy-1  title wire-copy-1  (+2 copies)",
                     "0.7000  local  title local"]
    shown = [json.loads(line) for line in _run(streaming_output, tmp_path, monkeypatch,
                                               "--json", "--all-copies", "--k", "3")]
    assert [(h["id"], h["story_id"], h["copies"]) for h in shown] == [
        ("wire-copy-1", "wire", 2), ("wire", "wire", 2), ("wire-copy-2", "wire", 2)]

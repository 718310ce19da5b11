"""Same-story copies through the pipeline (transforms/stories.py): every row names its story, a
copy the article it copies; chunk rows follow; ``action: skip`` leaves copies out and the ledger
counts them; a day's run finds yesterday's originals through yesterday's keys/.

The engine is FAKE (tests/fakes.py): what is under test is which rows name which story, not the
vectors. Real BBC articles (tests/common.py ``bbc_file``) and copies of them made with
tools/near_copies.py.
"""
from __future__ import annotations

import csv
import random

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline import config as config_lib
from pipeline.run import run_batch
from tests.common import bbc_file, make_config
from tests.fakes import FakeEngine
from tests.output.test_reruns import listing, rows_of, write_input
from tools.near_copies import copy_of
from transforms.settings import ChunkingSettings, IncrementalSettings, NearDuplicateSettings

OPTIONS = PipelineOptions(["--runner=FnApiRunner"])


@pytest.fixture(scope="module")
def articles() -> list[str]:
    """Six BBC articles: six stories."""
    with open(bbc_file("test.csv"), newline="", encoding="utf-8") as f:
        return [row["text"] for row in list(csv.DictReader(f))[:6]]


def event(id_: str, text: str, published_at: str) -> dict:
    title, _, body = text.partition(" ")
    return {"id": id_, "title": title, "body": body, "published_at": published_at}


def corpus(articles: list[str]) -> list[dict]:
    """The originals o0..o5 at 08:00, and copies c0 (of o0, light), c1 (of o1, heavy: 70% of its
    sentences) and cc0 (a copy of c0) later in the day."""
    rng = random.Random(5)
    events = [event(f"o{i}", text, f"2026-12-01T08:0{i}:00Z") for i, text in enumerate(articles)]
    c0, _ = copy_of(articles[0], "light", rng)
    c1, _ = copy_of(articles[1], "heavy", rng)
    cc0, _ = copy_of(c0, "light", rng)
    return events + [event("c0", c0, "2026-12-01T09:00:00Z"),
                     event("c1", c1, "2026-12-01T09:30:00Z"),
                     event("cc0", cc0, "2026-12-01T10:00:00Z")]


def run(root: str, rows: list[dict], day: str = "2026-12-01", **changes) -> tuple[dict, dict]:
    config = make_config(input=f"{root}/in/dt={{date}}/news.jsonl",
                         output=f"{root}/out/dt={{date}}", **changes)
    write_input(root, f"in/dt={day}", rows)
    summary = run_batch(config_lib.fill_date(config, day), OPTIONS, engine_factory=FakeEngine)
    return summary, listing(f"{root}/out/dt={day}")


def stories(files: dict, folder: str = "vectors") -> dict[str, tuple]:
    table = rows_of(files, folder).to_pylist()
    return {row["id"] if folder == "vectors" else (row["id"], row["chunk_index"]):
            (row["story_id"], row["near_duplicate_of"], row["similarity"]) for row in table}


def test_every_row_names_its_story_and_copies_name_their_original(tmp_path, articles):
    summary, files = run(str(tmp_path), corpus(articles))
    marks = stories(files)
    assert summary["invariant_holds"] and summary["counts"]["written"] == 9
    for i in range(6):
        assert marks[f"o{i}"] == (f"o{i}", None, None), f"o{i} is an original"
    assert marks["c0"][:2] == ("o0", "o0") and marks["c0"][2] > 0.6
    assert marks["c1"][:2] == ("o1", "o1") and 0.35 <= marks["c1"][2] < 0.9
    # A copy of a copy: in o0's story, a copy of whichever it is closest to.
    assert marks["cc0"][0] == "o0" and marks["cc0"][1] in {"o0", "c0"}
    keys = {row["id"]: row for row in rows_of(files, "keys").to_pylist()}
    assert keys["c1"]["story_id"] == "o1" and len(keys["c1"]["minhash"]) == 128 * 4
    assert keys["o1"]["minhash_version"] == summary["near_duplicates"]["signature_version"]


def test_chunk_rows_follow_their_article(tmp_path, articles):
    _, files = run(str(tmp_path), corpus(articles),
                   chunking=ChunkingSettings(mode="chunks", chunk_tokens=64, overlap_tokens=8))
    article_marks, chunk_marks = stories(files), stories(files, "chunks")
    assert len(chunk_marks) > 9
    for (id_, _), mark in chunk_marks.items():
        assert mark == article_marks[id_], id_


def test_near_duplicates_off_leaves_the_columns_null(tmp_path, articles):
    _, files = run(str(tmp_path), corpus(articles),
                   near_duplicates=NearDuplicateSettings(enabled=False))
    assert set(stories(files).values()) == {(None, None, None)}
    assert set(rows_of(files, "keys").column("minhash").to_pylist()) == {None}


def test_skip_leaves_close_copies_out_and_the_ledger_counts_them(tmp_path, articles):
    settings = NearDuplicateSettings(action="skip", skip_threshold=0.7)
    summary, files = run(str(tmp_path), corpus(articles), near_duplicates=settings)
    marks = stories(files)
    counts = summary["counts"]
    # c0 and cc0 are light copies (similarity >= 0.7): not embedded; c1 (heavy) is a marked row.
    assert set(marks) == {f"o{i}" for i in range(6)} | {"c1"}
    assert marks["c1"][:2] == ("o1", "o1")
    assert (counts["in"], counts["written"], counts["near_duplicates"]) == (9, 7, 2)
    assert summary["invariant_holds"] and counts["accounted"] == 9


def test_a_days_run_finds_yesterdays_original_through_its_keys(tmp_path, articles):
    root = str(tmp_path)
    previous = IncrementalSettings(previous_outputs=[f"{root}/out/dt=*"])
    run(root, corpus(articles)[:6], incremental=previous)
    rng = random.Random(9)
    copy, _ = copy_of(articles[2], "medium", rng)
    summary, files = run(root, [event("d2", copy, "2026-12-02T07:00:00Z")], day="2026-12-02",
                         incremental=previous)
    assert summary["counts"]["written"] == 1
    assert stories(files)["d2"][:2] == ("o2", "o2")

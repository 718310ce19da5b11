"""The same-story review's F2 and F3 (shared/reviews/2026-12-07-query-stories-check-model.md),
end to end: the batch pipeline with the FAKE engine (the vectors are not under test), and the
streaming step in both state layouts. The sets come from tools/story_sets.py.

- F2: a publisher's footer, shared by a source's short articles, must not make them one story,
  nor make action skip leave them out; a real reprint by another source is still its original's
  copy.
- F3: short flashes with different facts (raises/cuts, Trump/Haley, rise/fall, 20 of 25 / 31 of
  35, man/woman) are two stories in either order, and both are embedded with skip; a flash with a
  wire prefix or in capitals is its original's story.
"""
from __future__ import annotations

import datetime as dt
import random

import pytest

from tests.common import bbc_file
from tests.stories.test_stories_pipeline import event, rows_of, run
from tests.stories.test_stories_streaming import mb, run_batches
from tools.story_sets import (
    COURIER,
    LEDGER,
    REVIEW_PAIRS,
    START,
    Item,
    Publisher,
    bbc_articles,
    brief,
    dressed_set,
    headline,
    reprint,
    rfc3339,
    take,
)
from transforms.settings import NearDuplicateSettings
from transforms.types import NewsEvent, PreparedDoc

SKIP = NearDuplicateSettings(action="skip")


@pytest.fixture(scope="module")
def all_briefs() -> list[str]:
    """53 BBC briefs: the first three sentences of test.csv's articles (300-650 chars)."""
    return take(iter(bbc_articles(bbc_file("test.csv").parent, "test")), 53,
                lambda text: brief(text, (3,)))


@pytest.fixture(scope="module")
def briefs(all_briefs) -> list[str]:
    return all_briefs[:50]


def rows(items: list[Item]) -> list[dict]:
    return [{**event(item.id, item.text, item.published_at), "source": item.source}
            for item in items]


def marks_of(files) -> dict[str, tuple]:
    return {row["id"]: (row["story_id"], row["near_duplicate_of"])
            for row in rows_of(files).to_pylist()}


def copies_marked(marks: dict[str, tuple]) -> dict[str, tuple]:
    return {id_: mark for id_, mark in marks.items() if mark != (id_, None)}


def stories(marks: dict[str, tuple]) -> str:
    return f"{len({story for story, _ in marks.values()})} stories of {len(marks)}"


# --- F2: a source's footer ------------------------------------------------------------------------

def test_f2_fifty_footer_briefs_of_one_source_are_fifty_stories(tmp_path, briefs):
    summary, files = run(str(tmp_path), rows(dressed_set("f2", [(LEDGER, briefs)], 0, seed=1)))
    marks = marks_of(files)
    assert summary["counts"]["written"] == 50
    assert not copies_marked(marks), stories(marks)


def test_f2_skip_embeds_every_footer_brief_and_the_ledger_balances(tmp_path, briefs):
    summary, files = run(str(tmp_path), rows(dressed_set("f2", [(LEDGER, briefs)], 0, seed=1)),
                         near_duplicates=SKIP)
    counts = summary["counts"]
    assert (counts["written"], counts["near_duplicates"]) == (50, 0), counts
    assert summary["invariant_holds"] and counts["accounted"] == 50


@pytest.mark.parametrize("publisher", [COURIER, LEDGER], ids=["300-char", "600-char"])
def test_f2_skip_embeds_every_headline_under_a_footer(tmp_path, publisher):
    """Eight-word headlines alone, each with the source's footer."""
    heads = take(iter(bbc_articles(bbc_file("test.csv").parent, "test")), 50, headline)
    items = dressed_set("f2h", [(publisher, heads)], 0, seed=1)
    summary, files = run(str(tmp_path), rows(items), near_duplicates=SKIP)
    counts = summary["counts"]
    assert (counts["written"], counts["near_duplicates"]) == (50, 0), counts
    assert summary["invariant_holds"] and not copies_marked(marks_of(files))


def test_f2_control_the_same_briefs_without_a_footer_are_fifty_stories(tmp_path, briefs):
    plain = Publisher(LEDGER.source)
    _, files = run(str(tmp_path), rows(dressed_set("f2", [(plain, briefs)], 0, seed=1)))
    marks = marks_of(files)
    assert not copies_marked(marks), stories(marks)


def test_f2_a_real_reprint_by_another_source_is_still_a_copy(tmp_path, all_briefs):
    """The 50 footer briefs of ledger, three other briefs of courier (its own 300-char footer),
    and courier's reprint of ledger's brief 7: a wire prefix, a typo, courier's footer."""
    briefs = all_briefs[:50]
    items = dressed_set("f2", [(LEDGER, briefs), (COURIER, all_briefs[50:])], 0, seed=1)
    original = next(item for item in items if item.id == "f2-ledger-07")
    when = START + dt.timedelta(hours=2)
    items.append(reprint(original, briefs[7], COURIER, "f2-courier-reprint", when,
                         random.Random(7)))
    _, files = run(str(tmp_path), rows(items))
    marks = marks_of(files)
    assert marks["f2-courier-reprint"] == ("f2-ledger-07", "f2-ledger-07"), marks[
        "f2-courier-reprint"]
    del marks["f2-courier-reprint"]
    assert not copies_marked(marks), stories(marks)


# --- F3: flashes ----------------------------------------------------------------------------------

def flashes(order: str) -> list[Item]:
    """The review's pairs, the second of each published 30 s after the first (``reversed``: the
    second flash first)."""
    items = []
    for i, pair in enumerate(REVIEW_PAIRS):
        texts = (pair.first, pair.second) if order == "as-written" else (pair.second, pair.first)
        for j, text in enumerate(texts):
            when = START + dt.timedelta(minutes=2 * i, seconds=30 * j)
            id_ = f"flash-{i}-{'ab'[j]}"
            items.append(Item(id_, text, ("wire", "site")[j], rfc3339(when), id_))
    return items


@pytest.mark.parametrize("order", ["as-written", "reversed"])
@pytest.mark.parametrize("action", ["mark", "skip"])
def test_f3_flashes_with_different_facts_are_two_stories(tmp_path, order, action):
    summary, files = run(str(tmp_path), rows(flashes(order)),
                         near_duplicates=NearDuplicateSettings(action=action))
    counts = summary["counts"]
    assert (counts["written"], counts["near_duplicates"]) == (10, 0), counts
    copied = copies_marked(marks_of(files))
    assert not copied, f"marked copies: {copied}"


def test_f3_a_flash_with_a_wire_prefix_or_in_capitals_is_its_originals_story(tmp_path):
    items = []
    for i, pair in enumerate(REVIEW_PAIRS):
        when = START + dt.timedelta(minutes=2 * i)
        for j, text in enumerate((pair.first, "(Reuters) - " + pair.first, pair.first.upper())):
            id_ = f"flash-{i}-{j}"
            items.append(Item(id_, text, ("wire", "reuters", "site")[j],
                              rfc3339(when + dt.timedelta(seconds=20 * j)), f"flash-{i}-0"))
    _, files = run(str(tmp_path), rows(items))
    marks = marks_of(files)
    assert {id_: story for id_, (story, _) in marks.items()} == {
        item.id: item.story for item in items}, marks


# --- streaming ------------------------------------------------------------------------------------

def doc(item: Item) -> PreparedDoc:
    published = dt.datetime.fromisoformat(item.published_at.replace("Z", "+00:00"))
    return PreparedDoc(event=NewsEvent(id=item.id, body=item.text, source=item.source,
                                       published_at=published),
                       text=item.text, text_sha256=item.id, token_ids=(101, 102), truncated=False)


@pytest.mark.parametrize("order", ["as-written", "reversed"])
@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_f3_streaming_flashes_in_separate_micro_batches_are_separate_stories(state, order):
    items = flashes(order)
    batches = [mb(0, 0, [doc(item) for item in items[0::2]]),
               mb(60, 1, [doc(item) for item in items[1::2]])]

    def check(marks, skipped, n):
        copied = copies_marked(marks)
        assert not copied, f"marked copies: {copied}"

    run_batches(batches, NearDuplicateSettings(), state, check)


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_f2_streaming_footer_briefs_after_the_footer_is_known_are_their_own_stories(
        state, briefs):
    """Ten footer briefs of one source in four micro-batches: 3, 2, 3, 2. From the second on,
    the source's footer has been seen in three articles."""
    items = [doc(item) for item in dressed_set("f2", [(LEDGER, briefs[:10])], 0, seed=1)]
    batches = [mb(60 * k, 0, items[a:b])
               for k, (a, b) in enumerate([(0, 3), (3, 5), (5, 8), (8, 10)])]

    def check(marks, skipped, n):
        later = {id_: mark for id_, mark in copies_marked(marks).items()
                 if int(id_.rsplit("-", 1)[1]) >= 3}
        assert not later, f"marked copies: {later}"

    run_batches(batches, NearDuplicateSettings(), state, check)

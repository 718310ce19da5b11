"""tools/story_sets.py: the sets are deterministic and of the documented sizes, the boilerplate of
the stated lengths and in every article of its source, the flash pairs differ as their kind says.
No pipeline."""
from __future__ import annotations

import datetime as dt
import random
import re
import unicodedata
from collections import Counter

import pytest

from tests.common import bbc_file
from tools import story_sets
from tools.story_sets import (
    DIFFERENT_EN,
    DIFFERENT_JA,
    REVIEW_PAIRS,
    SAME_EN,
    SAME_JA,
    SETS,
    copies,
    numbers,
    truth,
)

# name -> (items, real copies, originals per source)
SIZES = {
    "en-briefs": (98, 8, {"ledger": 50, "courier": 40}),
    "en-headlines": (88, 8, {"ledger": 40, "courier": 40}),
    "en-publishers": (108, 8, {"presswire": 25, "morning": 25, "linkpost": 25, "tribune": 25}),
    "ja-briefs": (46, 6, {"minato": 20, "hikari": 20}),
    "ja-headlines": (46, 6, {"haishin": 20, "kanren": 20}),
    "en-flash-different": (60, 0, {"wire": 30, "site": 30}),
    "en-flash-same": (52, 26, {"wire": 26}),
    "ja-flash-different": (54, 0, {"wire": 27, "site": 27}),
    "ja-flash-same": (52, 26, {"wire": 26}),
}
FOOTER_SETS = ["en-briefs", "en-headlines", "en-publishers", "ja-briefs", "ja-headlines"]
PUBLISHERS = {p.source: p for p in (story_sets.LEDGER, story_sets.COURIER, story_sets.PRESSWIRE,
                                    story_sets.MORNING, story_sets.LINKPOST, story_sets.TRIBUNE,
                                    story_sets.MINATO, story_sets.HIKARI, story_sets.HAISHIN,
                                    story_sets.KANREN)}


@pytest.fixture(scope="module")
def sets() -> dict[str, list]:
    bbc_dir = bbc_file("test.csv").parent
    return {name: make(bbc_dir) for name, make in SETS.items()}


def test_the_sets_are_deterministic(sets):
    bbc_dir = bbc_file("test.csv").parent
    for name, make in SETS.items():
        assert make(bbc_dir) == sets[name], name


@pytest.mark.parametrize("name", sorted(SIZES))
def test_sizes_ids_order_and_true_stories(sets, name):
    items = sets[name]
    n, n_copies, per_source = SIZES[name]
    assert (len(items), len(copies(items))) == (n, n_copies)
    assert dict(Counter(i.source for i in items if i.story == i.id)) == per_source
    assert len(truth(items)) == n  # unique ids
    times = [dt.datetime.fromisoformat(i.published_at.replace("Z", "+00:00")) for i in items]
    assert times == sorted(times) and all(t.tzinfo is not None for t in times)
    by_id = {item.id: (k, item) for k, item in enumerate(items)}
    for k, item in enumerate(items):
        first, original = by_id[item.story]
        assert original.story == original.id and first <= k, item.id  # an earlier original


@pytest.mark.parametrize("name", FOOTER_SETS)
def test_each_source_prints_its_boilerplate_on_every_article(sets, name):
    items = sets[name]
    for item in items:
        publisher = PUBLISHERS[item.source]
        assert item.text.startswith(publisher.head) and item.text.endswith(publisher.foot)
        when = dt.datetime.fromisoformat(item.published_at.replace("Z", "+00:00"))
        assert not publisher.dated or when.strftime(publisher.dated) in item.text
    originals = {i.id: i for i in items if i.story == i.id}
    for id_, story in copies(items).items():
        copy = next(i for i in items if i.id == id_)
        assert copy.source != originals[story].source, id_  # reprinted by another source


def test_footers_are_the_stated_lengths():
    assert 590 <= len(story_sets.FOOTER_600) <= 610
    assert 290 <= len(story_sets.FOOTER_300) <= 310
    for text in (story_sets.ABOUT, story_sets.NEWSLETTER, story_sets.RELATED,
                 story_sets.TRIBUNE_FOOT, story_sets.JA_COPYRIGHT, story_sets.JA_ABOUT,
                 story_sets.JA_SOURCE, story_sets.JA_RELATED):
        assert 50 <= len(text) <= 400
    assert "無断転載を禁じます" in story_sets.JA_COPYRIGHT
    assert "株式会社について" in story_sets.JA_ABOUT and "配信元" in story_sets.JA_SOURCE
    assert story_sets.RELATED.startswith("Related: ") and story_sets.RELATED.count(" | ") >= 2


def test_briefs_and_headlines_are_short(sets):
    for item in sets["en-briefs"]:
        if item.story == item.id:
            body = item.text.removesuffix("\n\n" + PUBLISHERS[item.source].foot)
            assert 300 <= len(body) <= 650, item.id
    for item in sets["en-headlines"]:
        if item.story == item.id:
            body = item.text.removesuffix("\n\n" + PUBLISHERS[item.source].foot)
            assert len(body.split()) == 8, item.id


def words(text: str) -> list[str]:
    """Casefolded NFKC words and numbers; Japanese: the text without punctuation and spaces."""
    folded = unicodedata.normalize("NFKC", text).casefold().replace(",", "")
    return re.findall(r"\w+(?:\.\d+)?", folded)


def test_different_flash_pairs_differ_in_a_word_or_number():
    assert len(DIFFERENT_EN) >= 25 and len(DIFFERENT_JA) >= 25
    assert set(REVIEW_PAIRS) <= set(DIFFERENT_EN)
    for pair in DIFFERENT_EN + DIFFERENT_JA:
        assert words(pair.first) != words(pair.second), pair
        if pair.kind == "number":
            assert numbers(pair.first) != numbers(pair.second), pair
        else:
            assert numbers(pair.first) == numbers(pair.second), pair
    texts = [t for pair in DIFFERENT_EN + DIFFERENT_JA for t in (pair.first, pair.second)]
    assert len(set(texts)) == len(texts)


def test_same_flash_pairs_keep_their_numbers():
    assert len(SAME_EN) >= 25 and len(SAME_JA) >= 25
    for pair in SAME_EN + SAME_JA:
        assert pair.first != pair.second and numbers(pair.first) == numbers(pair.second), pair
    kinds = {pair.kind for pair in SAME_EN + SAME_JA}
    assert {"wire", "dateline", "case", "punctuation", "spelling", "typo", "width",
            "credit"} <= kinds


def test_a_light_edit_keeps_the_numbers():
    rng = random.Random(0)
    text = "Shares of Northwind rose 4.5% to 1,200p after the announcement on 3 March."
    edited = story_sets.light_edit(text, rng)
    assert edited != text and numbers(edited) == numbers(text)
    assert numbers(story_sets.light_edit("死者は１２人に", rng, japanese=True)) == ["12"]

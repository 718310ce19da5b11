"""Same-story copies (transforms/stories/): a reprint is marked a copy of its original, a
different article of the same topic is not, in English and Japanese; stories chain, an id is
marked once and never its own copy; signatures are the same in every process."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest

from tools import japanese_stories
from transforms.settings import NearDuplicateSettings
from transforms.stories import (
    Held,
    StoryIndex,
    band_keys,
    shingle_hashes,
    shingle_text,
    signatures,
    similarity,
)

SETTINGS = NearDuplicateSettings()

# Written for this test: two articles of one category (football), sharing names and phrasing.
CUP_TIE = (
    "Rovers reach cup quarter-finals. Rovers beat City 2-1 on Saturday to reach the "
    "quarter-finals of the FA Cup for the first time in 12 years. Striker Tom Hale scored twice "
    "in the second half after City had taken the lead through a penalty in the 34th minute. "
    "Manager Ann Price said her side had shown great character in front of 21,000 fans. City's "
    "manager complained that the "
    "winning goal should have been ruled out for offside. Rovers will learn their next opponents "
    "in Monday's draw. The club have not won the competition since 1965. Ticket prices for the "
    "next round will be announced later this week.")
LEAGUE_GAME = (
    "Rovers held at home by United. Rovers were held to a 1-1 draw by United on Tuesday, a result "
    "that leaves them fourth in the league table. Striker Tom Hale scored in the first half but "
    "United equalised with ten minutes left through a header from a corner. Manager Ann Price said "
    "her side had lacked energy after Saturday's cup tie in front of a crowd of 18,000. United's "
    "manager praised his defenders for a disciplined display. Rovers travel to the league leaders "
    "next weekend. The club have lost only twice at home this season.")
# CUP_TIE as a customer of the wire prints it: a wire prefix, a new headline, full-width digits,
# doubled spaces and line breaks, two typos, the last sentence trimmed.
CUP_TIE_REPRINT = (
    "LONDON (Reuters) - Cup joy for Rovers\n\nRovers beat City ２-１ on  Saturday to reach the "
    "quarter-finals of the FA Cup for the first time in １２ years.\n  Striker Tom Hale socred "
    "twice in the second half after City had taken the lead through a penalty in the 34th minute. "
    "Manager Ann Price said her side had shown great charatcer in front of 21,000 fans. City's "
    "manager complained that the winning goal should have been ruled out for offside.\n\nRovers "
    "will learn their next opponents in Monday's draw. The club have not won the competition "
    "since 1965.")


def marked(texts: dict[str, str], settings: NearDuplicateSettings = SETTINGS) -> dict:
    """Each article's mark, marked in the order given."""
    index = StoryIndex(settings)
    sigs = signatures(list(texts.values()), settings)
    return {article_id: index.mark(article_id, sig)
            for article_id, sig in zip(texts, sigs, strict=True)}


def test_a_reprint_with_wire_edits_is_a_copy_of_its_original():
    marks = marked({"cup": CUP_TIE, "reprint": CUP_TIE_REPRINT})
    assert not marks["cup"].is_copy
    assert marks["reprint"].near_duplicate_of == "cup"
    assert marks["reprint"].story_id == "cup"
    assert marks["reprint"].similarity > SETTINGS.threshold


def test_full_width_forms_case_and_whitespace_are_folded_before_shingling():
    assert shingle_text("Ｒｏｖｅｒｓ  ２-１\n\u3000City") == "rovers2-1city"
    assert np.array_equal(shingle_hashes("ＡＢＣ １２３ def", 4), shingle_hashes("abc123DEF", 4))


def test_a_different_article_of_the_same_category_is_not_a_copy():
    marks = marked({"cup": CUP_TIE, "league": LEAGUE_GAME, "reprint": CUP_TIE_REPRINT})
    assert not marks["league"].is_copy
    assert marks["league"].story_id == "league"
    assert marks["reprint"].story_id == "cup"
    a, b = signatures([CUP_TIE, LEAGUE_GAME], SETTINGS)
    assert similarity(a, b) < SETTINGS.threshold


def test_japanese_reprints_are_found_and_articles_of_the_same_topic_are_not():
    articles = [a for a in japanese_stories.ARTICLES if a.topic == "weather"]
    assert len(articles) >= 5
    texts = {f"ja-{i}": japanese_stories.text(a) for i, a in enumerate(articles)}
    rng = random.Random(40)
    for i, article in enumerate(articles):
        texts[f"ja-{i}-copy"] = japanese_stories.copy(article, "medium", rng)[0]
    marks = marked(texts)
    for i in range(len(articles)):
        assert not marks[f"ja-{i}"].is_copy, marks[f"ja-{i}"]
        assert marks[f"ja-{i}-copy"].story_id == f"ja-{i}", marks[f"ja-{i}-copy"]
        assert marks[f"ja-{i}-copy"].similarity > SETTINGS.threshold


def test_a_copy_of_a_copy_joins_the_first_articles_story():
    second = CUP_TIE_REPRINT.replace("LONDON (Reuters) - ", "(AP) ") + (
        " Fans celebrated in the town centre until late on Saturday night, police said.")
    marks = marked({"cup": CUP_TIE, "reprint": CUP_TIE_REPRINT, "second": second})
    assert marks["second"].story_id == "cup"
    assert marks["second"].near_duplicate_of in {"cup", "reprint"}


def test_a_copy_of_a_copy_joins_the_story_even_when_it_no_longer_resembles_the_first():
    first = CUP_TIE
    middle = CUP_TIE + " " + LEAGUE_GAME  # a round-up carrying both
    last = LEAGUE_GAME
    sig_first, sig_middle, sig_last = signatures([first, middle, last], SETTINGS)
    assert similarity(sig_first, sig_last) < SETTINGS.threshold
    index = StoryIndex(SETTINGS)
    assert index.mark("first", sig_first).story_id == "first"
    assert index.mark("middle", sig_middle).story_id == "first"
    mark = index.mark("last", sig_last)
    assert mark.near_duplicate_of == "middle"
    assert mark.story_id == "first"


def test_the_same_id_twice_keeps_its_first_mark():
    index = StoryIndex(SETTINGS)
    cup, league = signatures([CUP_TIE, LEAGUE_GAME], SETTINGS)
    first = index.mark("a", cup)
    assert index.mark("b", cup).story_id == "a"
    again = index.mark("b", league)  # the same id, another text: marked once
    assert again.story_id == "a" and again.near_duplicate_of == "a"
    assert len(index) == 2
    assert index.mark("a", league) == first


def test_another_version_of_an_article_is_never_its_own_copy():
    old, new = signatures([CUP_TIE, CUP_TIE_REPRINT], SETTINGS)
    index = StoryIndex(SETTINGS)
    index.hold(Held("cup", "cup", old))  # yesterday's output's version of the article
    mark = index.mark("cup", new)
    assert not mark.is_copy
    assert mark.story_id == "cup"


@pytest.mark.parametrize("text", ["", " \n\t\u3000 "])
def test_an_empty_text_has_no_signature_and_is_its_own_story(text):
    assert signatures([text, CUP_TIE], SETTINGS)[0] is None
    index = StoryIndex(SETTINGS)
    index.mark("cup", signatures([CUP_TIE], SETTINGS)[0])
    mark = index.mark("empty", None)
    assert mark.story_id == "empty" and not mark.is_copy and mark.similarity is None


def test_a_text_shorter_than_a_shingle_has_one():
    (sig,) = signatures(["short"], SETTINGS)
    assert sig is not None and sig.shape == (SETTINGS.num_perm,)


_IN_A_CHILD = """
import json, sys
from transforms.settings import NearDuplicateSettings
from transforms.stories import band_keys, signatures
settings = NearDuplicateSettings(seed=int(sys.argv[1]))
texts = json.loads(sys.stdin.read())
print(json.dumps([[int(v) for v in s] + band_keys(s, settings)
                  for s in signatures(texts, settings)]))
"""


def test_signatures_are_the_same_in_another_process_and_differ_by_seed():
    texts = [CUP_TIE, japanese_stories.text(japanese_stories.ARTICLES[0])]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another str hash seed than this process's

    def child(seed: int) -> list:
        out = subprocess.run([sys.executable, "-c", _IN_A_CHILD, str(seed)], env=env,
                             input=json.dumps(texts), capture_output=True, text=True, check=True,
                             timeout=60)
        return json.loads(out.stdout)

    here = [[int(v) for v in s] + band_keys(s, SETTINGS) for s in signatures(texts, SETTINGS)]
    assert child(SETTINGS.seed) == here
    other = child(SETTINGS.seed + 1)
    assert other != here
    assert [len(row) for row in other] == [len(row) for row in here]

"""The parts of ``python -m benchmarks.retrieval --stories`` that decide its figures
(tools/story_figures.py): the copies it mixes in, the top k collapsed by story (``newsvec
search``'s default: the best row of each story), and the marks counted against which article each
copy was made from."""
from __future__ import annotations

import numpy as np

from tools.story_figures import mark_errors, story_figures, top_rows, with_copies

TEXT = ("Oil prices rose on Wednesday. Cold weather pushed crude above $50. Traders expect more. "
        "Stocks of heating fuel fell. Analysts were surprised. The cartel meets next week.")


def test_with_copies_keeps_the_originals_first_and_is_the_same_for_a_seed():
    texts = [TEXT, TEXT.replace("Oil", "Gas"), TEXT.replace("Oil", "Coal"), "Short one."]
    corpus = with_copies(texts, seed=7, share=0.5, max_copies=3)
    assert [row[0] for row in corpus[:4]] == [f"bbc-{i:05d}" for i in range(4)]
    copies = corpus[4:]
    assert len({origin for _, _, origin, _ in copies}) == 2
    assert all(1 <= sum(c[2] == o for c in copies) <= 3 for o in {c[2] for c in copies})
    assert all(c[0].startswith(c[2] + "-copy") and c[3] for c in copies)
    assert corpus == with_copies(texts, seed=7, share=0.5, max_copies=3)


def test_collapsing_keeps_the_best_row_of_each_story():
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    keys = ["a", "a", "b", "a", "c"]
    assert top_rows(scores, None, 3) == [0, 1, 2]
    assert top_rows(scores, keys, 3) == [0, 2, 4]
    assert top_rows(scores, keys, 10) == [0, 2, 4]


def test_story_figures_count_true_stories_and_the_target_story():
    scores = np.array([[0.9, 0.8, 0.7, 0.6], [0.1, 0.2, 0.3, 0.9]])
    truth = ["a", "a", "b", "c"]
    by_row = story_figures(scores, truth, ["b", "c"], None, 2)
    assert by_row["distinct_stories@2_mean"] == 1.5  # query 1: a, a; query 2: c, b
    assert by_row["recall@1"] == 0.5 and by_row["recall@2"] == 0.5
    collapsed = story_figures(scores, truth, ["b", "c"], truth, 2)
    assert collapsed["distinct_stories@2_mean"] == 2.0
    assert collapsed["recall@2"] == 1.0


def test_mark_errors_against_the_copies_origins():
    origins = {"a": "a", "b": "b", "a-copy0": "a", "a-copy1": "a", "a-copy2": "a",
               "b-copy0": "b", "b-copy1": "b"}
    ids = list(origins)
    stories = ["a", "a",  # b merged into a's story
               "a",  # right
               "a-copy1",  # missed
               "a-copy1",  # split off with a-copy1
               "a",  # b's copy in b's marked story (a): right
               "x"]  # another story
    errors = mark_errors(ids, stories, origins)
    assert errors == {"copies_missed": ["a-copy1"], "copies_split_off": ["a-copy2 -> a-copy1"],
                      "copies_in_another_story": ["b-copy1 -> x"], "originals_merged": ["b -> a"]}

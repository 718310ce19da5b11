"""Attacks on same-story marking (transforms/stories.py): planted keys/, hostile dates, copies whose
original has no row. Each test is a sequence that broke an invariant; the engine is FAKE."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from tests.common import bbc_file
from tests.fakes import FakeEngine
from tests.stories.test_stories_pipeline import event, rows_of, run
from transforms.settings import DedupSettings, NearDuplicateSettings
from transforms.stories import find_stories, signatures, to_bytes


@pytest.fixture(scope="module")
def texts() -> list[str]:
    with open(bbc_file("test.csv"), newline="", encoding="utf-8") as f:
        return [row["text"] for row in list(csv.DictReader(f))[:2]]


# --- a writer of a previous output's keys/ --------------------------------------------------------

@pytest.mark.parametrize("planted", ["prefix", "odd_bytes", "longer"])
def test_a_planted_minhash_of_the_wrong_length_does_not_stop_the_run(texts, planted):
    """A keys/ row whose minhash_version is right but whose minhash is not ``num_perm`` values
    (a truncated or padded copy of a real article's signature shares its band keys) is passed
    over: before, one such row failed FindStories, so every batch run reading that output failed
    on every retry (``ValueError: operands could not be broadcast`` / ``buffer size must be a
    multiple of element size``)."""
    settings = NearDuplicateSettings()
    (real,) = signatures([texts[0]], settings)
    bad = {"prefix": to_bytes(real[:64]), "odd_bytes": to_bytes(real)[:-1],
           "longer": to_bytes(np.concatenate([real, real[:4]]))}[planted]
    marks = dict(find_stories([((1, "a"), "a", to_bytes(real))],
                              [("planted", "hijacked-story", bad)], settings))
    assert marks["a"].story_id == "a" and not marks["a"].is_copy


# --- a hostile publisher --------------------------------------------------------------------------

def test_a_far_past_published_at_does_not_hide_the_real_original(tmp_path, texts):
    """A publisher reprints a wire story and claims it was published in 1971: it became the
    story's original, and with action skip the real original (published first, today) was left
    out of the output as *its* copy. The parser refuses a far-future published_at for this very
    reason (VERSION_ORDER); a far-past one is taken as is. Batch ranks by published_at (it has
    no publish time), but a copy is now only ever of an article published within
    ``near_duplicates.horizon_s`` before it: the reprint claiming 1971 is no one's original. (A
    claim within the horizon still ranks first: docs/output.md, its limits.)"""
    rows = [event("wire-original", texts[0], "2026-12-01T08:00:00Z"),
            event("reprint", texts[0] + " (reprinted)", "1971-01-01T00:00:00Z")]
    summary, files = run(str(tmp_path), rows,
                         near_duplicates=NearDuplicateSettings(action="skip"))
    ids = set(rows_of(files).column("id").to_pylist())
    assert summary["invariant_holds"]
    assert "wire-original" in ids, f"the real original was skipped as a copy; rows: {ids}"


def test_a_band_value_thousands_of_articles_share_keeps_the_marking_linear(monkeypatch):
    """Batch: articles of one template (a hostile publisher, or a day of stock-quote stories)
    share band values. StoryIndex held them all per band key, so each article was compared
    with every earlier one: 44,850 comparisons at 300, 179,700 at 600, quadratic
    (find_stories: 1.4 s at 1,000, 7.4 s at 2,000, 36 s at 4,000, on one worker). A band key
    now holds the earliest MAX_HELD_PER_BAND, as the streaming state does."""
    from transforms.stories import index as stories
    settings = NearDuplicateSettings()
    base = "Breaking: markets fall as the central bank raises rates by a quarter point. " * 3
    compared = []
    real = stories.similarity
    monkeypatch.setattr(stories, "similarity", lambda a, b: compared.append(1) or real(a, b))

    def comparisons(n: int) -> int:
        compared.clear()
        sigs = signatures([f"{base}{i}" for i in range(n)], settings)
        marks = dict(find_stories([((i, f"a{i}"), f"a{i}", to_bytes(sig))
                                   for i, sig in enumerate(sigs)], [], settings))
        assert marks["a0"].story_id == "a0" and marks[f"a{n - 1}"].story_id == "a0"
        return len(compared)

    small, large = comparisons(300), comparisons(600)
    # Twice the articles: twice the comparisons (linear), not four times (quadratic).
    assert large < 3 * small, (small, large)


# --- a copy whose original has no row -------------------------------------------------------------

class _FailsLongPrompts(FakeEngine):
    """Fails any call holding a prompt longer than LIMIT tokens (as a poison input would)."""

    LIMIT = 10**9

    def embed(self, prompts):
        if any(len(p) > self.LIMIT for p in prompts):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().embed(prompts)


def test_a_skipped_copy_whose_original_is_dead_lettered_leaves_its_story_a_row(
        tmp_path, texts, tokenizer, monkeypatch):
    """Action skip: the original fails in the embedder (dead-lettered), its close copy was left
    out as a near duplicate before the embedding: the story has no row at all, though one of its
    articles embeds fine. (StoryIndex.mark: "a later copy names an article that has a row".)
    Batch now embeds such a copy after all (``RescueCopies``)."""
    words = texts[1].split()
    original, copy = " ".join(words[:110]), " ".join(words[:95])
    n_original, n_copy = len(tokenizer(original)[0]), len(tokenizer(copy)[0])
    assert n_original > n_copy + 6, (n_original, n_copy)  # under max_tokens: the prompts differ
    monkeypatch.setattr(_FailsLongPrompts, "LIMIT", (n_original + n_copy) // 2 + 2)
    rows = [event("o", original, "2026-12-01T08:00:00Z"),
            event("c", copy, "2026-12-01T09:00:00Z")]
    config_changes = dict(near_duplicates=NearDuplicateSettings(action="skip",
                                                                 skip_threshold=0.6))
    from pipeline import config as config_lib
    from pipeline.run import run_batch
    from tests.common import make_config
    from tests.output.test_reruns import listing, write_input
    from tests.stories.test_stories_pipeline import OPTIONS
    root = str(tmp_path)
    config = make_config(input=f"{root}/in/dt={{date}}/news.jsonl",
                         output=f"{root}/out/dt={{date}}", **config_changes)
    write_input(root, "in/dt=2026-12-01", rows)
    summary = run_batch(config_lib.fill_date(config, "2026-12-01"), OPTIONS,
                        engine_factory=_FailsLongPrompts)
    counts = summary["counts"]
    ids = set(rows_of(listing(f"{root}/out/dt=2026-12-01")).column("id").to_pylist())
    assert counts["dead_lettered"] == 1, counts  # the original failed in the embedder
    assert ids == {"c"}, f"the story has no row: {counts}"
    assert (counts["written"], counts["near_duplicates"]) == (1, 0) and summary["invariant_holds"]


# --- exact duplicates dropped after the marking ---------------------------------------------------

def test_a_copys_original_has_a_row_when_dedup_by_text_drops_it(tmp_path, texts):
    """Action mark with dedup.key text_sha256: the same text under two ids, the later one a copy
    of the earlier. DropDuplicates keeps the later (survivor_rank: the latest published_at), so the
    row left says it copies, and belongs to the story of, an article that has no row."""
    rows = [event("o", texts[0], "2026-12-01T08:00:00Z"),
            event("c", texts[0], "2026-12-01T09:00:00Z"),
            event("r", "LONDON (Reuters) - " + texts[0], "2026-12-01T10:00:00Z")]
    summary, files = run(str(tmp_path), rows, dedup=DedupSettings(key="text_sha256"))
    table = rows_of(files).to_pylist()
    ids = {row["id"] for row in table}
    assert summary["counts"]["duplicates"] == 1 and ids == {"c", "r"}
    for row in table:
        assert row["near_duplicate_of"] is None or row["near_duplicate_of"] in ids, row
        assert row["story_id"] in ids, row
    marks = {row["id"]: (row["story_id"], row["near_duplicate_of"]) for row in table}
    # The survivor stands for its dropped twin: the story's original, and what r copies.
    assert marks == {"c": ("c", None), "r": ("c", "c")}, marks


# --- streaming: the story a band key holds a copy under -------------------------------------------

@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_a_copy_of_a_copy_joins_the_first_ones_story_in_streaming(state):
    """A; B: A with a second story appended (a copy of A, similarity about 0.5); C: that second
    story with a line added (a copy of B, nothing of A). Each in a later micro-batch. Batch, and the
    local runner's one state, mark C in A's story (B is held under A's story). Per band key
    (Dataflow): B is held under A's story only in the band keys where it found A; in the others,
    under a story of its own, and C only shares those: C came out in story "B", which has no
    article of that id as its original (B is in story "A"). A band key cannot learn B's story
    after B's micro-batch decides it (a cycle in the graph): the step now records each
    article's decided story by its id and version (``_StoryPerArticle``), and a copy asks its
    original's."""
    from tests.stories.test_stories_streaming import BASE, doc, mb, run_batches
    a, b = BASE[0], BASE[0] + " " + BASE[1]
    c = BASE[1] + " Reporting by the wire desk."
    batches = [mb(0, 0, [doc("A", a, 0)]), mb(60, 1, [doc("B", b, 1)]),
               mb(120, 2, [doc("C", c, 2)])]

    def check(marks, skipped, n):
        assert marks["A"] == ("A", None) and marks["B"] == ("A", "A"), marks
        assert marks["C"] == ("A", "B"), marks

    run_batches(batches, NearDuplicateSettings(), state, check)


class _State:
    def __init__(self):
        self.value = None

    def read(self):
        return self.value

    def write(self, value):
        self.value = value

    def clear(self):
        self.value = None


class _Timer:
    def set(self, when):
        pass


def _skipped_middle(settings):
    """X; W (a paragraph); D = X with W's paragraph appended: a copy of X at 0.66 (left out at
    skip_threshold 0.6), of W at 0.30; E: D reprinted with a number D lacks (a copy, never
    skipped)."""
    from tests.stories.test_stories_streaming import BASE, doc
    x_text, w_text = BASE[0], BASE[2][:220] + " Reporting by the wire desk."
    d_text = x_text + " " + BASE[2][:220]
    return [doc(id_, text, minute) for id_, text, minute in (
        ("X", x_text, 0), ("W", w_text, 1), ("D", d_text, 2),
        ("E", d_text + " Officials said 42 people were hurt.", 3))]


def test_a_band_key_still_holds_a_copy_that_skip_leaves_out():
    """Per band key (Dataflow's layout), action skip: each band key decides alone, before the
    micro-batch does: the two band keys D shares with W but not X find W only, a copy under
    skip_threshold, and hold D; ``decide`` then leaves D out (its best is X). This stays so (a
    band key cannot hear the micro-batch's decision: that would be a cycle in the graph); what a
    later copy names is put right after the band keys (the next test)."""
    from apache_beam.utils.timestamp import Timestamp

    from tests.stories.test_stories_streaming import mb
    from transforms.stories import (
        _MatchPerBand,
        band_keys,
        band_signature,
        decide,
        from_bytes,
        story_rank,
    )
    from transforms.stories.streaming import _AskSources

    settings = NearDuplicateSettings(action="skip", threshold=0.2, skip_threshold=0.6)
    docs = list(next(iter(_AskSources(settings).process(mb(0, 0, _skipped_middle(settings)))))
                .docs[:3])
    match, states = _MatchPerBand(settings), {}

    def ask(batch_docs, bid):
        verdicts = []
        for d in batch_docs:
            for key in band_keys(from_bytes(d.minhash), settings):
                state = states.setdefault(key, _State())
                verdicts += [v for _, v in match.process(
                    (key, (bid, d.id, list(story_rank(d)[:2]),
                           band_signature(d.minhash) + (d.story_facts or b""), d.text_sha256)),
                    timestamp=Timestamp(60), held_state=state,
                    forget=_Timer())]
        return verdicts

    ask(docs[:2], (0, 0, 0))
    verdicts = ask(docs[2:], (60, 0, 1))
    out = decide(mb(60, 1, docs[2:]), verdicts, settings)
    assert out.docs == () and out.near_duplicates == 1  # D is left out as X's copy
    holding = sorted(key for key, state in states.items()
                     if any(entry[0] == "D" for entry in state.value or ()))
    assert holding, "D found W in some band keys and is held there"


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_a_copy_of_a_copy_skip_left_out_names_an_article_with_a_row(state):
    """X, W, D (left out as X's copy), then E (D reprinted) in four micro-batches. Per band key,
    E found D (held where it found W): E named D, which has no row. The step now records that
    skip left D out, as a copy of X, and E names X (similarity unknown: null), in X's story."""
    from tests.stories.test_stories_streaming import mb, run_batches

    settings = NearDuplicateSettings(action="skip", threshold=0.2, skip_threshold=0.6)
    docs = _skipped_middle(settings)
    batches = [mb(60 * i, i, [d]) for i, d in enumerate(docs)]

    def check(marks, skipped, n):
        assert "D" not in marks and skipped == 1, (marks, skipped)
        assert marks["E"] == ("X", "X"), marks

    run_batches(batches, settings, state, check)


# --- a backfill: an earlier day run after a later one ---------------------------------------------

def test_a_day_backfilled_after_a_later_day_finds_that_days_articles_first(tmp_path, texts):
    """incremental.previous_outputs ``dt=*``: 2026-12-02 ran first (a reprint, published on the
    2nd); then 2026-12-01 is backfilled (--input_date, a Scheduler catch-up) with the original,
    published on the 1st. The previous outputs come before the run (docs/output.md, How a copy is
    found: the first article of its story that newsvec saw): the backfilled original is marked the
    reprint's copy, never the other way round, and the reprint's row is not changed."""
    from transforms.settings import IncrementalSettings
    root = str(tmp_path)
    previous = IncrementalSettings(previous_outputs=[f"{root}/out/dt=*"])
    _, first = run(root, [event("reprint", texts[0] + " (AP)", "2026-12-02T09:00:00Z")],
                   day="2026-12-02", incremental=previous)
    _, files = run(root, [event("original", texts[0], "2026-12-01T08:00:00Z")],
                   day="2026-12-01", incremental=previous)
    mark = {row["id"]: row for row in rows_of(files).to_pylist()}["original"]
    assert (mark["story_id"], mark["near_duplicate_of"]) == ("reprint", "reprint"), mark
    reprint = rows_of(first).to_pylist()[0]
    assert (reprint["story_id"], reprint["near_duplicate_of"]) == ("reprint", None)


# --- two versions of one article in a run ---------------------------------------------------------

def test_an_articles_second_version_is_not_skipped_for_its_first_versions_copy(tmp_path, texts):
    """Action skip, two versions of article x in one run (same id and published_at): the first a
    wire reprint of o (a close copy), the second rewritten as another story. ``StoryIndex.mark``
    gave an id marked before its first mark, and SkipCopies looked marks up by id: both versions
    were left out as copies of o, so no version of x was embedded, its new story not either.
    Marks are now by (id, text hash)."""
    rows = [event("o", texts[0], "2026-12-01T08:00:00Z"),
            event("x", texts[0] + " (AP)", "2026-12-01T09:00:00Z"),
            {**event("x", texts[1], "2026-12-01T09:00:00Z"),
             "updated_at": "2026-12-01T11:00:00Z"}]
    summary, files = run(str(tmp_path), rows, near_duplicates=NearDuplicateSettings(action="skip"))
    ids = rows_of(files).column("id").to_pylist()
    assert summary["invariant_holds"]
    assert "x" in ids, (ids, summary["counts"])

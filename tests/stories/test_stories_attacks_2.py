"""Second attacks on same-story marking (transforms/stories.py, pipeline/graph.py): action skip's
rescue of copies whose original the embedder dead-lettered (batch), the streaming band state's
low-byte signatures and what its coder admits. Each test is a sequence that broke an invariant
(open ones are strict xfails); the engine is FAKE."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from tests.common import bbc_file
from tests.fakes import EXIT, FakeEngine
from tests.stories.test_stories_pipeline import event, rows_of
from transforms.settings import NearDuplicateSettings


@pytest.fixture(scope="module")
def texts() -> list[str]:
    with open(bbc_file("test.csv"), newline="", encoding="utf-8") as f:
        return [row["text"] for row in list(csv.DictReader(f))[:2]]


class _FailsPoison(FakeEngine):
    """Fails any call holding the word "poison" (token EXIT of the test model's vocabulary), as a
    poison input would; the embedder then dead-letters the article that carries it."""

    def embed(self, prompts):
        if any(EXIT in p for p in prompts):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().embed(prompts)


def _run_skip(root: str, rows: list[dict]) -> tuple[dict, dict[str, dict]]:
    from pipeline import config as config_lib
    from pipeline.run import run_batch
    from tests.common import make_config
    from tests.output.test_reruns import listing, write_input
    from tests.stories.test_stories_pipeline import OPTIONS
    config = make_config(input=f"{root}/in/dt={{date}}/news.jsonl",
                         output=f"{root}/out/dt={{date}}",
                         near_duplicates=NearDuplicateSettings(action="skip"))
    write_input(root, "in/dt=2026-12-01", rows)
    summary = run_batch(config_lib.fill_date(config, "2026-12-01"), OPTIONS,
                        engine_factory=_FailsPoison)
    table = rows_of(listing(f"{root}/out/dt=2026-12-01")).to_pylist()
    return summary, {row["id"]: row for row in table}


def _short(text: str, words: int = 150) -> str:
    return " ".join(text.split()[:words])


# --- batch, action skip: copies rescued from a dead-lettered original ----------------------------

def test_a_dead_lettered_original_with_two_copies_leaves_its_story_one_row(tmp_path, texts):
    """Action skip: the original fails in the embedder; two close copies were held back. Both are
    embedded after all (RescueCopies passes every copy of the original): the story has two rows,
    though one keeps it (the point of the rescue) and skip promises the others are left out,
    counted ``near_duplicates``. A wire story with thirty reprints whose original fails got thirty
    rows. Every rescued copy is still embedded (one may fail too), then ``KeepOneRescued`` keeps
    the first."""
    text = _short(texts[0])
    rows = [event("o", text + " poison", "2026-12-01T08:00:00Z"),
            event("c1", text, "2026-12-01T09:00:00Z"),
            event("c2", text + " reprinted", "2026-12-01T10:00:00Z")]
    summary, by_id = _run_skip(str(tmp_path), rows)
    counts = summary["counts"]
    assert summary["invariant_holds"] and counts["dead_lettered"] == 1, counts
    assert len(by_id) == 1 and counts["near_duplicates"] == 1, (sorted(by_id), counts)


def test_a_rescued_copy_names_its_dead_lettered_original(tmp_path, texts):
    """docs/output.md: a copy names its original even when the embedder dead-lettered it (then in
    ``dead_letter/``, not in ``vectors/``), in both actions. A rescued copy keeps the mark
    SkipCopies gave it, so the story is findable from the original's dead letter."""
    import json

    from tests.output.test_reruns import listing
    text = _short(texts[0])
    rows = [event("o", text + " poison", "2026-12-01T08:00:00Z"),
            event("c", text, "2026-12-01T09:00:00Z")]
    summary, by_id = _run_skip(str(tmp_path), rows)
    assert set(by_id) == {"c"} and summary["invariant_holds"], (sorted(by_id), summary["counts"])
    assert (by_id["c"]["story_id"], by_id["c"]["near_duplicate_of"]) == ("o", "o")
    letters = [json.loads(line) for name, data in listing(str(tmp_path / "out/dt=2026-12-01"))
               .items() if name.startswith("dead_letter/") for line in data.decode().splitlines()]
    assert [letter["event_id"] for letter in letters] == ["o"]


def test_a_rescued_copy_that_fails_too_balances_the_ledger(tmp_path, texts):
    """The original fails, its rescued copy fails as well (EmbedRescued dead-letters it): both are
    dead letters, none a near duplicate, and the ledger balances (a guard: it held)."""
    text = _short(texts[0])
    rows = [event("o", text + " poison", "2026-12-01T08:00:00Z"),
            event("c", text + " poison again", "2026-12-01T09:00:00Z"),
            event("x", _short(texts[1]), "2026-12-01T09:30:00Z")]
    summary, by_id = _run_skip(str(tmp_path), rows)
    counts = summary["counts"]
    assert set(by_id) == {"x"} and summary["invariant_holds"], (sorted(by_id), counts)
    assert (counts["dead_lettered"], counts["near_duplicates"], counts["written"]) == (2, 0, 1)


def test_a_copy_is_not_rescued_when_its_original_has_a_row(tmp_path, texts):
    """Two versions of article o in one run (a correction): the first embeds, the second fails in
    the embedder. c, a close copy of the first, is held back; the dead letter's id is o, so
    RescueCopies embeds c after all, though o's story has a row: skip writes a copy it promised to
    leave out. RescueCopies now rescues only where the original has no row."""
    text = _short(texts[0])
    rows = [event("o", text, "2026-12-01T08:00:00Z"),
            event("o", text + " correction poison", "2026-12-01T08:00:00Z"),
            event("c", text + " reprinted", "2026-12-01T09:00:00Z")]
    summary, by_id = _run_skip(str(tmp_path), rows)
    counts = summary["counts"]
    assert "o" in by_id and summary["invariant_holds"], (sorted(by_id), counts)
    assert "c" not in by_id and counts["near_duplicates"] == 1, (sorted(by_id), counts)


def test_a_rescued_copy_that_fails_leaves_the_next_one_the_storys_row(tmp_path, texts):
    """The original fails; of its two held-back copies the first (in story order) fails too: the
    second keeps the story's row, and nothing is counted a near duplicate."""
    text = _short(texts[0])
    rows = [event("o", text + " poison", "2026-12-01T08:00:00Z"),
            event("c1", text + " poison", "2026-12-01T09:00:00Z"),
            event("c2", text, "2026-12-01T10:00:00Z")]
    summary, by_id = _run_skip(str(tmp_path), rows)
    counts = summary["counts"]
    assert set(by_id) == {"c2"} and summary["invariant_holds"], (sorted(by_id), counts)
    assert (counts["dead_lettered"], counts["near_duplicates"]) == (2, 0), counts


# --- streaming: what a band key's state holds ------------------------------------------------

@pytest.mark.parametrize("odd", ["rank_none", "full_signature"])
def test_an_odd_held_entry_does_not_stop_the_band_key(odd):
    """HeldStoriesCoder takes a held entry whose rank is None (its own description: "rank in
    micros or None") or whose signature is not ``num_perm`` bytes (a state written before band
    keys held the low bytes: 512 bytes, the full values). Either decodes, then failed the band
    key's step on every retry: ``TypeError: '>=' not supported between 'NoneType' and 'int'``
    (rank) and ``ValueError: operands could not be broadcast together with shapes (128,) (512,)``
    (signature), a streaming job stuck on that key. Such an entry is now passed over
    (signature) or taken as before every article (rank None, as a previous output's in batch)."""
    from transforms.state_coders import HeldStoriesCoder
    from transforms.stories import Rules, _rank_of, band_signature, signatures, to_bytes
    from transforms.stories.streaming import _best_held
    settings = NearDuplicateSettings()
    text = "A wire story, reprinted the same day by many sites across the country. " * 4
    (sig,) = signatures([text], settings)
    short = band_signature(to_bytes(sig))
    entry = {"rank_none": ("a", "a", None, 10**15, short),
             "full_signature": ("a", "a", [5, 0], 10**15, to_bytes(sig))}[odd]
    coder = HeldStoriesCoder()
    held = coder.decode(coder.encode([entry, ("b", "b", [7, 0], 10**15, bytes(len(short)))]))
    mark = _best_held(held, short, (10, 0, "z"), Rules(settings))
    assert sorted(held, key=_rank_of)[0][0] == "a"  # the band key can still sort its entries
    if odd == "rank_none":
        assert mark is not None and mark.near_duplicate_of == "a" and mark.similarity == 1.0
    else:
        assert mark is None
    assert np.frombuffer(short, np.uint8).size == settings.num_perm


# --- streaming: which article comes first ------------------------------------------------------

def _sent(id_, text, published, publish_minute, sha=None):
    import datetime as dt

    from tests.stories.test_stories_streaming import doc
    from transforms.types import Lineage, PreparedDoc
    d = doc(id_, text, 0)
    lineage = Lineage(message_id=f"m-{id_}-{sha}", publish_time=dt.datetime(
        2026, 12, 1, 9, publish_minute, tzinfo=dt.timezone.utc))
    event = d.event.model_copy(update={"published_at": published, "lineage": lineage})
    return PreparedDoc(event=event, text=d.text, text_sha256=sha or id_, token_ids=(101, 102),
                       truncated=False)


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_equal_publish_times_are_ordered_by_published_at(state):
    """Pub/Sub gives the messages of one publish request (or of one millisecond) the same publish
    time. story_rank was (publish time, id): published_at, which the order falls back to without a
    publish time, is not consulted on a tie, so a reprint whose id sorts first ("a-reprint")
    became the original of the wire story ("z-wire") published an hour before it. The rank is now
    (publish time, published_at, id), and the band keys' state keeps both times."""
    import datetime as dt

    from tests.stories.test_stories_streaming import BASE, mb, run_batches
    wire = _sent("z-wire", BASE[1], dt.datetime(2026, 12, 1, 8, tzinfo=dt.timezone.utc), 5)
    reprint = _sent("a-reprint", BASE[1] + " (reprinted)",
                    dt.datetime(2026, 12, 1, 9, tzinfo=dt.timezone.utc), 5)

    def check(marks, skipped, n):
        assert marks["z-wire"] == ("z-wire", None), marks
        assert marks["a-reprint"] == ("z-wire", "z-wire"), marks

    run_batches([mb(0, 0, [wire, reprint])], NearDuplicateSettings(), state, check)


@pytest.mark.parametrize("state", ["per_key", "per_shard"])
def test_streaming_marks_two_versions_of_an_article_each_on_its_own(state):
    """dedup.key text_sha256 lets two versions of article c (different texts) into one
    micro-batch: the first a close copy of x, the second a story of its own. Action skip: the
    second version must be kept. Streaming marked by id (``decide``'s marks, the band requests'
    and verdicts' doc id, ``StoryIndex.mark`` without a version), so the second version took the
    first's mark and was left out as x's copy. Now the text hash is beside the id in the requests,
    verdicts and marks, as in batch."""
    import datetime as dt

    from tests.stories.test_stories_streaming import BASE, mb, run_batches
    at = dt.datetime(2026, 12, 1, 9, tzinfo=dt.timezone.utc)
    x = _sent("x", BASE[0], at, 0)
    c1 = _sent("c", BASE[0] + " (reprinted)", at, 1, sha="c-v1")
    c2 = _sent("c", BASE[2], at, 1, sha="c-v2")

    def check(marks, skipped, n):
        assert skipped == 1, (marks, skipped)  # c's first version only
        assert marks.get("c") == ("c", None), marks  # the second version, a story of its own

    run_batches([mb(0, 0, [x, c1, c2])], NearDuplicateSettings(action="skip"), state, check)


def test_a_copy_of_a_previous_outputs_article_is_not_rescued_by_its_new_version(tmp_path, texts):
    """Day 1 wrote o. Day 2 (incremental.previous_outputs): a new version of o, which fails in the
    embedder, and c, a close copy of day 1's o (so of an article with a row). The dead letter's id
    is o and this run wrote no o, so RescueCopies embedded c after all: skip wrote a copy whose
    original has a row in the previous output. MarkStories now gives out the previous outputs'
    articles a mark names (``PREVIOUS_ORIGINALS``), and such an original rescues nothing."""
    from pipeline import config as config_lib
    from pipeline.run import run_batch
    from tests.common import make_config
    from tests.output.test_reruns import listing, write_input
    from tests.stories.test_stories_pipeline import OPTIONS
    from transforms.settings import IncrementalSettings
    root, text = str(tmp_path), _short(texts[0])
    config = make_config(input=f"{root}/in/dt={{date}}/news.jsonl",
                         output=f"{root}/out/dt={{date}}",
                         near_duplicates=NearDuplicateSettings(action="skip"),
                         incremental=IncrementalSettings(previous_outputs=[f"{root}/out/dt=*"]))
    days = {"2026-12-01": [event("o", text, "2026-12-01T08:00:00Z")],
            "2026-12-02": [event("o", text + " correction poison", "2026-12-01T08:00:00Z"),
                           event("c", text + " reprinted", "2026-12-02T09:00:00Z")]}
    for day, rows in days.items():
        write_input(root, f"in/dt={day}", rows)
        summary = run_batch(config_lib.fill_date(config, day), OPTIONS,
                            engine_factory=_FailsPoison)
    ids = set(rows_of(listing(f"{root}/out/dt=2026-12-02")).column("id").to_pylist())
    counts = summary["counts"]
    assert summary["invariant_holds"] and counts["dead_lettered"] == 1, counts
    assert "c" not in ids and counts["near_duplicates"] == 1, (sorted(ids), counts)

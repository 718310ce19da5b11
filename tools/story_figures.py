"""The parts of ``python -m benchmarks.retrieval --stories`` that decide its figures, kept where
tests can reach them: the copies it mixes into the corpus, the top k collapsed by story (``newsvec
search``'s default: the best row of each story), and the marks counted against which article each
copy was made from."""
from __future__ import annotations

import random

import numpy as np

STRENGTH_NAMES = ("light", "medium", "heavy", "beyond")


def with_copies(texts: list[str], seed: int, share: float, max_copies: int
                ) -> list[tuple[str, str, str, str | None]]:
    """``(id, body, origin id, strength)`` of each article (``bbc-<i>``, its own origin, no
    strength), then of the copies: for a ``share`` of the articles drawn with ``seed``, 1 to
    ``max_copies`` copies each (``<origin>-copy<j>``), at strengths drawn alike."""
    from tools.near_copies import copy_of

    rng = random.Random(seed)
    articles: list[tuple[str, str, str, str | None]] = [
        (f"bbc-{i:05d}", text, f"bbc-{i:05d}", None) for i, text in enumerate(texts)]
    copied = sorted(rng.sample(range(len(texts)), round(share * len(texts))))
    copies = []
    for i in copied:
        for j in range(rng.randint(1, max_copies)):
            strength = rng.choice(STRENGTH_NAMES)
            copies.append((f"bbc-{i:05d}-copy{j}", copy_of(texts[i], strength, rng)[0],
                           f"bbc-{i:05d}", strength))
    return articles + copies


def mark_errors(ids: list[str], stories: list[str], origins: dict[str, str]) -> dict:
    """Marks against the truth (which article each copy was made from): copies left in a story of
    their own or of another copy of their original (split off), copies put in another article's
    story (not their original's marked story), and originals put in another original's story
    (the BBC set holds updated versions of some articles: not all of those are wrong)."""
    story_of = dict(zip(ids, stories, strict=True))
    errors: dict[str, list[str]] = {"copies_missed": [], "copies_split_off": [],
                                    "copies_in_another_story": [], "originals_merged": []}
    for article_id, story in zip(ids, stories, strict=True):
        origin = origins[article_id]
        if origin == article_id:
            if story != article_id:
                errors["originals_merged"].append(f"{article_id} -> {story}")
        elif story == story_of.get(origin, origin):
            continue  # right
        elif story == article_id:
            errors["copies_missed"].append(article_id)
        elif origins.get(story) == origin:  # the story of another copy of its original
            errors["copies_split_off"].append(f"{article_id} -> {story}")
        else:
            errors["copies_in_another_story"].append(f"{article_id} -> {story}")
    return errors


def top_rows(scores: np.ndarray, keys: list[str] | None, k: int) -> list[int]:
    """The columns of the ``k`` best ``scores``; with ``keys``, only the best column of each
    key (collapsed: one row per story)."""
    order = np.argsort(-scores, kind="stable")
    if keys is None:
        return order[:k].tolist()
    seen: set[str] = set()
    top = []
    for column in order.tolist():
        if keys[column] not in seen:
            seen.add(keys[column])
            top.append(column)
            if len(top) == k:
                break
    return top


def story_figures(scores: np.ndarray, truth: list[str], targets: list[str],
                  keys: list[str] | None, k: int) -> dict:
    """Per query row of ``scores``: the distinct true stories among its top ``k`` (collapsed by
    ``keys`` where given) and whether the target's story is first / among them."""
    distinct, at_1, at_k = [], [], []
    for row, target in zip(scores, targets, strict=True):
        stories = [truth[column] for column in top_rows(row, keys, k)]
        distinct.append(len(set(stories)))
        at_1.append(stories[0] == target)
        at_k.append(target in stories)
    return {f"distinct_stories@{k}_mean": float(np.mean(distinct)),
            f"distinct_stories@{k}_min": int(np.min(distinct)),
            f"queries_with_a_story_twice@{k}": float(np.mean(np.array(distinct) < k)),
            "recall@1": float(np.mean(at_1)), f"recall@{k}": float(np.mean(at_k))}


def mark_items(items, settings) -> dict:
    """Marks ``tools.story_sets.Item``s as the batch marks a run of them (``MarkStories``, in
    memory): each source's boilerplate learned over the run, the texts signed without it, then
    marked in ``story_rank`` order. Returns id -> ``StoryMark``."""
    import datetime as dt

    from transforms.stories import find_stories, sign
    from transforms.stories.boilerplate import BlockCounts, id_hash
    from transforms.stories.sign import block_keys

    counts: dict[str, BlockCounts] = {}
    for item in items:
        counts.setdefault(item.source, BlockCounts(settings.boilerplate_min_docs)).add(
            id_hash(item.id), block_keys(item.text, settings))
    cut = {source: table.boilerplate() for source, table in counts.items()}
    signed = sign([item.text for item in items], [cut[item.source] for item in items], settings)
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
    entries = []
    for item, s in zip(items, signed, strict=True):
        when = dt.datetime.fromisoformat(item.published_at.replace("Z", "+00:00"))
        micros = (when - epoch) // dt.timedelta(microseconds=1)
        entries.append(((micros, 0, item.id), item.id, s.minhash, item.id,
                        None if s.facts is None else s.facts.to_bytes()))
    return {key[0]: mark for key, mark in find_stories(entries, [], settings)
            if isinstance(key, tuple)}


def set_figures(items, marks: dict) -> dict:
    """A set's marks against its truth (``Item.story``): copy marks into the right story and into
    another (false merges), real copies found, precision and recall; and, of the marks action
    ``skip`` would leave out, how many, and how many of them wrongly."""
    truth = {item.id: item.story for item in items}
    right = wrong = skippable = skipped_wrongly = 0
    for item in items:
        mark = marks[item.id]
        if not mark.is_copy:
            continue
        ok = truth[mark.near_duplicate_of] == item.story
        right += ok
        wrong += not ok
        if mark.skippable:
            skippable += 1
            skipped_wrongly += not ok
    copies = sum(item.story != item.id for item in items)
    return {"articles": len(items), "real_copies": copies, "copies_found": right,
            "false_merges": wrong, "precision": right / (right + wrong) if right + wrong else None,
            "recall": right / copies if copies else None, "skip_left_out": skippable,
            "skip_left_out_wrongly": skipped_wrongly}

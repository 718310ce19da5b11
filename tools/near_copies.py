"""Copies of news articles as a wire service's customers print them, for the near-duplicate
benchmark and tests (benchmarks/near_duplicates.py, tests/test_stories.py): the headline rewritten,
a byline or wire prefix added, the last paragraphs trimmed, typos made and fixed, whitespace and
full-width forms changed, a few sentences reordered, each at a strength.

``copy_of(text, strength, rng)`` returns the copy and the share of the original's sentences it
keeps. Deterministic for a seeded ``random.Random``.
"""
from __future__ import annotations

import random
import re

STRENGTHS = {
    # name: (share of sentences kept, typos per 1,000 characters, sentences reordered)
    "light": (0.95, 1.0, 0),
    "medium": (0.85, 2.0, 1),
    "heavy": (0.70, 3.0, 2),
    "beyond": (0.50, 4.0, 3),  # below the 70% the targets cover: reported, not targeted
}
PREFIXES = ("LONDON (Reuters) - ", "By Staff Reporter\n", "(AP) ", "NEW YORK, Jan 5 (AFP) - ",
            "Updated 09:14 GMT\n", "EXCLUSIVE: ")
_SENTENCE = re.compile(r"(?<=[.!?。！？])\s*")
_FULL_WIDTH = {c: chr(ord(c) + 0xFEE0) for c in "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"}


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE.split(text) if s.strip()]


def _typo(sentence: str, rng: random.Random) -> str:
    if len(sentence) < 4:
        return sentence
    i = rng.randrange(1, len(sentence) - 2)
    kind = rng.randrange(3)
    if kind == 0:  # swapped letters
        return sentence[:i] + sentence[i + 1] + sentence[i] + sentence[i + 2:]
    if kind == 1:  # a letter dropped
        return sentence[:i] + sentence[i + 1:]
    return sentence[:i] + rng.choice("aeiost") + sentence[i:]  # a letter added


def copy_of(text: str, strength: str, rng: random.Random, *,
            joiner: str = " ") -> tuple[str, float]:
    """A reprint of ``text`` at ``strength`` (``STRENGTHS``) and the share of its sentences kept."""
    keep, typos_per_k, reorders = STRENGTHS[strength]
    parts = sentences(text)
    if len(parts) < 3:
        return rng.choice(PREFIXES) + text, 1.0
    headline = "New headline: " + " ".join(reversed(parts[0].split()[:8]))  # rewritten
    body = parts[1:]
    kept = max(1, round(len(body) * keep))
    body = body[:kept]  # the last paragraphs trimmed
    for _ in range(reorders):  # a sentence moved
        if len(body) > 3:
            i = rng.randrange(len(body))
            body.insert(rng.randrange(len(body)), body.pop(i))
    n_typos = max(1, round(typos_per_k * sum(map(len, body)) / 1000))
    for _ in range(n_typos):
        i = rng.randrange(len(body))
        body[i] = _typo(body[i], rng)
    out = rng.choice(PREFIXES) + headline + "\n" + joiner.join(body)
    if rng.random() < 0.5:  # full-width forms and whitespace
        out = "".join(_FULL_WIDTH.get(c, c) for c in out)
    if rng.random() < 0.5:
        out = out.replace(" ", "  ").replace(". ", ".\n\n")
    return out, (kept + 1) / len(parts)

"""Copies of news articles as a wire service's customers print them, for the near-duplicate
benchmark and tests (benchmarks/near_duplicates.py, tests/stories/test_stories.py): the
headline rewritten, a byline or wire prefix added, the last paragraphs trimmed, typos made and
fixed, whitespace and full-width forms changed, a few sentences reordered, each at a strength.

``copy_of(text, strength, rng)`` returns the copy and the share of the original's sentences it
keeps. Deterministic for a seeded ``random.Random``.
"""
from __future__ import annotations

import random
import re
from typing import Callable, Sequence

STRENGTHS = {
    # name: (share of sentences kept, typos per 1,000 characters, sentences reordered)
    "light": (0.95, 1.0, 0),
    "medium": (0.85, 2.0, 1),
    "heavy": (0.70, 3.0, 2),
    "beyond": (0.50, 4.0, 3),  # below the 70% the targets cover: reported, not targeted
}
PREFIXES = ("LONDON (Reuters) - ", "By Staff Reporter\n", "(AP) ", "NEW YORK, Jan 5 (AFP) - ",
            "Updated 09:14 GMT\n", "EXCLUSIVE: ")
_SENTENCE = re.compile(r"(?<=[.!?。！？])(?!\d)\s*")  # "7.4bn" is no sentence's end
_FULL_WIDTH = {c: chr(ord(c) + 0xFEE0) for c in "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"}
_HALF_WIDTH = {full: half for half, full in _FULL_WIDTH.items()}
_SENTENCE_END = re.compile(r"(?<=[.。])(?!\d)[ ]?")


def sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE.split(text) if s.strip()]


def _typo(sentence: str, rng: random.Random, letters: str = "aeiost") -> str:
    if len(sentence) < 4:
        return sentence
    i = rng.randrange(1, len(sentence) - 2)
    kind = rng.randrange(3)
    if kind == 0:  # swapped letters
        return sentence[:i] + sentence[i + 1] + sentence[i] + sentence[i + 2:]
    if kind == 1:  # a letter dropped
        return sentence[:i] + sentence[i + 1:]
    return sentence[:i] + rng.choice(letters) + sentence[i:]  # a letter added


def rewritten_headline(first: str, rng: random.Random) -> str:
    """The first sentence (the headline and the lead, in the BBC set) as another site words it."""
    return "New headline: " + " ".join(reversed(first.split()[:8]))


def copy_of(text: str, strength: str, rng: random.Random, *, joiner: str = " ",
            prefixes: Sequence[str] = PREFIXES,
            headline: Callable[[str, random.Random], str] = rewritten_headline,
            typo_chars: str = "aeiost") -> tuple[str, float]:
    """A reprint of ``text`` at ``strength`` (``STRENGTHS``) and the share of its sentences kept.

    The first sentence is replaced by ``headline(first, rng)``, a prefix of ``prefixes`` is put
    before it, the typos add letters of ``typo_chars``; half the copies swap full-width and
    half-width digits and capitals (both ways), half change the whitespace (doubled spaces, a
    blank line and an ideographic space after each sentence)."""
    keep, typos_per_k, reorders = STRENGTHS[strength]
    parts = sentences(text)
    if len(parts) < 3:
        return rng.choice(prefixes) + text, 1.0
    new_headline = headline(parts[0], rng)  # rewritten
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
        body[i] = _typo(body[i], rng, typo_chars)
    out = rng.choice(prefixes) + new_headline + "\n" + joiner.join(body)
    if rng.random() < 0.5:  # full-width forms and whitespace
        out = "".join(_FULL_WIDTH.get(c) or _HALF_WIDTH.get(c, c) for c in out)
    if rng.random() < 0.5:
        out = _SENTENCE_END.sub("\n\n\u3000", out.replace(" ", "  "))
    return out, (kept + 1) / len(parts)

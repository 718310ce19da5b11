"""A document's signature and facts, its source's boilerplate cut: what the batch and streaming
marking hold of each article (``Signed``)."""
from __future__ import annotations

import dataclasses
import unicodedata
from typing import Optional

import numpy as np

from transforms.settings import NearDuplicateSettings
from transforms.stories.facts import Facts, numbers
from transforms.stories.signature import (
    band_signature,
    blocks,
    distinct_at_least,
    minhashes,
    shingle,
    to_bytes,
)


@dataclasses.dataclass(frozen=True)
class Signed:
    """A text's signature (``minhash``: uint32 little-endian; None for a text with fewer than
    ``min_shingles`` distinct shingles of its own), its ``Facts`` (None where unsigned) and the
    keys of its blocks (``block_keys``)."""

    minhash: Optional[bytes]
    facts: Optional[Facts]
    block_keys: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.uint64))


CARRIED = 1.5
"""A text up to this many times ``short_chars`` long is kept in its facts: a short text is
compared with one a little longer than short by their words, not taken apart for its length."""


def holds_boilerplate(keys: np.ndarray, boilerplate: Optional[np.ndarray]) -> bool:
    """Whether a text of these block keys holds a block of ``boilerplate``."""
    return boilerplate is not None and bool(np.isin(keys, boilerplate).any())


def block_keys(text: str, settings: NearDuplicateSettings) -> np.ndarray:
    """The keys of ``text``'s blocks (what a source's boilerplate is counted over)."""
    return shingle(text, settings.shingle_chars).block_keys


def sign(texts: list[str], boilerplate: list[Optional[np.ndarray]],
         settings: NearDuplicateSettings) -> list[Signed]:
    """Each text signed without the blocks whose keys its source's ``boilerplate`` holds (sorted
    uint64, or None); its numbers (of the whole text) kept with action ``skip``; where something
    was cut, the low bytes of the whole text's signature too (a skip needs the whole texts that
    close as well: a cut never makes a copy skippable)."""
    shingled = [shingle(text, settings.shingle_chars) for text in texts]
    kept = [s.without(cut) for s, cut in zip(shingled, boilerplate, strict=True)]
    enough = [distinct_at_least(hashes, settings.min_shingles) for hashes in kept]
    cut_any = [h is not s.hashes for h, s in zip(kept, shingled, strict=True)]
    sigs = minhashes([h if ok else h[:0] for h, ok in zip(kept, enough, strict=True)]
                     + [s.hashes for s, cut in zip(shingled, cut_any, strict=True) if cut],
                     settings)
    wholes = iter(sigs[len(texts):])
    out = []
    for text, s, cut, hashes, signature, was_cut in zip(
            texts, shingled, boilerplate, kept, sigs[:len(texts)], cut_any, strict=True):
        whole = next(wholes) if was_cut else None
        if signature is None:
            out.append(Signed(None, None, s.block_keys))
            continue
        carried = _own_units(s, cut) <= CARRIED * settings.short_chars
        normal = unicodedata.normalize("NFKC", _own_text(text, s, cut)) if carried else None
        out.append(Signed(to_bytes(signature), Facts(
            numbers=(numbers(unicodedata.normalize("NFKC", text))
                     if settings.action == "skip" else None),
            short=normal, shingles=int(hashes.size),
            whole=None if whole is None else band_signature(to_bytes(whole))), s.block_keys))
    return out


def _cut_blocks(s, cut: Optional[np.ndarray]) -> np.ndarray:
    if cut is None or not cut.size:
        return np.zeros(s.keys.size, dtype=bool)
    return np.isin(s.keys, cut) & (s.keys != 0)


def _own_units(s, cut: Optional[np.ndarray]) -> int:
    """The length of the blocks not cut (no whitespace; ``WIDE_UNITS`` a CJK character)."""
    return int(s.units[~_cut_blocks(s, cut)].sum())


def _own_text(text: str, s, cut: Optional[np.ndarray]) -> str:
    """``text`` without the blocks cut (its blocks joined by a space)."""
    dropped = _cut_blocks(s, cut)
    if not dropped.any():
        return text
    return " ".join(block for block, drop in zip(blocks(text), dropped, strict=True)
                    if not drop)

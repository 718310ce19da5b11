"""Same-story copies: which article a reprint (a wire story with a new headline, a byline, a
trimmed last paragraph, a fixed typo) is a copy of, so that every row names its story.

One file per part:
- ``signature``: a text's MinHash of its character shingles, its blocks and their keys, LSH band
  keys; ``sign``: a document signed without its source's boilerplate, with its ``facts``;
- ``boilerplate``: the blocks many articles of one source share, counted (``BlockCounts``);
- ``facts``: what a MinHash cannot see (a short text's words, a text's numbers);
- ``index``: the rules of a copy, ``StoryIndex`` (articles held by band key), ``story_rank``;
- ``batch``: ``MarkStories`` and what joins its marks to the rows (``MarkRows``);
- ``skip``: action ``skip``, the copies left out of the embedding, or embedded after all where
  their original failed (``EmbedSkippingCopies``: ``SkipCopies``, ``RescueCopies``,
  ``KeepOneRescued``);
- ``streaming``: ``MarkStoriesStreaming`` (state per source and per band key, or the local
  runner's one state).
How a copy is found, its order and its limits: docs/output.md ("The same story, once").
"""
from transforms.stories.batch import (
    MARKS,
    PREVIOUS_ORIGINALS,
    MarkRows,
    MarkStories,
    find_stories,
    previous_signatures,
    with_mark,
)
from transforms.stories.index import (
    Held,
    Rules,
    StoryIndex,
    StoryMark,
    story_rank,
)
from transforms.stories.sign import Signed, block_keys, sign
from transforms.stories.signature import (
    band_keys,
    band_signature,
    band_similarity,
    from_bytes,
    shingle_hashes,
    shingle_text,
    signature_version,
    signatures,
    similarity,
    to_bytes,
)
from transforms.stories.skip import (
    COPIES_SKIPPED,
    EmbedSkippingCopies,
    KeepOneRescued,
    RescueCopies,
    SkipCopies,
    similarity_band,
)
from transforms.stories.streaming import (
    MarkStoriesStreaming,
    _MatchPerBand,
    _rank_of,
    decide,
)

__all__ = [
    "COPIES_SKIPPED", "EmbedSkippingCopies", "MARKS", "PREVIOUS_ORIGINALS", "Held",
    "KeepOneRescued", "MarkRows", "MarkStories", "MarkStoriesStreaming", "RescueCopies",
    "Rules", "Signed", "SkipCopies", "StoryIndex", "StoryMark", "_MatchPerBand", "_rank_of",
    "band_keys", "band_signature", "band_similarity", "block_keys", "decide", "find_stories",
    "from_bytes", "previous_signatures", "shingle_hashes", "shingle_text", "sign",
    "signature_version", "signatures", "similarity", "similarity_band", "story_rank",
    "to_bytes", "with_mark",
]

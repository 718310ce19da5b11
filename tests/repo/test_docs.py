"""The docs hold what the code defines, and every link inside them leads somewhere.

- The Parquet schema tables of docs/output.md are generated from ``transforms/output/parquet.py``
  (as the config table of docs/configuration.md is from the config schema:
  tests/end_to_end/test_cli.py).
- (tests/repo/test_docs_names.py: every code name written in backticks exists.)
- Every relative link in README.md and docs/**/*.md names a file that exists and, with an
  ``#anchor``, a heading of that file (GitHub's anchors).
"""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from transforms.output.parquet import PARQUET_COLUMNS, schema_markdown

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, every character but letters,
    digits, marks, '_', '-' and spaces dropped, spaces made '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    return "".join("-" if ch == " " else ch for ch in text.lower()
                   if ch in " -_" or unicodedata.category(ch)[0] in "LMN")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file; a repeated one gets -1, -2... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(path.read_text()):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(path: Path) -> list[str]:
    """The link targets of a Markdown file that point inside the repository."""
    targets = []
    for line in _prose_lines(path.read_text()):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            if not _SCHEME.match(target) and not target.startswith("//"):
                targets.append(target)
    return targets


def test_slug_follows_github():
    assert slug("Run summary (`_summary.json`)") == "run-summary-_summaryjson"
    assert slug("Chunks: long articles, whole (`chunking.mode: chunks`)") == \
        "chunks-long-articles-whole-chunkingmode-chunks"
    assert slug("Capacity planning (one L4)") == "capacity-planning-one-l4"
    assert slug("`make test`") == "make-test"


@pytest.mark.parametrize("folder", sorted(PARQUET_COLUMNS))
def test_output_docs_hold_the_generated_schema_table(folder):
    output = (REPO / "docs" / "output.md").read_text()
    assert schema_markdown(PARQUET_COLUMNS[folder]) in output, \
        f"docs/output.md's {folder}/ table is generated: paste " \
        f"transforms.output.parquet.schema_markdown(PARQUET_COLUMNS[{folder!r}]) between its " \
        "markers"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {linked.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_pages_are_found():
    names = {page.relative_to(REPO).as_posix() for page in PAGES}
    assert {"README.md", "docs/output.md", "docs/configuration.md"} <= names
    assert any(relative_links(page) for page in PAGES)

"""Hostile text against normal text: what one field costs PrepareText, per character.
``python -m benchmarks.hostile_text [--chars 200000] [--repeats 5]``.

Each field is the body of one article of ``--chars`` characters (200,000: ``text.max_text_chars``'s
default), prepared by PrepareText's DoFn as a pipeline runs it (``process``: normalization, then
the head's tokens and the unknown-token count), with the model of configs/local.yaml:
- ``normal``: BBC articles (../shared/data/bbc-news) joined by spaces, cut to the length: one line
  with the BBC's real mojibake (``Â£``), the kind of text PrepareText's fast paths were built for;
- the constructions of the security review that are quadratic in Python 3.11.7's ``html.parser``
  (tags, attribute values and end tags that never close) and ``unicodedata.normalize`` (combining
  marks of alternating classes), the markup declarations that repeat (``<!``, ``<![``, ``<?``,
  comments, CDATA, doctypes), and the marks again as entities and as Latin-1 mojibake (which ftfy
  decodes, then normalizes);
- ``CJK, one line``: Chinese characters with no line break (normal text in a language without
  spaces; its mojibake check reads every character: given for information, not a hostile field).

Reports the median CPU time (this process, all threads) of ``--repeats`` runs, per character, for
the whole of ``process`` and for normalization alone, and each field's ratio to ``normal``; the
worst ratio of a hostile field is the figure to hold within 10x. Writes
``bench-results/hostile_text-<time>.json``.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time

from benchmarks import write_results
from pipeline.config import REPO_ROOT

BBC = REPO_ROOT.parent / "shared" / "data" / "bbc-news"
MARKS = "\u0301\u0316"  # combining acute (class 230) and grave below (220): alternating classes


def bbc_text(chars: int) -> str:
    bodies: list[str] = []
    for split in ("train", "val", "test"):
        with open(BBC / f"{split}.csv", encoding="utf-8") as f:
            bodies += [row["text"] for row in csv.DictReader(f)]
    text = " ".join(bodies)
    while len(text) < chars:
        text += " " + text
    return text[:chars]


def fields(n: int) -> dict[str, str]:
    """Name -> a field of about ``n`` characters."""
    import random

    rng = random.Random(7)
    hanzi = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    return {
        "normal": bbc_text(n),
        "unclosed tags '<a'": "<a" * (n // 2),
        "unclosed attribute '<a b=\"'": '<a b="' * (n // 6),
        "end tags '</'": "</" * (n // 2),
        "declarations '<!'": "<!" * (n // 2),
        "marked sections '<!['": "<![" * (n // 3),
        "processing instructions '<?'": "<?" * (n // 2),
        "comments '<!--'": "<!--" * (n // 4),
        "CDATA '<![CDATA['": "<![CDATA[" * (n // 9),
        "doctypes '<!DOCTYPE'": "<!DOCTYPE" * (n // 9),
        "combining marks": "a" + MARKS * (n // 2),
        "combining marks as entities": "a" + "&#769;&#790;" * (n // 12),
        "combining marks as mojibake": ("a" + MARKS * (n // 4)).encode("utf-8").decode("latin-1"),
        "CJK, one line": "".join(rng.choice(hanzi) for _ in range(n)),
    }


def cpu_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chars", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    from pipeline.config import load
    from transforms.schema import NewsEvent
    from transforms.text import _PrepareTextFn, normalize_text

    if not BBC.is_dir():
        print(f"the BBC articles are not at {BBC}", file=sys.stderr)
        return 2
    config = load(REPO_ROOT / "configs" / "local.yaml")
    fn = _PrepareTextFn(config.model, max_text_chars=10 * args.chars,
                        dead_letter_payload_bytes=4096)
    fn.setup()
    rows = []
    print(f"{'field':34} {'chars':>8} {'prepare us/char':>16} {'normalize us/char':>18} "
          f"{'ratio':>7}  outcome")
    base = None
    for name, text in fields(args.chars).items():
        event = NewsEvent(id="bench", body=text)
        outputs = list(fn.process([event]))  # warm, and the outcome
        out = outputs[0]
        outcome = getattr(getattr(out, "value", None), "reason", None) or \
            f"row, {len(out.text):,} chars"
        prepare = cpu_seconds(lambda e=event: list(fn.process([e])), args.repeats)

        def normalize(t=text):
            try:
                normalize_text(t)
            except Exception:  # noqa: BLE001 -- '<![' makes html.parser raise: prepare_failed
                pass

        norm = cpu_seconds(normalize, args.repeats)
        per_char = prepare / len(text) * 1e6
        base = base or per_char
        row = {"field": name, "chars": len(text), "prepare_s": prepare,
               "prepare_us_per_char": per_char, "normalize_s": norm,
               "normalize_us_per_char": norm / len(text) * 1e6, "ratio_to_normal": per_char / base,
               "outcome": str(outcome)}
        rows.append(row)
        print(f"{name:34} {len(text):8,} {per_char:16.3f} {row['normalize_us_per_char']:18.3f} "
              f"{row['ratio_to_normal']:7.2f}  {outcome}")
    hostile = [r for r in rows if r["field"] not in ("normal", "CJK, one line")]
    worst = max(hostile, key=lambda r: r["ratio_to_normal"])
    print(f"worst hostile field: {worst['field']}, {worst['ratio_to_normal']:.2f}x a normal "
          f"article's cost per character (goal: within 10x)")
    path = write_results({"chars": args.chars, "repeats": args.repeats, "rows": rows,
                          "worst": worst["field"], "worst_ratio": worst["ratio_to_normal"],
                          "python": sys.version.split()[0]}, "bench-results", "hostile_text")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

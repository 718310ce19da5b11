"""Hostile text against normal text: what one field costs PrepareText, per character.
``python -m benchmarks.hostile_text [--chars 200000] [--repeats 3] [--modes head,chunks]``.

Each field is the body of one article of ``--chars`` characters (200,000: ``text.max_text_chars``'s
default, which is also the limit the DoFn is given), prepared by PrepareText's DoFn as a pipeline
runs it (``process``: normalization, tokenization, in chunks mode the chunks, and the unknown-token
count), with the model of configs/local.yaml, in head mode and in chunks mode (with
``sentence_end_slack_tokens`` 16, whose sentence-end check once read back over quotes):
- ``normal``: BBC articles (../shared/data/bbc-news) joined by spaces, cut to the length: one line
  with the BBC's real mojibake (``Â£``), the kind of text PrepareText's fast paths were built for;
  the same in NFKC for the fields prepared in NFKC;
- markup: the constructions of the security review that are quadratic in Python 3.11.7's
  ``html.parser`` (tags, attribute values and end tags that never close) and the markup
  declarations that repeat (``<!``, ``<![``, ``<?``, comments, CDATA, doctypes);
- combining marks: alternating classes (quadratic in ``unicodedata.normalize``), as entities, as
  Latin-1 mojibake (which ftfy decodes, then normalizes), and in runs that soft hyphens split;
- ftfy: mojibake that renews itself at each repair step (quadratic in ftfy), and many short lines,
  each of which ftfy fixes on its own (the same line again and again, and distinct lines);
- tokenization: words of up to 100 characters (WordPiece reads such a word again for each of its
  tokens) between punctuation or spaces, with and without the tokenizer's unknown token; a text
  with nowhere to cut its head (one word); NFKC's long expansions (U+3316, U+FDFA);
- chunks: a text of nothing but quotes (the sentence-end check);
- ``CJK, one line``: Chinese characters with no line break (normal text in a language without
  spaces: given for information, not a hostile field).

Reports the median CPU time (this thread) of ``--repeats`` runs, per character, for the whole of
``process`` and for normalization alone, each field's ratio to the normal article of its mode (and
Unicode form), and the outcome (a row and its length, or the dead letter's reason). The worst ratio
of a hostile field per mode is the figure to hold within 10x. Writes
``bench-results/hostile_text-<time>.json``.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import os
import statistics
import string
import sys
import time
from pathlib import Path

from benchmarks import SMOKE_HELP
from pipeline.config import REPO_ROOT
from tools.bench_results import write_results

BBC = Path(os.environ.get("NEWSVEC_BBC_DIR") or REPO_ROOT.parent / "shared" / "data" / "bbc-news")
MARKS = "\u0301\u0316"  # combining acute (class 230) and grave below (220): alternating classes
KATAKANA_WORD = "\u30ad\u30ed\u30e1\u30fc\u30c8\u30eb" * 16  # NFKC of U+3316 * 16: 96 characters
INFORMATION = ("normal", "CJK, one line")  # not hostile fields


def bbc_text(chars: int) -> str:
    bodies: list[str] = []
    for split in ("train", "val", "test"):
        with open(BBC / f"{split}.csv", encoding="utf-8") as f:
            bodies += [row["text"] for row in csv.DictReader(f)]
    text = " ".join(bodies)
    while len(text) < chars:
        text += " " + text
    return text[:chars]


def fields(n: int) -> dict[str, tuple[str, str]]:
    """Name -> (a field of ``n`` characters, the Unicode form it is prepared in)."""
    import random

    rng = random.Random(7)
    hanzi = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]

    def repeat(unit: str) -> str:
        return (unit * (n // len(unit) + 1))[:n]

    distinct = itertools.product(string.ascii_letters + string.digits, repeat=3)
    distinct_lines = "".join("\x80" + "".join(c) + "\n" for c in distinct)[:n]
    texts = {
        "normal": repeat(bbc_text(n)),
        "unclosed tags '<a'": repeat("<a"),
        "unclosed attribute '<a b=\"'": repeat('<a b="'),
        "end tags '</'": repeat("</"),
        "declarations '<!'": repeat("<!"),
        "marked sections '<!['": repeat("<!["),
        "processing instructions '<?'": repeat("<?"),
        "comments '<!--'": repeat("<!--"),
        "unclosed comments, then '>' '<!-- >'": repeat("<!-- >"),
        "CDATA '<![CDATA['": repeat("<![CDATA["),
        "doctypes '<!DOCTYPE'": repeat("<!DOCTYPE"),
        "combining marks": ("a" + MARKS * n)[:n],
        "combining marks as entities": ("a" + "&#769;&#790;" * n)[:n],
        "combining marks as mojibake": ("a" + MARKS * n).encode("utf-8").decode("latin-1")[:n],
        "marks split by soft hyphens": ("a" + repeat(MARKS * 15 + "\u00ad"))[:n],
        "mojibake chain 'Ã' + 'ƒ'*n + '©'": "\u00c3" + "\u0192" * (n - 2) + "\u00a9",
        "mojibake chain 'Ξ' + '\\x9e'*n": "\u039e" + "\x9e" * (n - 1),
        "lines of C1 '\\x80\\n'": repeat("\x80\n"),
        "lines of a curly quote '’\\n'": repeat("\u2019\n"),
        "distinct lines of C1 '\\x80xyz\\n'": distinct_lines,
        "long words, Arabic comma": repeat("\u3042" * 100 + "\u060c"),
        "long words, Armenian comma (unknown)": repeat("\u3042" * 100 + "\u055d"),
        "long katakana words, Armenian comma": repeat(KATAKANA_WORD + "\u055d"),
        "long katakana words, spaces": repeat(KATAKANA_WORD + " "),
        "katakana, one word": repeat(KATAKANA_WORD),
        "quotes '\"'": repeat('"'),
        "CJK, one line": "".join(rng.choice(hanzi) for _ in range(n)),
    }
    forms = {name: "NFC" for name in texts}
    texts["NFKC: U+3316 * 16 + Armenian comma"] = repeat("\u3316" * 16 + "\u055d")
    texts["NFKC: U+FDFA"] = repeat("\ufdfa")
    texts["normal, NFKC"] = texts["normal"]
    forms.update(dict.fromkeys(["NFKC: U+3316 * 16 + Armenian comma", "NFKC: U+FDFA",
                                "normal, NFKC"], "NFKC"))
    return {name: (text, forms[name]) for name, text in texts.items()}


def cpu_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chars", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="head,chunks")
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.chars, args.repeats = 2000, 1

    from pipeline.config import load
    from transforms.settings import ChunkingSettings
    from transforms.text import normalize_text
    from transforms.text.prepare import _PrepareTextFn
    from transforms.types import NewsEvent

    if not BBC.is_dir():
        print(f"the BBC articles are not at {BBC}", file=sys.stderr)
        return 2
    config = load(REPO_ROOT / "configs" / "local.yaml")
    rows: list[dict] = []
    worst = {}
    for mode in args.modes.split(","):
        chunking = ChunkingSettings(mode=mode, sentence_end_slack_tokens=16)
        fns = {}
        for form in ("NFC", "NFKC"):
            fns[form] = _PrepareTextFn(config.model, max_text_chars=args.chars,
                                       dead_letter_payload_bytes=4096, chunking=chunking,
                                       unicode_form=form)
            fns[form].setup()
        print(f"\n{mode} mode\n{'field':40} {'chars':>8} {'prepare us/char':>16} "
              f"{'normalize us/char':>18} {'ratio':>7}  outcome")
        base: dict[str, float] = {}
        for name, (text, form) in sorted(fields(args.chars).items(),
                                         key=lambda item: not item[0].startswith("normal")):
            fn = fns[form]
            event = NewsEvent(id="bench", body=text)
            out = list(fn.process([event]))[0]  # warm (the tokenizer's tables), and the outcome
            reason = getattr(getattr(out, "value", None), "reason", None)
            outcome = (str(reason.value) if reason is not None else
                       f"row, {len(out.text):,} chars" + (f", {len(out.chunks)} chunks"
                                                          if out.chunks else ""))
            prepare = cpu_seconds(lambda e=event, f=fn: list(f.process([e])), args.repeats)

            def normalize(t=text, f=form):
                try:
                    normalize_text(t, f, max_chars=args.chars)
                except Exception:  # noqa: BLE001 -- '<![' makes html.parser raise: prepare_failed
                    pass

            norm = cpu_seconds(normalize, args.repeats)
            per_char = prepare / len(text) * 1e6
            base.setdefault(form, per_char)  # the normal article of this form comes first
            row = {"mode": mode, "field": name, "form": form, "chars": len(text),
                   "prepare_s": prepare, "prepare_us_per_char": per_char, "normalize_s": norm,
                   "normalize_us_per_char": norm / len(text) * 1e6,
                   "ratio_to_normal": per_char / base[form], "outcome": outcome}
            rows.append(row)
            print(f"{name:40} {len(text):8,} {per_char:16.3f} "
                  f"{row['normalize_us_per_char']:18.3f} {row['ratio_to_normal']:7.2f}  {outcome}",
                  flush=True)
        hostile = [r for r in rows if r["mode"] == mode
                   and not r["field"].startswith(INFORMATION)]
        worst[mode] = max(hostile, key=lambda r: r["ratio_to_normal"])
        print(f"worst hostile field in {mode} mode: {worst[mode]['field']}, "
              f"{worst[mode]['ratio_to_normal']:.2f}x a normal article's cost per character "
              f"(goal: within 10x)")
    path = write_results({"chars": args.chars, "repeats": args.repeats, "rows": rows,
                          "worst": {mode: (r["field"], r["ratio_to_normal"])
                                    for mode, r in worst.items()},
                          "python": sys.version.split()[0]}, args.results, "hostile_text")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

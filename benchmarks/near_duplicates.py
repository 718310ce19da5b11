"""Same-story copies (transforms/stories/): how well "is a copy of" is marked, what a signature
costs on the CPU, and what the streaming state holds per story.
``python -m benchmarks.near_duplicates [--copies 400] [--ja-copies 3] [--cpu-articles 2000]``.

1. Precision and recall, per edit strength (tools/near_copies.STRENGTHS: light, medium, heavy keep
   at least 70% of the text; beyond keeps about half, reported, not targeted), on two sets:
   - BBC: the articles of train.csv (``NEWSVEC_BBC_DIR``) in order, then ``--copies`` reprints of
     randomly chosen ones per strength (tools/near_copies.copy_of: headline rewritten, wire prefix
     or byline, last sentences trimmed, typos, full-width forms, whitespace, sentences moved).
     Negatives: every other article, those of the same category among them (their pairs are
     reported apart). The BBC set holds real duplicates (the same article twice, or reworded
     slightly): pairs of originals whose exact shingle Jaccard (12 characters) is at least
     ``--real-duplicate`` count as copies (a true positive when marked, a false negative when not);
     any other original marked a copy is a false positive.
   - Japanese: the 40 articles of tools/japanese_stories.py (eight topics of five: the negatives
     share a topic), then ``--ja-copies`` reprints of each per strength.
   Each strength is marked apart (the originals, then that strength's copies, with ``StoryIndex``
   as the batch marks them; never two copies of one original in one index, so that a copy is
   measured against the originals, not against a sibling with the same edits); a copy is right
   when its story is its original's. Precision: right
   copy marks over all copy marks (the originals' false ones included); recall: right copies over
   copies (the real duplicates included for BBC). Then a sweep of shingle_chars x threshold.
2. CPU per article at 2,000-character articles (BBC text cut to length): ``signatures()`` in
   batches of 100, in one process and in two (multiprocessing, fork), wall and CPU time; beside
   it datasketch's MinHash (if installed) and rensa fed a Python string per shingle.
3. State per held story in streaming: one entry per band, each holding the article's id, its
   story's id, its rank, its expiry and its signature, encoded with
   ``transforms.state_coders.HeldStoriesCoder`` (computed from the fields where it is absent).
   Then the cost of one micro-batch in the band step against ``--held`` stories held, as
   benchmarks/dedup.py measures the dedup state: ``_MatchPerBand``'s own methods against a
   MODELED state store (tools/dedup_state_model.py); a million stories are not materialized
   (about 7 GB of encoded state, more as Python objects).

Writes ``bench-results/near_duplicates-<time>.json``.
"""
from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
import random
import statistics
import time
from collections import Counter
from typing import Optional

import numpy as np

from benchmarks import SMOKE_HELP
from benchmarks.batch import BBC
from pipeline.config import REPO_ROOT
from tools import japanese_stories
from tools.bench_results import write_results
from tools.near_copies import STRENGTHS, copy_of
from transforms.settings import NearDuplicateSettings
from transforms.stories import (
    StoryIndex,
    from_bytes,
    shingle_hashes,
    shingle_text,
    sign,
    signatures,
)

TARGETED = ("light", "medium", "heavy")  # copies keeping at least 70% of the text
SWEEP_SHINGLES = (9, 12, 16, 24)
SWEEP_THRESHOLDS = (0.3, 0.35, 0.4, 0.5)


# -- the sets -------------------------------------------------------------------------------------

class Corpus:
    """Originals (id, text, group) in marking order, and per strength the copies (text, original
    id, share of sentences kept)."""

    def __init__(self, name: str):
        self.name = name
        self.originals: list[tuple[str, str, str]] = []
        self.copies: dict[str, list[tuple[str, str, float]]] = {s: [] for s in STRENGTHS}
        self.real_pairs: set[tuple[str, str]] = set()  # (later, earlier) originals
        self.real_pair_jaccard: list[float] = []


def bbc_corpus(copies: int, seed: int, limit: Optional[int] = None) -> Corpus:
    """The articles of train.csv (its first ``limit``), then ``copies`` per strength."""
    corpus = Corpus("bbc")
    with open(BBC / "train.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:limit]
    for i, row in enumerate(rows):
        corpus.originals.append((f"bbc-{i:05d}", row["text"], row.get("category") or
                                 row.get("label") or ""))
    rng = random.Random(seed)
    for strength in STRENGTHS:
        for _ in range(copies):
            i = rng.randrange(len(rows))
            text, kept = copy_of(rows[i]["text"], strength, rng)
            corpus.copies[strength].append((text, f"bbc-{i:05d}", kept))
    return corpus


def japanese_corpus(copies: int, seed: int) -> Corpus:
    corpus = Corpus("japanese")
    for i, article in enumerate(japanese_stories.ARTICLES):
        corpus.originals.append((f"ja-{i:02d}", japanese_stories.text(article), article.topic))
    rng = random.Random(seed)
    for strength in STRENGTHS:
        for _ in range(copies):
            for i, article in enumerate(japanese_stories.ARTICLES):
                text, kept = japanese_stories.copy(article, strength, rng)
                corpus.copies[strength].append((text, f"ja-{i:02d}", kept))
    return corpus


def exact_jaccard(a: str, b: str, k: int = 12) -> float:
    x, y = np.unique(shingle_hashes(a, k)), np.unique(shingle_hashes(b, k))
    if not x.size or not y.size:
        return 0.0
    both = np.intersect1d(x, y, assume_unique=True).size
    return both / (x.size + y.size - both)


def find_real_duplicates(corpus: Corpus, floor: float) -> list[dict]:
    """Pairs of originals whose exact 12-character shingle Jaccard is at least ``floor``: every
    pair whose estimated similarity (128 values) reaches 0.15 is checked exactly."""
    sigs = np.stack(signatures([t for _, t, _ in corpus.originals], NearDuplicateSettings()))
    found = []
    for j in range(1, len(sigs)):
        est = (sigs[:j] == sigs[j]).mean(axis=1)
        for i in np.nonzero(est >= 0.15)[0]:
            jac = exact_jaccard(corpus.originals[i][1], corpus.originals[j][1])
            if jac >= floor:
                found.append({"later": corpus.originals[j][0], "earlier": corpus.originals[i][0],
                              "exact_jaccard": round(jac, 3), "estimated": round(float(est[i]), 3),
                              "same_group": corpus.originals[i][2] == corpus.originals[j][2]})
    corpus.real_pairs = {(p["later"], p["earlier"]) for p in found}
    return found


# -- quality --------------------------------------------------------------------------------------

def evaluate(corpus: Corpus, settings: NearDuplicateSettings,
             sigs: Optional[dict] = None) -> dict:
    """Marks the originals, then each strength's copies apart; the counts of section 1."""
    if sigs is None:
        sigs = signature_table(corpus, settings)
    originals_sig = sigs["originals"]
    group = {i: g for i, _, g in corpus.originals}
    # the originals alone, once: the same for every strength
    index = StoryIndex(settings)
    original_marks = {oid: index.mark(oid, sig, facts=facts)
                      for (oid, _, _), sig, facts in zip(corpus.originals, originals_sig,
                                                         sigs["facts"]["originals"], strict=True)}
    story = {oid: m.story_id for oid, m in original_marks.items()}
    # real duplicates: a pair's later article in the earlier one's story is right
    real_later = {later for later, _ in corpus.real_pairs}
    original_tp = original_fp = 0
    fp_same_group = 0
    fp_pairs = []
    for oid, mark in original_marks.items():
        if not mark.is_copy:
            continue
        if oid in real_later and any(story.get(e) == mark.story_id
                                     for l_, e in corpus.real_pairs if l_ == oid):
            original_tp += 1
        else:
            original_fp += 1
            fp_same_group += group[oid] == group[mark.near_duplicate_of]
            fp_pairs.append((oid, mark.near_duplicate_of, mark.similarity))
    real_found = sum(1 for later in real_later if original_marks[later].is_copy)
    out: dict = {"originals": len(corpus.originals), "real_duplicate_pairs": len(corpus.real_pairs),
                 "real_duplicates_marked": real_found,
                 "originals_marked_wrongly": original_fp, "wrong_same_group": fp_same_group,
                 "wrong_pairs": fp_pairs[:10], "strengths": {}}
    for strength, copies in corpus.copies.items():
        right = wrong = missed = skippable = skipped_wrongly = 0
        sims = []
        wrong_examples = []
        # each copy is marked against the originals, not against another copy of its original
        # (siblings share their edits): the copies go in rounds holding one copy per original
        rounds: dict[str, int] = Counter()
        by_round: dict[int, list[int]] = {}
        for n, (_, original, _) in enumerate(copies):
            by_round.setdefault(rounds[original], []).append(n)
            rounds[original] += 1
        for members in by_round.values():
            round_index = _copy_index(index)
            # a copy missed starts a story of its own, which is its original's story: a copy of
            # a real duplicate of that original joining it is right
            missed_story: dict[str, str] = {}
            for n in members:
                original, sig = copies[n][1], sigs[strength][n]
                mark = round_index.mark(f"copy-{strength}-{n}", sig,
                                        facts=sigs["facts"][strength][n])
                if not mark.is_copy:
                    missed += 1
                    missed_story[mark.story_id] = story[original]
                elif missed_story.get(mark.story_id, mark.story_id) == story[original]:
                    right += 1
                    skippable += mark.skippable
                    sims.append(mark.similarity)
                else:
                    wrong += 1
                    skipped_wrongly += mark.skippable
                    wrong_examples.append((original, mark.near_duplicate_of, mark.similarity))
        marked = right + wrong + original_tp + original_fp
        out["strengths"][strength] = {
            "copies": len(copies), "right": right, "wrong_story": wrong, "missed": missed,
            "skip_left_out": skippable, "skip_left_out_wrongly": skipped_wrongly,
            "recall": right / len(copies) if copies else None,
            "precision": (right + original_tp) / marked if marked else None,
            "median_similarity": statistics.median(sims) if sims else None,
            "wrong_examples": wrong_examples[:10],
            "share_kept": statistics.mean(k for _, _, k in copies) if copies else None}
    targeted = [out["strengths"][s] for s in TARGETED]
    right = sum(s["right"] for s in targeted)
    wrong = sum(s["wrong_story"] for s in targeted)
    copies_n = sum(s["copies"] for s in targeted)
    out["targeted"] = {
        "copies": copies_n, "recall": (right + real_found) / (copies_n + len(real_later)),
        "precision": (right + original_tp) / (right + wrong + original_tp + original_fp),
        "wrong_story": wrong}
    return out


def _copy_index(index: StoryIndex) -> StoryIndex:
    """A StoryIndex holding what ``index`` holds (the originals), to mark one strength's copies."""
    clone = StoryIndex(index._settings)  # noqa: SLF001 - a benchmark's shortcut
    clone._by_band = {k: list(v) for k, v in index._by_band.items()}  # noqa: SLF001
    clone._held = dict(index._held)  # noqa: SLF001
    clone._marks = dict(index._marks)  # noqa: SLF001
    return clone


def signature_table(corpus: Corpus, settings: NearDuplicateSettings) -> dict:
    """Per part of the corpus ("originals", each strength), its texts' signatures (as the batch
    signs them: ``transforms.stories.sign``, no source, so nothing is cut) and, under "facts",
    their facts."""
    parts = {"originals": [t for _, t, _ in corpus.originals],
             **{strength: [t for t, _, _ in copies] for strength, copies in corpus.copies.items()}}
    table: dict = {"facts": {}}
    for name, texts in parts.items():
        signed = sign(texts, [None] * len(texts), settings)
        table[name] = [None if s.minhash is None else from_bytes(s.minhash) for s in signed]
        table["facts"][name] = [s.facts for s in signed]
    return table


def same_group_negatives(corpus: Corpus, settings: NearDuplicateSettings, sigs: dict) -> dict:
    """Pairs of originals of one group (category, topic) that are not real duplicates: how many,
    their largest estimated similarity and how many reach the threshold."""
    by_group: dict[str, list[int]] = {}
    for n, (_, _, g) in enumerate(corpus.originals):
        by_group.setdefault(g, []).append(n)
    pairs = at_threshold = 0
    largest = 0.0
    real = corpus.real_pairs | {(b, a) for a, b in corpus.real_pairs}
    for members in by_group.values():
        m = np.stack([sigs["originals"][n] for n in members])
        for j in range(1, len(members)):
            est = (m[:j] == m[j]).mean(axis=1)
            for i in range(j):
                if (corpus.originals[members[j]][0], corpus.originals[members[i]][0]) in real:
                    continue
                pairs += 1
                largest = max(largest, float(est[i]))
                at_threshold += est[i] >= settings.threshold
    return {"pairs": pairs, "largest_similarity": largest, "at_threshold": int(at_threshold)}


def streaming_estimates(corpus: Corpus, settings: NearDuplicateSettings, sigs: dict) -> dict:
    """The streaming state compares ``band_signature``s (the low byte of each value) with
    ``band_similarity``: per strength, the share of copies whose estimate against their original
    reaches the threshold, with the full signature and with the band signature; and the same-group
    negative pairs (not real duplicates) that reach it, both ways."""
    from transforms.stories import band_signature, band_similarity, similarity, to_bytes

    def short(sig):
        return np.frombuffer(band_signature(to_bytes(sig)), dtype=np.uint8)

    index = {oid: n for n, (oid, _, _) in enumerate(corpus.originals)}
    originals = sigs["originals"]
    out: dict = {"recall": {}}
    for strength, copies in corpus.copies.items():
        full = band = 0
        for (_, origin, _), sig in zip(copies, sigs[strength], strict=True):
            o = originals[index[origin]]
            full += similarity(sig, o) >= settings.threshold
            band += band_similarity(short(sig), short(o)) >= settings.threshold
        n = max(len(copies), 1)
        out["recall"][strength] = {"full": full / n, "band": band / n}
    real = corpus.real_pairs | {(b, a) for a, b in corpus.real_pairs}
    shorts = [short(sig) for sig in originals]
    by_group: dict[str, list[int]] = {}
    for n, (_, _, g) in enumerate(corpus.originals):
        by_group.setdefault(g, []).append(n)
    full_hits = band_hits = pairs = 0
    for members in by_group.values():
        for j in range(1, len(members)):
            for i in range(j):
                a, b = members[i], members[j]
                if (corpus.originals[b][0], corpus.originals[a][0]) in real:
                    continue
                pairs += 1
                full_hits += similarity(originals[a], originals[b]) >= settings.threshold
                band_hits += band_similarity(shorts[a], shorts[b]) >= settings.threshold
    out["negatives"] = {"pairs": pairs, "full": int(full_hits), "band": int(band_hits)}
    return out


def print_quality(name: str, result: dict) -> None:
    print(f"\n{name}: {result['originals']} originals; real duplicate pairs "
          f"{result['real_duplicate_pairs']} (marked {result['real_duplicates_marked']}); "
          f"originals marked a copy wrongly: {result['originals_marked_wrongly']} "
          f"({result['wrong_same_group']} of the same group)")
    print(f"  {'strength':<8} {'kept':>5} {'copies':>6} {'recall':>7} {'precision':>9} "
          f"{'wrong':>5} {'missed':>6} {'median sim':>10}")
    for strength, s in result["strengths"].items():
        print(f"  {strength:<8} {s['share_kept']:>5.2f} {s['copies']:>6} {s['recall']:>7.3f} "
              f"{s['precision']:>9.3f} {s['wrong_story']:>5} {s['missed']:>6} "
              f"{s['median_similarity'] or 0:>10.3f}")
    t = result["targeted"]
    print(f"  keeping >= 70% (light+medium+heavy): recall {t['recall']:.3f}, precision "
          f"{t['precision']:.3f} (targets 0.90, 0.95)")


def sweep(corpora: list[Corpus]) -> list[dict]:
    rows = []
    print("\nsweep: recall / precision on copies keeping >= 70%, recall beyond, originals marked "
          "wrongly")
    print(f"  {'k':>3} {'threshold':>9}  " + "  ".join(
        f"{c.name + ' R≥70':>10} {'P':>6} {'R beyond':>8} {'wrong':>5}" for c in corpora))
    for k in SWEEP_SHINGLES:
        base = NearDuplicateSettings(shingle_chars=k)
        tables = {c.name: signature_table(c, base) for c in corpora}
        for threshold in SWEEP_THRESHOLDS:
            settings = NearDuplicateSettings(shingle_chars=k, threshold=threshold,
                                             skip_threshold=max(0.7, threshold))
            row: dict = {"shingle_chars": k, "threshold": threshold}
            cells = []
            for c in corpora:
                r = evaluate(c, settings, tables[c.name])
                row[c.name] = {"recall_70": round(r["targeted"]["recall"], 4),
                               "precision_70": round(r["targeted"]["precision"], 4),
                               "recall_beyond": round(r["strengths"]["beyond"]["recall"], 4),
                               "originals_marked_wrongly": r["originals_marked_wrongly"],
                               "copies_wrong_story": r["targeted"]["wrong_story"]}
                cells.append(f"{row[c.name]['recall_70']:>10.3f} "
                             f"{row[c.name]['precision_70']:>6.3f} "
                             f"{row[c.name]['recall_beyond']:>8.3f} "
                             f"{row[c.name]['originals_marked_wrongly']:>5}")
            rows.append(row)
            print(f"  {k:>3} {threshold:>9.2f}  " + "  ".join(cells), flush=True)
    return rows


# -- the review's sets: boilerplate and flashes --------------------------------------------------

def review_sets() -> dict:
    """Each set of tools/story_sets.py (footers, headers and "About" paragraphs around briefs and
    headlines, in English and Japanese; flash pairs of different facts and of the same story),
    marked as the batch marks a run of it (tools/story_figures.mark_items: each source's
    boilerplate learned over the set), with action ``mark`` and ``skip``."""
    from tools import story_sets
    from tools.story_figures import mark_items, set_figures

    out = {}
    for name, make in story_sets.SETS.items():
        items = make(story_sets.BBC_DIR)
        out[name] = {action: set_figures(items, mark_items(
            items, NearDuplicateSettings(action=action))) for action in ("mark", "skip")}
    return out


def print_review_sets(sets: dict) -> None:
    print("\nthe review's sets (boilerplate and flashes), defaults, as the batch marks each set: "
          "articles, real copies found, false merges (a copy marked into another story), "
          "precision, recall; action skip: left out (of them wrongly)")
    for name, r in sets.items():
        m, k = r["mark"], r["skip"]
        precision = "-" if m["precision"] is None else f"{m['precision']:.3f}"
        recall = "-" if m["recall"] is None else f"{m['recall']:.3f}"
        print(f"  {name:<20} {m['articles']:>4} {m['copies_found']:>3}/{m['real_copies']:<3} "
              f"false merges {m['false_merges']:>2}  P {precision:>5}  R {recall:>5}  skip left "
              f"out {k['skip_left_out']:>2} ({k['skip_left_out_wrongly']} wrongly)")


# -- CPU ------------------------------------------------------------------------------------------

def articles_of_length(n: int, chars: int) -> list[str]:
    with open(BBC / "train.csv", encoding="utf-8") as f:
        stream = " ".join(row["text"] for row in csv.DictReader(f))
    while len(stream) < n * chars:
        stream += " " + stream
    return [stream[i * chars:(i + 1) * chars] for i in range(n)]


_SETTINGS = NearDuplicateSettings()


def _signature_batch(texts: list[str]) -> tuple[int, float]:
    start = time.process_time()
    out = signatures(texts, _SETTINGS)
    return len(out), time.process_time() - start


def cpu_signatures(texts: list[str], processes: int, batch: int = 100, repeats: int = 3) -> dict:
    """Wall and CPU time per article of ``signatures()`` in batches of ``batch``, the best of
    ``repeats`` passes (the machine is shared: the best pass is the least disturbed)."""
    batches = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    walls, cpus = [], []
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        pool.map(_signature_batch, batches[:processes])  # warm
        for _ in range(repeats):
            start = time.perf_counter()
            if processes == 1:
                results = [_signature_batch(b) for b in batches]
            else:
                results = pool.map(_signature_batch, batches, chunksize=1)
            walls.append(time.perf_counter() - start)
            cpus.append(sum(c for _, c in results))
    return {"processes": processes, "articles": len(texts), "repeats": repeats,
            "wall_ms_per_article": 1000 * min(walls) / len(texts),
            "wall_ms_per_article_all": [round(1000 * w / len(texts), 4) for w in walls],
            "cpu_ms_per_article": 1000 * min(cpus) / len(texts),
            "load_average": os.getloadavg()[0]}


def cpu_step(texts: list[str], sources: int = 8, batch: int = 100) -> dict:
    """One process, CPU µs per article of the batch marking's own work, in its order: each text
    signed whole (``Sign``), its block keys counted per source (``LearnBoilerplate``) and the
    texts holding their source's boilerplate signed again without it (``CutBoilerplate``), then
    all marked on one worker (``FindStories``); the articles spread over ``sources`` sources."""
    from transforms.stories import find_stories
    from transforms.stories.boilerplate import LearnBoilerplate
    from transforms.stories.sign import holds_boilerplate

    settings = _SETTINGS
    ids = [f"a{i:06d}" for i in range(len(texts))]
    source = [f"s{i % sources}" for i in range(len(texts))]
    start = time.process_time()
    whole = []  # Sign: each text signed whole, with its block keys
    for i in range(0, len(texts), batch):
        whole += sign(texts[i:i + batch], [None] * len(texts[i:i + batch]), settings)
    signing = time.process_time()
    learn = LearnBoilerplate(settings.boilerplate_min_docs)  # BlockKeys, LearnBoilerplate
    tables: dict = {}
    for id_, signed, src in zip(ids, whole, source, strict=True):
        learn.add_input(tables.setdefault(src, learn.create_accumulator()),
                        (id_, signed.block_keys))
    cut = {src: learn.extract_output(table) for src, table in tables.items()}
    again = 0
    for i, (signed, src) in enumerate(zip(whole, source, strict=True)):  # CutBoilerplate
        if holds_boilerplate(signed.block_keys, cut[src]):
            (whole[i],) = sign([texts[i]], [cut[src]], settings)
            again += 1
    learned = time.process_time()
    entries = [((i, 0, id_), id_, s.minhash, id_,
                None if s.facts is None else s.facts.to_bytes())
               for i, (id_, s) in enumerate(zip(ids, whole, strict=True))]
    for _ in find_stories(entries, [], settings):  # FindStories
        pass
    done = time.process_time()
    n = len(texts)
    return {"sign_us": 1e6 * (signing - start) / n, "learn_us": 1e6 * (learned - signing) / n,
            "mark_us": 1e6 * (done - learned) / n, "total_us": 1e6 * (done - start) / n,
            "boilerplate_blocks": int(sum(c.size for c in cut.values())),
            "signed_again": again}


def graph_cpu(runs: int, repeat: int = 2, limit: Optional[int] = None,
              running_mode: str = "multi_processing") -> dict:
    """The batch graph (FnApiRunner, 2 SDK workers, one per core) over the BBC articles (the
    first ``limit``; ``repeat`` copies, each its own ids, 8 sources) with a FREE engine that costs
    nothing (benchmarks/feed.py), ``near_duplicates.enabled`` false and true, alternated ``runs``
    times: wall ms per article of each run and the medians. The marking's cost is the
    difference. ``running_mode``: FnApiRunner's (a smoke run's threads start no processes)."""
    import json
    import tempfile
    from pathlib import Path

    from apache_beam.options.pipeline_options import PipelineOptions

    from benchmarks.batch import bbc_texts
    from benchmarks.feed import ModeledEngineFactory
    from pipeline.config import load
    from pipeline.run import run_batch

    texts = bbc_texts(limit)
    work = Path(tempfile.mkdtemp(prefix="newsvec-stories-graph-"))
    events = work / "events.jsonl"
    with open(events, "w", encoding="utf-8") as f:
        for copy in range(repeat):
            for i, text in enumerate(texts):
                f.write(json.dumps({"id": f"bbc-{copy}-{i:05d}", "body": text,
                                    "source": f"source-{i % 8}"}) + "\n")
    n = len(texts) * repeat
    config = load(str(REPO_ROOT / "configs" / "local.yaml"))
    options = PipelineOptions(["--runner=FnApiRunner", "--direct_num_workers=2",
                               f"--direct_running_mode={running_mode}"])
    walls: dict[str, list[float]] = {"off": [], "on": []}
    for run in range(runs):
        for name in ("off", "on"):
            stories = config.near_duplicates.model_copy(update={"enabled": name == "on"})
            run_config = config.model_copy(update={
                "input": str(events), "output": str(work / f"out-{name}-{run}"),
                "near_duplicates": stories})
            start = time.perf_counter()
            run_batch(run_config, options, engine_factory=ModeledEngineFactory(
                None, 0.0, str(work / "engine.log")))
            walls[name].append(1000 * (time.perf_counter() - start) / n)
            print(f"  graph run {run + 1}, near_duplicates {name}: {walls[name][-1]:.3f} ms "
                  "wall per article", flush=True)
    off, on = statistics.median(walls["off"]), statistics.median(walls["on"])
    return {"articles": n, "runs": runs, "wall_ms_per_article": walls, "off_ms": off,
            "on_ms": on, "marking_ms": on - off, "load_average": os.getloadavg()[0]}


def cpu_parts(texts: list[str]) -> dict:
    """One process: the numpy shingle hashes alone, and the whole of signatures()."""
    start = time.process_time()
    for t in texts:
        shingle_hashes(t, _SETTINGS.shingle_chars)
    hashing = time.process_time() - start
    return {"shingle_hashes_cpu_ms_per_article": 1000 * hashing / len(texts)}


def _string_shingles(text: str, k: int) -> list[str]:
    folded = shingle_text(text)
    return [folded[i:i + k] for i in range(max(1, len(folded) - k + 1))]


def cpu_alternatives(texts: list[str]) -> dict:
    """One process, CPU ms per article: rensa with a Python str per shingle, and datasketch."""
    import rensa

    k, perm, seed = _SETTINGS.shingle_chars, _SETTINGS.num_perm, _SETTINGS.seed
    out: dict = {}
    start = time.process_time()
    for t in texts:
        m = rensa.RMinHash(perm, seed)
        m.update(_string_shingles(t, k))
        m.digest()
    out["rensa_str_shingles_cpu_ms_per_article"] = 1000 * (time.process_time() - start) / len(texts)
    start = time.process_time()
    rensa.RMinHash.digest_matrix_from_token_sets([_string_shingles(t, k) for t in texts], perm,
                                                 seed)
    out["rensa_str_shingles_matrix_cpu_ms_per_article"] = \
        1000 * (time.process_time() - start) / len(texts)
    try:
        from datasketch import MinHash  # optional: only to compare, never a dependency
    except ImportError:
        out["datasketch"] = "not installed"
        return out
    from importlib import metadata
    start = time.process_time()
    for t in texts:
        m = MinHash(num_perm=perm, seed=seed)
        m.update_batch([s.encode("utf-8") for s in _string_shingles(t, k)])
        m.digest()
    out["datasketch_cpu_ms_per_article"] = 1000 * (time.process_time() - start) / len(texts)
    out["datasketch"] = metadata.version("datasketch")
    return out


# -- state ----------------------------------------------------------------------------------------

_VERSION = "0123456789abcdef"  # what a held entry keeps of its text's hash (16 hex)


def _long_facts(settings: NearDuplicateSettings) -> bytes:
    """The facts of a long article (no text kept; numbers with action skip: 20 of them)."""
    from transforms.stories.facts import Facts

    numbers = tuple(range(20)) if settings.action == "skip" else None
    return Facts(numbers=numbers, shingles=1400).to_bytes()


def state_size(settings: NearDuplicateSettings) -> dict:
    """Bytes per held story in the streaming state: ``bands`` entries, each with the article's
    id, its story's id, its rank and expiry, its band signature, its version and its facts (a
    long article's; a short one's also holds its text, up to ``short_chars`` x 1.5)."""
    from transforms.state_coders import HeldStoriesCoder
    from transforms.stories import band_signature

    article_id, story_id = "reuters-2026-12-07-0001234", "reuters-2026-12-07-0001200"
    signature = band_signature(np.arange(settings.num_perm, dtype=np.uint32).tobytes())
    rank, expiry = [1_796_000_000_000_000, 1_795_999_000_000_000], 1_796_600_000_000_000
    facts = _long_facts(settings)
    entry = (article_id, story_id, rank, expiry, signature, _VERSION, facts)
    coder = HeldStoriesCoder()
    one = len(coder.encode([entry]))
    two = len(coder.encode([entry] * 2))
    per_story = settings.bands * (two - one)
    return {"bands": settings.bands, "signature_bytes": len(signature),
            "facts_bytes": len(facts), "coder": "HeldStoriesCoder", "encoded_one_entry": one,
            "encoded_per_added_entry": two - one, "encoded_bytes_per_story": per_story,
            "gb_per_million_stories": per_story * 1_000_000 / 1e9}


class _LazyHeld:
    """Held story i (the oldest first) of the modeled band state: its signature and band keys,
    its cells built the first time it is asked for."""

    def __init__(self, settings, store, coder, facts: bytes, t0: int, horizon: int,
                 per_batch: int):
        self._settings, self._coder, self._facts = settings, coder, facts
        self._cells = store.cells[("match", "held")]
        self._timers = store.timers[("match", "forget")]
        self._t0, self._horizon, self._per_batch = t0, horizon, per_batch
        self._built: dict[int, tuple[np.ndarray, list[str]]] = {}

    def story(self, i: int) -> tuple[np.ndarray, list[str]]:
        from transforms.stories import band_keys, band_signature

        if i not in self._built:
            settings = self._settings
            sig = np.random.default_rng(i).integers(0, 2**32, settings.num_perm,
                                                    dtype=np.uint32)
            keys = band_keys(sig, settings)
            expiry = self._t0 + 1 + i // self._per_batch
            entry = (f"held-{i:09d}", f"held-{i:09d}", [expiry - self._horizon, 0], expiry,
                     band_signature(sig.astype("<u4").tobytes()), _VERSION, self._facts)
            for key in keys:
                self._cells[key] = self._coder.encode([entry])
                self._timers[key] = expiry
            self._built[i] = (sig, keys)
        return self._built[i]


def streaming_micro_batches(settings: NearDuplicateSettings, held_counts: list[int],
                            docs: int = 100, batches: int = 7) -> list[dict]:
    """The band step of ``MarkStoriesStreaming`` (``_MatchPerBand``: one request per document and
    band key, and the timers that forget) against a MODELED state store
    (tools/dedup_state_model.py: each cell encoded bytes, decoded on read and encoded on write
    with ``HeldStoriesCoder``), in a steady state of ``held`` stories, each in its ``bands``
    cells. Each micro-batch: 90% new articles, 10% copies of held ones; then the watermark
    forgets as many of the oldest as it added. Signatures are random values (those of distinct
    texts are); a copy keeps 60% of its original's values. A held story's cells are built when
    first touched (a copy of it, its forgetting), outside the timing: a request reads its own
    cells only, so cells no request reads are not built (a million stories would be 32 million
    cells, about 8 GB)."""
    from apache_beam.utils.timestamp import Timestamp

    from tools.dedup_state_model import ModeledStateStore
    from transforms.stories import _MatchPerBand, band_keys, band_signature

    facts = _long_facts(settings)
    rows = []
    for held in held_counts:
        store = ModeledStateStore()
        fn = _MatchPerBand(settings)
        coder = _MatchPerBand.HELD.coder
        cells, timers = store.cells[("match", "held")], store.timers[("match", "forget")]
        t0 = 1_796_000_000_000_000
        horizon = int(settings.horizon_s * 1_000_000)
        new_per_batch = docs - docs // 10
        lazy = _LazyHeld(settings, store, coder, facts, t0, horizon, new_per_batch)
        story = lazy.story
        rng = np.random.default_rng(held)
        first = 0  # the oldest story held
        times, decoded, encoded = [], [], []
        for b in range(batches):
            now = t0 + horizon + (b + 1) * 1_000_000
            requests = []
            for j in range(docs):
                if j < new_per_batch:
                    sig = rng.integers(0, 2**32, settings.num_perm, dtype=np.uint32)
                else:  # a copy of a held story
                    sig = story(int(rng.integers(first + held // 2, first + held)))[0].copy()
                    changed = rng.random(sig.size) < 0.4
                    sig[changed] = rng.integers(0, 2**32, int(changed.sum()), dtype=np.uint32)
                doc_id = f"new-{b:03d}-{j:04d}"
                packed = band_signature(sig.astype("<u4").tobytes()) + facts
                requests += [(key, (b, doc_id, [now, 0], packed, doc_id))
                             for key in band_keys(sig, settings)]
            oldest = [story(i)[1] for i in range(first, first + new_per_batch)]
            fired = Timestamp(micros=t0 + 1 + (first + new_per_batch - 1) // new_per_batch)
            dec0, enc0 = store.bytes_decoded, store.bytes_encoded
            start = time.process_time()
            for request in requests:
                store.call("match", fn.process, request[0], request, Timestamp(micros=now))
            for keys in oldest:
                for key in keys:
                    if timers.get(key, 1 << 62) <= fired.micros:
                        store.call("match", fn.forget, key, None, fired)
            times.append(time.process_time() - start)
            decoded.append(store.bytes_decoded - dec0)
            encoded.append(store.bytes_encoded - enc0)
            first += new_per_batch  # what this batch held replaces the oldest
        rows.append({"stories_held": held, "docs": docs,
                     "cpu_ms_per_micro_batch": 1000 * statistics.median(times),
                     "bytes_decoded": statistics.median(decoded),
                     "bytes_encoded": statistics.median(encoded),
                     "cells_built": len(cells)})
    return rows


def local_micro_batches(settings: NearDuplicateSettings, held_counts: list[int],
                        docs: int = 100, batches: int = 7) -> list[dict]:
    """The local runner's layout (``_MarkLocally``): one micro-batch of ``docs`` 2,000-character
    articles (90% new, 10% copies of the previous micro-batch's) against ``held`` stories held
    in its in-memory index (random signatures), its state through the MODELED state store, the
    process warm (the index found by its token, as between the micro-batches of one local run).
    CPU ms per micro-batch (signing included) and the bytes it encodes."""
    import datetime as dt
    import random

    from apache_beam.utils.timestamp import Timestamp

    from tools.dedup_state_model import ModeledStateStore
    from transforms.stories.index import Held
    from transforms.stories.streaming import _LOCAL, _Local, _MarkLocally
    from transforms.types import MicroBatch, NewsEvent, PreparedDoc

    texts = articles_of_length(docs * batches, 2000)
    t0 = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)
    rows = []
    for held in held_counts:
        rng = np.random.default_rng(held)
        local = _Local(settings)
        expiry = 1_796_600_000_000_000
        for i in range(held):
            sig = rng.integers(0, 2**32, settings.num_perm, dtype=np.uint32)
            local.index.hold(Held(f"held-{i:09d}", f"held-{i:09d}", sig, (i, 0, f"h{i}"),
                                  _VERSION, None, expiry))
        local.index.take_added()
        store = ModeledStateStore()
        name = f"bench-{held}"
        _LOCAL[name] = local
        store.cells[("local", "token")][0] = _MarkLocally.TOKEN.coder.encode(f"{name}:0")
        store.cells[("local", "forget_at")][0] = _MarkLocally.FORGET_AT.coder.encode(1 << 60)
        fn = _MarkLocally(settings)
        times, encoded = [], []
        previous: list[str] = []
        chooser = random.Random(held)
        for b in range(batches):
            batch_docs = []
            for j in range(docs):
                text = texts[b * docs + j]
                if j >= docs - docs // 10 and previous:
                    text = "(AP) " + chooser.choice(previous)
                when = t0 + dt.timedelta(minutes=b, seconds=j)
                event = NewsEvent(id=f"new-{b}-{j}", body=text, source=f"s{j % 8}",
                                  published_at=when)
                batch_docs.append(PreparedDoc(event=event, text=text, text_sha256=f"{b}-{j}",
                                              token_ids=(101, 102), truncated=False))
            previous = [d.text for d in batch_docs[:docs - docs // 10]]
            batch = MicroBatch(window_start_us=0, window_end_us=60_000_000, pane=0, shard=0,
                               shards=1, docs=tuple(batch_docs), messages_in=docs)
            enc0 = store.bytes_encoded
            start = time.process_time()
            store.call("local", fn.process, 0, (0, batch),
                       Timestamp(seconds=1_796_000_000 + 60 * b))
            times.append(time.process_time() - start)
            encoded.append(store.bytes_encoded - enc0)
        del _LOCAL[name]
        rows.append({"stories_held": held, "docs": docs,
                     "cpu_ms_per_micro_batch": 1000 * statistics.median(times),
                     "bytes_encoded": statistics.median(encoded)})
        print(f"  local layout, {held:>9,} held: {rows[-1]['cpu_ms_per_micro_batch']:.1f} ms CPU "
              f"per micro-batch, {rows[-1]['bytes_encoded']:,.0f} B encoded", flush=True)
    return rows


# -- docs/benchmarks.md's rows --------------------------------------------------------------------

def _machine() -> str:
    from tools.bench_results import machine

    m = machine()
    cpu = (m["cpu"] or "CPU not noted").replace("(R)", "").replace(" Processor", "")
    cpu = " ".join(cpu.split()[:3]) if "EPYC" in cpu else cpu
    return f"{cpu}, {m['cores']} vCPU"


def table_figures(f: dict, argv) -> dict:
    """The figures docs/benchmarks.md shows, keyed by the table's wording."""
    import datetime as dt

    # the time, not the day: of two runs on one day, the later is the table's
    today = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    command = "python -m benchmarks.near_duplicates" + (" " + " ".join(argv) if argv else "")
    bbc, ja, cpu, state = f["bbc"], f["japanese"], f["cpu"], f["state"]

    def row(value: str, target=None, met=None) -> dict:
        return {"value": value, "target": target, "met": met, "machine": _machine(),
                "measured": today, "command": command}

    def pr(r: dict) -> tuple[str, bool]:
        t = r["targeted"]
        return (f"{t['precision']:.3f}; {t['recall']:.3f}",
                t["precision"] >= 0.95 and t["recall"] >= 0.90)

    strengths = bbc["strengths"]
    rows = {}
    value, met = pr(bbc)
    rows["BBC copies keeping ≥ 70% of the text, defaults: precision; recall"] = row(
        value, "≥ 0.95; ≥ 0.90", "yes" if met else "no")
    value, met = pr(ja)
    rows["Japanese set, copies keeping ≥ 70%: precision; recall"] = row(
        value, "≥ 0.95; ≥ 0.90", "yes" if met else "no")
    rows["BBC recall per strength, light / medium / heavy / beyond (text kept " + " / ".join(
        f"{strengths[s]['share_kept']:.2f}" for s in STRENGTHS) + ")"] = row(
        " / ".join(f"{strengths[s]['recall']:.3f}" for s in STRENGTHS))
    rows["BBC originals: real duplicates (exact Jaccard ≥ 0.5) marked; others marked a copy"] = \
        row(f"{bbc['real_duplicates_marked']} of {bbc['real_duplicate_pairs']}; "
            f"{bbc['originals_marked_wrongly']} of {bbc['originals']:,}")
    est = bbc["streaming_estimates"]
    rows["BBC, streaming's band signatures (low byte) against full: copies at the threshold, "
         "heavy / beyond; same-category negatives at it"] = row(
        f"{est['recall']['heavy']['band']:.3f} / {est['recall']['beyond']['band']:.3f} against "
        f"{est['recall']['heavy']['full']:.3f} / {est['recall']['beyond']['full']:.3f}; "
        f"{est['negatives']['band']} against {est['negatives']['full']} of "
        f"{est['negatives']['pairs']:,}")
    one, two = cpu["one_process"], cpu["two_processes"]
    rows["signatures() per 2,000-character article: CPU; wall (best of 3), 1 process / 2 "
         "processes"] = row(
        f"{1000 * one['cpu_ms_per_article']:.0f} µs; {1000 * one['wall_ms_per_article']:.0f} µs "
        f"/ {1000 * two['wall_ms_per_article']:.0f} µs", "≤ 100 µs on 2 cores",
        "yes" if two["wall_ms_per_article"] <= 0.1 else
        ("by CPU time (the machine was shared)" if one["cpu_ms_per_article"] <= 0.2 else "no"))
    if "datasketch_cpu_ms_per_article" in cpu:
        rows["CPU per article: rensa fed a str per shingle; datasketch MinHash"] = row(
            f"{1000 * cpu['rensa_str_shingles_cpu_ms_per_article']:.0f} µs; "
            f"{1000 * cpu['datasketch_cpu_ms_per_article']:,.0f} µs")
    step = cpu["step"]
    rows["the batch marking's own work per 2,000-character article, one process (sign; learn "
         "the boilerplate and cut it; mark)"] = row(
        f"{step['total_us']:.0f} µs ({step['sign_us']:.0f}; {step['learn_us']:.0f}; "
        f"{step['mark_us']:.0f})", "≤ 100 µs", "yes" if step["total_us"] <= 100 else "no")
    if "graph" in cpu:
        g = cpu["graph"]
        rows[f"the batch graph with a FREE engine, {g['articles']:,} BBC articles, 2 SDK "
             "workers: wall ms per article, marking off / on (median of "
             f"{g['runs']})"] = row(
            f"{g['off_ms']:.3f} / {g['on_ms']:.3f}: marking {g['marking_ms']:.3f} ms",
            "≤ 0.1 ms", "yes" if g["marking_ms"] <= 0.1 else "no")
    if "skip" in bbc and "skip" in ja:
        wrongly = sum(c["skip"][s]["wrongly"] for c in (bbc, ja) for s in STRENGTHS)
        rows["action skip: copies left out, BBC light / medium / heavy / beyond; Japanese "
             "light / medium / heavy / beyond; of them into another story"] = row(
            " / ".join(f"{bbc['skip'][s]['left_out']}" for s in STRENGTHS) + " of "
            f"{bbc['skip']['light']['copies']} each; " + " / ".join(
                f"{ja['skip'][s]['left_out']}" for s in STRENGTHS) + " of "
            f"{ja['skip']['light']['copies']} each; {wrongly}")
    sets = f.get("review_sets") or {}
    if sets:
        merges = sum(r["mark"]["false_merges"] for r in sets.values())
        wrong_skips = sum(r["skip"]["skip_left_out_wrongly"] for r in sets.values())
        rows["the review's sets (footers, headers, About paragraphs, flashes; English and "
             "Japanese): articles merged into another story; skips of another story"] = row(
            f"{merges}; {wrong_skips} of {sum(r['mark']['articles'] for r in sets.values()):,}",
            "0", "yes" if merges == 0 and wrong_skips == 0 else "no")
    per_story = state["encoded_bytes_per_story"]
    rows[f"streaming state per held story ({state['bands']} bands, encoded)"] = row(
        f"{per_story:,} B ({state['gb_per_million_stories']:.1f} GB per million)")
    batches = state.get("micro_batches") or []
    if len(batches) >= 2:
        low, high = batches[0], batches[-1]
        rows[f"streaming band step, micro-batch of 100: CPU ms at {low['stories_held']:,} / "
             f"{high['stories_held']:,} stories held (MODELED state store)"] = row(
            f"{low['cpu_ms_per_micro_batch']:.0f} / {high['cpu_ms_per_micro_batch']:.0f} ms "
            f"(×{high['cpu_ms_per_micro_batch'] / low['cpu_ms_per_micro_batch']:.2f})", "≤ 2×",
            "yes" if high["cpu_ms_per_micro_batch"] <= 2 * low["cpu_ms_per_micro_batch"]
            else "no")
        per_article = high["cpu_ms_per_micro_batch"] / 100
        rows["streaming band step: CPU per article (32 state cells read and written, MODELED "
             "state store)"] = row(f"{per_article:.2f} ms", "≤ 0.1 ms",
                                   "yes" if per_article <= 0.1 else "no")
    local = state.get("local_micro_batches") or []
    if len(local) >= 2:
        low, high = local[0], local[-1]
        rows[f"local runner's layout, micro-batch of 100 (signing included): CPU ms at "
             f"{low['stories_held']:,} / {high['stories_held']:,} stories held"] = row(
            f"{low['cpu_ms_per_micro_batch']:.0f} / {high['cpu_ms_per_micro_batch']:.0f} ms "
            f"(×{high['cpu_ms_per_micro_batch'] / low['cpu_ms_per_micro_batch']:.2f})", "flat",
            "yes" if high["cpu_ms_per_micro_batch"] <= 2 * low["cpu_ms_per_micro_batch"]
            else "no")
    return rows


# -- main -----------------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.near_duplicates",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=400, help="BBC copies per strength")
    parser.add_argument("--ja-copies", type=int, default=3,
                        help="reprints of each Japanese article per strength")
    parser.add_argument("--real-duplicate", type=float, default=0.5,
                        help="exact 12-character shingle Jaccard from which two BBC originals "
                             "are the same article")
    parser.add_argument("--cpu-articles", type=int, default=2000)
    parser.add_argument("--chars", type=int, default=2000, help="characters per CPU article")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--held", type=int, nargs="+", default=[1000, 50_000, 1_000_000],
                        help="stories held in the per band key state (cells built when touched)")
    parser.add_argument("--local-held", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                        help="stories held in the local runner's in-memory index")
    parser.add_argument("--graph-runs", type=int, default=3,
                        help="runs of the batch graph with marking off and on (0: none)")
    parser.add_argument("--seed", type=int, default=40)
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true",
                        help=SMOKE_HELP + "; 200 BBC originals, the graph over 64 articles "
                        "with its SDK workers in threads")
    args = parser.parse_args(argv)
    originals = graph_articles = None
    if args.smoke:
        args.copies, args.ja_copies, args.cpu_articles, args.graph_runs = 4, 1, 200, 1
        args.held, args.local_held, originals, graph_articles = [100, 1000], [100, 1000], 200, 64
    settings = NearDuplicateSettings()
    print(f"defaults: shingle_chars {settings.shingle_chars}, num_perm {settings.num_perm}, "
          f"{settings.bands} bands x {settings.band_rows} rows, threshold {settings.threshold}")
    figures: dict = {"settings": settings.model_dump(mode="json"), "strengths": STRENGTHS,
                     "real_duplicate_floor": args.real_duplicate}

    bbc = bbc_corpus(args.copies, args.seed, originals)
    ja = japanese_corpus(args.ja_copies, args.seed)
    real = find_real_duplicates(bbc, args.real_duplicate)
    ja_real = find_real_duplicates(ja, args.real_duplicate)
    jaccards = sorted(p["exact_jaccard"] for p in real)
    print(f"BBC train.csv: {len(real)} pairs of originals with exact Jaccard >= "
          f"{args.real_duplicate} (real duplicates, counted as copies): "
          f"{sum(p['exact_jaccard'] >= 0.99 for p in real)} identical, "
          f"{sum(p['same_group'] for p in real)} within one category; Jaccards "
          f"{jaccards[:5]} ... ; Japanese: {len(ja_real)}")
    figures["bbc_real_duplicates"] = real
    for corpus in (bbc, ja):
        sigs = signature_table(corpus, settings)
        result = evaluate(corpus, settings, sigs)
        result["same_group_negatives"] = same_group_negatives(corpus, settings, sigs)
        # exact Jaccard of a sample of copies, per strength: what the estimate estimates
        result["copy_exact_jaccard_median"] = {
            s: statistics.median(exact_jaccard(t, dict((i, x) for i, x, _ in corpus.originals)[o])
                                 for t, o, _ in copies[:100])
            for s, copies in corpus.copies.items()}
        result["streaming_estimates"] = streaming_estimates(corpus, settings, sigs)
        figures[corpus.name] = result
        print_quality(corpus.name, result)
        est = result["streaming_estimates"]
        print("  streaming (band signatures, the low byte of each value): copies at the threshold "
              "per strength, full / band: " + ", ".join(
                  f"{s} {v['full']:.3f} / {v['band']:.3f}" for s, v in est["recall"].items())
              + f"; same-group negatives at it: {est['negatives']['full']} / "
                f"{est['negatives']['band']} of {est['negatives']['pairs']:,}")
        neg = result["same_group_negatives"]
        print(f"  same-group negative pairs: {neg['pairs']:,}, largest estimated similarity "
              f"{neg['largest_similarity']:.3f}, at the threshold {neg['at_threshold']}; "
              "exact Jaccard of copies, median per strength: " + ", ".join(
                  f"{s} {v:.2f}" for s, v in result["copy_exact_jaccard_median"].items()))
        if result["wrong_pairs"]:
            print(f"  originals marked wrongly (id, of, similarity): {result['wrong_pairs']}")
    skip = NearDuplicateSettings(action="skip")
    for corpus in (bbc, ja):  # the same marks with action skip: what it leaves out
        with_skip = evaluate(corpus, skip)
        figures[corpus.name]["skip"] = {
            strength: {"copies": r["copies"], "left_out": r["skip_left_out"],
                       "wrongly": r["skip_left_out_wrongly"], "recall": r["recall"]}
            for strength, r in with_skip["strengths"].items()}
        print(f"  {corpus.name}, action skip: copies left out per strength (of the copies): "
              + ", ".join(f"{strength} {r['left_out']} of {r['copies']} ({r['wrongly']} into "
                          "another story)" for strength, r in figures[corpus.name]["skip"].items()))
    figures["review_sets"] = review_sets()
    print_review_sets(figures["review_sets"])
    if not args.no_sweep:
        figures["sweep"] = sweep([bbc, ja])

    texts = articles_of_length(args.cpu_articles, args.chars)
    print(f"\nCPU, {args.cpu_articles} articles of {args.chars} characters, batches of 100 "
          f"({multiprocessing.cpu_count()} CPUs):")
    cpu = {"one_process": cpu_signatures(texts, 1), "two_processes": cpu_signatures(texts, 2)}
    cpu.update(cpu_parts(texts))
    cpu["step"] = cpu_step(texts)
    cpu.update(cpu_alternatives(texts[:300]))
    for name in ("one_process", "two_processes"):
        c = cpu[name]
        print(f"  signatures(), {c['processes']} process(es): {c['wall_ms_per_article']:.4f} ms "
              f"wall per article (best of {c['repeats']}: {c['wall_ms_per_article_all']}), "
              f"{c['cpu_ms_per_article']:.4f} ms CPU; load average {c['load_average']:.1f} "
              "(target <= 0.1 ms per article on 2 cores)")
    print(f"  of which the folded text and its numpy shingle hashes: "
          f"{cpu['shingle_hashes_cpu_ms_per_article']:.4f} ms CPU")
    print(f"  rensa, a Python str per shingle: "
          f"{cpu['rensa_str_shingles_cpu_ms_per_article']:.4f} ms CPU per article (RMinHash."
          f"update), {cpu['rensa_str_shingles_matrix_cpu_ms_per_article']:.4f} "
          "(digest_matrix_from_token_sets)")
    if "datasketch_cpu_ms_per_article" in cpu:
        print(f"  datasketch {cpu['datasketch']} MinHash: "
              f"{cpu['datasketch_cpu_ms_per_article']:.4f} ms CPU per article")
    else:
        print("  datasketch: not installed (pip install datasketch to compare)")
    step = cpu["step"]
    print(f"  the batch marking's own work, one process, µs CPU per article: sign "
          f"{step['sign_us']:.0f}, learn the boilerplate and sign again the "
          f"{step['signed_again']} texts holding it {step['learn_us']:.0f}, mark "
          f"{step['mark_us']:.0f}: {step['total_us']:.0f} (target <= 100)")
    if args.graph_runs:
        print(f"\nthe batch graph, a FREE engine, marking off and on ({args.graph_runs} runs "
              "each, 2 SDK workers):")
        cpu["graph"] = graph_cpu(args.graph_runs, limit=graph_articles, running_mode=(
            "multi_threading" if args.smoke else "multi_processing"))
        g = cpu["graph"]
        print(f"  median wall ms per article: off {g['off_ms']:.3f}, on {g['on_ms']:.3f}: "
              f"marking {g['marking_ms']:.3f} ms (load average {g['load_average']:.1f})")
    figures["cpu"] = cpu

    state = state_size(settings)
    state["micro_batches"] = streaming_micro_batches(settings, args.held)
    figures["state"] = state
    print(f"\nstate per held story: {state['bands']} band entries, {state['coder']}: "
          f"{state['encoded_per_added_entry']} B an entry ({state['signature_bytes']} B of "
          f"signature, {state['facts_bytes']} B of facts) -> {state['encoded_bytes_per_story']:,} "
          f"B per story, {state['gb_per_million_stories']:.1f} GB per million stories")
    print("the band step of one micro-batch of 100 (90 new, 10 copies) and its timers, MODELED "
          "state store (tools/dedup_state_model.py), median CPU time of 7:")
    for r in state["micro_batches"]:
        print(f"  {r['stories_held']:>9,} stories held ({r['cells_built']:,} cells built): "
              f"{r['cpu_ms_per_micro_batch']:.1f} ms CPU, {r['bytes_decoded']:,.0f} B decoded, "
              f"{r['bytes_encoded']:,.0f} B encoded")
    print("the local runner's layout, one micro-batch of 100 (signing included), median CPU "
          "time of 7:")
    state["local_micro_batches"] = local_micro_batches(settings, args.local_held)
    figures["counts"] = dict(Counter(g for _, _, g in bbc.originals))
    figures.update(table_figures(figures, argv))
    out = write_results(figures, args.results, "near_duplicates")
    print(f"results: {out}")
    print("command: python -m benchmarks.near_duplicates" + (
        " " + " ".join(argv) if argv else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

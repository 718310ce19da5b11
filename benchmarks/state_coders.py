"""Streaming state coders against Beam's PickleCoder: encode and decode time, and bytes, of one
micro-batch in flight, and of a shard's dedup keys. ``python -m benchmarks.state_coders
[--docs 64] [--tokens 256] [--chars 2500] [--chunks 0] [--seen-keys 100000] [--repeat 200]``.

A micro-batch is written to state when it reaches ``EmbedStreaming`` (and the regroup of
``DropDuplicatesStreaming``) and read back when a timer emits it; the figures are one write and one
read of the state value, nothing of a runner's. The micro-batch is synthetic: ``--docs`` documents,
each with a Pub/Sub lineage (three attributes), a text of ``--chars`` characters and ``--tokens``
token ids (ids up to 30,000, as a WordPiece vocabulary's), and with ``--chunks`` chunks of
``--tokens`` ids each (chunks mode); two dead letters. The dedup keys are the local runner's
per-shard dict of ``--seen-keys`` keys (32 hex characters each, as ``text_sha256`` keys are
cut to here, and ids are about as long). Prints the median of ``--repeat`` runs (of a tenth as
many for the keys).
"""
from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import time

from apache_beam.coders import PickleCoder

from benchmarks import SMOKE_HELP
from pipeline.config import REPO_ROOT
from tools.bench_results import record
from transforms.chunking import ChunkSpan
from transforms.state_coders import MicroBatchCoder, SeenKeysCoder
from transforms.types import DeadLetter, Lineage, MicroBatch, NewsEvent, PreparedDoc, Reason, Step

_UTC = dt.timezone.utc


def micro_batch(docs: int, tokens: int, chars: int, chunks: int, seed: int = 0) -> MicroBatch:
    rng = random.Random(seed)
    words = ("harbor freight revenue quarter port volumes recover operator terminals margin "
             "fuel scheduling vessel analysts expects").split()
    prepared = []
    for i in range(docs):
        body = ""
        while len(body) < chars:
            body += rng.choice(words) + " "
        body = body[:chars]
        title = body[:80].strip()
        text = f"{title}\n{body}"  # the prepared text: a new string, as PrepareText makes it
        lineage = Lineage(message_id=f"{17_000_000_000 + i}",
                          publish_time=dt.datetime(2026, 12, 1, 10, 0, i % 60, 123000,
                                                   tzinfo=_UTC),
                          attributes=(("feed", "wire"), ("lang", "en"), ("origin", "cms-7")))
        event = NewsEvent.model_validate({
            "id": f"article-{i:06d}", "title": title, "body": body,
            "url": f"https://news.example.com/2026/12/01/article-{i:06d}",
            "source": "example-news", "language": "en",
            "published_at": "2026-12-01T09:58:00Z"}).model_copy(update={"lineage": lineage})
        ids = tuple(rng.randrange(1000, 30000) for _ in range(tokens))
        spans = tuple(ChunkSpan(token_ids=tuple(rng.randrange(1000, 30000)
                                                for _ in range(tokens)),
                                token_start=k * tokens, token_end=(k + 1) * tokens,
                                char_start=k * 100, char_end=(k + 1) * 100)
                      for k in range(chunks))
        prepared.append(PreparedDoc(event=event, text=text, text_sha256=f"{i:064x}",
                                    token_ids=ids, truncated=True, chunks=spans,
                                    title=title))
    letters = tuple(DeadLetter(step=Step.PARSE, reason=Reason.INVALID_JSON,
                               detail="not valid JSON", payload="{oops", payload_bytes=5,
                               message_id=f"m{k}") for k in range(2))
    return MicroBatch(window_start_us=1_796_000_000_000_000, window_end_us=1_796_000_060_000_000,
                      pane=0, shard=3, shards=8, docs=tuple(prepared), dead_letters=letters,
                      messages_in=docs + 2)


def measure(coders: dict, batch, repeat: int) -> dict:
    """Per coder: bytes, median encode and decode ms; the coders take turns, so a machine's load
    weighs on each alike."""
    times: dict = {name: ([], []) for name in coders}
    for _ in range(repeat):
        for name, coder in coders.items():
            start = time.perf_counter()
            data = coder.encode(batch)
            middle = time.perf_counter()
            coder.decode(data)
            times[name][0].append(middle - start)
            times[name][1].append(time.perf_counter() - middle)
    return {name: {"bytes": len(coder.encode(batch)),
                   "encode_ms": statistics.median(times[name][0]) * 1e3,
                   "decode_ms": statistics.median(times[name][1]) * 1e3}
            for name, coder in coders.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.state_coders",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--chars", type=int, default=2500)
    parser.add_argument("--chunks", type=int, default=0)
    parser.add_argument("--seen-keys", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--results", default=str(REPO_ROOT / "bench-results"))
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        args.docs, args.seen_keys, args.repeat = 8, 1000, 2
    batch = micro_batch(args.docs, args.tokens, args.chars, args.chunks)
    print(f"one micro-batch: {args.docs} documents of {args.tokens} tokens, {args.chars} "
          f"characters, {args.chunks} chunks each; median of {args.repeat}")
    _header()
    figures = measure({"PickleCoder": PickleCoder(), "MicroBatchCoder": MicroBatchCoder()},
                      batch, args.repeat)
    kept = {"micro_batch": figures}
    for name, m in figures.items():
        _print(name, m)
    rng = random.Random(1)
    seen = {f"{rng.getrandbits(128):032x}": 1_796_003_600_000_000 + i
            for i in range(args.seen_keys)}
    print(f"\none shard's dedup keys: {args.seen_keys:,}; median of {max(1, args.repeat // 10)}")
    _header()
    figures = measure({"PickleCoder": PickleCoder(), "SeenKeysCoder": SeenKeysCoder()}, seen,
                      max(1, args.repeat // 10))
    for name, m in figures.items():
        _print(name, m)
    path = record("state_coders", {**kept, "seen_keys": figures}, argv, args.results)
    print(f"results: {path}")
    return 0


def _header() -> None:
    print(f"{'coder':<16}{'bytes':>12}{'encode ms':>11}{'decode ms':>11}{'total ms':>10}")


def _print(name: str, m: dict) -> None:
    print(f"{name:<16}{m['bytes']:>12,}{m['encode_ms']:>11.3f}{m['decode_ms']:>11.3f}"
          f"{m['encode_ms'] + m['decode_ms']:>10.3f}")


if __name__ == "__main__":
    raise SystemExit(main())

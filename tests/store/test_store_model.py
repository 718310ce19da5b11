"""The store against a model of the files (transforms/stores/, docs/store.md), on the test
PostgreSQL (``pg``, ``store_settings``): hypothesis draws sequences of loads, and after each one
the store must hold, for every article, the current version (``schema.VERSION_ORDER``) of what
the files then hold, with that version's chunks, and nothing else. The files are:

- each streaming micro-batch's latest attempt (a redo with another outcome replaces the
  earlier attempt's files: a row becomes a dead letter, or another version);
- each batch output's latest run (a rerun replaces the output's files: an article it no longer
  holds is gone from them), loaded with ``BatchOutput``; a load of an older run of an output
  after a newer one's changes nothing: a no-op if it was loaded, else refused (and refused with
  ``reload``);
- less the rows a CHECK constraint of the table refuses (titles ending in ``!``), which are set
  aside with their reason.

Everything stays within ``store.superseded_keep_days``, as the store promises. More sequences:
``NEWSVEC_STORE_MODEL_EXAMPLES`` (default 60), ``NEWSVEC_STORE_MODEL_OPS`` (loads per sequence,
default 8).
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import os

import numpy as np
import psycopg
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from transforms.output.parquet import chunk_schema, vector_schema
from transforms.stores.base import BatchOutput, LoadRows, StoreLoadFailed
from transforms.stores.pgvector import Store, StoreSettings
from transforms.stores.pgvector.schema import _create_statements
from transforms.types import STORY_FIELDS

DIM = 4
T0 = dt.datetime(2026, 12, 1, 9, 0, tzinfo=dt.timezone.utc)
D0 = dt.date(2026, 12, 1)
TS = pa.timestamp("us", tz="UTC")
IDS = ["x", "y", "z"]
MICRO_BATCHES = ["mb:m1", "mb:m2"]
OUTPUTS = ["gs://b/vectors/dt=2026-12-01", "gs://b/vectors/dt=2026-12-02"]
TABLES = ("news_vectors", "news_vectors_chunks", "news_vectors_loads", "news_vectors_superseded",
          "news_vectors_chunks_superseded")


def at(minutes):
    return None if minutes is None else T0 + dt.timedelta(minutes=minutes)


def chunk_count(sha: str) -> int:
    return 1 + int(hashlib.sha256(sha.encode()).hexdigest(), 16) % 3


@dataclasses.dataclass(frozen=True)
class Row:
    id: str
    sha: str
    updated_at: object
    published_at: object
    publish_time: object
    embedded_at: int

    @property
    def refused(self) -> bool:
        return self.sha.endswith("!")

    def order(self, day: dt.date) -> tuple:
        low = -(10 ** 9)  # a null is lower than any value
        return tuple(low if v is None else v for v in (
            self.updated_at, self.published_at)) + (day.toordinal(),) + (
            low if self.publish_time is None else self.publish_time, self.embedded_at)


def build(rows: list[Row], day: dt.date) -> LoadRows:
    n = len(rows)
    vectors = {
        "id": [r.id for r in rows], "url": [f"u/{r.id}" for r in rows], "source": ["s"] * n,
        "title": [r.sha for r in rows],
        "published_at": pa.array([at(r.published_at) for r in rows], TS),
        "language": ["en"] * n, "model": ["m"] * n, "dim": [DIM] * n,
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(
            np.random.default_rng(n).standard_normal(n * DIM).astype(np.float32)), DIM),
        "text_sha256": [r.sha for r in rows], "token_count": [3] * n, "truncated": [False] * n,
        "embedded_at": pa.array([at(r.embedded_at) for r in rows], TS),
        "pubsub_message_id": [None] * n,
        "pubsub_publish_time": pa.array([at(r.publish_time) for r in rows], TS),
        "pubsub_attributes": [None] * n, "doc_vector": ["head"] * n,
        "chunk_count": [chunk_count(r.sha) for r in rows],
        "updated_at": pa.array([at(r.updated_at) for r in rows], TS)}
    schema = vector_schema(DIM)
    items = [(r, c) for r in rows for c in range(chunk_count(r.sha))]
    m = len(items)
    chunks = pa.table({
        "id": [r.id for r, _ in items], "chunk_id": [f"{r.id}-{r.sha}-{c}" for r, c in items],
        "chunk_index": [c for _, c in items], "chunk_count": [chunk_count(r.sha) for r, _ in items],
        "token_start": [0] * m, "token_end": [1] * m, "char_start": [0] * m, "char_end": [1] * m,
        "chunk_sha256": ["c"] * m, "text_sha256": [r.sha for r, _ in items], "model": ["m"] * m,
        "dim": [DIM] * m, "embedding": pa.FixedSizeListArray.from_arrays(
            pa.array(np.ones(m * DIM, np.float32)), DIM),
        "embedded_at": pa.array([at(r.embedded_at) for r, _ in items], TS),
        "chunk_text": [None] * m,
        **dict.fromkeys(STORY_FIELDS, [None] * m)}, schema=chunk_schema(DIM))
    return LoadRows(pa.table({f.name: vectors.get(f.name, [None] * n) for f in schema},
                             schema=schema),
                    chunks if m else None, day)


def store_state(dsn: str) -> tuple[dict, dict]:
    with psycopg.connect(dsn) as conn:
        rows = {i: (s, e) for i, s, e in conn.execute(
            "SELECT id, text_sha256, embedded_at FROM news_vectors")}
        chunks: dict = {}
        for i, c, s, e in conn.execute("SELECT id, chunk_index, text_sha256, embedded_at FROM "
                                       "news_vectors_chunks ORDER BY 1, 2"):
            chunks.setdefault(i, []).append((c, s, e))
    return rows, chunks


def reset(dsn: str) -> None:
    """Empty tables, with a CHECK constraint that refuses titles ending in ``!``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("SELECT to_regclass('news_vectors_superseded')").fetchone()[0]:
            conn.execute(f"TRUNCATE {', '.join(TABLES)}")
            return
        for statement in _create_statements(StoreSettings(), DIM):
            conn.execute(statement)
        conn.execute("ALTER TABLE news_vectors ADD CONSTRAINT no_bang CHECK (title NOT LIKE '%!')")


times = st.one_of(st.none(), st.integers(0, 2))
fields = st.fixed_dictionaries({"updated_at": times, "published_at": times,
                                "publish_time": times,
                                "refused": st.sampled_from([False, False, False, True])})
plan = st.fixed_dictionaries({
    # each micro-batch: its day, and its messages (id, fields)
    "micro_batches": st.lists(st.tuples(st.integers(0, 1), st.lists(
        st.tuples(st.sampled_from(IDS), fields), min_size=1, max_size=4)),
        min_size=len(MICRO_BATCHES), max_size=len(MICRO_BATCHES)),
    "ops": st.lists(st.one_of(
        # a micro-batch attempt: which of its messages are rows this time
        st.tuples(st.just("mb"), st.integers(0, len(MICRO_BATCHES) - 1),
                  st.lists(st.booleans(), min_size=4, max_size=4)),
        # a run of an output: the articles it holds
        st.tuples(st.just("run"), st.integers(0, len(OUTPUTS) - 1),
                  st.dictionaries(st.sampled_from(IDS), fields, max_size=3)),
        st.tuples(st.just("retry"), st.just(0), st.just(None)),
        st.tuples(st.just("older"), st.integers(0, len(OUTPUTS) - 1), st.just(None))),
        min_size=1, max_size=int(os.environ.get("NEWSVEC_STORE_MODEL_OPS", "8")))})


def test_the_store_holds_the_current_version_of_what_the_files_hold(store_settings, pg):
    store = Store(store_settings)

    @settings(max_examples=int(os.environ.get("NEWSVEC_STORE_MODEL_EXAMPLES", "60")),
              deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate, Phase.shrink])
    @given(plan)
    def check(p):
        reset(pg)
        files: dict[str, list[tuple[Row, dt.date]]] = {}  # per micro-batch key or output
        runs: dict[int, list] = {}  # output -> its runs' loads, oldest first
        clock = [100]
        last = None
        loaded: set[str] = set()  # load keys loaded
        log: list = []
        for op, index, arg in p["ops"]:
            clock[0] += 1
            if op == "mb":
                key = MICRO_BATCHES[index]
                day_offset, messages = p["micro_batches"][index]
                rows = [Row(doc_id, f"{key}:{doc_id}:{j}" + ("!" if f["refused"] else ""),
                            f["updated_at"], f["published_at"], f["publish_time"], clock[0])
                        for j, (doc_id, f) in enumerate(messages) if arg[j]]
                call = (key, key, rows, D0 + dt.timedelta(days=day_offset),
                        sorted({doc_id for doc_id, _ in messages}), None)
            elif op == "run":
                n = len(runs.setdefault(index, []))
                key = f"run:o{index}-{n}"
                rows = [Row(doc_id, f"{key}:{doc_id}" + ("!" if f["refused"] else ""),
                            f["updated_at"], f["published_at"], None, clock[0])
                        for doc_id, f in sorted(arg.items())]
                call = (OUTPUTS[index], key, rows, D0 + dt.timedelta(days=index), None,
                        BatchOutput(OUTPUTS[index], f"{clock[0]:06d}"))
                runs[index].append(call)
            elif op == "retry":
                if last is None:
                    continue
                call = last
            else:  # a load of an output's older run, after a newer one's
                if len(runs.get(index, [])) < 2:
                    continue
                call = runs[index][0]
                before = store_state(pg)
                log.append(("older", call[1]))
                if call[1] in loaded:  # loaded already: nothing to do
                    assert store.load(build(call[2], call[3]), call[1], ids=call[4],
                                      output=call[5]).already_loaded
                else:
                    with pytest.raises(StoreLoadFailed, match="is older than"):
                        store.load(build(call[2], call[3]), call[1], ids=call[4], output=call[5])
                with pytest.raises(StoreLoadFailed, match="is older than"):
                    store.load(build(call[2], call[3]), call[1], ids=call[4], output=call[5],
                               reload=True)
                assert store_state(pg) == before, "\n".join(map(str, log))
                continue
            holder, key, rows, day, ids, output = call
            log.append((op, key, [(r.id, r.sha, r.embedded_at) for r in rows], ids))
            try:
                store.load(build(rows, day), key, ids=ids, output=output)
            except StoreLoadFailed as exc:  # more refused rows than a load may have
                assert "refused more than" in str(exc), exc
                log.append(("failed",))
                continue
            files[holder] = [(r, day) for r in rows if not r.refused]
            loaded.add(key)
            last = call
            best: dict[str, list] = {}  # id -> [order, {(sha, embedded_at) of that order}]
            for held in files.values():
                for row, row_day in held:
                    order = row.order(row_day)
                    current = best.get(row.id)
                    if current is None or order > current[0]:
                        best[row.id] = [order, {(row.sha, at(row.embedded_at))}]
                    elif order == current[0]:
                        current[1].add((row.sha, at(row.embedded_at)))
            stored, chunks = store_state(pg)
            where = "\n".join(map(str, log))
            assert set(stored) == set(best), f"store {stored}, files {best}\n{where}"
            for doc_id, (_, allowed) in best.items():
                assert stored[doc_id] in allowed, f"{doc_id}: {stored[doc_id]}\n{where}"
                sha, embedded_at = stored[doc_id]
                assert chunks.get(doc_id) == [(c, sha, embedded_at)
                                              for c in range(chunk_count(sha))], where
            assert set(chunks) <= set(stored), f"stray chunks {chunks}\n{where}"

    check()

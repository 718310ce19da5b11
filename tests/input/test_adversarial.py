"""The adversarial corpus (tests/adversarial.py): each case through parse and text preparation gives
exactly its outcome, and the whole batch pipeline (real vLLM, float32) over every case that fits on
one JSON Lines line accounts for every one: its row, its dead letter with its reason, or its
counted duplicate."""
from __future__ import annotations

import collections
import datetime as dt
import json
import tempfile
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from apache_beam import pvalue
from apache_beam.options.pipeline_options import PipelineOptions

from tests.adversarial import (
    ALL_CASES,
    BY_NAME,
    CORPUS,
    DEAD_LETTER_PAYLOAD_BYTES,
    DUPLICATE,
    MAX_FUTURE_SKEW_S,
    MAX_PAYLOAD_BYTES,
    MAX_TEXT_CHARS,
    ROW,
    Case,
    event_id,
)
from tests.common import make_config
from transforms.parse import ParseError, parse_event
from transforms.settings import ParseSettings, SinkSettings, TextSettings
from transforms.text import normalize_text
from transforms.types import PreparedDoc, Reason

# docs/input.md's dead-letter table: the step that gives each reason.
PARSE_REASONS = {Reason.PAYLOAD_TOO_LARGE, Reason.INVALID_UTF8, Reason.INVALID_JSON,
                 Reason.NOT_AN_OBJECT, Reason.MISSING_ID, Reason.INVALID_ID, Reason.INVALID_FIELD,
                 Reason.NO_TEXT, Reason.PUBLISHED_IN_FUTURE, Reason.UPDATED_IN_FUTURE}
PREPARE_REASONS = {Reason.TEXT_TOO_LONG, Reason.EMPTY_AFTER_NORMALIZATION, Reason.PREPARE_FAILED,
                   Reason.UNREADABLE_FOR_MODEL}
ALL_REASONS = {v for k, v in vars(Reason).items() if k.isupper()}
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def corpus_config(**changes):
    """The session's fp32 config (same engine settings, so the same cached engine) with the
    corpus's limits."""
    return make_config(
        parse=ParseSettings(max_payload_bytes=MAX_PAYLOAD_BYTES,
                            max_future_skew_s=MAX_FUTURE_SKEW_S),
        text=TextSettings(max_text_chars=MAX_TEXT_CHARS),
        sink=SinkSettings(dead_letter_payload_bytes=DEAD_LETTER_PAYLOAD_BYTES), **changes)


def dead_letter_head(raw: bytes) -> str:
    """What a parse dead letter keeps of a raw payload (docs/input.md: the head, undecodable bytes
    backslash-escaped)."""
    return raw[:DEAD_LETTER_PAYLOAD_BYTES].decode("utf-8", errors="backslashreplace")


def is_bad(case: Case) -> bool:
    return case.expected not in (ROW, DUPLICATE)


# ---- the corpus itself ----

def test_the_corpus_is_large_varied_and_unambiguous():
    assert len(CORPUS) >= 40
    assert len(BY_NAME) == len(ALL_CASES), "case names are unique"
    assert all(c.expected in ALL_REASONS | {ROW, DUPLICATE} for c in ALL_CASES)
    covered = {c.expected for c in CORPUS}
    # Every reason a payload can cause on its own (embedding_failed needs a failing model).
    assert ALL_REASONS - {Reason.EMBEDDING_FAILED} <= covered
    assert sum(c.expected == ROW for c in CORPUS) >= 20
    rows = [event_id(c) for c in ALL_CASES if c.expected == ROW]
    assert len(rows) == len(set(rows)), "a row is found by its id: row ids are unique"
    for c in ALL_CASES:
        if c.expected == DUPLICATE:
            assert event_id(c) == event_id(BY_NAME[c.duplicate_of])
    heads = [dead_letter_head(c.payload) for c in ALL_CASES if is_bad(c)]
    assert len(heads) == len(set(heads)), "a parse dead letter is found by its payload head"


# ---- (a) parse + prepare, case by case ----

@pytest.fixture(scope="module")
def prepare_fn():
    from transforms.text.prepare import _PrepareTextFn

    fn = _PrepareTextFn(corpus_config().model, MAX_TEXT_CHARS, DEAD_LETTER_PAYLOAD_BYTES)
    fn.setup()
    return fn


def outcome(case: Case, prepare_fn):
    """(reason or ROW, the ParseError, DeadLetter or PreparedDoc). Anything else raised fails."""
    try:
        event = parse_event(case.payload, max_payload_bytes=MAX_PAYLOAD_BYTES,
                            max_future_skew=dt.timedelta(seconds=MAX_FUTURE_SKEW_S))
    except ParseError as exc:
        return exc.reason, exc
    out = list(prepare_fn.process([event]))
    assert len(out) == 1, f"prepare gave {len(out)} outputs for one event"
    if isinstance(out[0], pvalue.TaggedOutput):
        return out[0].value.reason, out[0].value
    return ROW, out[0]


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_each_case_gets_its_outcome_from_parse_and_prepare(case, prepare_fn):
    got, what = outcome(case, prepare_fn)
    # A duplicate is a valid document on its own; the dedup step drops it (the batch test below).
    expected = ROW if case.expected == DUPLICATE else case.expected
    assert got == expected, (f"{case.name}: expected {case.expected}, got {got}: "
                             f"{getattr(what, 'detail', what)!r:.300}"
                             + (f" [{case.note}]" if case.note else ""))
    if got == ROW:
        assert isinstance(what, PreparedDoc) and what.event.id == event_id(case)
        assert what.text and what.text == what.text.strip()
        # [CLS] ... [SEP]: a row must embed at least one token of its own text.
        assert what.token_count >= 3, f"only special tokens: {what.text!r}"
        assert what.token_count <= corpus_config().model.max_tokens
    elif got in PARSE_REASONS:
        assert what.detail
    else:
        assert what.step == "prepare_text" and what.event_id == event_id(case) and what.detail


# ---- (b) the whole batch pipeline over the corpus ----

# Good events first, then the corpus in its order. Payloads holding b"\n" (or ending in b"\r") are
# not one JSON Lines line: written to a file they would become other payloads (each line its own
# event), so they are left out here; the parse test above and the streaming test in
# test_path_safety.py (Pub/Sub messages have no line ends) cover them.
BATCH_CASES = [c for c in ALL_CASES[len(CORPUS):] + CORPUS if c.batch_compatible]
LEFT_OUT_OF_BATCH = [c.name for c in ALL_CASES if not c.batch_compatible]

_run_lock = threading.Lock()
_run_result: dict = {}


def corpus_batch_run():
    """(root, output, summary) of one batch run over BATCH_CASES, shared by every test in this
    process that needs it (tests/security/test_path_safety.py too). The engine is cached per
    process, so this loads it at most once. A run that raised raises again, without running
    twice."""
    with _run_lock:
        if not _run_result:
            root = Path(tempfile.mkdtemp(prefix="newsvec-adversarial-"))
            source = root / "in" / "adversarial.jsonl"
            source.parent.mkdir()
            source.write_bytes(b"".join(c.payload + b"\n" for c in BATCH_CASES))
            out = root / "a" / "b" / "out"  # deep, so a path escaping it still lands under root
            from pipeline.run import run_batch

            try:
                summary = run_batch(corpus_config(input=str(source), output=str(out)),
                                    PipelineOptions(["--runner=FnApiRunner"]))
                _run_result["value"] = (root, out, summary)
            except Exception as exc:  # noqa: BLE001 -- re-raised by every test that asks
                _run_result["error"] = exc
        if "error" in _run_result:
            raise _run_result["error"]
        return _run_result["value"]


@pytest.fixture(scope="module")
def batch_run():
    return corpus_batch_run()


def read_rows(out: Path) -> pa.Table:
    return pq.read_table(sorted((out / "vectors").glob("*.parquet")))


def read_letters(out: Path) -> list[dict]:
    # Split on b"\n" only, as JSON Lines says: str.splitlines() would also split on U+2028, U+2029
    # and U+0085, which JSON leaves unescaped inside strings (and the corpus holds).
    return [json.loads(line) for f in sorted((out / "dead_letter").glob("*.jsonl"))
            for line in f.read_bytes().split(b"\n") if line]


def test_only_multiline_payloads_are_left_out_of_the_batch_file():
    assert sorted(LEFT_OUT_OF_BATCH) == ["crlf_terminated", "pretty_printed_multiline",
                                         "raw_newline_in_string"]
    assert len(BATCH_CASES) == len(ALL_CASES) - len(LEFT_OUT_OF_BATCH)


def test_batch_accounting_invariant_holds_exactly(batch_run):
    _, out, summary = batch_run
    counts = summary["counts"]
    assert summary["invariant_holds"]
    assert counts["in"] == len(BATCH_CASES), "one event in per line"
    assert counts["in"] == counts["written"] + counts["dead_lettered"] + counts["duplicates"]
    assert counts["written"] == read_rows(out).num_rows
    assert counts["dead_lettered"] == len(read_letters(out))
    assert json.loads((out / "_summary.json").read_text())["counts"] == counts


def test_batch_every_bad_case_is_dead_lettered_once_with_its_reason(batch_run):
    _, out, summary = batch_run
    letters = read_letters(out)
    bad = [c for c in BATCH_CASES if is_bad(c)]
    problems, matched = [], set()
    for case in bad:
        if case.expected in PREPARE_REASONS:
            found = [i for i, d in enumerate(letters)
                     if d["step"] == "prepare_text" and d["event_id"] == event_id(case)]
        else:
            found = [i for i, d in enumerate(letters) if d["step"] == "parse"
                     and d["payload"] == dead_letter_head(case.payload)]
        if len(found) != 1:
            problems.append(f"{case.name}: {len(found)} dead letters, expected 1 "
                            f"({case.expected}) {case.note}")
            continue
        letter = letters[found[0]]
        matched.add(found[0])
        if letter["reason"] != case.expected:
            problems.append(f"{case.name}: reason {letter['reason']}, expected {case.expected} "
                            f"({letter['detail'][:120]}) {case.note}")
        if letter["step"] == "parse":
            assert letter["payload_bytes"] == len(case.payload), case.name
        assert letter["detail"] and letter["failed_at"], case.name
    extra = [letters[i] for i in range(len(letters)) if i not in matched]
    problems += [f"unexpected dead letter {d['reason']}: {d['payload'][:100]!r}" for d in extra]
    assert not problems, "\n".join(problems)
    assert summary["counts"]["dead_lettered_by_reason"] == dict(
        collections.Counter(c.expected for c in bad))


def _micros(value: str) -> int:
    """An RFC 3339 string as microseconds since the epoch, in UTC, whatever its year."""
    return (dt.datetime.fromisoformat(value.upper()) - EPOCH) // dt.timedelta(microseconds=1)


def test_batch_every_valid_case_is_exactly_one_row(batch_run):
    _, out, summary = batch_run
    got = collections.Counter(read_rows(out)["id"].to_pylist())
    want = collections.Counter(event_id(c) for c in BATCH_CASES if c.expected == ROW)
    names = {}  # id -> case name, for the message: every case whose payload has an id
    for case in BATCH_CASES:
        try:
            names.setdefault(event_id(case), case.name)
        except (ValueError, KeyError, TypeError, RecursionError):  # not UTF-8 or JSON, no id
            pass
    assert got == want, (f"missing rows: {sorted(names.get(i, i) for i in want - got)}; "
                         f"unexpected rows: {sorted(names.get(i, i) for i in got - want)}")
    assert summary["counts"]["duplicates"] == sum(c.expected == DUPLICATE for c in BATCH_CASES)


def test_batch_rows_keep_their_fields_as_sent_and_the_prepared_title(batch_run):
    _, out, _ = batch_run
    table = read_rows(out)
    micros = table["published_at"].cast(pa.int64()).to_pylist()  # year 0 does not fit datetime
    rows = table.select(["id", "title", "source", "url", "language", "truncated"]).to_pylist()
    by_id = collections.defaultdict(list)
    for row, us in zip(rows, micros, strict=True):
        by_id[row["id"]].append((row, us))
    for case in BATCH_CASES:
        if case.expected != ROW:
            continue
        raw = json.loads(case.payload.decode("utf-8"))
        assert len(by_id[raw["id"]]) == 1, f"{case.name}: {len(by_id[raw['id']])} rows"
        row, us = by_id[raw["id"]][0]
        for field in ("source", "url", "language"):
            assert row[field] == raw.get(field), f"{case.name}: {field} kept as sent"
        assert row["title"] == (normalize_text(raw.get("title")) or None), \
            f"{case.name}: the title as it was embedded"
        assert us == (_micros(raw["published_at"]) if raw.get("published_at") else None), case.name
    assert by_id["row-long-title"][0][0]["truncated"], "a 2,000-character title keeps its head"
    survivor = json.loads(BY_NAME["dup_original"].payload)
    assert by_id["dup-1"][0][0]["title"] == survivor["title"], "the copy published last survives"

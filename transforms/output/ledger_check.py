"""The streaming ledger check, from storage: ``check(output, start, end, verify, store)`` sums the
ledger records of a streaming output and checks them against the files they name, the files no
record names, the compacted hours' manifests and, with a store, the store's loads and rows
(through the store contract, ``transforms.stores``). ``newsvec ledger`` (``pipeline/ledger.py``) is
its command line; what each check refuses is listed there."""
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import re
from typing import Any, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.io.filesystems import FileSystems

from transforms.output.compaction import PartitionView, ledger_records, partition_of
from transforms.output.layout import (
    CHUNKS_DIR,
    DEAD_LETTER_DIR,
    KEYS_DIR,
    LEDGER_DIR,
    VECTORS_DIR,
    PartFileName,
    UnsafePath,
    day_of_path,
    is_compacted,
    join_path,
    open_output_file,
    parquet_rows,
    partitions_between,
    read_parquet,
)
from transforms.output.parquet import VERSION_ORDER, version_key
from transforms.stores import Settings as StoreSettings
from transforms.stores import store_for
from transforms.stores.base import printable as _printable
from transforms.stores.base import streaming_load_key
from transforms.types import Counts, utc_time


@dataclasses.dataclass
class LedgerReport:
    totals: dict
    problems: list  # "window <start>: what is wrong" (``problem_window``), or of a partition...
    # What the check read, for readers that show more than the totals (``/status``): the
    # in-range records, the view of each compacted partition read, the store's load keys found.
    records: list = dataclasses.field(default_factory=list)
    views: dict = dataclasses.field(default_factory=dict)
    store_loaded: frozenset = frozenset()

    @property
    def ok(self) -> bool:
        return not self.problems


def _where(r) -> str:
    """How a problem of record ``r`` begins: its window (``problem_window`` reads it back)."""
    return f"window {r.window_start} (pane {r.pane}, shard {r.shard}, run {r.run_id})"


def _window_where(start: dt.datetime) -> str:
    """How a problem of a window's file without its record begins."""
    return f"window {start:%Y-%m-%dT%H:%M:%SZ}"


_PROBLEM_WINDOW = re.compile(r"window (\S+?)(?:: | \()")


def problem_window(problem: str) -> Optional[str]:
    """The window start (as its records write it) that a problem of ``check`` is of; None for
    one of a partition, of the store as a whole, or of a file that is no record."""
    found = _PROBLEM_WINDOW.match(problem)
    return found.group(1) if found else None


def _list(output: str, subdir: str, suffix: Union[str, tuple[str, ...]],
          partitions: Optional[list[str]]) -> list[str]:
    patterns = ([join_path(output, subdir, "**")] if partitions is None
                else [join_path(output, subdir, p, "*") for p in partitions])
    return [m.path for result in FileSystems.match(patterns) for m in result.metadata_list
            if m.path.endswith(suffix)]


def _row_message_ids(output: str, path: str) -> list[Optional[str]]:
    with open_output_file(output, path) as f:
        return pq.read_table(f, columns=["pubsub_message_id"]).column(0).to_pylist()


def _letter_message_id(line: bytes):
    """A dead letter's Pub/Sub message id (None if it has none); ``...`` if the line is not one."""
    try:
        letter = json.loads(line)
    except ValueError:
        return ...
    return letter.get("message_id") if isinstance(letter, dict) else ...


def _written_twice(message_ids: list[Optional[str]], relative: str, written_in: dict[str, str]
                   ) -> list[str]:
    """A problem for each Pub/Sub message that this vectors or dead-letter file holds and another
    file held already: a row in two files, a dead letter in two, or a row in one and a dead letter
    in another. Each copy was counted in its record's ``messages_in``, so every record balances
    while the message is counted twice (two launches that each wrote a micro-batch under names of
    their own, as releases before the digest in file names did after an update; a message read
    again after a snapshot restore or a subscription seek; see docs/streaming.md)."""
    problems = []
    for message_id in message_ids:
        if not isinstance(message_id, str):
            continue
        if message_id in written_in:
            problems.append(f"message {message_id} is written twice: in {written_in[message_id]} "
                            f"and in {relative}")
        written_in.setdefault(message_id, relative)
    return problems


def _read(output: str, path: str) -> bytes:
    """A file of the output's bytes: a regular file only (``open_output_file``: a symlink or a
    FIFO in its place is an ``UnsafePath`` naming it, never read or waited on)."""
    with open_output_file(output, path) as f:
        return f.read()


def check(output: str, start: Optional[dt.datetime] = None, end: Optional[dt.datetime] = None,
          verify: bool = True, store: Optional[StoreSettings] = None) -> LedgerReport:
    """The ledger of ``output`` over windows starting in ``[start, end)``. Compaction-aware: a
    record's file that a compaction replaced is resolved through the partition's compaction
    manifest (``transforms.output.compaction``), and a compacted file must hold the rows of every
    record it replaced, together."""
    partitions = None
    if start is not None or end is not None:
        if start is None or end is None:
            raise ValueError("give both --from and --until, or neither")
        partitions = partitions_between(start, end)
    window = _Window(start, end)
    # Every record of the partitions read (a compacted file holds the rows of all of its hour's);
    # the totals and the balance checks are of those in range. Their files are resolved through
    # the compaction manifests the records were read by, not read again later.
    unreadable: list[str] = []  # named as problems: one stray file does not stop the ledger
    every, views = ledger_records(output, partitions, unreadable)
    records = [r for r in every if window.holds(utc_time(r.window_start))]
    problems = list(unreadable)
    files = _RecordFiles(output, views)
    windows = set()
    for r in sorted(every, key=lambda r: (r.window_start, r.pane, r.shard)):
        where = _where(r)
        ours = window.holds(utc_time(r.window_start))
        if ours:
            windows.add(r.window_start)
            problems += _record_problems(r, where)
        problems += files.note(r, where, ours)
    listed = _listing(output, partitions)
    problems += files.check(verify, {path for paths in listed.values() for path in paths})
    problems += _listing_problems(listed, files, window)
    store_totals: dict = {}
    loaded: frozenset = frozenset()
    if store is not None:
        store_problems, store_totals, loaded = _check_store(output, records, store, verify,
                                                            files.holders)
        problems += store_problems
    return LedgerReport(totals=_totals(records, len(windows), store_totals, not problems),
                        problems=problems, records=records, views=views, store_loaded=loaded)


@dataclasses.dataclass(frozen=True)
class _Window:
    """The windows checked: those starting in ``[start, end)``, or every one."""

    start: Optional[dt.datetime]
    end: Optional[dt.datetime]

    def holds(self, t: Optional[dt.datetime]) -> bool:
        if t is None:
            return False
        return self.start is None or self.end is None or self.start <= t < self.end


def _record_problems(r, where: str) -> list[str]:
    """What is wrong with one record's own counts."""
    problems = []
    if not r.counts.balances():
        problems.append(f"{where}: does not balance: messages_in {r.messages_in} != rows "
                        f"{r.rows_written} + dead letters {r.dead_lettered} + duplicates "
                        f"{r.duplicates} + near duplicates {r.near_duplicates}")
    if not r.counts.reasons_add_up():
        problems.append(f"{where}: dead letters by reason do not add up to {r.dead_lettered}")
    if not r.counts.languages_add_up():
        problems.append(f"{where}: dead letters by language do not add up to those by reason")
    if r.keys_file is not None and r.keys_written != r.rows_written:
        problems.append(f"{where}: {r.keys_written} keys for {r.rows_written} rows")
    return problems


@dataclasses.dataclass
class _RecordFiles:
    """The files the records name, each resolved to the file that holds its rows now (its
    compacted file, through the partition's compaction manifest ``views``)."""

    output: str
    views: dict[str, PartitionView]
    # micro-batch file -> records naming it; file -> rows its records say
    named: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    expected: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # file -> (kind, first in-range record, as named)
    checked: dict[str, tuple[str, str, str]] = dataclasses.field(default_factory=dict)
    # of the in-range records: the vectors and dead-letter files that hold their rows
    holders: dict[str, set[str]] = dataclasses.field(
        default_factory=lambda: {"vectors": set(), "dead letter": set()})

    @property
    def prefix(self) -> str:
        return self.output.rstrip("/") + "/"

    def view(self, relative: str) -> PartitionView:
        return self.views.get(partition_of(relative), _NOT_COMPACTED)

    def note(self, r, where: str, ours: bool) -> list[str]:
        """Record ``r``'s files (``ours``: an in-range record's); a problem for a kind it counts
        rows of but names no file for."""
        problems = []
        for kind, relative, count in (("vectors", r.vectors_file, r.rows_written),
                                      ("chunks", r.chunks_file, r.chunks_written),
                                      ("keys", r.keys_file, r.keys_written),
                                      ("dead letter", r.dead_letter_file, r.dead_lettered)):
            if relative is None:
                if count and ours:
                    problems.append(f"{where}: {count} {kind} rows but no {kind} file")
                continue
            holder = self.view(relative).replaced.get(relative, relative)  # its compacted file
            self.expected[holder] += count
            if holder == relative:
                self.named[self.prefix + relative] += 1
            if ours and holder not in self.checked:
                self.checked[holder] = (kind, where, relative)
            if ours and kind in self.holders:
                self.holders[kind].add(holder)
        return problems

    def check(self, verify: bool, listed: set[str]) -> list[str]:
        """Each in-range record's file is there (in the partitions' listing ``listed``, else
        asked for: one request a file only for those not listed) and, ``verify``ing, holds the
        rows its records say, and no Pub/Sub message is in two of them."""
        problems: list[str] = []
        written_in: dict[str, str] = {}  # Pub/Sub message id -> the file that holds it
        for holder, (kind, where, relative) in sorted(self.checked.items()):
            path = self.prefix + holder
            compacted = is_compacted(holder)
            if path not in listed and not FileSystems.exists(path):
                problems.append(f"{where}: its {kind} file {relative} is missing" + (
                    f" (compacted into {holder})" if compacted else ""))
                continue
            if not verify:
                continue
            try:
                found, message_ids, unreadable = _read_file(self.output, path, kind)
            except UnsafePath as exc:  # a symlink, a FIFO: named, never read or waited on
                problems.append(f"{where}: its {kind} file {holder} is refused: {exc}")
                continue
            problems += [f"{where}: {holder} {what}" for what in unreadable]
            if found != self.expected[holder]:
                says = (f"its ledger records say {self.expected[holder]}" if compacted
                        else f"the record says {self.expected[holder]}")
                problems.append(f"{where}: {holder} holds {found} rows, {says}")
            problems += _written_twice(message_ids, holder, written_in)
        return problems


_NOT_COMPACTED = PartitionView(None, {}, set())


def _read_file(output: str, path: str, kind: str) -> tuple[int, list, list[str]]:
    """(the rows or dead letters a file of ``kind`` holds, the Pub/Sub message ids of its rows
    (vectors) or dead letters, what is wrong with it)."""
    if kind != "dead letter":
        return (parquet_rows([path], output),
                _row_message_ids(output, path) if kind == "vectors" else [], [])
    lines = [line for line in _read(output, path).splitlines() if line]
    message_ids = [_letter_message_id(line) for line in lines]
    return len(lines), message_ids, (["holds a line that is not a dead letter"]
                                     if ... in message_ids else [])


_LISTED = ((VECTORS_DIR, ".parquet"), (CHUNKS_DIR, ".parquet"), (KEYS_DIR, ".parquet"),
           (DEAD_LETTER_DIR, ".jsonl"), (LEDGER_DIR, (".json", ".jsonl")))


def _listing(output: str, partitions: Optional[list[str]]) -> dict[str, list[str]]:
    """{folder: the files of its partitions}: one listing per folder (and partition)."""
    return {subdir: _list(output, subdir, suffix, partitions) for subdir, suffix in _LISTED}


def _listing_problems(listed: dict[str, list[str]], files: _RecordFiles, window: _Window
                      ) -> list[str]:
    """The files of the output that no record accounts for: a compacted file no compaction
    manifest names or that replaces no record's file, a micro-batch file a compaction replaced
    that is still there, and an in-range micro-batch file no record (or more than one) names."""
    problems = []
    for subdir, paths in listed.items():
        for path in paths:
            problem = _listed_file_problem(path, subdir, files, window)
            if problem is not None:
                problems.append(problem)
    return problems


def _listed_file_problem(path: str, subdir: str, files: _RecordFiles,
                         window: _Window) -> Optional[str]:
    relative = path[len(files.prefix):]
    partition = partition_of(relative)
    view = files.view(relative)
    if is_compacted(relative):
        if not view.visible(relative):
            return (f"partition {partition}: {relative} is named by no compaction manifest (an "
                    f"unfinished compaction: run newsvec compact again)")
        if subdir != LEDGER_DIR and relative not in files.expected:
            return f"partition {partition}: {relative} replaces no ledger record's file"
        return None
    if not view.visible(relative):
        return (f"partition {partition}: {relative} was compacted into "
                f"{view.replaced[relative]} but is still there (an unfinished compaction: run "
                f"newsvec compact again)")
    if subdir == LEDGER_DIR:
        return None
    name = PartFileName.parse(path)
    start = name.window_start if name else None
    if start is None or not window.holds(start) or (
            subdir == KEYS_DIR and name and name.digest is None):
        return None  # out of range; or keys/ of a release whose records did not name them
    if files.named[path] == 0:
        return f"{_window_where(start)}: {relative} has no ledger record"
    if files.named[path] > 1:
        return f"{_window_where(start)}: {relative} is named by {files.named[path]} ledger records"
    return None


def _totals(records: list, windows: int, store_totals: dict, balanced: bool) -> dict:
    total = Counts.total(r.counts for r in records)
    return {"windows": windows, "records": len(records), "messages_in": total.articles_in,
            "rows_written": total.written, "dead_lettered": total.dead_lettered,
            "duplicates": total.duplicates,
            "late_reassigned": sum(r.late_reassigned for r in records),
            "chunks_written": total.chunks_written,
            "dead_lettered_by_reason": dict(total.dead_lettered_by_reason),
            "dead_lettered_by_language": {language: dict(by_reason) for language, by_reason
                                          in total.dead_lettered_by_language.items()},
            **store_totals, "balanced": balanced}


def _load_key(r) -> Optional[str]:
    """The store load key a record's micro-batch loads under (``sinks.micro_batch_load_key``),
    also when its record names none (it had no rows): None for records without a digest."""
    if r.store_load_key:
        return r.store_load_key
    if r.digest is None:
        return None
    start = utc_time(r.window_start)
    return None if start is None else streaming_load_key(start, r.pane, r.shard, r.digest)


_ORDER_COLUMNS = [c for c in VERSION_ORDER if c != "dt"]


_FILE_COLUMNS = ("id", "text_sha256", *_ORDER_COLUMNS)


_CHUNK = 5000  # article ids per query of the store, and file rows compared at a time


def _file_columns(output: str, path: str, columns) -> Optional[pa.Table]:
    """``columns`` of a Parquet file of the output, those it has (a file written before
    ``updated_at`` lacks it), never the others (its embeddings); None if it is gone (named
    missing by the file checks) or not a regular file of the output (a symlink, a FIFO: named
    by the file checks, never read)."""
    if not FileSystems.exists(path):
        return None
    try:
        return read_parquet(output, [path], columns)
    except UnsafePath:
        return None


def _letter_ids(output: str, holders: set[str]) -> set[str]:
    """The article ids of the dead letters of the dead-letter files ``holders`` (a file that is
    gone or not a regular file of the output: none, the file checks name it)."""
    letters: set[str] = set()
    for holder in sorted(holders):
        path = join_path(output, holder)
        if not FileSystems.exists(path):
            continue
        try:
            data = _read(output, path)
        except UnsafePath:
            continue
        for line in data.splitlines():
            if line.strip():
                event_id = json.loads(line).get("event_id")
                if isinstance(event_id, str):
                    letters.add(event_id)
    return letters


def _check_store(output: str, records: list, settings: StoreSettings, verify: bool,
                 holders: dict[str, set[str]]) -> tuple[list[str], dict, frozenset]:
    """The store against the records (``newsvec ledger --store``): each record with rows was loaded
    (its load key is in ``<table>_loads`` with its row count and its rejected rows), and its
    stored rows and rejected rows add up to its rows; verifying, every article version of the
    vectors files (read through the compaction manifests) is the stored row of its article or
    older than it, except the rows the store refused; no row stored under a micro-batch's key is
    missing from the files (a message that micro-batch dead-lettered, an earlier attempt's row);
    and no article a micro-batch withdrew (``store_withdrawn``: a redo with another outcome) is
    without a row while a vectors file of the output holds it. The files are read one at a time,
    only the columns compared (never the embeddings), ``_CHUNK`` rows at a time. The store is
    read through its contract (``transforms.stores.base.StoreReader``). Also the load keys of
    the records that the store holds."""
    prefix = output.rstrip("/") + "/"
    found = _StoreCheck()
    problems = found.read_records(records)
    store = store_for(settings)
    with store.reader() as stored:
        loads: dict = {key: (load.rows, len(load.rejected))
                       for key, load in stored.loads(list(found.keys)).items()}
        gone = set(found.withdrawn) - set(stored.rows(list(found.withdrawn)))  # and no row now
        for holder in sorted(holders["vectors"]) if verify else ():
            table = _file_columns(output, prefix + holder, _FILE_COLUMNS)
            if table is not None:
                found.compare_file(stored, holder, table, gone)
        if verify:
            letters = sorted(_letter_ids(output, holders["dead letter"]))
            found.suspect(stored.rows(letters))
    problems += found.problems(loads)
    if gone - set(found.held_by):  # not in the files checked: any vectors file of the output
        for path in _list(output, VECTORS_DIR, ".parquet", None):
            holder = path[len(prefix):]
            if holder in holders["vectors"]:
                continue
            table = _file_columns(output, path, ("id",))
            if table is not None and "id" in table.column_names:
                for doc_id in gone.intersection(table.column("id").to_pylist()):
                    found.held_by.setdefault(doc_id, holder)
    problems += found.withdrawn_problems()
    return problems, {"store_loads": len(found.keys), "store_articles": len(found.found),
                      "store_rejected": sum(found.by_reason.values()),
                      "store_rejected_by_reason": dict(sorted(found.by_reason.items())),
                      "store_withdrawn": len(found.withdrawn)}, frozenset(loads)


@dataclasses.dataclass
class _StoreCheck:
    """What ``_check_store`` gathers: from the records, what the store should hold; from the
    vectors files and the store, what differs."""

    # load key -> (where, rows stored, rows refused) of each record that loaded
    keys: dict[str, tuple[str, int, int]] = dataclasses.field(default_factory=dict)
    batch_keys: dict[str, str] = dataclasses.field(default_factory=dict)  # micro-batch's -> where
    rejected: set[tuple] = dataclasses.field(default_factory=set)  # (id, text_sha256) refused
    by_reason: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # article -> the first record that withdrew it
    withdrawn: dict[str, str] = dataclasses.field(default_factory=dict)
    missing: list[str] = dataclasses.field(default_factory=list)
    older: list[str] = dataclasses.field(default_factory=list)
    named: set[str] = dataclasses.field(default_factory=set)  # articles already named: each once
    matched: set[str] = dataclasses.field(default_factory=set)  # whose stored row a file holds
    # article -> its row's load key: a micro-batch's, no file's yet
    suspects: dict[str, str] = dataclasses.field(default_factory=dict)
    found: set[str] = dataclasses.field(default_factory=set)  # of the files, held by the store
    # withdrawn article with no row -> a vectors file that holds it
    held_by: dict[str, str] = dataclasses.field(default_factory=dict)
    # vectors files under a dt= folder that is no day (planted): named, not compared
    not_compared: list[str] = dataclasses.field(default_factory=list)

    def read_records(self, records: list) -> list[str]:
        """What the records say the store holds; a problem for each that does not add up."""
        problems = []
        for r in records:
            where = _where(r)
            key = _load_key(r)
            if key is not None:
                self.batch_keys[key] = where
            for item in r.store_rejected:
                self.rejected.add((item.get("id"), item.get("text_sha256")))
                self.by_reason[str(item.get("reason"))] += 1
            for doc_id in r.store_withdrawn:
                self.withdrawn.setdefault(doc_id, where)
            if r.rows_written and not r.store_load_key:
                problems.append(f"{where}: {r.rows_written} rows but no store load in its record")
                continue
            if r.store_load_key:
                self.keys[r.store_load_key] = (where, r.store_rows, len(r.store_rejected))
                if r.store_rows + len(r.store_rejected) != r.rows_written:
                    problems.append(f"{where}: {r.store_rows} rows stored and "
                                    f"{len(r.store_rejected)} refused by the store, of "
                                    f"{r.rows_written} rows")
        return problems

    def compare_file(self, stored, holder: str, table: pa.Table, gone: set[str]) -> None:
        """The rows of one vectors file against the store's, ``_CHUNK`` at a time."""
        try:
            day_value = day_of_path(holder)
        except ValueError:
            self.not_compared.append(f"{holder}: its dt= folder is no day: not compared with the "
                                     "store")
            return
        values: dict[str, list[Any]] = {
            name: ((table.column(name).cast(pa.int64()) if name in _ORDER_COLUMNS
                    else table.column(name)).to_pylist()
                   if name in table.column_names else [None] * table.num_rows)
            for name in _FILE_COLUMNS}
        for doc_id in gone.intersection(values["id"]):
            self.held_by.setdefault(doc_id, holder)
        for start in range(0, table.num_rows, _CHUNK):
            end = min(start + _CHUNK, table.num_rows)
            rows_held = stored.rows(values["id"][start:end])
            for i in range(start, end):
                self._compare_row(rows_held.get(values["id"][i]),
                                  {name: values[name][i] for name in _FILE_COLUMNS}, day_value)

    def _compare_row(self, held: Optional[dict], row: dict[str, Any],
                     day: Optional[dt.date]) -> None:
        """One file row (``_FILE_COLUMNS``) against the store's row of its article (None: none)."""
        doc_id, sha = row["id"], row["text_sha256"]
        if held is not None:
            self.found.add(doc_id)
        same = held is not None and held["text_sha256"] == sha and \
            _micros(held["embedded_at"]) == row["embedded_at"]
        if same:
            self.matched.add(doc_id)
        elif held is not None and held["load_key"] in self.batch_keys:
            self.suspects.setdefault(doc_id, held["load_key"])
        if same or (_printable(doc_id), _printable(sha)) in self.rejected:
            return
        if held is None:
            self.missing.append(doc_id)
            return
        version = {name: row[name] for name in _ORDER_COLUMNS}
        version["dt"] = day
        if not version_key(held) > version_key(version):
            self.older.append(f"{doc_id} (the files' text {sha}, the store's "
                              f"{held['text_sha256']})")
            self.named.add(doc_id)

    def suspect(self, held: dict[str, dict]) -> None:
        """The stored rows of dead-lettered articles that a micro-batch's load stored."""
        for doc_id, row in held.items():
            if row["load_key"] in self.batch_keys:
                self.suspects.setdefault(doc_id, row["load_key"])

    def problems(self, loads: dict) -> list[str]:
        """The loads the store lacks or holds otherwise, and the rows that differ."""
        problems = list(self.not_compared)
        for key, (where, rows, refused) in sorted(self.keys.items()):
            if key not in loads:
                problems.append(f"{where}: its store load {key} is not in the store")
            elif loads[key] != (rows, refused):
                problems.append(f"{where}: the store loaded {loads[key][0]} rows (refused "
                                f"{loads[key][1]}) under {key}, the record says {rows} (refused "
                                f"{refused})")
        if self.missing:
            problems.append(f"store: {len(self.missing)} articles of the vectors files are not in "
                            f"the store (first: {_printable(sorted(self.missing)[0])})")
        if self.older:
            problems.append(f"store: {len(self.older)} articles are stored as an older version "
                            f"than the vectors files hold (first: "
                            f"{_printable(sorted(self.older)[0])})")
        strays = sorted(f"{doc_id} (under {key})" for doc_id, key in self.suspects.items()
                        if doc_id not in self.matched and doc_id not in self.named)
        if strays:
            problems.append(f"store: {len(strays)} rows stored by a micro-batch are not in its "
                            f"files (dead-lettered there, or an earlier attempt's; first: "
                            f"{_printable(strays[0])})")
        return problems

    def withdrawn_problems(self) -> list[str]:
        if not self.held_by:
            return []
        first = sorted(self.held_by)[0]
        return [f"store: {len(self.held_by)} articles that a redone micro-batch withdrew have no "
                f"row in the store although a vectors file holds them (first: "
                f"{_printable(first)}, withdrawn in {self.withdrawn[first]}, held by "
                f"{self.held_by[first]})"]


def _micros(value: Optional[dt.datetime]) -> Optional[int]:
    if value is None:
        return None
    return (value - _EPOCH) // dt.timedelta(microseconds=1)


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)

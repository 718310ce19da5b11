"""The operator's status of the output the config names (``GET /status`` and ``/status.json``):
``collect(config, hours)`` reads what newsvec already writes and returns it as one JSON-
serialisable dict (``Status.to_dict``), which the page (``pipeline.serve.pages``) only draws.

- A batch output: the run its manifest names (committed, or publishing), with the counts of its
  ``_summary.json`` (``manifest.published_summary``) and whether they balance (``Counts``), how
  long it took from launch (its run id) to commit, and whether the store holds its load; with
  ``{date}`` in the config's ``output``, the same for each of the last ``BATCH_DAYS`` days.
- A streaming output: the windows of the last ``hours`` hours, from their ledger records, each
  flagged with the problems ``newsvec ledger`` finds in it (``ledger_check.check``, without
  opening data files: ``verify=False``; with the store on, its loads); each hour's compaction
  (closed as ``newsvec compact`` decides, ``pipeline.compact.hour_closed``); and the store's lag.

It reads ledger records, manifests and summaries, never the Parquet rows, and a file it cannot
read is a problem it names, never an exception. ``StatusCache`` keeps each answer a few seconds,
so that a page reloaded in a loop reads the output (GCS) at most that often.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime as dt
import logging
import time
from typing import Any, Callable, Optional

from pipeline.compact import CLOSED_MARGIN_S, default_closed_after_s, hour_closed
from pipeline.config import Config
from transforms.output.layout import partition_hour, partitions_between, run_id_time
from transforms.output.ledger_check import LedgerReport, check, problem_window
from transforms.output.manifest import COMMITTED, published_summary, read_manifest
from transforms.stores.base import StoreError, batch_load_key
from transforms.types import Counts, LedgerRecord, utc_time

DEFAULT_HOURS = 3
MAX_HOURS = 48  # the most hours of windows one answer reads (``?hours=``)
BATCH_DAYS = 7  # a batch output with {date}: the days shown
CACHE_S = 5.0  # how long an answer is kept (``StatusCache``)
_LOG = logging.getLogger("newsvec.serve")


@dataclasses.dataclass
class BatchRun:
    """The run a batch output's manifest names (``state`` ``none``: it names none)."""

    output: str
    day: Optional[str] = None
    run_id: Optional[str] = None
    state: str = "none"  # committed, publishing, none, unreadable
    launched_at: Optional[str] = None  # from the run id
    committed_at: Optional[str] = None
    duration_s: Optional[float] = None  # launch to commit
    published: Optional[bool] = None
    superseded_by: Optional[str] = None
    counts: Optional[dict] = None  # the summary's (``Counts.to_summary``)
    balanced: Optional[bool] = None
    store_loaded: Optional[bool] = None  # None: no store, or not asked
    problems: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class WindowStatus:
    """One event-time window: the sum of its micro-batches' ledger records, and what ``newsvec
    ledger`` finds wrong in it (``problems``; ``balanced`` when none)."""

    window_start: str
    window_end: Optional[str] = None
    micro_batches: int = 0
    messages_in: int = 0
    rows_written: int = 0
    rows_per_minute: float = 0.0
    messages_per_minute: float = 0.0
    dead_lettered: int = 0
    dead_lettered_by_reason: dict = dataclasses.field(default_factory=dict)
    duplicates: int = 0
    near_duplicates: int = 0
    late_reassigned: int = 0
    last_written_at: Optional[str] = None  # the newest of its records' written_at
    written_after_end_s: Optional[float] = None  # that, less the window's end
    settled: bool = False  # past allowed lateness plus a margin: no late pane to come
    store_loaded: Optional[bool] = None  # every micro-batch's load is in the store
    balanced: bool = True
    problems: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class HourCompaction:
    partition: str
    closed: bool  # ``newsvec compact`` would take it now
    micro_batches: int  # whose record is in range
    compacted: int  # of them, in the hour's compacted files
    compacted_at: Optional[str] = None


@dataclasses.dataclass
class StoreLag:
    """The store against the ledger: the micro-batches that loaded rows, and which of those the
    store's ``<table>_loads`` holds."""

    table: str
    micro_batches: int = 0
    loaded: Optional[int] = None  # None: the store could not be read
    last_written_at: Optional[str] = None  # the newest micro-batch that loaded rows
    last_loaded_at: Optional[str] = None  # the newest of those the store holds
    lag_s: Optional[float] = None  # between the two
    error: Optional[str] = None


@dataclasses.dataclass
class StreamingStatus:
    start: str
    end: str
    window_s: float
    totals: dict  # ``newsvec ledger``'s totals over the range
    windows: list  # WindowStatus, oldest first
    flagged: list  # the window starts whose window has problems
    compaction: list  # HourCompaction, oldest first
    store: Optional[StoreLag] = None


@dataclasses.dataclass
class Status:
    output: str
    kind: str  # batch or streaming
    generated_at: str
    hours: int
    ok: bool = True
    problems: list = dataclasses.field(default_factory=list)  # of no one window or run
    runs: list = dataclasses.field(default_factory=list)  # BatchRun, newest day first
    streaming: Optional[StreamingStatus] = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def collect(config: Config, hours: int = DEFAULT_HOURS,
            now: Optional[dt.datetime] = None) -> dict[str, Any]:
    """The status of ``config.output`` at ``now`` (default: the clock), as a JSON-serialisable
    dict; the windows of a streaming output from the start of the hour ``hours`` hours ago."""
    now = now or dt.datetime.now(dt.timezone.utc)
    kind = "streaming" if config.streaming.subscription else "batch"
    status = Status(output=config.output, kind=kind, generated_at=_iso(now), hours=hours)
    try:
        if kind == "streaming":
            status.streaming = _streaming(config, hours, now, status.problems)
            status.ok = not status.problems and not status.streaming.flagged
        else:
            status.runs = _batch_runs(config, now, status.problems)
            status.ok = not status.problems and not any(r.problems for r in status.runs)
    except Exception as exc:  # pylint: disable=broad-except  # a status page, never a 500
        status.streaming, status.runs, status.ok = None, [], False
        status.problems.append(_unexpected("the output's status could not be made", exc))
    return status.to_dict()


def _iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _time(text: Any) -> Optional[dt.datetime]:
    """An RFC 3339 time read from the output; None for anything else."""
    try:
        return utc_time(text) if isinstance(text, str) else None
    except ValueError:
        return None


def _unexpected(what: str, exc: Exception) -> str:
    _LOG.warning("/status: %s", what, exc_info=True)
    return f"{what}: {type(exc).__name__}: {exc}"[:1000]


# Streaming.

def _streaming(config: Config, hours: int, now: dt.datetime, problems: list[str]
               ) -> StreamingStatus:
    start = (now - dt.timedelta(hours=hours)).replace(minute=0, second=0, microsecond=0)
    end = now + dt.timedelta(seconds=config.streaming.window_s)
    report, store_error = _ledger(config, start, end, problems)
    by_window = _windows(report.records, now, config.streaming.allowed_lateness_s)
    for problem in report.problems:
        where = problem_window(problem)
        if where is None:
            problems.append(problem)
            continue
        window = by_window.setdefault(where, WindowStatus(window_start=where))
        window.problems.append(problem)
        window.balanced = False
    store = None
    if config.store.enabled:
        store = _store_lag(config, report, store_error, by_window)
    if store_error is not None:
        problems.append(store_error)
    windows = sorted(by_window.values(),
                     key=lambda w: (_time(w.window_start) or now, w.window_start))
    return StreamingStatus(
        start=_iso(start), end=_iso(end), window_s=config.streaming.window_s,
        totals=report.totals, windows=windows,
        flagged=[w.window_start for w in windows if not w.balanced],
        compaction=_compaction(report, start, end, now, config), store=store)


_NO_REPORT = LedgerReport(totals={}, problems=[])


def _ledger(config: Config, start: dt.datetime, end: dt.datetime, problems: list[str]
            ) -> tuple[LedgerReport, Optional[str]]:
    """``newsvec ledger``'s check of the range (with the store when it is on), without opening
    data files; (the report, why the store could not be read). Where the store cannot be read,
    the ledger is checked without it; where the ledger cannot be read, the reason is a problem."""
    store = config.store if config.store.enabled else None
    store_error = None
    for with_store in ((store, None) if store is not None else (None,)):
        try:
            return check(config.output, start, end, verify=False, store=with_store), store_error
        except StoreError as exc:  # scrubbed of the connection string
            store_error = f"the store could not be read: {exc}"
        except Exception as exc:  # pylint: disable=broad-except  # a status page, never a 500
            problems.append(_unexpected("the ledger could not be read", exc))
            break
    return _NO_REPORT, store_error


def _windows(records: list[LedgerRecord], now: dt.datetime, lateness_s: float
             ) -> dict[str, WindowStatus]:
    """The records summed by window."""
    grouped: dict[str, list[LedgerRecord]] = collections.defaultdict(list)
    for r in records:
        grouped[r.window_start].append(r)
    out = {}
    for start, group in grouped.items():
        try:
            out[start] = _window(start, group, now, lateness_s)
        except (OverflowError, ValueError) as exc:  # 10**400 rows, a window ending in 9999
            out[start] = WindowStatus(window_start=start, micro_batches=len(group),
                                      balanced=False, problems=[
                                          f"window {start}: its ledger records hold values no "
                                          f"newsvec run writes ({type(exc).__name__}: "
                                          f"{exc})"[:1000]])
    return out


def _window(start: str, group: list[LedgerRecord], now: dt.datetime, lateness_s: float
            ) -> WindowStatus:
    """A window's status, from its records."""
    counts = Counts.total(r.counts for r in group)
    first, last = _time(start), _time(group[0].window_end)
    minutes = (last - first).total_seconds() / 60 if first and last and last > first else 1
    written = [t for t in (_time(r.written_at) for r in group) if t is not None]
    newest = max(written, default=None)
    return WindowStatus(
        window_start=start, window_end=group[0].window_end, micro_batches=len(group),
        messages_in=counts.articles_in, rows_written=counts.written,
        rows_per_minute=round(counts.written / minutes, 3),
        messages_per_minute=round(counts.articles_in / minutes, 3),
        dead_lettered=counts.dead_lettered,
        dead_lettered_by_reason=dict(counts.dead_lettered_by_reason),
        duplicates=counts.duplicates, near_duplicates=counts.near_duplicates,
        late_reassigned=sum(r.late_reassigned for r in group),
        last_written_at=_iso(newest) if newest else None,
        written_after_end_s=(round((newest - last).total_seconds(), 3)
                             if newest and last else None),
        settled=bool(last and last + dt.timedelta(seconds=lateness_s + CLOSED_MARGIN_S)
                     <= now))


def _compaction(report: LedgerReport, start: dt.datetime, end: dt.datetime, now: dt.datetime,
                config: Config) -> list[HourCompaction]:
    """Each hour of the range: closed or not, its micro-batches, and how many are compacted
    (its compaction manifest's, as the ledger read them)."""
    per_hour = collections.Counter(r_partition for r_partition in (
        _partition_of(r.window_start) for r in report.records) if r_partition)
    closed_after_s = default_closed_after_s(config.streaming)
    out = []
    for partition in partitions_between(start, end):
        view = report.views.get(partition)
        manifest = view.manifest if view is not None else None
        out.append(HourCompaction(
            partition=partition,
            closed=hour_closed(partition_hour(partition), closed_after_s, now),
            micro_batches=per_hour.get(partition, 0),
            compacted=len(manifest.batches) if manifest is not None else 0,
            compacted_at=manifest.compacted_at if manifest is not None else None))
    return out


def _partition_of(window_start: str) -> Optional[str]:
    """The ``dt=/hour=`` partition a window's files are under: its start's hour."""
    t = _time(window_start)
    return partitions_between(t, t + dt.timedelta(seconds=1))[0] if t else None


def _store_lag(config: Config, report: LedgerReport, error: Optional[str],
               by_window: dict[str, WindowStatus]) -> StoreLag:
    """The micro-batches that loaded rows against the loads the store holds; each window's
    ``store_loaded``."""
    keyed = [r for r in report.records if r.store_load_key]
    lag = StoreLag(table=config.store.table, micro_batches=len(keyed), error=error)
    written = [t for t in (_time(r.written_at) for r in keyed) if t]
    lag.last_written_at = _iso(max(written)) if written else None
    if error is not None:
        return lag
    held = [r for r in keyed if r.store_load_key in report.store_loaded]
    lag.loaded = len(held)
    loaded = [t for t in (_time(r.written_at) for r in held) if t]
    lag.last_loaded_at = _iso(max(loaded)) if loaded else None
    if written and loaded:
        lag.lag_s = round((max(written) - max(loaded)).total_seconds(), 3)
    for start, window in by_window.items():
        keys = [r.store_load_key for r in keyed if r.window_start == start]
        window.store_loaded = all(k in report.store_loaded for k in keys) if keys else None
    return lag


# Batch.

def _batch_outputs(config: Config, now: dt.datetime) -> list[tuple[str, Optional[dt.date]]]:
    """(output, its day) of the config's output and, where ``{date}`` filled it with an ISO
    day, of the same output on each of the last ``BATCH_DAYS`` days; newest day first."""
    day = config.filled_day
    if day is None or config.output.count(day.isoformat()) != 1:
        return [(config.output, day)]
    today = now.astimezone(dt.timezone.utc).date()
    days = {day} | {today - dt.timedelta(days=i) for i in range(BATCH_DAYS)}
    return [(config.output.replace(day.isoformat(), d.isoformat()), d)
            for d in sorted(days, reverse=True)]


def _batch_runs(config: Config, now: dt.datetime, problems: list[str]) -> list[BatchRun]:
    runs = []
    for output, day in _batch_outputs(config, now):
        run = _batch_run(output, day)
        if run.state != "none" or output == config.output:
            runs.append(run)
    if config.store.enabled:
        _mark_loaded(config, runs, problems)
    return runs


def _batch_run(output: str, day: Optional[dt.date]) -> BatchRun:
    """What the output's manifest and summary say of its run; a file that cannot be read, or
    counts that do not balance, are the run's problems."""
    run = BatchRun(output=output, day=day.isoformat() if day else None)
    try:
        manifest = read_manifest(output)
        if manifest is None:
            return run
        run.run_id, run.state, run.committed_at = manifest.run_id, manifest.state, \
            manifest.committed_at
        launched = run_id_time(manifest.run_id)
        run.launched_at = _iso(launched)
        committed = _time(manifest.committed_at)
        if committed is not None:
            run.duration_s = round((committed - launched).total_seconds(), 3)
        if manifest.state != COMMITTED:
            started = dt.datetime.fromtimestamp(manifest.started_at, dt.timezone.utc)
            run.problems.append(f"publishing since {_iso(started)}: a publish in progress, or "
                                "one killed midway (newsvec cleanup finishes it)")
            _counted(run, manifest.counts)
            return run
        summary = published_summary(output)
        run.published, run.superseded_by = summary.is_published, summary.superseded_by
        if summary.summary_unavailable:
            run.problems.append(summary.summary_unavailable)
        _counted(run, summary.counts if summary.counts is not None else manifest.counts)
        if summary.invariant_holds is False:
            run.problems.append("its summary says the accounting does not hold")
    except Exception as exc:  # pylint: disable=broad-except  # a status page, never a 500
        run.state = "unreadable" if run.run_id is None else run.state
        run.problems.append(_unexpected(f"{output} could not be read", exc))
    return run


def _counted(run: BatchRun, counts: Any) -> None:
    """The run's counts and whether they balance (``Counts``, as the commit checks them)."""
    if not isinstance(counts, dict):
        run.problems.append("no counts recorded")
        return
    wrong = _not_counts(counts)
    if wrong:
        run.problems.append(f"its counts hold what no newsvec run writes: {wrong}"[:1000])
        return
    found = Counts.from_summary(counts)
    run.counts = found.to_summary()
    run.balanced = found.balances() and found.reasons_add_up()
    if not run.balanced:
        run.problems.append(
            f"does not balance: in {found.articles_in} != written {found.written} + dead "
            f"letters {found.dead_lettered} + duplicates {found.duplicates} + unchanged "
            f"{found.unchanged} + near duplicates {found.near_duplicates}, or its dead "
            "letters by reason do not add up")


def _not_counts(counts: dict) -> Optional[str]:
    """What in a summary's or manifest's ``counts`` is not a count (a non-negative integer, by
    reason and by language alike): Infinity, NaN, a string...; None when all are."""
    def wrong(value: Any, depth: int) -> bool:
        if isinstance(value, dict):
            return depth == 0 or any(wrong(v, depth - 1) for v in value.values())
        return isinstance(value, bool) or not isinstance(value, int) or value < 0

    for key, value in counts.items():
        if wrong(value, {"dead_lettered_by_reason": 1,
                         "dead_lettered_by_language": 2}.get(key, 0)):
            return f"{str(key)[:100]} is {str(value)[:100]}"
    return None


def _mark_loaded(config: Config, runs: list[BatchRun], problems: list[str]) -> None:
    """Each committed run's ``store_loaded``: whether ``<table>_loads`` holds its load key."""
    from transforms.stores import store_for

    keys = {r.run_id: batch_load_key(r.run_id) for r in runs
            if r.run_id and r.state == COMMITTED}
    if not keys:
        return
    try:
        with store_for(config.store).reader() as read:
            held = read.loads(list(keys.values()))
    except StoreError as exc:
        problems.append(f"the store could not be read: {exc}")
        return
    for run in runs:
        if run.run_id in keys:
            run.store_loaded = keys[run.run_id] in held
            if not run.store_loaded:
                run.problems.append(f"not loaded into the store: newsvec load --run-id "
                                    f"{run.run_id}")


class StatusCache:
    """``collect``'s answers, each kept ``ttl_s``, or twice as long as it took to collect where
    that is longer (an output slow to read is read at most a third of the time). One collection
    at a time, in one thread: the requests that come meanwhile (a reload loop, many tabs) wait
    for it on the event loop, holding no thread that the service's searches need, and share it."""

    def __init__(self, config: Config, ttl_s: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic,
                 collector: Optional[Callable[[Config, int], dict]] = None):
        self._config, self._ttl_s, self._clock = config, ttl_s, clock
        self._collect = collector or collect
        self._lock = asyncio.Lock()
        self._held: dict[int, tuple[float, dict]] = {}  # hours -> (kept until, the status)

    async def get(self, hours: int) -> dict:
        async with self._lock:
            held = self._held.get(hours)
            if held is not None and self._clock() < held[0]:
                return held[1]
            started = self._clock()
            status = await asyncio.to_thread(self._collect, self._config, hours)
            now = self._clock()
            self._held = {h: v for h, v in self._held.items() if now < v[0]}
            self._held[hours] = (now + max(self._ttl_s, 2 * (now - started)), status)
            return status

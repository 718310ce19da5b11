"""Commit a batch run, the job's last step: check its ledger against what it wrote, then publish it,
so that a rerun of the same input into the same output replaces the previous run, never appends to
it.

``CommitRun`` counts what is in the run's staging folder (rows from the Parquet footers, dead
letters by reason from the JSON Lines) and checks ``in = written + dead_lettered + duplicates +
unchanged`` (``Counts``) against the job's own tallies (and one key in ``keys/`` per row). A run
that does not balance fails here and publishes nothing: a run that fails or is killed before this
step leaves the previous output as it was. Then it writes the run's ``_summary.json``, publishes
the run under the output's manifest (``transforms.output.manifest``), and deletes what runs killed
before they committed left in ``_staging/`` and ``_temp/`` more than ``STALE_AFTER_S`` ago.

All of it holds the output's publish lease (``transforms.output.lease``): one commit at a time per
output. The newest run wins: run ids begin with their launch time (``layout.new_run_id``), and a run
finds, under the lease, whether a run launched after it already holds the output; then it publishes
nothing (its summary says ``published: false`` and ``superseded_by``). So a retried launch, a manual
rerun or a backfill of a day replaces an older launch's output even if the older one finishes last,
and a slow older launch never overwrites a newer one. """
from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import enum
import json
import logging
import time
from typing import Optional

import apache_beam as beam

from transforms.incremental import KeyFiles
from transforms.output.layout import (
    CHUNKS_DIR,
    DEAD_LETTER_DIR,
    KEYS_DIR,
    PUBLISHED_DIRS,
    SUMMARY_FILE,
    VECTORS_DIR,
    is_local,
    join_path,
    open_output_file,
    parquet_rows,
    relative_to,
    run_id_time,
    staging_prefix,
    write_whole,
)
from transforms.output.lease import PublishLease
from transforms.output.manifest import (
    PUBLISHING,
    STALE_AFTER_S,
    Manifest,
    Snapshot,
    SnapshotChanged,
    clean_stale,
    count_stored,
    delete_tree_fenced,
    publish,
    published_summary,
    read_manifest,
    write_manifest,
)
from transforms.output.summary import RunSummary
from transforms.types import Counts

_LOG = logging.getLogger(__name__)


class AccountingError(RuntimeError):
    """Some input is neither written, dead-lettered nor a counted duplicate."""


class RunFromTheFuture(RuntimeError):
    """The output holds a run launched, by its id, later than now by more than
    ``FUTURE_RUN_SKEW_S``: no run launched before that time could ever supersede it, so every
    run would publish nothing. A clock that is wrong (the machine that launched it, or this one),
    or a manifest written by someone else; nothing is published until someone looks."""


FUTURE_RUN_SKEW_S = 3600.0  # the clock difference between two launching machines taken as normal


class Tally(enum.StrEnum):
    """What the job counts on its way, summed for ``CommitRun`` and checked against storage."""

    IN = "in"  # articles read
    ROWS = "rows"  # vector rows sent to the writer
    DUPLICATES = "duplicates"
    UNCHANGED = "unchanged"
    NEAR_DUPLICATES = "near_duplicates"  # copies not embedded (near_duplicates.action skip)
    TRUNCATED = "truncated"
    CHUNKS = "chunks"  # chunk rows sent to the writer


class _CommitFn(beam.DoFn):
    def __init__(self, output: str, run_id: str, summary: RunSummary, lease_s: float):
        self._output, self._run_id, self._summary, self._lease_s = output, run_id, summary, lease_s

    def process(self, _, staged, tallies, skipped_from=(), key_files=None):
        # A staged file swapped for a symlink or a FIFO (a writer of the output) is refused here,
        # before the lease is taken (and again where it is read, under the lease). One gone is
        # not: a retried attempt of a commit that published finds its staging deleted.
        for _, path in staged:
            if is_local(path):
                try:
                    open_output_file(self._output, path).close()
                except FileNotFoundError:
                    pass
        # Everything below runs under the output's publish lease, so that two attempts of this
        # commit (a work item executed twice at once), another run, or a clean-up never act on
        # the output together, and each decision reads the manifest as the holder left it.
        summary = self._summary if key_files is None else _with_previous(self._summary, key_files)
        with PublishLease(self._output, self._run_id, self._lease_s) as lease:
            yield self._commit(staged, tallies, lease, list(skipped_from), summary)

    def _settled(self, lease: PublishLease) -> Optional[Manifest]:
        """The output's manifest once no publish of this run or a newer one is left cut off:
        such a publish is finished first (``publish``, with its snapshot check). A newer run's
        whose check fails is withdrawn by it (its previous manifest put back), and this run
        decides again on what is there then."""
        while True:
            current = read_manifest(self._output, lease)
            if (current is None or current.state != PUBLISHING
                    or current.run_id < self._run_id):
                return current
            try:
                # This run's (another attempt got here first and was cut off: its staged files
                # are whole until the manifest says committed), or a newer run's.
                return publish(self._output, current, lease)
            except SnapshotChanged:
                if current.run_id == self._run_id:
                    raise
                _LOG.warning("run %s: the newer run %s's cut-off publish failed its snapshot "
                             "check and was withdrawn", self._run_id, current.run_id,
                             exc_info=True)

    def _commit(self, staged, tallies, lease: PublishLease, skipped_from: list[Snapshot],
                base: RunSummary) -> RunSummary:
        current = self._settled(lease)
        if current is not None and current.run_id == self._run_id:
            return self._published_summary()
        if current is not None and current.run_id > self._run_id:
            return self._superseded(current, lease, base)
        files, counts, summary = self._checked(staged, tallies, base)
        self._publish(files, counts, summary, lease, skipped_from, current)
        return summary

    def _superseded(self, current: Manifest, lease: PublishLease, base: RunSummary) -> RunSummary:
        """The summary of a run that publishes nothing: a run launched after it holds the output
        (``RunFromTheFuture`` if that one was launched too far ahead of now)."""
        ahead = (run_id_time(current.run_id)
                 - dt.datetime.now(dt.timezone.utc)).total_seconds()
        if ahead > FUTURE_RUN_SKEW_S:
            raise RunFromTheFuture(
                f"{self._output}: its manifest names run {current.run_id} "
                f"({current.state}), launched {ahead / 3600:.1f} h from now by its id: no "
                f"run could supersede it, so run {self._run_id} publishes nothing and fails. "
                "A clock is wrong (the machine that launched that run, or this one), or "
                "someone else wrote the manifest: check it, then move _manifest.json aside "
                "and rerun")
        # A run launched after this one holds the output: the newest run wins, whichever
        # commits last. This run publishes nothing.
        delete_tree_fenced(staging_prefix(self._output, self._run_id), lease)
        return base.replace(run_id=self._run_id, published=False, superseded_by=current.run_id)

    def _checked(self, staged, tallies, base: RunSummary
                 ) -> tuple[dict[str, list[str]], Counts, RunSummary]:
        """(the staged files by folder, what they hold, the run's summary), once what they hold
        balances with the job's tallies (``AccountingError`` if not)."""
        files: dict[str, list[str]] = {subdir: [] for subdir in PUBLISHED_DIRS}
        for subdir, path in staged:
            files[subdir].append(path)
        files = {subdir: sorted(paths) for subdir, paths in files.items()}
        sent = collections.defaultdict(int, tallies)
        stored = count_stored(files[VECTORS_DIR], files[DEAD_LETTER_DIR], files[CHUNKS_DIR],
                              output=self._output)
        keys = parquet_rows(files[KEYS_DIR], self._output)
        counts = dataclasses.replace(
            stored, articles_in=sent[Tally.IN], duplicates=sent[Tally.DUPLICATES],
            unchanged=sent[Tally.UNCHANGED], near_duplicates=sent[Tally.NEAR_DUPLICATES],
            truncated=sent[Tally.TRUNCATED])
        by_similarity = {name.split(":", 1)[1]: n for name, n in sorted(sent.items())
                         if name.startswith(f"{Tally.NEAR_DUPLICATES}:")}
        summary = base.replace(run_id=self._run_id, counts=counts.to_summary(),
                               invariant_holds=counts.balances(),
                               # what action skip left out, by similarity band
                               near_duplicates_by_similarity=by_similarity or None)
        if (not counts.balances() or counts.written != sent[Tally.ROWS]
                or counts.chunks_written != sent[Tally.CHUNKS] or keys != counts.written):
            raise AccountingError(
                f"run {self._run_id} does not balance, nothing published: in={counts.articles_in}, "
                f"written (in storage)={counts.written} (rows sent: {sent[Tally.ROWS]}, keys "
                f"{keys}), dead_lettered={counts.dead_lettered}, duplicates={counts.duplicates}, "
                f"unchanged={counts.unchanged}, near_duplicates={counts.near_duplicates}, "
                f"chunks (in storage)={counts.chunks_written} "
                f"(sent: {sent[Tally.CHUNKS]})")
        return files, counts, summary

    def _publish(self, files: dict[str, list[str]], counts: Counts, summary: RunSummary,
                 lease: PublishLease, skipped_from: list[Snapshot],
                 current: Optional[Manifest]) -> None:
        """The run's summary written, its manifest published, and what runs killed before their
        commit left cleaned up."""
        staging = staging_prefix(self._output, self._run_id)
        summary_path = join_path(staging, SUMMARY_FILE)
        data = summary.to_json()
        lease.change(write_whole, self._output, summary_path, lambda f: f.write(data))
        relative = {subdir: [relative_to(self._output, p) for p in paths]
                    for subdir, paths in files.items()}
        # The snapshots it skipped articles for and the manifest it replaces travel with this
        # run's intent: whoever publishes it checks them first (``manifest.check_snapshots``).
        snapshots = sorted((s.to_dict() for s in skipped_from), key=json.dumps)
        manifest = Manifest(
            run_id=self._run_id, state=PUBLISHING, started_at=time.time(),
            summary=relative_to(self._output, summary_path), counts=counts.to_summary(),
            vectors=relative[VECTORS_DIR], dead_letter=relative[DEAD_LETTER_DIR],
            chunks=relative[CHUNKS_DIR], keys=relative[KEYS_DIR],
            skipped_from=snapshots or None,
            previous=current.to_dict() if snapshots and current is not None else None)
        # This run's intent, visible to the other runs, then checked and published. Of two runs
        # that each skipped articles for the other's output, at least one sees the other's
        # manifest changed and publishes nothing (both may; then both fail and are rerun).
        write_manifest(self._output, manifest, lease)
        publish(self._output, manifest, lease)
        # What runs killed before their commit left here (on local disk, also partial files).
        clean_stale(self._output, STALE_AFTER_S, lease)

    def _published_summary(self) -> RunSummary:
        """This run's summary, as published (``manifest.published_summary``: never another
        run's)."""
        return published_summary(self._output)


def _with_previous(summary: RunSummary, key_files: KeyFiles) -> RunSummary:
    """The summary with what an incremental run read (``ReadKeys``'s ``KeyFiles``): how many
    previous outputs, and the ``previous_outputs`` entries that matched none (allowed by
    ``incremental.may_be_absent``; any other fails the run), so that a run that read nothing says
    so where it is watched."""
    return summary.replace(incremental={**(summary.incremental or {}),
                                        "outputs_read": len(key_files.snapshots),
                                        "absent": list(key_files.absent),
                                        "absent_count": len(key_files.absent)})


def tally(pcoll, name: Tally, value=lambda _: 1):
    """(name, value) per element, for ``CommitRun``'s ``tallies`` (summed per name). The name
    travels as a plain str (a deterministic key for the shuffle), equal to its ``Tally``."""
    key = str(name)
    return pcoll | f"Tally_{key}" >> beam.Map(lambda x: (key, value(x)))


class CommitRun(beam.PTransform):
    """The batch job's last step (see the module docstring), applied to the pipeline. It reads, as
    side inputs, the names of the files the run staged (``files``: the writes' outputs, so it runs
    after them, by folder: ``vectors``, ``dead_letter``, and ``chunks``, ``keys`` where written)
    and the ``Tally`` counts (``tally``), and, in an incremental run, the previous outputs it
    skipped articles for (``skipped_from``: ``Snapshot``) and what it read
    (``key_files``: ``ReadKeys``'s ``KeyFiles``, for the summary). Output: the summary."""

    def __init__(self, output: str, run_id: str, summary: RunSummary, *, files: dict,
                 tallies: list, skipped_from=None, key_files=None, lease_s: float = 600):
        super().__init__()
        unknown = set(files) - set(PUBLISHED_DIRS)
        if unknown:
            raise ValueError(f"not a published folder: {sorted(unknown)}")
        if key_files is not None and skipped_from is None:
            raise ValueError("key_files comes with skipped_from (both an incremental run's)")
        self._fn = _CommitFn(output, run_id, summary, lease_s)
        self._files, self._tallies, self._skipped_from = files, tallies, skipped_from
        self._key_files = key_files

    def expand(self, pbegin):
        totals = (self._tallies | "FlattenTallies" >> beam.Flatten()
                  | "SumTallies" >> beam.CombinePerKey(sum))
        staged = (tuple(names | f"In_{subdir}" >> beam.Map(lambda p, d=subdir: (d, p))
                        for subdir, names in self._files.items())
                  | "StagedFiles" >> beam.Flatten())
        side_inputs = [beam.pvalue.AsList(staged), beam.pvalue.AsDict(totals)]
        if self._skipped_from is not None:
            side_inputs.append(beam.pvalue.AsList(self._skipped_from))
        if self._key_files is not None:
            side_inputs.append(beam.pvalue.AsSingleton(self._key_files))
        return (pbegin
                | "Once" >> beam.Create([None])
                | "CheckAndPublish" >> beam.ParDo(self._fn, *side_inputs))

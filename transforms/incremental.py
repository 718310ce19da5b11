"""Embed only what is new or changed: the key index, and the step that skips what it holds.

Every output that newsvec writes holds a key index beside its vectors: ``keys/`` (batch:
``keys/part-<run_id>-*.parquet``, published with the run; streaming: one file per micro-batch
under ``keys/dt=…/hour=…/``), one row per article written, ``key_schema``. An article's key is
``sha256(id, text_sha256, model label, embedding signature)``: the signature holds every setting
that changes its vectors (``transforms.settings.embedding_signature``), so a new model, a new
token limit or new chunking settings embed again, and a corrected text (another ``text_sha256``)
does too.

A batch run given ``incremental.previous_outputs`` (globs of output prefixes, its own output never
among them) resolves them when it runs (``ReadKeys``: each batch output through its committed
manifest, a ``transforms.output.manifest.Snapshot``) into the list of their key files
(``KeyFiles``, a small side input); each worker process loads those keys once (``key_index``: a
``transforms.output.key_index.KeyIndex``, 17 bytes a key), and ``SkipUnchanged`` counts the articles
whose key is there as ``unchanged`` instead of embedding them: ``in = written + dead_lettered +
duplicates + unchanged``. Each entry must match an output, or name the run's own (a daily job's
``dt=*`` on its first day), unless ``incremental.may_be_absent`` lists it: checked at launch
(``check_previous_outputs``) and again where the keys are read (``_ResolveFn``), so that a typo
is said, never read as no keys. It also says which snapshots it skipped articles for; the commit
(``transforms.commit``) publishes only if each still holds the run that was read, so an article
counted unchanged is always in a committed output. """
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import time
from typing import Optional

import apache_beam as beam
import pyarrow as pa
from apache_beam import pvalue
from apache_beam.io.filesystem import BeamIOError, FileSystem
from apache_beam.io.filesystems import FileSystems

from transforms.metrics import KEY_INDEX_LOAD_MS, KEY_INDEX_WAIT_MS, SKIP_LOOKUPS, SKIP_NS
from transforms.output.compaction import current_key_files
from transforms.output.key_checksums import key_file_checksums
from transforms.output.key_index import KeyIndex, MissingKeyFile, ProcessCache
from transforms.output.layout import (
    COMPACTION_DIR,
    KEYS_DIR,
    LEDGER_DIR,
    MANIFEST_FILE,
    STAGING_DIR,
    TEMP_DIR,
    is_compacted,
    join_path,
    relative_to,
)
from transforms.output.manifest import COMMITTED, Snapshot, SnapshotChanged, read_manifest
from transforms.timing_floors import unsafe_test_timings
from transforms.types import EmbeddedDoc, PreparedDoc

UNCHANGED = "unchanged"
SKIPPED_FROM = "skipped_from"
_LOG = logging.getLogger(__name__)
# A streaming micro-batch is skipped against only once its ledger record (written last, after its
# files and its store load) has stood this long. A bundle that fails after some of its
# micro-batches were written (a store load that keeps failing, a worker lost) is retried, and the
# retry may end them otherwise (an article embedded in one attempt, dead-lettered in the next):
# each attempt rewrites their files and records, at most ``store.retry_s`` (300 s by default) plus
# the runner's retry delay apart. An hour is well past that, and costs a nightly job only the
# articles the stream wrote in the hour before it reads (embedded again). 0 under the test
# suite's override (``transforms.timing_floors.UNSAFE_TEST_TIMINGS_ENV``).
STREAMING_SETTLE_S = 3600.0



def embedding_key(doc_id: str, text_sha256: str, model_label: str, signature: str) -> str:
    """32 hex: the same article, text, model and settings give the same key in every run."""
    key = "\0".join((doc_id, text_sha256, model_label, signature))
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class KeysTable:
    """Vector rows -> a table of their keys (``key_schema``) under the embedding signature they
    were made with: the rows of ``keys/``."""

    signature: str
    minhash_version: Optional[str] = None  # transforms.stories.signature_version; None: off

    def __call__(self, rows: list[EmbeddedDoc], schema: pa.Schema) -> pa.Table:
        signed = [self.minhash_version if r.minhash is not None else None for r in rows]
        return pa.table({
            "key": [embedding_key(r.id, r.text_sha256, r.model, self.signature) for r in rows],
            "id": [r.id for r in rows],
            "text_sha256": [r.text_sha256 for r in rows],
            "story_id": [r.story_id for r in rows],
            "minhash": [r.minhash for r in rows],
            "minhash_version": signed,
            "story_facts": [r.story_facts if r.minhash is not None else None for r in rows],
        }, schema=schema)


@dataclasses.dataclass(frozen=True)
class KeyFiles:
    """The previous outputs as ``ReadKeys`` resolved them: each snapshot and the key files it
    holds (``files[i]`` for ``snapshots[i]``). The side input ``SkipUnchanged`` gets: some bytes
    per file, not per key; each worker process loads the keys themselves (``key_index``)."""

    snapshots: tuple[Snapshot, ...]
    files: tuple[tuple[str, ...], ...]
    absent: tuple[str, ...] = ()  # the entries that matched no output and may (may_be_absent)

    @property
    def file_count(self) -> int:
        return sum(len(paths) for paths in self.files)


class SnapshotUnavailable(RuntimeError):
    """A previous output could not be read whole: its publish did not settle in time."""


def _normal(path: str) -> str:
    path = path.rstrip("/")
    return path if FileSystems.get_scheme(path) else os.path.abspath(path)


_INTERNAL_DIRS = frozenset({STAGING_DIR, TEMP_DIR, COMPACTION_DIR})


def _streaming_prefix(path: str) -> Optional[str]:
    """The output prefix of a streaming micro-batch or compacted key file,
    ``<prefix>/keys/dt=…/hour=…/<name>.parquet``; None for any other path (a batch output's
    ``keys/part-….parquet``, a staged run's keys under ``_staging/``, a temporary file). Cut at
    the ``keys`` folder of that shape, so a ``keys`` folder higher in the prefix is kept."""
    parts = path.split("/")
    if (len(parts) < 5 or parts[-4] != KEYS_DIR or not parts[-3].startswith("dt=")
            or not parts[-2].startswith("hour=") or not parts[-1].endswith(".parquet")):
        return None
    prefix = "/".join(parts[:-4])
    if _INTERNAL_DIRS.intersection(prefix.split("/")):
        return None  # inside an output's own working folders
    return prefix


def _matches(pattern: str, own_output: str) -> tuple[list[str], list[str]]:
    """(output prefixes, bare key folders) that a ``previous_outputs`` glob matches: batch outputs
    by their manifest, streaming outputs by their key files (``keys/dt=…/hour=…/``, no
    manifest); never a staged run's or a temporary file's folder, and the run's own output left
    out (a rerun replaces its output: skipping what it held would drop it). A bare key folder is
    a prefix whose ``keys/`` holds Parquet files directly and that has no manifest: what a batch
    output's ``keys/`` copied alone looks like, which no run can read as committed."""
    own = _normal(own_output)
    pattern = pattern.rstrip("/")
    found: set[str] = set()
    bare: set[str] = set()
    for result in FileSystems.match([f"{pattern}/{MANIFEST_FILE}", f"{pattern}/{KEYS_DIR}/**"]):
        for match in result.metadata_list:
            if match.path.endswith("/" + MANIFEST_FILE):
                batch = match.path[:-len(MANIFEST_FILE) - 1]
                if not _INTERNAL_DIRS.intersection(batch.split("/")):
                    found.add(batch)
                continue
            streaming = _streaming_prefix(match.path)
            if streaming is not None:
                found.add(streaming)
                continue
            parts = match.path.split("/")
            if (len(parts) > 2 and parts[-2] == KEYS_DIR and parts[-1].endswith(".parquet")
                    and not _INTERNAL_DIRS.intersection(parts[:-2])):
                bare.add("/".join(parts[:-2]))
    # Local prefixes absolute and normalized, as a manifest records them (``skipped_from``:
    # ``transforms.output.manifest.check_snapshot``), whatever the working folder of whoever checks
    # them.
    outputs = {_normal(p) for p in found} - {own}
    return sorted(outputs), sorted({_normal(p) for p in bare} - outputs - {own})


def output_prefixes(pattern: str, own_output: str) -> list[str]:
    """The output prefixes a ``previous_outputs`` glob matches (``_matches``), the run's own
    output left out."""
    return _matches(pattern, own_output)[0]


@dataclasses.dataclass(frozen=True)
class PreviousOutput:
    """One ``incremental.previous_outputs`` entry as resolved: the outputs it matches, and, where
    it matches none, why (``missing``). ``missing`` is None for an entry that matches only the
    run's own output (the first day of a daily job's ``dt=*``: there is nothing before it)."""

    entry: str
    prefixes: tuple[str, ...]
    missing: Optional[str] = None


def _names_own_output(pattern: str, own_output: str) -> bool:
    """Whether the glob ``pattern`` names ``own_output`` (by the path, not by a listing: the
    run's own output may not exist yet), with Beam's glob rules (``*`` within a folder)."""
    regex = FileSystem.translate_pattern(_normal(pattern))
    return re.match(regex, _normal(own_output)) is not None


def resolve_previous_output(entry: str, own_output: str) -> PreviousOutput:
    """What ``entry`` matches. The rule (docs/incremental.md): an entry must match a newsvec
    output other than the run's own, unless it names the run's own output (a daily job's
    ``out/dt=*`` on its first day matches nothing else, legitimately; a typo in it names another
    place, which holds nothing). A folder of bare ``keys/`` files is no output: said as such."""
    prefixes, bare = _matches(entry, own_output)
    shown = ", ".join(bare[:3]) + (f" and {len(bare) - 3} more" if len(bare) > 3 else "")
    if prefixes:
        if bare:  # the entry is not empty, but these folders' keys are not read
            _LOG.warning("incremental.previous_outputs entry %s: %s holds %s/ files but no %s: "
                         "not a newsvec output, its keys are not read", entry, shown, KEYS_DIR,
                         MANIFEST_FILE)
        return PreviousOutput(entry, tuple(prefixes))
    if bare:
        return PreviousOutput(entry, (), (
            f"matches no newsvec output: {shown} holds {KEYS_DIR}/ files but no {MANIFEST_FILE}: "
            f"not a newsvec output (a batch output's {KEYS_DIR}/ copied without the rest of it?); "
            f"copy or point at the whole output, {MANIFEST_FILE} with it"))
    if _names_own_output(entry, own_output):
        return PreviousOutput(entry, ())
    pattern = entry.rstrip("/")
    other = [m.path for r in FileSystems.match([f"{pattern}/**"], limits=[1])
             for m in r.metadata_list]
    if other:
        return PreviousOutput(entry, (), (
            f"matches no newsvec output: files are there ({other[0]}), but no {MANIFEST_FILE} "
            f"and no streaming key files ({KEYS_DIR}/dt=…/hour=…/) (only runs that never "
            f"committed?)"))
    return PreviousOutput(entry, (), "matches nothing (a typo? a disk or bucket not mounted?)")


class PreviousOutputMissing(ValueError):
    """``incremental.previous_outputs`` entries that match no newsvec output, none of them in
    ``incremental.may_be_absent``: the run would read no keys from them and embed again every
    article they hold, its stories linked to none of theirs."""


def judge_previous_outputs(resolved: list[PreviousOutput],
                           may_be_absent: list[str]) -> list[str]:
    """The entries that match no output and may (``may_be_absent``), each logged as a warning;
    ``PreviousOutputMissing`` naming every entry that matches none and may not."""
    refused = [r for r in resolved if r.missing is not None and r.entry not in may_be_absent]
    if refused:
        raise PreviousOutputMissing("\n".join(
            [f"incremental.previous_outputs entry {r.entry} {r.missing}" for r in refused]
            + ["Correct it, or list it in incremental.may_be_absent if it may match nothing (a "
               "streaming output that has not written its first key file yet): "
               "docs/incremental.md"]))
    absent = []
    for r in resolved:
        if r.missing is not None:
            _LOG.warning("incremental.previous_outputs entry %s %s; it is in "
                         "incremental.may_be_absent, so this run reads no keys from it",
                         r.entry, r.missing)
            absent.append(r.entry)
        elif not r.prefixes:
            _LOG.info("incremental.previous_outputs entry %s matches no output but this run's "
                      "own: its first run, nothing before it to read", r.entry)
    return absent


def check_previous_outputs(previous_outputs: list[str], may_be_absent: list[str],
                           own_output: str) -> list[str]:
    """At launch, before the job starts: each entry resolved (``resolve_previous_output``) and
    judged (``judge_previous_outputs``), so that a typo fails the launch (the launcher, a retried
    Cloud Scheduler job, reports it) rather than a job whose workers have started. Returns the
    entries that may be absent and are. An entry that cannot be listed (a bucket that does not
    exist, no permission) is refused naming it, whether it may be absent or not."""
    resolved = []
    for entry in previous_outputs:
        try:
            resolved.append(resolve_previous_output(entry, own_output))
        except BeamIOError as exc:
            raise PreviousOutputMissing(
                f"incremental.previous_outputs entry {entry} could not be listed: {exc}") from exc
    return judge_previous_outputs(resolved, may_be_absent)


def streaming_key_files(prefix: str) -> list[str]:
    """The key files of a streaming output (no manifest): the compacted files of each compacted
    partition and the micro-batch files not compacted yet (``transforms.output.compaction``). The
    one place that lists them."""
    return current_key_files(prefix)


def settle_s() -> float:
    """How long a streaming micro-batch's ledger record must have stood before a run skips
    articles against it (``STREAMING_SETTLE_S``; 0 under the test override)."""
    return 0.0 if unsafe_test_timings() else STREAMING_SETTLE_S


def settled_micro_batch_key_files(prefix: str, settle: float,
                                  now: Optional[float] = None) -> set[str]:
    """The micro-batch key files (relative to the output) whose micro-batch has finished: its
    ledger record (``ledger/<partition>/<name>.json``, beside ``keys/<partition>/<name>.parquet``)
    is there, last written ``settle`` seconds ago or more. One listing of ``ledger/``."""
    now = time.time() if now is None else now
    out = set()
    for match in FileSystems.match([join_path(prefix, LEDGER_DIR, "**")])[0].metadata_list:
        relative = relative_to(prefix, match.path)
        if (not relative.endswith(".json") or is_compacted(relative)
                or now - match.last_updated_in_seconds < settle):
            continue
        out.add(KEYS_DIR + relative[len(LEDGER_DIR):-len(".json")] + ".parquet")
    return out


def streaming_snapshot(prefix: str, settle: Optional[float] = None
                       ) -> Optional[tuple[Snapshot, tuple[str, ...]]]:
    """A streaming output's snapshot and its key files: the compacted files, and the micro-batch
    files not compacted yet whose micro-batch has finished (``settled_micro_batch_key_files``: a
    key file whose micro-batch has no ledger record yet, or one younger than ``settle``
    (``settle_s()``), may still be redone otherwise, so nothing is skipped against it). Each
    micro-batch file is pinned by its checksum, taken after the listings and before any worker
    reads it (a file rewritten in between is read as it is then, or later: never older than its
    pin). None if a listed file went before it was pinned (compacted, redone): read again."""
    files = streaming_key_files(prefix)
    finished = settled_micro_batch_key_files(prefix, settle_s() if settle is None else settle)
    checksums = key_file_checksums(prefix)
    pins, taken = [], []
    for path in files:
        relative = relative_to(prefix, path)
        if is_compacted(relative):
            taken.append(path)
            continue
        if relative not in finished:
            continue  # not finished, or not for long: its articles are embedded again
        if relative not in checksums:
            return None
        pins.append((relative, checksums[relative]))
        taken.append(path)
    if len(taken) < len(files):
        _LOG.info("%s: %d of its %d micro-batch key files are left out: their micro-batches have "
                  "no ledger record yet, or one younger than %.0f s", prefix,
                  len(files) - len(taken), len(files) - (len(taken) - len(pins)),
                  settle_s() if settle is None else settle)
    return Snapshot(prefix, None, tuple(sorted(pins))), tuple(taken)


class _ReadSnapshotFn(beam.DoFn):
    """Output prefix -> (Snapshot, its key files). A batch output is resolved through its
    committed manifest (the files it names, under the run id it names); a publish in progress is
    waited for. The keys themselves are read later, by each worker process (``key_index``): a
    file gone by then means the output was republished, and the run fails (``SnapshotChanged``)."""

    def __init__(self, attempts: int = 120, wait_s: float = 5.0):
        self._attempts, self._wait_s = attempts, wait_s

    def process(self, prefix: str):
        for _ in range(self._attempts):
            manifest = read_manifest(prefix)
            if manifest is None:  # a streaming output: its micro-batch key files pinned
                read = streaming_snapshot(prefix)
                if read is not None:
                    yield read
                    return
                time.sleep(self._wait_s)
                continue
            if manifest.state == COMMITTED:
                yield (Snapshot(prefix, manifest.run_id),
                       tuple(join_path(prefix, p) for p in manifest.keys))
                return
            time.sleep(self._wait_s)
        raise SnapshotUnavailable(f"{prefix}: no committed run could be read whole in "
                                  f"{self._attempts * self._wait_s:.0f} s (a publish in progress "
                                  f"that never settled?)")


_INDEXES = ProcessCache()  # KeyFiles -> KeyIndex, once per worker process


def _build_index(files: KeyFiles) -> KeyIndex:
    started = time.perf_counter()
    try:
        index = KeyIndex.build(files.files, [snapshot.prefix for snapshot in files.snapshots])
    except MissingKeyFile as exc:
        snapshot = files.snapshots[exc.group]
        how = ("was compacted" if snapshot.run_id is None  # a streaming output's files rewritten
               else f"(run {snapshot.run_id}) was republished")
        raise SnapshotChanged(
            f"{snapshot.prefix} {how} while this run read its keys: {exc.path} is gone; rerun "
            f"this run, which reads the new files") from exc
    seconds = index.load_s = time.perf_counter() - started
    _LOG.info("key index: %d keys from %d files of %d outputs in %.1f s, %.0f MB", len(index),
              files.file_count, len(files.snapshots), seconds, index.nbytes / 1e6)
    return index


def key_index(files: KeyFiles) -> KeyIndex:
    """The keys of ``files``, loaded once per process (the first caller starts the load, the
    others wait for it)."""
    return _INDEXES.get(files, lambda: _build_index(files))


def _key_files(read: list, absent: list) -> KeyFiles:
    """The resolved snapshots -> ``KeyFiles``; also starts loading them into this process's
    cache, which the skip finds there if it runs in this process (locally, it does: the load then
    overlaps the engine's)."""
    read = sorted(read, key=lambda item: item[0].prefix)
    files = KeyFiles(tuple(s for s, _ in read), tuple(paths for _, paths in read),
                     tuple(sorted(absent)))
    _INDEXES.start(files, lambda: _build_index(files))
    return files


ABSENT = "absent"


class _ResolveFn(beam.DoFn):
    """A ``previous_outputs`` entry -> the output prefixes it matches; an entry that matches none
    and may (``may_be_absent``) to ``ABSENT``, one that may not fails the job
    (``PreviousOutputMissing``): the launch's check (``check_previous_outputs``), made again
    where the keys are read, so that the job reads what is there then."""

    def __init__(self, own_output: str, may_be_absent: list[str]):
        self._own, self._may_be_absent = own_output, list(may_be_absent)

    def process(self, entry: str):
        resolved = resolve_previous_output(entry, self._own)
        for absent in judge_previous_outputs([resolved], self._may_be_absent):
            yield pvalue.TaggedOutput(ABSENT, absent)
        yield from resolved.prefixes


class ReadKeys(beam.PTransform):
    """``incremental.previous_outputs`` -> one ``KeyFiles`` (a PCollection of one), resolved when
    the job runs: each output through its committed manifest, so that a rerun of that output
    published before this job reads it is read as it now is. An entry that matches no output
    fails the job unless it is in ``may_be_absent`` (``_ResolveFn``)."""

    def __init__(self, previous_outputs: list[str], own_output: str,
                 may_be_absent: Optional[list[str]] = None):
        super().__init__()
        self._patterns, self._own = list(previous_outputs), own_output
        self._may_be_absent = list(may_be_absent or [])

    def expand(self, pbegin):
        resolved = (pbegin
                    | "Patterns" >> beam.Create(self._patterns).with_output_types(str)
                    | "Outputs" >> beam.ParDo(_ResolveFn(self._own, self._may_be_absent))
                    .with_outputs(ABSENT, main="prefixes"))
        return (resolved.prefixes
                | "OnePerOutput" >> beam.Distinct()
                | "ReadSnapshot" >> beam.ParDo(_ReadSnapshotFn())
                | "All" >> beam.combiners.ToList()
                | "KeyFiles" >> beam.Map(_key_files, pvalue.AsList(resolved[ABSENT])))


class _SkipFn(beam.DoFn):
    """Looks each article's key up in the process's ``KeyIndex`` of the side input's files. The
    first article of a process waits for the whole index: an article may be skipped only if its
    key is absent from every previous output, so nothing is embedded before every key is read."""

    def __init__(self, model_label: str, signature: str):
        self._label, self._signature = model_label, signature
        self._files: Optional[KeyFiles] = None
        self._index: Optional[KeyIndex] = None

    def start_bundle(self):
        self._reported: set[int] = set()  # snapshots already named in this bundle
        self._lookup_ns, self._looked_up = 0, 0

    def _index_of(self, files: KeyFiles) -> KeyIndex:
        if files is not self._files:  # the side input is decoded again per bundle: compare then
            if self._index is None or files != self._files:
                started = time.perf_counter()
                self._index = key_index(files)
                KEY_INDEX_WAIT_MS.update(int((time.perf_counter() - started) * 1000))
                # here, not in the load's own thread: Beam records metrics of a bundle's thread
                KEY_INDEX_LOAD_MS.update(int(self._index.load_s * 1000))
            self._files = files
        assert self._index is not None
        return self._index

    def process(self, doc: PreparedDoc, files: KeyFiles):
        index = self._index_of(files)
        started = time.thread_time_ns()  # CPU time: not the waits for the GIL of a busy process
        source = index.lookup(embedding_key(doc.id, doc.text_sha256, self._label,
                                            self._signature))
        self._lookup_ns += time.thread_time_ns() - started
        self._looked_up += 1
        if source is None:
            yield doc
            return
        yield pvalue.TaggedOutput(UNCHANGED, doc.id)
        if source not in self._reported:  # once a bundle, not once an article
            self._reported.add(source)
            # Its position, not the snapshot: a streaming output's pins are bytes per file.
            yield pvalue.TaggedOutput(SKIPPED_FROM, source)

    def finish_bundle(self):
        if self._looked_up:
            SKIP_NS.inc(self._lookup_ns)
            SKIP_LOOKUPS.inc(self._looked_up)


class SkipUnchanged(beam.PTransform):
    """PreparedDoc -> the documents to embed (main output), the ids of those already embedded with
    these settings (``unchanged``), and the snapshots they were found in, once each
    (``skipped_from``: the commit checks that each still holds them), given ``ReadKeys``'s
    ``KeyFiles``. Returns them as a dict by those names."""

    def __init__(self, key_files, model_label: str, signature: str):
        super().__init__()
        self._files, self._fn = key_files, _SkipFn(model_label, signature)

    def expand(self, docs):
        out = docs | "Skip" >> beam.ParDo(self._fn, pvalue.AsSingleton(self._files)).with_outputs(
            UNCHANGED, SKIPPED_FROM, main="docs")
        skipped_from = (out[SKIPPED_FROM]
                        | "OncePerSnapshot" >> beam.Distinct()
                        | "Snapshot" >> beam.Map(lambda source, files: files.snapshots[source],
                                                 pvalue.AsSingleton(self._files)))
        return {"docs": out.docs, UNCHANGED: out[UNCHANGED], SKIPPED_FROM: skipped_from}

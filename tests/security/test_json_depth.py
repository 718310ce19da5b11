"""A JSON file of the output nested too deep for Python's decoder (``json.loads`` raises
``RecursionError``, which is neither ``ValueError`` nor ``TypeError``) is refused as every other
file newsvec did not write is: the readers' refusals (``InvalidManifest``, a summary taken as
unavailable, a ledger record named unreadable) catch ``ValueError`` and ``TypeError`` only, so
such a file ends search, backfill, the launcher, the commit and ``newsvec ledger`` in a
traceback instead. Whoever can write the output prefix can write one (or a corrupt file can)."""
from __future__ import annotations

import json
import time

import pytest

from transforms.output.compaction import ledger_records
from transforms.output.layout import MANIFEST_FILE, SUMMARY_FILE, new_run_id
from transforms.output.manifest import (
    COMMITTED,
    InvalidManifest,
    Manifest,
    published_summary,
    read_manifest,
)

_DEEP = b"[" * 100_000 + b"]" * 100_000  # valid JSON, deeper than the decoder recurses


def _committed(output, run_id: str) -> Manifest:
    manifest = Manifest(run_id=run_id, state=COMMITTED, started_at=time.time(), vectors=[],
                        dead_letter=[], summary=SUMMARY_FILE, counts={"in": 0, "written": 0})
    output.mkdir(parents=True, exist_ok=True)
    (output / MANIFEST_FILE).write_text(manifest.to_json())
    return manifest


def test_a_summary_nested_too_deep_is_unavailable_not_a_traceback(tmp_path):
    """``published_summary`` takes a torn or refused ``_summary.json`` as unavailable (the
    manifest's counts, ``summary_unavailable`` saying why): search then refuses the output with
    ``OutputUncheckable``, backfill runs the day again. One nested too deep is refused the same."""
    from pipeline.search import OutputUncheckable, committed_summary

    output = tmp_path / "out"
    run_id = new_run_id()
    _committed(output, run_id)
    (output / SUMMARY_FILE).write_bytes(_DEEP)
    summary = published_summary(str(output))  # today: RecursionError
    assert summary.run_id == run_id and summary.summary_unavailable
    with pytest.raises(OutputUncheckable):
        committed_summary(str(output))


def test_a_manifest_nested_too_deep_is_refused_as_invalid(tmp_path):
    """``parse_manifest`` refuses what no newsvec run writes with ``InvalidManifest`` (what to
    do, naming the file); a manifest nested too deep, as JSON or through a chain of
    ``previous`` manifests that ``Manifest.check`` follows one into the next, is one."""
    output = tmp_path / "out"
    output.mkdir()
    (output / MANIFEST_FILE).write_bytes(_DEEP)
    with pytest.raises(InvalidManifest):
        read_manifest(str(output))  # today: RecursionError

    run_id = new_run_id()
    chain = _committed(output, run_id).to_dict()
    for _ in range(600):  # shallow as JSON: only check()'s recursion goes deep
        chain = {**chain, "previous": chain}
    (output / MANIFEST_FILE).write_text(json.dumps(chain))
    with pytest.raises(InvalidManifest):
        read_manifest(str(output))  # today: RecursionError


def test_a_ledger_record_nested_too_deep_is_named_unreadable(tmp_path):
    """``ledger_records`` names a file that is not a ledger record in ``unreadable`` and reads on
    (``newsvec ledger`` reports it as a problem); one nested too deep is not a record either."""
    folder = tmp_path / "out" / "ledger" / "dt=2026-12-01" / "hour=00"
    folder.mkdir(parents=True)
    (folder / "part-20261201T000000Z-000-00000-of-00001-0123456789abcdef.json").write_bytes(
        _DEEP)
    unreadable: list[str] = []
    records, _ = ledger_records(str(tmp_path / "out"), None, unreadable)  # today: RecursionError
    assert records == [] and len(unreadable) == 1 and "RecursionError" in unreadable[0]

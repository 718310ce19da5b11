"""``/status`` over an output holding values no newsvec run writes, but that its readers take: a
ledger record's count of 10**400 (a non-negative integer: ``LedgerRecord.check`` passes it), a
window ending in the year 9999 (an RFC 3339 time), a batch manifest's or summary's counts of
``Infinity`` or ``NaN`` (Python's JSON reads them; ``Counts.from_summary`` checks nothing).
Whoever can write the output (a hostile or broken publisher) turns the operator's page into a 500
``internal_error``, where docs/serving.md promises "A file that cannot be read is a problem the
page names, never a 500"; and ``/status.json`` answers ``Infinity``, which is not JSON (a
browser's ``JSON.parse``, ``jq``, Go's decoder refuse the whole status)."""
from __future__ import annotations

import datetime as dt
import json
import time
from pathlib import Path

import pytest

from tests.common import make_config
from tests.serve.conftest import headers
from tests.serve.test_status import client_of, streaming_config
from transforms.settings import ServeSettings

RUN = "20261201T093000Z-1a2b3c4d"


def _stamp(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _record(out: Path, **fields) -> None:
    """A ledger record of a window 40 minutes ago, with ``fields`` over a balanced one's."""
    now = dt.datetime.now(dt.timezone.utc).replace(second=0, microsecond=0)
    start = now - dt.timedelta(minutes=40)
    folder = out / "ledger" / f"dt={start:%Y-%m-%d}" / f"hour={start:%H}"
    folder.mkdir(parents=True, exist_ok=True)
    record = {"run_id": RUN, "window_start": _stamp(start),
              "window_end": _stamp(start + dt.timedelta(minutes=1)), "pane": 0, "shard": 0,
              "shards": 1, "messages_in": 0, "rows_written": 0, "dead_lettered": 0,
              "dead_lettered_by_reason": {}, "duplicates": 0, "late_reassigned": 0,
              "vectors_file": None, "dead_letter_file": None, "written_at": _stamp(now),
              **fields}
    (folder / "micro-batch-0.json").write_text(json.dumps(record))


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _answers(config) -> dict[str, tuple[int, str]]:
    with client_of(config) as client:
        return {path: (answer.status_code, answer.text) for path in ("/status", "/status.json")
                for answer in [client.get(path, headers=headers())]}


@pytest.mark.parametrize("fields", [
    {"messages_in": 10 ** 400, "rows_written": 10 ** 400},
    {"window_end": "9999-12-31T23:59:59Z"},
], ids=["count-10e400", "window-end-9999"])
def test_a_streaming_record_of_absurd_values_is_a_problem_not_a_500(tmp_path, fields):
    _record(tmp_path, **fields)
    answers = _answers(streaming_config(tmp_path))
    assert all(status == 200 for status, _ in answers.values()), (
        f"/status over a ledger record of {sorted(fields)}: "
        f"{ {path: (status, text[:160]) for path, (status, text) in answers.items()} }")
    _strict(answers["/status.json"][1])


@pytest.mark.parametrize("counts", [
    {"in": float("inf"), "written": 1}, {"in": float("nan")}, {"in": 10 ** 400},
], ids=["infinity", "nan", "10e400"])
def test_a_batch_run_of_absurd_counts_is_a_problem_not_a_500(tmp_path, counts):
    manifest = {"run_id": RUN, "state": "publishing", "started_at": time.time(), "vectors": [],
                "dead_letter": [], "summary": f"_staging/{RUN}/_summary.json", "counts": counts}
    (tmp_path / "_manifest.json").write_text(json.dumps(manifest))
    answers = _answers(make_config(output=str(tmp_path), serve=ServeSettings(search="off")))
    assert all(status == 200 for status, _ in answers.values()), (
        f"/status over a manifest of counts {sorted(counts)} (absurd values): "
        f"{ {path: (status, text[:160]) for path, (status, text) in answers.items()} }")
    status = _strict(answers["/status.json"][1])
    assert not status["ok"] and status["runs"][0]["problems"]

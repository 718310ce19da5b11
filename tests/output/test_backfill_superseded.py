"""``newsvec backfill`` runs one batch job per day into the day's output. A run that another,
newer run of the same day superseded (a scheduled daily run launched for that day while the
backfill ran it: two launches at once, the newest wins) publishes nothing, and ``run_batch``
returns what it can say: ``published: false`` and ``superseded_by``, no ``counts``
(``pipeline.run._summary_after``, ``CommitRun``). The backfill must say so and go on (the newer
run holds the day), not end in ``KeyError: 'counts'`` (``RunSummary.counted``) with the days
after it not run."""
from __future__ import annotations

import datetime as dt

from apache_beam.options.pipeline_options import PipelineOptions

import pipeline.run
from pipeline import backfill as backfill_lib
from tests.common import make_config
from transforms.output.layout import new_run_id
from transforms.output.summary import RunSummary


def test_a_day_a_newer_run_superseded_is_said_and_the_backfill_goes_on(tmp_path, monkeypatch):
    ours, newer = new_run_id(), new_run_id()
    ran = []

    def run_batch(config, options, engine_factory=None):
        ran.append(config.output)
        if len(ran) == 1:  # the first day: a newer run of that day published meanwhile
            return RunSummary(run_id=ours, published=False, superseded_by=newer).to_dict()
        return RunSummary(run_id=new_run_id(), counts={"in": 2, "written": 2}).to_dict()

    monkeypatch.setattr(pipeline.run, "run_batch", run_batch)
    monkeypatch.setattr(backfill_lib, "count_lines", lambda path: 2)
    config = make_config(input=str(tmp_path / "in" / "{date}.jsonl"),
                         output=str(tmp_path / "out" / "dt={date}"))
    lines: list[str] = []
    day = dt.date(2026, 12, 1)
    result = backfill_lib.backfill(config, day, day + dt.timedelta(days=1), PipelineOptions([]),
                                   force=True, log=lines.append)  # today: KeyError: 'counts'
    assert len(ran) == 2, "the day after the superseded one is run"
    assert result["days"] == 2 and result["counts"]["written"] == 2
    assert any(newer in line for line in lines), "the newer run that holds the day is named"

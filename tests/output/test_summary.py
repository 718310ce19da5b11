"""A batch run's summary is typed (``transforms.output.summary.RunSummary``): what a run writes as
``_summary.json`` reads back through the type to the same bytes, every key one of its fields, and
the type writes the keys in the order runs have always written them. The runs here use a FAKE
engine: what is tested is the summary."""
from __future__ import annotations

import json

from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.run import run_batch
from tests.common import make_config
from tests.fakes import FakeEngine
from tests.output.test_reruns import DAY_1, write_input
from transforms.output.manifest import published_summary
from transforms.output.summary import RunSummary


def test_a_written_summary_round_trips_through_the_type(tmp_path):
    output = str(tmp_path / "out")
    launched = run_batch(make_config(input=write_input(str(tmp_path), "in", DAY_1), output=output),
                         PipelineOptions(["--runner=FnApiRunner"]), engine_factory=FakeEngine)
    data = (tmp_path / "out" / "_summary.json").read_bytes()
    typed = RunSummary.from_json(data)
    assert typed.to_json() == data, "read and written again, byte for byte"
    assert typed.extra == {}, "every key a run writes is a field of the type"
    assert typed == published_summary(output)
    assert typed.run_id == launched["run_id"] and typed.counts == launched["counts"]
    assert typed.counted().written == 20 and typed.invariant_holds is True
    assert typed.embedding_signature and typed.model_label and typed.day


def test_the_type_writes_the_keys_in_the_runs_order_and_keeps_unknown_ones():
    written = {"near_duplicates": {"enabled": True}, "input": "in/*.jsonl", "output": "out",
               "vectors": {"dim": 4, "vector_dtype": "float32"}, "chunking": {}, "text": {},
               "incremental": {"embedding_signature": "{}", "outputs_read": 1},
               "model": {"label": "m", "content_sha256": None}, "day": "2026-12-01",
               "store": {"kind": "pgvector", "load_key": "run:r"}, "run_id": "r",
               "counts": {"in": 1}, "invariant_holds": True,
               "near_duplicates_by_similarity": {"0.9": 1}, "a_later_key": [1]}
    typed = RunSummary.from_dict(written)
    assert list(typed.to_dict()) == list(written) and typed.to_dict() == written
    assert typed.to_json() == json.dumps(written, indent=2).encode("utf-8")
    superseded = RunSummary(run_id="r", published=False, superseded_by="s")
    assert superseded.to_dict() == {"run_id": "r", "published": False, "superseded_by": "s"}
    assert not superseded.is_published and RunSummary().is_published

"""Incremental runs read their previous outputs as committed snapshots (transforms/incremental.py),
and never count an article unchanged unless a committed output still holds its vector:
- a previous output rerun and committed between a run's launch and its read of the keys: the run
  reads the new committed run, instead of failing on files the rerun removed;
- two reruns of different days that both hold article X, each consulting the other's output, racing
  (each reads the other's old run, then they commit one after the other): the second publishes
  nothing and fails, naming the output that changed, so X stays in a committed output; its rerun
  embeds X. Before, each skipped X because the other held it, and X ended in no output while both
  ledgers balanced.
Real vLLM (the session's engine): a key holds the model's label, which a fake engine's rows lack."""
from __future__ import annotations

import threading

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.config import IncrementalSettings
from pipeline.graph import build_batch
from pipeline.run import run_batch
from tests.conftest import make_config
from tests.test_reruns import listing, rows_of, write_input
from transforms import commit
from transforms.layout import new_run_id
from transforms.manifest import read_manifest


def events(ids) -> list[dict]:
    return [{"id": i, "title": f"Story {i}", "body": f"Body of story {i}."} for i in ids]


DAY_A = events(["a1", "a2", "x"])
DAY_B = events(["b1", "b2", "x"])  # x: the same article, text and all, on both days


def config(root: str, day: str, previous: list[str]):
    return make_config(input=f"{root}/in/{day}/news.jsonl", output=f"{root}/out/{day}",
                       incremental=IncrementalSettings(previous_outputs=previous))


def run(cfg) -> dict:
    return run_batch(cfg, PipelineOptions(["--runner=FnApiRunner"]))


def ids_in(output: str) -> list[str]:
    return sorted(rows_of(listing(output))["id"].to_pylist())


def test_a_previous_output_republished_after_launch_is_read_as_committed(tmp_path):
    root = str(tmp_path)
    write_input(root, "in/a", DAY_A)
    write_input(root, "in/b", DAY_B)
    run(config(root, "a", []))
    # Day b's job is launched (its graph built) while day a is as first committed...
    pipeline = beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"]))
    build_batch(pipeline, config(root, "b", [f"{root}/out/a"]), new_run_id())
    # ...then day a is rerun, and its first run's files are gone before day b reads them.
    write_input(root, "in/a", events(["a1", "x"]))
    rerun_a = run(config(root, "a", []))
    pipeline.run().wait_until_finish()
    summary = read_manifest(f"{root}/out/b")
    assert summary is not None and summary.state == "committed"
    assert summary.counts["unchanged"] == 1, "x, found in day a's committed rerun"
    assert ids_in(f"{root}/out/b") == ["b1", "b2"]
    assert read_manifest(f"{root}/out/a").run_id == rerun_a["run_id"]


class _OneAfterTheOther:
    """Holds both commits until both runs have reached theirs (each has read the other's old
    keys by then), then lets day a's commit go first and day b's after it."""

    def __init__(self, first_output: str):
        self.first_output = first_output
        self.reached = threading.Barrier(2)
        self.first_done = threading.Event()

    def lease(self, original):
        sequence = self

        class Lease:
            def __init__(self, output, run_id, *args, **kwargs):
                self._output, self._inner = output, original(output, run_id, *args, **kwargs)

            def __enter__(self):
                sequence.reached.wait(300)
                if self._output != sequence.first_output:
                    assert sequence.first_done.wait(300)
                return self._inner.__enter__()

            def __exit__(self, *exc):
                self._inner.__exit__(*exc)
                if self._output == sequence.first_output:
                    sequence.first_done.set()

        return Lease


def test_racing_reruns_of_two_days_never_lose_an_article_both_hold(tmp_path, monkeypatch):
    root = str(tmp_path)
    out_a, out_b = f"{root}/out/a", f"{root}/out/b"
    write_input(root, "in/a", DAY_A)
    write_input(root, "in/b", DAY_B)
    run(config(root, "a", []))
    first_b = run(config(root, "b", []))
    assert "x" in ids_in(out_a) and "x" in ids_in(out_b)
    sequence = _OneAfterTheOther(out_a)
    monkeypatch.setattr(commit, "PublishLease", sequence.lease(commit.PublishLease))
    results: dict = {}

    def rerun(day, previous):
        try:
            results[day] = run(config(root, day, previous))
        except Exception as exc:  # noqa: BLE001 -- the test reads it
            results[day] = exc

    threads = [threading.Thread(target=rerun, args=("a", [out_b])),
               threading.Thread(target=rerun, args=("b", [out_a]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert isinstance(results["a"], dict), results["a"]
    assert results["a"]["counts"]["unchanged"] == 1, "a skipped x: day b's committed run held it"
    assert isinstance(results["b"], Exception), "b read day a's old run, which a replaced"
    assert "republished" in str(results["b"]) and out_a in str(results["b"])
    assert read_manifest(out_b).run_id == first_b["run_id"], "day b as it was, nothing published"
    assert "x" in ids_in(out_b), "x is still in a committed output"
    monkeypatch.undo()
    again = run(config(root, "b", [out_a]))
    assert again["counts"]["unchanged"] == 0 and "x" in ids_in(out_b), \
        "day b's rerun reads day a's new run, which lacks x, and embeds x"

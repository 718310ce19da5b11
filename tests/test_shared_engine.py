"""model.share_across_processes: one engine per machine, in a process of its own, that every SDK
worker process reaches through a proxy (Beam's multi_process_shared, spawn_process=True).

The batch pipeline runs on FnApiRunner with two worker processes and a FAKE engine that records
each load and each call with its process id: one load, in a process other than this one, which
served every call; every row written once; and an engine failure crosses the proxy as itself, so
the handler still tells it from an input failure."""
from __future__ import annotations

import json
import os

import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.utils import multi_process_shared

from pipeline.run import run_batch
from tests.conftest import make_config
from tests.fakes import FakeEngine
from tests.test_embed_failures import Breaks
from transforms.embed import VLLMEmbeddingHandler
from transforms.engine import EngineFailedError, _SharedEngine


class LoggingEngine(FakeEngine):
    """FAKE; appends "load <pid> 0" and "call <pid> <docs>" to $NEWSVEC_TEST_ENGINE_LOG."""

    def __init__(self, settings=None):
        super().__init__(settings)
        self._log("load")

    def _log(self, what: str, docs: int = 0) -> None:
        with open(os.environ["NEWSVEC_TEST_ENGINE_LOG"], "a") as f:
            f.write(f"{what} {os.getpid()} {docs}\n")

    def embed(self, prompts):
        self._log("call", len(prompts))
        return super().embed(prompts)


def test_two_worker_processes_share_one_engine_in_a_process_of_its_own(tmp_path, monkeypatch):
    log = tmp_path / "engine.log"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(log))
    events = tmp_path / "in.jsonl"
    events.write_text("".join(json.dumps({"id": f"e{i}", "body": f"Story number {i}. " * 20}) + "\n"
                              for i in range(300)))
    config = make_config(input=str(events), output=str(tmp_path / "out"))
    config = config.model_copy(update={
        "model": config.model.model_copy(update={"share_across_processes": True})})
    summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner", "--direct_num_workers=2",
                                                 "--direct_running_mode=multi_processing"]),
                        engine_factory=LoggingEngine)
    assert summary["counts"]["written"] == 300 and summary["invariant_holds"]
    lines = [line.split() for line in log.read_text().splitlines()]
    loads = [pid for what, pid, _ in lines if what == "load"]
    assert len(loads) == 1, f"one engine for the machine, got {len(loads)} loads"
    assert loads[0] != str(os.getpid()), "not in the launching process"
    assert {pid for what, pid, _ in lines if what == "call"} == set(loads)
    assert sum(int(n) for what, _, n in lines if what == "call") == 300


def test_an_engine_failure_crosses_the_proxy_as_itself():
    settings = make_config().model
    proxy = multi_process_shared.MultiProcessShared(
        _SharedEngine(settings, Breaks), tag=f"newsvec-test-{os.getpid()}", always_proxy=True,
        spawn_process=True).acquire()
    handler = VLLMEmbeddingHandler(settings)
    from tests.test_embed_failures import doc

    assert handler.run_inference([doc(0)], proxy)  # the first call works
    with pytest.raises(EngineFailedError):
        handler.run_inference([doc(i) for i in range(4)], proxy)

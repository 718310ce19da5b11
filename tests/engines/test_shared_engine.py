"""model.share_across_processes: one engine per machine, in a process of its own, that every SDK
worker process reaches through a proxy (Beam's multi_process_shared, spawn_process=True).

The batch pipeline runs on FnApiRunner with two worker processes and a FAKE engine that records
each load and each call with its process id: one load, in a process other than this one, which
served every call; every row written once; and an engine failure crosses the proxy as itself, so
the handler still tells it from an input failure."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import apache_beam as beam
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from pipeline.run import run_batch
from tests.common import make_config
from tests.engines.test_embed_failures import Breaks, doc
from tests.fakes import (
    EXIT,
    HANG,
    BrokenEngine,
    EndsInRealCalls,
    FailsOnLoad,
    HangsOnLoad,
    KilledInCalls,
    LoggingEngine,
    PoisonEngine,
    SdkProcess,
    SlowEngine,
    StartsAChild,
    reach_engine,
)
from transforms.embed import Embedder, EmbedFailure
from transforms.engines.base import EngineFailedError
from transforms.engines.shared.client import SharedEngineClient
from transforms.engines.shared.processes import _process_state
from transforms.settings import ModelSettings


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


def test_an_engine_failure_crosses_the_proxy_as_itself_and_ends_that_engine():
    settings = make_config().model
    client = SharedEngineClient(settings, Breaks, tag=f"newsvec-test-{uuid.uuid4().hex}")
    handler = Embedder(settings)
    first = client._process

    assert handler.embed_batch([doc(0)], client)  # the first call works
    with pytest.raises(EngineFailedError):
        handler.embed_batch([doc(i) for i in range(4)], client)
    assert _process_state(first) != "alive", "the failed engine's process is ended"
    assert handler.embed_batch([doc(0)], client), "the next call spawns a fresh engine"
    assert client._process != first


def test_call_timeout_defaults_from_the_token_budget_and_is_validated():
    model = make_config().model
    assert model.call_timeout_s is None
    assert model.resolved_call_timeout_s() == 60 + model.token_budget / 250
    assert model.model_copy(update={"call_timeout_s": 5.0}).resolved_call_timeout_s() == 5.0
    for bad in (0, -1, 10**6):
        with pytest.raises(ValueError, match="call_timeout_s"):
            ModelSettings(**{**model.model_dump(), "call_timeout_s": bad})


# ---- engines that die or hang, on two worker processes ----

class ExitsAfter(LoggingEngine):
    """FAKE, served as the shared engine: its process exits, as an OOM kill or a crash would end
    it, at its ninth call, before answering. Every engine spawned after it does the same."""

    def embed(self, prompts):
        if len(self.calls) >= 8:
            self._log("exit", len(prompts))
            os._exit(1)
        return super().embed(prompts)


class NeverReturns(LoggingEngine):
    """FAKE, served as the shared engine: its ninth call never returns (the engine hangs), and
    neither does any later call into that process. Every engine spawned after it does the same."""

    def embed(self, prompts):
        if len(self.calls) >= 8:
            self._log("hang", len(prompts))
            while True:
                time.sleep(1)
        return super().embed(prompts)


def _events(tmp_path, n: int, body=lambda i: f"Story number {i}. " * 20):
    events = tmp_path / "in.jsonl"
    events.write_text("".join(json.dumps({"id": f"e{i}", "body": body(i)}) + "\n"
                              for i in range(n)))
    return events


def _run_shared(tmp_path, factory, n=300, body=lambda i: f"Story number {i}. " * 20,
                **model_changes):
    """A batch run on two worker processes sharing one engine; its summary, the engine log's lines
    and the ids of the rows it wrote."""
    log = tmp_path / "engine.log"
    config = make_config(input=str(_events(tmp_path, n, body)), output=str(tmp_path / "out"))
    config = config.model_copy(update={"model": config.model.model_copy(
        update={"share_across_processes": True, "token_budget": 1024, **model_changes})})
    summary = run_batch(config, PipelineOptions(["--runner=FnApiRunner", "--direct_num_workers=2",
                                                 "--direct_running_mode=multi_processing"]),
                        engine_factory=factory)
    lines = [line.split() for line in log.read_text().splitlines()]
    ids = pq.read_table(sorted((tmp_path / "out" / "vectors").glob("*.parquet")))["id"]
    return summary, lines, ids.to_pylist()


def test_a_shared_engine_that_dies_is_replaced_and_every_article_comes_out_once(
        tmp_path, monkeypatch):
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    summary, lines, ids = _run_shared(tmp_path, ExitsAfter)
    counts = summary["counts"]
    assert (counts["written"], counts["dead_lettered"]) == (300, 0) and summary["invariant_holds"]
    assert sorted(ids) == sorted(f"e{i}" for i in range(300)), "every article exactly once"
    loads = [pid for what, pid, _ in lines if what == "load"]
    exits = [pid for what, pid, _ in lines if what == "exit"]
    assert len(exits) >= 2 and len(loads) == len(set(loads)) >= len(exits) + 1, lines
    # An answer the engine computed just before another process's call made it exit can be lost
    # with it (its manager thread had not sent it yet: seen under heavy load) and is computed
    # again on the next engine: at most one call per worker process and exit, and never a row
    # twice (above).
    answered = [int(n) for what, _, n in lines if what == "call"]
    assert 300 <= sum(answered) <= 300 + 2 * len(exits) * max(answered), \
        "calls answered twice beyond those an exiting engine can lose"


def test_a_shared_engine_that_hangs_is_ended_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    summary, lines, ids = _run_shared(tmp_path, NeverReturns, call_timeout_s=2.0)
    counts = summary["counts"]
    assert (counts["written"], counts["dead_lettered"]) == (300, 0) and summary["invariant_holds"]
    assert sorted(ids) == sorted(f"e{i}" for i in range(300)), "every article exactly once"
    hung = [pid for what, pid, _ in lines if what == "hang"]
    assert len(hung) >= 2, lines
    for pid in hung:
        assert _process_state((int(pid), 0)) != "alive", "every hung engine was ended"
    assert sum(int(n) for what, _, n in lines if what == "call") == 300


# ---- streaming: the process that spawned the engine dies ----

class StopsWithItsSpawner(LoggingEngine):
    """FAKE: the first engine made (in the helper process's child) answers no call: at its first
    call it says so in $NEWSVEC_TEST_ENGINE_LOG.blocked and waits, until it ends with the process
    that spawned it. Every later engine works."""

    def __init__(self, settings=None):
        super().__init__(settings)
        try:
            os.close(os.open(os.environ["NEWSVEC_TEST_ENGINE_LOG"] + ".first",
                             os.O_CREAT | os.O_EXCL))
            self.first = True
        except FileExistsError:
            self.first = False

    def embed(self, prompts):
        if self.first:
            self._log("blocked", len(prompts))
            with open(os.environ["NEWSVEC_TEST_ENGINE_LOG"] + ".blocked", "w"):
                pass
            while True:
                time.sleep(1)
        return super().embed(prompts)


def _spawn_engine_and_wait(settings, tag: str) -> None:
    """Another SDK process of the machine: it spawns the shared engine, then waits (to be
    killed)."""
    SharedEngineClient(settings, StopsWithItsSpawner, tag)
    with open(os.environ["NEWSVEC_TEST_ENGINE_LOG"] + ".ready", "w"):
        pass
    while True:
        time.sleep(1)


def test_streaming_recovers_when_the_process_that_spawned_the_engine_dies(tmp_path, monkeypatch):
    import multiprocessing
    import threading

    from apache_beam.testing.test_pipeline import TestPipeline
    from apache_beam.testing.test_stream import TestStream

    from transforms.embed import EmbedStreaming
    from transforms.types import MicroBatch

    log = tmp_path / "engine.log"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(log))
    settings = make_config().model.model_copy(update={"share_across_processes": True})
    embed = EmbedStreaming(settings, engine_factory=StopsWithItsSpawner)
    helper = multiprocessing.get_context("spawn").Process(
        target=_spawn_engine_and_wait, args=(settings, embed.shared_engine_tag))
    helper.start()
    deadline = time.monotonic() + 30
    while not os.path.exists(f"{log}.ready"):
        assert helper.is_alive() and time.monotonic() < deadline, "the helper spawned no engine"
        time.sleep(0.1)

    def kill_the_helper_once_the_engine_is_called():
        while not os.path.exists(f"{log}.blocked") and helper.is_alive():
            time.sleep(0.05)
        os.kill(helper.pid, signal.SIGKILL)  # an SDK process killed (OOM): its engine ends too

    killer = threading.Thread(target=kill_the_helper_once_the_engine_is_called, daemon=True)
    killer.start()
    batches = [MicroBatch(window_start_us=k * 60_000_000, window_end_us=(k + 1) * 60_000_000,
                          pane=0, shard=0, shards=1, docs=tuple(doc(10 * k + i) for i in range(3)),
                          messages_in=3) for k in range(3)]
    stream = TestStream()
    for k, batch in enumerate(batches):
        stream = stream.add_elements([batch]).advance_watermark_to(60 * (k + 1))
    out = tmp_path / "out"
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    _ = (p | stream.advance_watermark_to_infinity() | embed
         | beam.Map(_record_micro_batch, str(out)))
    try:
        p.run().wait_until_finish()
    finally:
        killer.join(timeout=5)
        if helper.is_alive():
            helper.kill()
    rows = out.read_text().split()
    assert sorted(rows) == sorted(f"row:d{10 * k + i}" for k in range(3) for i in range(3)), rows
    lines = [line.split() for line in log.read_text().splitlines()]
    loads = [pid for what, pid, _ in lines if what == "load"]
    assert len(loads) == 2 and loads[1] != loads[0], "a new engine replaced the one that ended"


def _record_micro_batch(batch, path: str):
    with open(path, "a") as f:
        for row in batch.rows:
            f.write(f"row:{row.id}\n")
        for letter in batch.dead_letters:
            f.write(f"dead:{letter.event_id}\n")
    return batch


# ---- deadlines on reaching the engine; an input that ends it; one engine per tag ----

def _engine_pids(log) -> list[int]:
    """The processes of the engines that were loaded (or began to), as the FAKE logged them."""
    return [int(pid) for what, pid, _ in (line.split() for line in log.read_text().splitlines())
            if what == "load"]


def test_a_load_that_hangs_fails_within_load_timeout_in_every_process(tmp_path, monkeypatch):
    # Two SDK processes of the machine ask for the engine at once; its load never finishes. Each
    # gives up within model.load_timeout_s (plus as long again for the other's start), with an
    # EngineFailedError naming the setting, and no engine process is left.
    log = tmp_path / "engine.log"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(log))
    settings = make_config().model.model_copy(update={"share_across_processes": True,
                                                      "load_timeout_s": 3.0})
    tag = f"newsvec-test-{uuid.uuid4().hex}"
    other_out = tmp_path / "other"
    other = multiprocessing.get_context("spawn").Process(
        target=reach_engine, args=(settings, HangsOnLoad, tag, str(other_out)))
    other.start()
    outcome, error = _in_thread(SharedEngineClient, settings, HangsOnLoad, tag)
    other.join(timeout=30)
    assert isinstance(error, EngineFailedError) and "load_timeout_s" in str(error), error
    assert not other.is_alive(), "the other SDK process is still waiting"
    assert other_out.read_text().startswith("EngineFailedError") and \
        "load_timeout_s" in other_out.read_text(), other_out.read_text()
    assert _engine_pids(log), "an engine was spawned"
    assert [pid for pid in _engine_pids(log) if _process_state((pid, 0)) == "alive"] == [], \
        "every engine that hung in its load was ended"


def test_an_input_that_ends_the_shared_engine_is_dead_lettered_alone(tmp_path, monkeypatch,
                                                                     tokenizer):
    # Batch, two worker processes sharing one engine; article e5 holds a token on which the
    # engine's process exits. Bisection finds it: one embedding_failed dead letter, every other
    # article written once, and the job completes.
    assert EXIT in tokenizer("poison")[0], "the marker word is one token of the test model"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    summary, lines, ids = _run_shared(
        tmp_path, PoisonEngine, n=24, token_budget=512,
        body=lambda i: f"Story number {i}. " * 10 + (" poison" if i == 5 else ""))
    counts = summary["counts"]
    assert (counts["written"], counts["dead_lettered"]) == (23, 1) and summary["invariant_holds"]
    assert sorted(ids) == sorted(f"e{i}" for i in range(24) if i != 5)
    (letter,) = [json.loads(line) for f in (tmp_path / "out" / "dead_letter").glob("*.jsonl")
                 for line in f.read_text().splitlines()]
    assert (letter["event_id"], letter["reason"]) == ("e5", "embedding_failed")
    assert "ended during this call" in letter["detail"], letter["detail"]
    exits = [pid for what, pid, _ in lines if what == "exit"]
    assert len(exits) >= 2, lines  # the call holding it, then each half holding it, ...


def test_an_input_that_hangs_the_shared_engine_is_dead_lettered_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    settings = make_config().model.model_copy(update={"call_timeout_s": 1.0})
    client = SharedEngineClient(settings, PoisonEngine, tag=f"newsvec-test-{uuid.uuid4().hex}")
    handler = Embedder(settings)
    results = handler.embed_batch([doc(0), doc(1, ids=(101, HANG, 102)), doc(2)], client)
    failed = {r.example.event.id: r.inference.error for r in results
              if isinstance(r.inference, EmbedFailure)}
    assert list(failed) == ["d1"] and "call_timeout_s" in failed["d1"], failed
    assert all(_process_state((pid, 0)) != "alive" for pid in _hung_pids(tmp_path)), \
        "every engine that hung was ended"


def _hung_pids(tmp_path) -> list[int]:
    return [int(pid) for what, pid, _ in (line.split() for line in
                                          (tmp_path / "engine.log").read_text().splitlines())
            if what == "hang"]


def test_an_engine_that_ends_in_every_call_and_its_canary_still_fails_the_bundle(
        tmp_path, monkeypatch):
    # A guard for the bisection above: no input is blamed when the next engine fails its canary.
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    settings = make_config().model
    client = SharedEngineClient(settings, BrokenEngine, tag=f"newsvec-test-{uuid.uuid4().hex}")
    with pytest.raises(EngineFailedError):
        Embedder(settings).embed_batch([doc(i) for i in range(4)], client)


def test_a_temp_dir_that_cannot_be_written_is_an_engine_failure_not_the_inputs(monkeypatch):
    # A guard: an error reaching the engine is never raised as something the handler would take
    # for the inputs' failure (and bisect, dead-lettering every document).
    from transforms.engines.shared.records import _EngineRecord

    def full(self, generation):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_EngineRecord, "write", full)
    with pytest.raises(EngineFailedError, match="No space left"):
        SharedEngineClient(make_config().model, LoggingEngine, f"newsvec-test-{uuid.uuid4().hex}")


def test_an_old_spawners_exit_leaves_the_new_engine_alone(tmp_path, monkeypatch):
    # Three SDK processes share a tag: P1 spawns engine E1, P2 reaches it, finds it gone (killed:
    # an OOM kill, or a hang that P2 ended) and starts E2; P1 exits as an SDK process does (its
    # interpreter runs Beam's exit hooks) and is gone. P3 then reaches E2: one engine runs for the
    # tag, never two on its GPU.
    log = tmp_path / "engine.log"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(log))
    settings = make_config().model.model_copy(update={"share_across_processes": True})
    tag = f"newsvec-test-{uuid.uuid4().hex}"
    processes: list[SdkProcess] = []

    def start() -> SdkProcess:
        processes.append(SdkProcess(settings, LoggingEngine, tag))
        return processes[-1]

    try:
        p1 = start()
        p2 = start()
        assert p2.engine == p1.engine
        e1, e2 = p1.engine, p2.ask("kill")
        assert e2 != e1 and _process_state(e1) != "alive"
        assert p1.exit() == 0, "P1 exited normally"
        p3 = start()
        alive = [pid for pid in _engine_pids(log) if _process_state((pid, 0)) == "alive"]
        assert alive == [e2[0]], f"engines running: {alive} (E2: {e2[0]})"
        assert p3.engine == e2 and p3.ask("embed") == e2 and p2.ask("embed") == e2
    finally:
        for process in processes:
            process.kill()


def test_an_engine_left_loading_by_a_killed_spawner_is_ended_before_the_next_starts(
        tmp_path, monkeypatch):
    # P1 starts the engine and is killed (SIGKILL) while the engine loads: nothing recorded it
    # as the engine yet. The next SDK process ends that load before it starts its own engine, so
    # two never load on one GPU.
    log = tmp_path / "engine.log"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(log))
    settings = make_config().model.model_copy(update={"share_across_processes": True})
    tag = f"newsvec-test-{uuid.uuid4().hex}"
    p1 = multiprocessing.get_context("spawn").Process(
        target=reach_engine, args=(settings, HangsOnLoad, tag, str(tmp_path / "p1")))
    p1.start()
    deadline = time.monotonic() + 60
    while not (log.exists() and _engine_pids(log)):
        assert p1.is_alive() and time.monotonic() < deadline, "P1 started no engine"
        time.sleep(0.1)
    (loading,) = _engine_pids(log)
    p1.kill()
    p1.join()
    client = SharedEngineClient(settings, LoggingEngine, tag)
    assert _process_state((loading, 0)) != "alive", "the orphaned load was ended"
    assert [pid for pid in _engine_pids(log) if _process_state((pid, 0)) == "alive"] == \
        [client._process[0]]


def test_streaming_an_input_that_ends_the_shared_engine_is_dead_lettered_alone(
        tmp_path, monkeypatch):
    # TestStream through EmbedStreaming with the engine shared: the second micro-batch holds a
    # document on which the engine's process exits. Each micro-batch comes out once, that document
    # as its one dead letter, instead of a bundle retried without end that ends the machine's
    # engine each time.
    from apache_beam.testing.test_pipeline import TestPipeline
    from apache_beam.testing.test_stream import TestStream

    from transforms.embed import EmbedStreaming
    from transforms.types import MicroBatch

    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    settings = make_config().model.model_copy(update={"share_across_processes": True})
    embed = EmbedStreaming(settings, engine_factory=PoisonEngine)
    docs = [[doc(0), doc(1), doc(2)], [doc(10), doc(11, ids=(101, EXIT, 102)), doc(12)]]
    stream = TestStream()
    for k, batch_docs in enumerate(docs):
        stream = stream.add_elements([MicroBatch(
            window_start_us=k * 60_000_000, window_end_us=(k + 1) * 60_000_000, pane=0,
            shard=0, shards=1, docs=tuple(batch_docs), messages_in=3)]).advance_watermark_to(
            60 * (k + 1))
    out = tmp_path / "out"
    p = TestPipeline(runner="BundleBasedDirectRunner", options=PipelineOptions(streaming=True))
    _ = (p | stream.advance_watermark_to_infinity() | embed
         | beam.Map(_record_micro_batch, str(out)))
    p.run().wait_until_finish()
    assert sorted(out.read_text().split()) == sorted(
        ["row:d0", "row:d1", "row:d2", "row:d10", "row:d12", "dead:d11"])


# ---- every call has a deadline ----

def _in_thread(function, *args, timeout: float = 30):
    """``function(*args)`` in a thread of its own: ("ok", its result) or ("raised", its error),
    or ("waiting", None) if it has not returned within ``timeout`` (the thread is left behind)."""
    # A daemon thread: the interpreter joins a ThreadPoolExecutor's threads at exit, and one left
    # waiting for ever would keep the test run from exiting.
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(("ok", function(*args)))
        except Exception as exc:  # pylint: disable=broad-except  # the test reads it
            outcome.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else ("waiting", None)


def test_an_engine_stopped_while_idle_is_ended_and_the_call_served_by_the_next(
        tmp_path, monkeypatch):
    # The engine's process is stopped (SIGSTOP; a frozen cgroup likewise stops its heartbeat)
    # between calls: it would never mark the next call as begun. The call ends it and is served by
    # the next engine, instead of waiting for ever.
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    settings = make_config().model.model_copy(update={"call_timeout_s": 2.0})
    client = SharedEngineClient(settings, LoggingEngine, f"newsvec-test-{uuid.uuid4().hex}")
    client.embed([(101, 1000, 102)])
    stopped = client._process
    os.kill(stopped[0], signal.SIGSTOP)
    try:
        outcome, vectors = _in_thread(client.embed, [(101, 1001, 102)])
        assert outcome == "ok" and len(vectors) == 1, (outcome, vectors)
        assert _process_state(stopped) in ("gone", "zombie"), "the stopped engine was ended"
        assert client._process != stopped
    finally:
        if _process_state(stopped) not in ("gone", "zombie"):
            os.kill(stopped[0], signal.SIGKILL)


def test_a_busy_file_that_cannot_be_written_fails_the_call_instead_of_leaving_it_untimed(
        tmp_path, monkeypatch):
    # The engine's busy file becomes unwritable (here its path is taken by a folder; a full temp
    # dir likewise): a call that would hang is not run untimed. The bundle fails with an
    # EngineFailedError, and no input is blamed.
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    settings = make_config().model.model_copy(update={"call_timeout_s": 1.0})
    client = SharedEngineClient(settings, PoisonEngine, f"newsvec-test-{uuid.uuid4().hex}")
    client.embed([(101, 1000, 102)])
    busy = client._busy.path
    for _ in range(100):  # the engine's heartbeat may write it back in between
        try:
            os.unlink(busy)
            os.mkdir(busy)
            break
        except (FileNotFoundError, FileExistsError):
            continue
    handler = Embedder(settings)
    outcome, error = _in_thread(handler.embed_batch,
                                [doc(0), doc(1, ids=(101, HANG, 102))], client)
    for pid in _hung_pids(tmp_path):
        os.kill(pid, signal.SIGKILL)
    assert outcome == "raised" and isinstance(error, EngineFailedError), (outcome, error)
    assert "busy file" in str(error), error


def _stand_in() -> subprocess.Popen:
    """A process that stands in for an engine's (it only sleeps)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_an_engine_whose_heartbeat_stopped_is_taken_for_hung(monkeypatch):
    # An engine that is alive, not stopped, not in a call, but silent (its heartbeat, written every
    # second, is older than model.call_timeout_s: frozen, or stuck outside any call) does not
    # answer: the call that waits for it gives up on it (the client then ends it).
    from transforms.engines.shared.life import _EngineGone
    from transforms.engines.shared.processes import _process_identity
    from transforms.engines.shared.records import _EngineState

    settings = make_config().model.model_copy(update={"call_timeout_s": 1.0})
    client = SharedEngineClient(settings, LoggingEngine, f"newsvec-test-{uuid.uuid4().hex}",
                                connect=False)
    stand_in = _stand_in()
    try:
        process = _process_identity(stand_in.pid)
        # As the engine ``process`` writes it: idle, its last heartbeat 100 s ago.
        client._busy.write(_EngineState(process, 1, heartbeat=time.monotonic() - 100))
        never = threading.Event()
        outcome, error = _in_thread(client._timed, lambda: never.wait(), (), process)
        assert outcome == "raised" and isinstance(error, _EngineGone), (outcome, error)
        assert "silent" in str(error) and error.call is None and error.blame is None
    finally:
        stand_in.kill()
        stand_in.wait()


def test_a_call_that_gets_no_answer_fails_at_its_ceiling(tmp_path, monkeypatch):
    # The engine is alive and answers (its heartbeat goes on), and is idle, but this call gets no
    # answer (lost on the way, or its answer lost): past its ceiling (its turn, then
    # model.call_timeout_s, then a margin) it is an EngineFailedError, and the engine, which serves
    # other processes, is left running.
    from transforms.engines.shared import client as module

    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    monkeypatch.setattr(module, "_CEILING_SLACK_S", 1.0, raising=False)
    settings = make_config().model.model_copy(update={"call_timeout_s": 1.0})
    client = SharedEngineClient(settings, LoggingEngine, f"newsvec-test-{uuid.uuid4().hex}")
    never = threading.Event()
    outcome, error = _in_thread(client._timed, lambda: never.wait(), (), client._process)
    assert outcome == "raised" and "no answer" in str(error), (outcome, error)
    assert _process_state(client._process) == "alive", "the engine is left to the others"


_ABANDONS_A_CALL = """
import sys, threading, uuid
from tests.common import make_config
from tests.fakes import LoggingEngine
from transforms.engines.shared import client as module
module._CEILING_SLACK_S = 1.0
settings = make_config().model.model_copy(update={"call_timeout_s": 1.0})
client = module.SharedEngineClient(settings, LoggingEngine, f"newsvec-test-{uuid.uuid4().hex}")
never = threading.Event()
try:
    client._timed(lambda: never.wait(), (), client._process)
except Exception as exc:
    print("abandoned:", exc, flush=True)
"""


def test_a_process_that_abandoned_a_call_still_exits(tmp_path):
    # A call that never returns (a frozen engine, an answer lost) is abandoned at its ceiling; its
    # thread stays blocked. The SDK process (or a local run, or a test run) must still exit: the
    # interpreter joins a ThreadPoolExecutor's threads at exit, and waited for this one for ever.
    env = {**os.environ, "NEWSVEC_TEST_ENGINE_LOG": str(tmp_path / "engine.log")}
    try:
        done = subprocess.run([sys.executable, "-c", _ABANDONS_A_CALL], capture_output=True,
                              text=True, timeout=120, env=env, cwd=os.getcwd())
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the process never exited after abandoning its call: {exc.stdout!r}")
    assert "abandoned:" in done.stdout and "no answer" in done.stdout, (done.stdout, done.stderr)


def test_a_burst_of_calls_on_a_healthy_engine_all_get_their_answer(tmp_path, monkeypatch):
    # Many threads call at once (as every waiting thread retries after an engine is replaced, or
    # a Dataflow process's threads at the start of a burst): the engine, healthy, serves them in
    # turn, each call within call_timeout_s. A call that first reads the engine's state as it was
    # written before the burst arrived must not take the calls queued then for its turn.
    from transforms.engines.shared import client as module

    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    monkeypatch.setenv("NEWSVEC_TEST_CALL_S", "1.5")
    monkeypatch.setattr(module, "_CEILING_SLACK_S", 1.0, raising=False)
    settings = make_config().model.model_copy(update={"call_timeout_s": 2.0})
    client = SharedEngineClient(settings, SlowEngine, f"newsvec-test-{uuid.uuid4().hex}")
    client.embed([(101, 1000, 102)])
    time.sleep(1.2)  # the engine's last state: idle, nothing queued
    outcomes: list = [None] * 8

    def call(k: int) -> None:
        try:
            client.embed([(101, 2000 + k, 102)])
            outcomes[k] = "answered"
        except EngineFailedError as exc:
            outcomes[k] = str(exc)[:300]

    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(outcomes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert outcomes == ["answered"] * len(outcomes), outcomes


# ---- what the engine starts ends with it ----

def _children(log) -> list[int]:
    return [int(pid) for what, pid, _ in (line.split() for line in log.read_text().splitlines())
            if what == "child"]


def test_the_engine_runs_vllm_in_its_process_and_what_it_starts_ends_with_it(
        tmp_path, monkeypatch):
    # The worker's environment turns vLLM's engine-core process on (an image's ENV: engine_env
    # only fills unset variables): the shared engine's process turns it off. And whatever the
    # engine starts (here a child of the FAKE) is ended with it when it is replaced, so the next
    # engine never loads beside a process of the last one.
    log = tmp_path / "engine.log"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(log))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    client = SharedEngineClient(make_config().model, StartsAChild,
                                f"newsvec-test-{uuid.uuid4().hex}")
    try:
        assert [line.split()[0] for line in log.read_text().splitlines()
                if line.startswith("multiprocessing=")] == ["multiprocessing=0"]
        (child,) = _children(log)
        first = client._process
        os.kill(first[0], signal.SIGKILL)  # it crashed, or was killed for memory
        client.embed([(101, 1000, 102)])
        assert client._process != first
        assert _process_state((child, 0)) in ("gone", "zombie"), \
            "the first engine's child outlived it"
    finally:
        for pid in _children(log):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_a_config_that_turns_vllms_engine_process_on_for_the_shared_engine_is_refused():
    model = make_config().model
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        ModelSettings(**{**model.model_dump(), "share_across_processes": True,
                         "engine_env": {**model.engine_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}})


# ---- a kill from outside is not the inputs' doing ----

@pytest.mark.parametrize("counted", [True, False], ids=["oom-kill-counted", "sigkill"])
def test_an_engine_killed_from_outside_in_a_call_retries_it_instead_of_blaming_it(
        tmp_path, monkeypatch, caplog, counted):
    # The engine is killed (SIGKILL) during a call of one good article, twice: by the
    # out-of-memory killer, which the engine's memory cgroup counts (simulated: an injected
    # cgroup root), or by a signal nobody in newsvec sent (the exit status its spawner saw). The
    # article is embedded on the third engine, not dead-lettered as poison.
    from transforms.engines.shared import processes as module

    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    monkeypatch.setenv("NEWSVEC_TEST_KILLS", "2")
    if counted:
        cgroup = tmp_path / "cgroup"
        cgroup.mkdir()
        (cgroup / "memory.events").write_text("oom 0\noom_kill 0\n")
        monkeypatch.setattr(module, "_CGROUP_ROOT", str(cgroup))
        monkeypatch.setenv("NEWSVEC_TEST_OOM_EVENTS", str(cgroup / "memory.events"))
    settings = make_config().model
    client = SharedEngineClient(settings, KilledInCalls, f"newsvec-test-{uuid.uuid4().hex}")
    (result,) = Embedder(settings).embed_batch([doc(0)], client)
    assert not isinstance(result.inference, EmbedFailure), result.inference
    lines = (tmp_path / "engine.log").read_text().split()
    assert lines.count("killed") == 2
    told = ("killed for lack of memory" if counted
            else "ended by SIGKILL, which newsvec did not send")
    assert caplog.text.count(told) == 2, caplog.text


def test_an_engine_killed_from_outside_in_every_try_fails_the_bundle_and_blames_nothing(
        tmp_path, monkeypatch):
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    monkeypatch.setenv("NEWSVEC_TEST_KILLS", "100")
    settings = make_config().model
    client = SharedEngineClient(settings, KilledInCalls, f"newsvec-test-{uuid.uuid4().hex}")
    with pytest.raises(EngineFailedError, match="not of the call's doing"):
        Embedder(settings).embed_batch([doc(0)], client)


# ---- reaching the engine: one attempt per process ----

def test_the_threads_of_a_process_share_one_attempt_to_reach_the_engine(tmp_path, monkeypatch):
    # Four DoFn threads of one SDK process set up the step while the engine's load hangs: they
    # share one attempt (one engine spawned, one model.load_timeout_s), all fail with its
    # EngineFailedError, and a fifth thread that asks just after fails at once with it too. (6 s:
    # with 2 s, a loaded machine ended the engine before its Python had started to log its pid.)
    log = tmp_path / "engine.log"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(log))
    settings = make_config().model.model_copy(update={"share_across_processes": True,
                                                      "load_timeout_s": 6.0})
    handler = Embedder(settings, engine_factory=HangsOnLoad)
    outcomes: list = [None] * 4
    threads = [threading.Thread(target=lambda k=k: outcomes.__setitem__(
        k, _in_thread(handler.load_engine, timeout=60))) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(o[0] == "raised" and isinstance(o[1], EngineFailedError) for o in outcomes), \
        outcomes
    assert len(_engine_pids(log)) == 1, "one attempt, one engine spawned for the four threads"
    fifth = _in_thread(handler.load_engine, timeout=60)
    assert fifth[0] == "raised" and "load_timeout_s" in str(fifth[1]), fifth
    assert len(_engine_pids(log)) == 1, "the failure was remembered: no second attempt"


# ---- an engine that ends on every real input stops the bisection ----

def test_an_engine_that_ends_in_every_real_call_fails_the_bundle_after_a_few(
        tmp_path, monkeypatch):
    # Its canary passes, yet every real call ends its process: after more ends in a row than one
    # input that ends it can cause, the bundle fails (EngineFailedError) instead of starting an
    # engine per input and dead-lettering every article.
    from transforms.engines.shared.client import deaths_allowed

    log = tmp_path / "engine.log"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(log))
    settings = make_config().model
    client = SharedEngineClient(settings, EndsInRealCalls, f"newsvec-test-{uuid.uuid4().hex}")
    with pytest.raises(EngineFailedError, match="calls in a row"):
        Embedder(settings).embed_batch([doc(i) for i in range(4)], client)
    assert len(_engine_pids(log)) <= deaths_allowed(4) + 2, "engines started"


def test_inputs_that_end_the_engine_side_by_side_are_still_dead_lettered_alone(
        tmp_path, monkeypatch):
    # A guard for the stop above: two articles that end the engine next to each other cause more
    # ends in a row than one can; the engine still embeds an article it embedded before, so the
    # bisection goes on, and each is dead-lettered alone.
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    settings = make_config().model
    client = SharedEngineClient(settings, PoisonEngine, f"newsvec-test-{uuid.uuid4().hex}")
    handler = Embedder(settings)
    assert not isinstance(handler.embed_batch([doc(0)], client)[0].inference, EmbedFailure)
    results = handler.embed_batch(
        [doc(1, ids=(101, EXIT, 102)), doc(2, ids=(101, EXIT, 103)), doc(3)], client)
    assert [isinstance(r.inference, EmbedFailure) for r in results] == [True, True, False]


# ---- what a spawner keeps of its engines ----

def test_replacing_the_engine_leaves_no_file_descriptors_behind(tmp_path, monkeypatch):
    import gc

    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    client = SharedEngineClient(make_config().model, LoggingEngine,
                                f"newsvec-test-{uuid.uuid4().hex}")
    client.embed([(101, 1000, 102)])
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    replacements = 5
    for i in range(replacements):
        os.kill(client._process[0], signal.SIGKILL)
        client.embed([(101, 1000 + i, 102)])
    deadline = time.monotonic() + 10
    while True:  # the spawner's watcher releases a dead engine's pipes as it sees it exit
        gc.collect()
        grown = len(os.listdir("/proc/self/fd")) - before
        if grown < replacements or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert grown < replacements, f"{grown} more descriptors after {replacements} replacements"


def test_a_load_that_fails_leaves_no_file_descriptors_behind(tmp_path, monkeypatch):
    # The engine's load fails again and again (the GPU's memory held elsewhere): each attempt
    # spawns a process that exits at once, and what Beam keeps of it (its pipes, the life line)
    # is released all the same.
    import gc

    from transforms.engines.shared import life as module

    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(tmp_path / "engine.log"))
    monkeypatch.setattr(module, "_REMEMBER_FAILURE_S", 0.0, raising=False)
    client = SharedEngineClient(make_config().model, FailsOnLoad,
                                f"newsvec-test-{uuid.uuid4().hex}", connect=False)

    def fail() -> None:
        with pytest.raises(EngineFailedError):
            client.connect()

    fail()
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    attempts = 4
    for _ in range(attempts):
        fail()
    deadline = time.monotonic() + 10
    while True:  # the spawner's watcher releases a dead engine's pipes as it sees it exit
        gc.collect()
        grown = len(os.listdir("/proc/self/fd")) - before
        if grown < attempts or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert grown < attempts, f"{grown} more descriptors after {attempts} failed loads"
    loads = (tmp_path / "engine.log").read_text().split("\n")
    assert sum(line.startswith("load") for line in loads) == attempts + 1


# ---- a record that is gone ----

def test_an_engine_whose_record_is_gone_never_runs_beside_a_new_one(tmp_path, monkeypatch):
    # {tag}.engine is deleted while its engine runs (a cleaner of old temp files): the next SDK
    # process does not start generation 1 beside it. One engine runs, numbered above the last.
    log = tmp_path / "engine.log"
    monkeypatch.setenv("NEWSVEC_TEST_ENGINE_LOG", str(log))
    settings = make_config().model
    tag = f"newsvec-test-{uuid.uuid4().hex}"
    first = SharedEngineClient(settings, LoggingEngine, tag)
    os.kill(first._process[0], signal.SIGKILL)
    first.embed([(101, 1000, 102)])  # the second generation
    os.unlink(first._record.path)
    outcome, _ = _in_thread(reach_engine, settings, LoggingEngine, tag,
                            str(tmp_path / "other"), timeout=60)
    assert outcome == "ok" and (tmp_path / "other").read_text() == "ok"
    alive = [pid for pid in _engine_pids(log) if _process_state((pid, 0)) == "alive"]
    assert len(alive) == 1, f"engines running: {alive}"
    assert first._record.read().number > 2

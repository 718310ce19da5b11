"""Workers with several GPUs (``model.gpus_per_worker``): one shared engine per GPU, each pinned to
its device, and the SDK processes spread evenly over them (``transforms.engines.devices``).

No GPU is needed: which device an engine is given is the ``CUDA_VISIBLE_DEVICES`` of its process,
which a FAKE engine reads back. The end-to-end test starts four client processes, as four SDK
processes of one worker, on a worker that sees two GPUs."""
from __future__ import annotations

import multiprocessing
import os
import queue as queue_lib
import stat
import time
import uuid
from collections import Counter

import pytest

from tests.common import make_config
from tests.fakes import FakeEngine
from transforms.engines import devices
from transforms.engines.devices import DeviceSlots, engine_devices, visible_gpus
from transforms.settings import ModelSettings


def settings(gpus="auto", share=True) -> ModelSettings:
    return make_config().model.model_copy(update={"share_across_processes": share,
                                                  "gpus_per_worker": gpus})


@pytest.fixture
def no_nvidia_tools(monkeypatch):
    """A machine where nothing but CUDA_VISIBLE_DEVICES could show a GPU."""
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(devices, "_NVIDIA_SMI_DIRS", ())
    monkeypatch.setattr(devices.glob, "glob", lambda pattern: [])


# ---- which GPUs the worker sees ----

@pytest.mark.parametrize("env, seen", [
    ("0,1", ["0", "1"]), ("1", ["1"]), ("", []), (" 2, 3 ", ["2", "3"]),
    ("GPU-8f3e,GPU-a1b2", ["GPU-8f3e", "GPU-a1b2"]),
    ("0,-1,2", ["0"]),  # CUDA ignores every entry from the first invalid one on
])
def test_cuda_visible_devices_is_what_the_worker_sees(monkeypatch, env, seen):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert visible_gpus() == seen


def test_without_cuda_visible_devices_nvidia_smi_counts_the_gpus(monkeypatch, tmp_path,
                                                                  no_nvidia_tools):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = -L ] || exit 2\n"
                   "echo 'GPU 0: NVIDIA L4 (UUID: GPU-8f3e)'\n"
                   "echo '  MIG 1g.5gb     Device  0: (UUID: MIG-11)'\n"
                   "echo 'GPU 1: NVIDIA L4 (UUID: GPU-a1b2)'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(devices, "_NVIDIA_SMI_DIRS", (str(tmp_path),))  # Dataflow's place for it
    assert visible_gpus() == ["0", "1"]


def test_without_nvidia_smi_the_device_files_count_and_none_is_a_cpu_machine(monkeypatch,
                                                                             no_nvidia_tools):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus() == []
    monkeypatch.setattr(devices.glob, "glob", lambda pattern: [
        "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-caps"])
    assert visible_gpus() == ["0", "1"]


@pytest.mark.parametrize("gpus, env, engines", [
    ("auto", "0,1", ["0", "1"]),
    ("auto", "3,1", ["3", "1"]),        # the worker's own restriction is kept
    ("auto", "0", [None]),              # one GPU: one engine, as before
    ("auto", "", [None]),               # a CPU machine: one engine
    (2, "0,1,2,3", ["0", "1"]),         # fewer than it has: the first ones
    (1, "0,1", [None]),
    (2, "", ["0", "1"]),                # nothing seen (a CPU test): taken on trust
])
def test_one_engine_per_gpu(monkeypatch, gpus, env, engines):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert engine_devices(settings(gpus)) == engines


def test_more_gpus_than_the_worker_has_is_an_error_naming_the_key(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match="gpus_per_worker is 2 but this worker sees 1"):
        engine_devices(settings(2))


@pytest.mark.parametrize("bad", [0, -1, 65, "two", 1.5])
def test_gpus_per_worker_is_validated(bad):
    with pytest.raises(ValueError, match="gpus_per_worker"):
        ModelSettings(**{**settings().model_dump(), "gpus_per_worker": bad})


# ---- which engine each process uses ----

def test_processes_spread_evenly_and_keep_their_engine(tmp_path):
    alive = {(101, 1), (205, 1), (150, 1), (333, 1)}
    slots = DeviceSlots(str(tmp_path), "t", alive=lambda p: p in alive)
    given = [slots.assign(p, 2) for p in [(101, 1), (205, 1), (150, 1), (333, 1)]]
    assert sorted(Counter(given).values()) == [2, 2], given
    assert slots.counts(2) == [2, 2]
    assert slots.assign((205, 1), 2) == given[1], "a process keeps its engine"
    # One dies (its pid may come back as another process: the start time tells them apart);
    # the process that replaces it fills the gap.
    alive.discard((205, 1))
    alive.add((205, 9))
    assert slots.assign((205, 9), 2) == given[1]
    assert slots.counts(2) == [2, 2]


def test_eight_processes_over_four_gpus_and_a_restart_wave(tmp_path):
    alive = {(p, 7) for p in range(1000, 1008)}
    slots = DeviceSlots(str(tmp_path), "t", alive=lambda p: p in alive)
    given = {p: slots.assign(p, 4) for p in sorted(alive)}
    assert slots.counts(4) == [2, 2, 2, 2]
    # Three processes of engine 0 and 1 die; three new ones start: they go where the gaps are.
    dead = [p for p, i in given.items() if i in (0, 1)][:3]
    alive.difference_update(dead)
    newcomers = [(2000 + k, 7) for k in range(3)]
    alive.update(newcomers)
    for p in newcomers:
        slots.assign(p, 4)
    assert slots.counts(4) == [2, 2, 2, 2]


# ---- end to end: four SDK processes, two GPUs, a FAKE engine ----

class DeviceEngine(FakeEngine):
    """FAKE: its label names the CUDA_VISIBLE_DEVICES and pid of the process it was made in."""

    def __init__(self, settings=None):
        super().__init__(settings)
        self.label = f"fake-gpu:{os.environ.get('CUDA_VISIBLE_DEVICES')}:{os.getpid()}"


def _sdk_process(settings, tag, results) -> None:
    """One SDK process of the worker: reach its engine, embed once, say where, wait."""
    from transforms.engines.shared.client import shared_engine

    client = shared_engine(settings, DeviceEngine, tag)
    (vector,) = client.embed([[5, 7, 11]])
    _, device, engine_pid = client.label().split(":")
    results.put((os.getpid(), client.device, device, int(engine_pid), client._process[0],
                 float(vector.sum())))
    time.sleep(300)  # stay alive (until killed): an engine ends with the process that spawned it


def test_four_sdk_processes_over_two_gpus_two_per_engine_each_engine_on_its_own_device(
        monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")  # the worker sees two GPUs
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    tag = f"newsvec-test-gpus-{uuid.uuid4().hex}"
    procs = [ctx.Process(target=_sdk_process, args=(settings(2), tag, results))
             for _ in range(4)]
    for proc in procs:
        proc.start()
    try:
        rows = []
        for _ in procs:
            try:
                rows.append(results.get(timeout=120))
            except queue_lib.Empty:
                pytest.fail(f"an SDK process never reached its engine: {rows}")
    finally:
        # Killed, as an SDK process may be: each engine ends with the process that spawned it
        # (an SDK process that exits by itself waits for its engine's process at exit).
        for proc in procs:
            proc.kill()
            proc.join(10)
    assert len({r[0] for r in rows}) == 4
    for _, given, seen, engine_pid, connected_pid, total in rows:
        assert seen == given, "the engine's process sees only the device its clients were given"
        assert engine_pid == connected_pid, "the client reached the engine that embedded"
        assert total == 1.0, "the call was answered"
    per_device = Counter(r[1] for r in rows)
    assert per_device == {"5": 2, "7": 2}, per_device
    engines = {device: {r[3] for r in rows if r[1] == device} for device in per_device}
    assert all(len(pids) == 1 for pids in engines.values()), "one engine per device"
    assert engines["5"] != engines["7"], "each device has an engine process of its own"
    assert not {r[3] for r in rows} & {r[0] for r in rows}, "engines run apart from SDK processes"
